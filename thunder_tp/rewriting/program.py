"""Local-shape rewrite: re-run every op on local pieces, with the collectives `rewriting/communication.py` derives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import thunder.torch as ltorch
from thunder.core import prims
from thunder.core.proxies import NumberProxy, Proxy, ProxyTag, TensorProxy
from thunder.core.pytree import tree_flatten, tree_map, tree_unflatten
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, get_tracectx, tracectx

from thunder_tp import collectives as C
from thunder_tp.collectives.labels import label_collectives, label_of
from thunder_tp.collectives.reshard import gather_into_tp_region, redistribute
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import REPLICATE, Layout, Partial, Replicate, Shard, TPGroup, is_even, rank_pieces
from thunder_tp.pieces import piece_parts
from thunder_tp.propagation.engine import Step
from thunder_tp.rewriting.communication import CollectiveSchedule, Need, schedule_collectives
from thunder_tp.thunder_internals.checkpointing import recompute_in_backward
from thunder_tp.thunder_internals.grad_mode import grad_reaches, in_grad_mode_of


@dataclass
class LocalValues:
    """Local value of every logical proxy, and the other layouts of it that steps need (each made once)."""

    tp: TPGroup
    layouts: dict[str, Layout]
    schedule: CollectiveSchedule
    #: the full shapes of the trace's inputs (whose proxies the prologue gave their local shapes)
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    #: what each collective is labelled by: the modules of the parameters (proxy name -> parameter name) and the
    #: logical op that computes each value
    names: Labels = field(default_factory=lambda: Labels({}, {}))
    #: names of the tp_copy_to_tp outputs whose grads are summed with the others of their dtype (GradSum.coalesced)
    coalesced: set[str] = field(default_factory=set)
    _memo: dict[tuple, TensorProxy] = field(default_factory=dict)

    def get(self, need: Need) -> TensorProxy:
        """The value `need` asks for."""
        if need.key not in self._memo:
            self._memo[need.key] = self._make(need)
        return self._memo[need.key]

    def full_shape(self, t: TensorProxy) -> tuple[int, ...]:
        """The logical (full) shape of `t`."""
        return self.input_shapes.get(t.name, tuple(t.shape))

    def value_of(self, t: TensorProxy) -> TensorProxy:
        """The local value of logical `t` in its own layout (an annotation's: its input's, made that layout)."""
        alias = self.schedule.aliases.get(t.name)
        if alias is None:
            return self.values[t.name]
        return self.get(self.schedule.resolved(alias.value, alias.layout)[-1])

    def _make(self, need: Need) -> TensorProxy:
        t, group = need.value, self.tp.group
        if not need.into_tp_region:
            return redistribute(self.value_of(t), self.layouts[t.name], need.layout, self.full_shape(t), group)
        summed = self.schedule.grad_sums[t.name]
        if summed.gathered:
            return gather_into_tp_region(self.value_of(t), self.layouts[t.name], self.full_shape(t), group)
        copy = C.tp_copy_to_tp(self.get(Need(t, need.layout)), group)
        if summed.coalesced:
            self.coalesced.add(copy.name)
        return copy


@dataclass(frozen=True)
class Labels:
    """Names for the collectives' labels: each parameter proxy's parameter name, each logical value's producer."""

    parameters: dict[str, str]
    producers: dict[str, BoundSymbol]

    def module(self, bsym: BoundSymbol | None) -> str | None:
        """The module whose parameter `bsym` reads (its name without the parameter's), if any."""
        if bsym is None:
            return None
        name = next((self.parameters[t.name] for t in _tensors(bsym) if t.name in self.parameters), None)
        return None if name is None else name.rpartition(".")[0] or name

    def of_need(self, consumer: BoundSymbol, need: Need, source: Layout) -> str:
        """`module: role` for the collectives that make `need`'s value for `consumer`: a reduction is named after
        the module that made the partial sums, anything else after the module that reads the value."""
        producer = self.producers.get(need.value.name)
        by = producer if isinstance(source, Partial) and producer is not None else consumer
        where = self.module(by) or self.module(consumer) or by.sym.name
        return f"{where}: {_role(source, need.layout, need.into_tp_region)}"


def _role(source: Layout, target: Layout, into_tp_region: bool) -> str:
    if into_tp_region:
        gathered = "sequence shards gathered into" if isinstance(source, Shard) else "input of"
        return f"{gathered} the TP region (its grad summed)"
    if isinstance(source, Partial):
        return "partial sums reduced" if isinstance(target, Replicate) else f"partial sums reduce-scattered ({target})"
    if isinstance(source, Shard) and isinstance(target, Replicate):
        return f"shards gathered ({source})"
    return f"{source} made {target}"


def coalesce_replicated_copies(bsyms: list[BoundSymbol], coalesced: set[str], tp: TPGroup) -> list[BoundSymbol]:
    """The copies into the TP region of values computed from the trace's inputs alone (`coalesced`: replicated
    parameters used by sharded compute: norm weights and row biases under SP, per-head q/k norm weights, routers,
    replicated K/V blocks, each maybe cast or offset first) -> one copy_all_to_tp per dtype, after the inputs and
    those computations (moved up): their grads are all-reduced together in one collective at the end of the
    backward (as Megatron-LM does). Copies whose grad nothing reaches (parameters used only upstream of no-grad
    code) stay apart: their grads stay None, as one device's, rather than zeros summed with the others."""
    groups: dict[Any, list[BoundSymbol]] = {}
    reached = grad_reaches(bsyms)
    for b in bsyms:
        if b.sym.id == C.tp_copy_to_tp.id and b.output.name in coalesced and b.output.name in reached:
            groups.setdefault(b.args[0].dtype, []).append(b)
    groups = {dtype: copies for dtype, copies in groups.items() if len(copies) > 1}
    if not groups:
        return bsyms
    producers = {o.name: b for b in bsyms if b.sym.id != prims.PrimIDs.UNPACK_TRIVIAL for o in _outputs(b)}
    moved = _ancestors([c.args[0] for copies in groups.values() for c in copies], producers)
    merged = [C.tp_copy_all_to_tp.bind([c.args[0] for c in copies], tp.group, output=tuple(c.output for c in copies))
              for copies in groups.values()]
    for bsym, copies in zip(merged, groups.values(), strict=True):
        label_collectives([bsym], f"replicated parameters: the grads of {len(copies)} summed")
    dropped = moved | {id(c) for copies in groups.values() for c in copies}
    first = next(i for i, b in enumerate(bsyms) if b.sym.id != prims.PrimIDs.UNPACK_TRIVIAL)
    rest = [b for b in bsyms[first:] if id(b) not in dropped]
    return bsyms[:first] + [b for b in bsyms if id(b) in moved] + merged + rest


def _ancestors(values: list[TensorProxy], producers: dict[str, BoundSymbol]) -> set[int]:
    """ids of the bound symbols that compute `values` from the inputs."""
    seen: set[int] = set()
    pending = [producers[v.name] for v in values if v.name in producers]
    while pending:
        b = pending.pop()
        if id(b) not in seen:
            seen.add(id(b))
            pending.extend(producers[t.name] for t in _tensors(b) if t.name in producers)
    return seen


def _outputs(bsym) -> list[TensorProxy]:
    return [x for x in tree_flatten(bsym.output)[0] if isinstance(x, TensorProxy)]


def _tensors(bsym) -> list[TensorProxy]:
    return [x for x in tree_flatten((bsym.args, bsym.kwargs))[0] if isinstance(x, TensorProxy)]


def rewrite(trace: TraceCtx, steps: list[Step], layouts: dict[str, Layout], tp: TPGroup,
            input_shapes: dict[str, tuple[int, ...]], arrive_unpadded: frozenset[str] = frozenset(),
            param_names: dict[str, str] | None = None) -> TraceCtx:
    """The local program of `trace`: each step re-run on local pieces, with the communication `schedule_collectives`
    derives, each collective labelled with the module it serves (`param_names`: proxy name -> parameter name);
    outputs returned Replicate. `input_shapes`: the full shapes of the inputs, whose proxies have their local shapes
    already. `arrive_unpadded`: inputs a simulation holds at each rank's true size (the parameters), padded to the
    longest piece where the program reads them."""
    ret = trace.bound_symbols[-1]
    assert ret.sym.id == prims.PrimIDs.RETURN, "a computation trace ends with its return"
    schedule = schedule_collectives(trace, steps, layouts, tp, training=True)
    producers = {o.name: step.bsym for step in steps for o in _outputs(step.bsym)}
    local = LocalValues(tp, layouts, schedule, input_shapes, names=Labels(dict(param_names or {}), producers))
    new = from_trace(trace)
    with tracectx(new):
        for bsym in trace.bound_symbols:
            if bsym.sym.id == prims.PrimIDs.UNPACK_TRIVIAL:
                new.bound_symbols.append(bsym.from_bsym())
                local.values[bsym.output.name] = bsym.output
        unpacked = dict(local.values)  # the inputs themselves, returned as they came (grads are mapped to them)
        for name in arrive_unpadded & unpacked.keys() if ranks_of(tp.group).one_trace_for_all else ():
            local.values[name] = padded_on_entry(unpacked[name], layouts[name], input_shapes[name], tp)
        for t in schedule.replica_sums:  # in the inputs' order: the same on every rank
            emitted_from = len(new.bound_symbols)
            layout = layouts[t.name]
            n = local.full_shape(t)[layout.dim]
            local.values[t.name], copy = replica_grads_summed(local.values[t.name], layout, n, tp)
            local.coalesced.add(copy.name)
            owner = local.names.parameters.get(t.name, t.name)
            label_collectives(new.bound_symbols[emitted_from:], f"{owner}: grads of its replicated chunks summed")
        for step, needs in zip(steps, schedule.needs, strict=True):
            _emit(step, needs, local)
        emitted_from = len(new.bound_symbols)
        returned = _returned_values(ret.args, local, unpacked)
        label_collectives(new.bound_symbols[emitted_from:], "the program's output: made whole")
        prims.python_return(*returned)
    new.bound_symbols = coalesce_replicated_copies(new.bound_symbols, local.coalesced, tp)
    new.set_provenance(TraceProvenance("thunder_tp: tensor-parallel rewrite"))
    return new


def replica_grads_summed(x: TensorProxy, layout: Shard, n: int, tp: TPGroup) -> tuple[TensorProxy, TensorProxy]:
    """`x` (this rank's piece of a tensor whose sharded dim is `n` long) unchanged, but in backward each replicated
    chunk's grad is summed over the ranks that hold it; with the copy into the TP region whose backward sums them.

    A chunk held by several ranks (K/V heads shared by the query heads of several ranks) gets a partial grad on each:
    the contributions of that rank's query heads. Every rank writes its replicated chunks into a zero
    buffer the size of those blocks in full (`tp_placed`: at a rank-dependent offset), the buffer is all_reduced over
    the TP group (the backward of tp_copy_to_tp) and each rank reads its chunks back: one all_reduce per replicated
    parameter, of the full K/V block (n_query_groups * head_size rows). A sum over each replica subgroup would move
    n_query_groups times fewer bytes but needs a process group per subgroup, created collectively by
    every rank of the world (a problem inside 2-D meshes and simulated ranks); the K/V weight is small
    next to the b*s*h activations of the block's two all_reduces, and weights stay identical on the
    replicas because their grads do.
    """
    dim = layout.dim
    blocks = layout.blocks or (n,)
    every = rank_pieces(layout, n, tp.size)
    pieces = piece_parts(x, layout, tp.rank, tp.size, ltorch)
    replicated = [i for i, split in enumerate(layout.block_splits()) if split is not None and split.replicated]
    block_starts = [sum(blocks[:i]) for i in range(len(blocks))]
    starts = {i: tuple(chunks[i][0] - block_starts[i] for chunks in every) for i in replicated}
    placed = [C.tp_placed(pieces[i], dim, starts[i], blocks[i], tp.group) for i in replicated]
    summed = C.tp_copy_to_tp(ltorch.cat(placed, dim) if len(placed) > 1 else placed[0], tp.group)
    at = 0
    for i in replicated:
        block = ltorch.getitem(summed, (slice(None),) * dim + (slice(at, at + blocks[i]),))
        pieces[i] = C.tp_taken(block, dim, starts[i], every[0][i][1], tp.group)
        at += blocks[i]
    return (ltorch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]), summed


def padded_on_entry(x: TensorProxy, layout: Layout, shape: tuple[int, ...], tp: TPGroup) -> TensorProxy:
    """A simulated input held at each rank's true size, padded to the longest piece (its grad trimmed back)."""
    if not isinstance(layout, Shard):
        return x
    every = rank_pieces(layout, int(shape[layout.dim]), tp.size)
    return x if is_even(every) else C.tp_padded_piece(x, layout.dim, every, tp.group)


def _returned_values(args: tuple, local: LocalValues, unpacked: dict[str, Any]) -> tuple:
    """What the local program returns: outputs Replicate; the inputs as each rank holds them (Thunder returns them
    under "flat_args", updated where they were written in place, e.g. a KV cache)."""
    def as_returned(tree):
        return tree_map(lambda x: _returned(x, local, unpacked), tree)
    if not (args and isinstance(args[0], dict) and "flat_args" in args[0]):
        return as_returned(args)
    def held(x):
        return unpacked.get(x.name, local.values.get(x.name, x)) if isinstance(x, Proxy) else x
    first = {k: tree_map(held, v) if k == "flat_args" else as_returned(v) for k, v in args[0].items()}
    return (first, *as_returned(args[1:]))


def _returned(x: Any, local: LocalValues, unpacked: dict[str, Any]) -> Any:
    if isinstance(x, TensorProxy):
        return unpacked[x.name] if x.name in unpacked else local.get(local.schedule.resolved(x, REPLICATE)[-1])
    if isinstance(x, Proxy):
        return local.values.get(x.name, x)
    return x


def _emit(step: Step, needs: list[Need], local: LocalValues) -> None:
    bsym, strategy = step.bsym, step.strategy
    outputs = tree_flatten(bsym.output)[0]
    if not any(isinstance(o, TensorProxy) for o in outputs):
        _emit_metadata_query(bsym, local)
        return
    if outputs[0].name in local.schedule.aliases:  # an annotation: its output is read through the schedule's alias
        return
    checkpointed = any(ProxyTag.RECOMPUTE_IN_BACKWARD in o.tags for o in outputs if isinstance(o, Proxy))
    flat, spec = tree_flatten((bsym.args, bsym.kwargs))
    needed = iter(needs)
    local_flat = [
        _local_input(bsym, next(needed), local, checkpointed) if isinstance(x, TensorProxy)
        else local.values.get(x.name, x) if isinstance(x, Proxy)
        else x
        for x in flat
    ]
    args, kwargs = tree_unflatten(local_flat, spec)
    emitted_from = len(get_tracectx().bound_symbols)
    with in_grad_mode_of([bsym]):
        result = (strategy.local or bsym.sym)(*args, **kwargs)
    where = local.names.module(bsym) or bsym.sym.name
    # another transform's collective (context parallelism's) keeps its label
    text = label_of(bsym) or f"{where}: {bsym.sym.name} computed on shards"
    label_collectives(get_tracectx().bound_symbols[emitted_from:], text)
    for logical, value in zip(outputs, tree_flatten(result)[0], strict=True):
        if isinstance(logical, Proxy):
            local.values[logical.name] = value
    if checkpointed:
        _recompute_in_backward(get_tracectx().bound_symbols[emitted_from:], outputs, local)


def _local_input(consumer: BoundSymbol, need: Need, local: LocalValues, checkpointed: bool) -> TensorProxy:
    """The input `need` asks for, its collectives labelled; for a checkpointed op, the collectives that make it are
    recomputed in the backward when the value itself is (computed inside the checkpointed region), and kept when it
    comes from outside (an embedding's all_reduce feeding the first checkpointed block is not re-issued)."""
    emitted_from = len(get_tracectx().bound_symbols)
    value = local.get(need)
    emitted = get_tracectx().bound_symbols[emitted_from:]
    if emitted:
        label_collectives(emitted, local.names.of_need(consumer, need, local.layouts[need.value.name]))
    if checkpointed and ProxyTag.RECOMPUTE_IN_BACKWARD in need.value.tags:
        recompute_in_backward(get_tracectx().bound_symbols[emitted_from:])
    return value


def _recompute_in_backward(emitted: list[BoundSymbol], outputs: list, local: LocalValues) -> None:
    """recompute_in_backward, except for outputs the logical trace keeps (a checkpointed region's outputs)."""
    recompute_in_backward(emitted)
    for logical in outputs:
        if isinstance(logical, Proxy) and ProxyTag.RECOMPUTE_IN_BACKWARD not in logical.tags:
            local.values[logical.name].tags.discard(ProxyTag.RECOMPUTE_IN_BACKWARD)


def _emit_metadata_query(bsym, local: LocalValues) -> None:
    """Shape/dtype queries: on replicated inputs, and shapes of any, re-run them (a shape's sharded dim scaled back
    to its full length, so that symbolic values stay symbolic); other queries of sharded ones take the logical
    (global) answer."""
    tensors = _tensors(bsym)
    is_shape = bsym.sym.id == prims.PrimIDs.SHAPE
    if is_shape or all(isinstance(local.layouts[t.name], Replicate) for t in tensors):
        def held(x):
            return local.value_of(x) if isinstance(x, TensorProxy) else local.values.get(x.name, x)
        args, kwargs = tree_map(lambda x: held(x) if isinstance(x, Proxy) else x, (bsym.args, bsym.kwargs))
        result = bsym.sym(*args, **kwargs)
        if is_shape:
            result = _full_shape(result, tensors[0], local)
        for logical, value in zip(tree_flatten(bsym.output)[0], tree_flatten(result)[0], strict=True):
            if isinstance(logical, Proxy):
                local.values[logical.name] = value
        return
    for logical in tree_flatten(bsym.output)[0]:
        if isinstance(logical, NumberProxy):
            local.values[logical.name] = logical.value


def _full_shape(shape: tuple, logical: TensorProxy, local: LocalValues) -> tuple:
    """The logical shape of `logical`, whose local piece has `shape` (symbolic dims as the piece has them)."""
    layout = local.layouts[logical.name]
    if not isinstance(layout, Shard):
        return shape
    n = local.full_shape(logical)[layout.dim]
    n = local.values.get(n.name, n) if isinstance(n, Proxy) else n
    return (*shape[: layout.dim], n, *shape[layout.dim + 1 :])
