"""The communication of a propagated program, derived once: every value each step needs in another layout, every
grad that is summed over the TP group, and the collectives they issue each way. The rewrite emits exactly these
(`rewriting/program.py`), and the automatic plan prices them (`Communication`, under reshard.py's alpha-beta cost): what
runs is what was priced by construction.

Which values have grads is decided here too, for both: the trace's inputs that require one (in training), and
an op's floating-point results when one of the arguments it is differentiable in has one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx

from thunder_tp.collectives.annotate import tp_annotate
from thunder_tp.collectives.reshard import collective_bytes, collective_cost, collective_kind, nbytes, wire_bytes
from thunder_tp.costs import ALPHA_BYTES
from thunder_tp.layouts import REPLICATE, Layout, Replicate, Shard, TPGroup, normalize
from thunder_tp.propagation.engine import Step
from thunder_tp.thunder_internals.prologue import flat_args

#: ops that read their later tensor arguments for metadata only (`mask.to(query)`: query's dtype and device)
_GRAD_FROM_FIRST = frozenset(s.id for s in (ltorch.to, ltorch.type_as, ltorch.expand_as, ltorch.view_as,
                                            ltorch.reshape_as))
#: ops whose result has no grad whatever their arguments
_NO_GRAD = frozenset(s.id for s in (ltorch.zeros_like, ltorch.ones_like, ltorch.full_like, ltorch.empty_like))


@dataclass(frozen=True)
class Need:
    """A step's tensor argument `value`, needed in `layout`; `into_tp_region`: a Replicate value used by sharded
    compute that has a grad, which is then a Partial sum (reduced by the value's `GradSum`)."""

    value: TensorProxy
    layout: Layout
    into_tp_region: bool = False

    @property
    def key(self) -> tuple[str, Layout, bool]:
        """What identifies the value it asks for (proxies are not hashable)."""
        return self.value.name, self.layout, self.into_tp_region


@dataclass(frozen=True)
class Redistribution:
    """`value`, which is `src`, made `dst` (once, whatever the number of steps that need it)."""

    value: TensorProxy
    src: Layout
    dst: Layout
    needs_grad: bool
    size: int

    @property
    def forward(self) -> str | None:
        """The collective it issues (None: nothing, or a local slice)."""
        return collective_kind(self.src, self.dst, self.value.shape, self.size)

    @property
    def bytes(self) -> int:
        """Bytes of the collective each way, the padding of uneven pieces included."""
        return collective_bytes(self.src, self.dst, self.value, self.size)

    @property
    def backward(self) -> str | None:
        """The conjugate's collective: a slice's (a reduce_scatter's, a gather then slice's) grad is all-gathered,
        an all_to_all's sent back; a reduction's and a gather's grads are local."""
        if not self.needs_grad or self.src == self.dst or not isinstance(self.dst, Shard):
            return None
        return "all_to_all" if self.forward == "all_to_all" else "all_gather"


@dataclass(frozen=True)
class GradSum:
    """The Partial grad of a Replicate `value` used by sharded compute, summed over the TP group.

    `gathered`: `value` is Shard and needed whole only there, so its gather and the sum are one symbol (forward
    all_gather, backward reduce_scatter). `coalesced`: `value` is computed from the trace's inputs alone (a
    replicated parameter, maybe cast or broadcast), so its grad is summed with the others of its dtype in one
    all_reduce at the end of the backward."""

    value: TensorProxy
    gathered: bool = False
    coalesced: bool = False
    layout: Layout = REPLICATE  # the value's own (a gathered value's Shard: its gather's padding is priced)

    @property
    def backward(self) -> str:
        return "reduce_scatter" if self.gathered else "all_reduce"


@dataclass
class Communication:
    """Collectives per step each way (kind -> count) and their summed alpha-beta cost (bytes-equivalent)."""

    forward: Counter = field(default_factory=Counter)
    backward: Counter = field(default_factory=Counter)
    cost: float = 0.0

    @property
    def count(self) -> int:
        """Collectives per step, both ways."""
        return sum(self.forward.values()) + sum(self.backward.values())

    def add(self, kind: str, size_bytes: int, group_size: int, *, backward: bool = False) -> None:
        """One collective of `kind` on a tensor of `size_bytes` bytes over `group_size` ranks."""
        (self.backward if backward else self.forward)[kind] += 1
        self.cost += collective_cost(kind, size_bytes, group_size)

    def __str__(self) -> str:
        def each(c):
            return " + ".join(f"{n} {k}" for k, n in sorted(c.items())) or "none"
        return (f"forward {each(self.forward)}; backward {each(self.backward)}; "
                f"cost {self.cost / 2**20:.2f} MiB-equivalent")


@dataclass
class CollectiveSchedule:
    """What a propagated program communicates: per step the value each tensor argument is read as, the
    redistributions and grad sums those reads imply, the replicated chunks of inputs whose grads are summed, and
    the returned values. An annotation emits nothing: its output is an alias, its input in the annotated layout."""

    tp: TPGroup
    needs_grad: set[str]
    needs: list[list[Need]]
    returned: list[Need]
    aliases: dict[str, Need]
    redistributions: dict[tuple[str, Layout], Redistribution]
    grad_sums: dict[str, GradSum]
    replica_sums: list[TensorProxy]
    issued: list[tuple[str, int]]
    issued_backward: list[tuple[str, int]] = field(default_factory=list)

    def resolved(self, t: TensorProxy, layout: Layout, into_tp_region: bool = False) -> list[Need]:
        """What reading `t` in `layout` reads, through aliases: the value it ends up with last, after the needs
        that materialize an alias read in another layout than its own."""
        alias = self.aliases.get(t.name)
        if alias is None:
            return [Need(t, layout, into_tp_region)]
        if alias.layout == layout:
            return self.resolved(alias.value, layout, into_tp_region)
        return [*self.resolved(alias.value, alias.layout), Need(t, layout, into_tp_region)]

    def price(self) -> Communication:
        """The collectives each way and their cost (a coalesced all_reduce pays its latency once per dtype)."""
        comm = Communication()
        size = self.tp.size
        for r in self.redistributions.values():
            if r.forward:
                comm.add(r.forward, r.bytes, size)
            if r.backward:
                comm.add(r.backward, r.bytes, size, backward=True)
        for kind, full_bytes in self.issued:
            comm.add(kind, full_bytes, size)
        for kind, full_bytes in self.issued_backward:
            comm.add(kind, full_bytes, size, backward=True)
        coalesced: set = set()
        for s in self.grad_sums.values():
            if s.gathered:  # the gather is the grad sum's own: forward all_gather, backward reduce_scatter
                comm.add("all_gather", wire_bytes(s.value, s.layout, size), size)
            if not s.coalesced:
                comm.add(s.backward, wire_bytes(s.value, s.layout, size), size, backward=True)
                continue
            first = s.value.dtype not in coalesced
            coalesced.add(s.value.dtype)
            comm.backward["all_reduce"] += first
            comm.cost += collective_cost("all_reduce", nbytes(s.value), size) - (0 if first else ALPHA_BYTES)
        return comm


def schedule_collectives(
    trace: TraceCtx, steps: list[Step], layouts: dict[str, Layout], tp: TPGroup, *, training: bool
) -> CollectiveSchedule:
    """The communication of `trace`'s `steps` (propagated: `layouts` holds every value's layout), forward and (when
    `training`) backward; what the program returns is made Replicate (but the inputs it hands back as held)."""
    inputs, returned = flat_args(trace), _returned_outputs(trace)
    input_names = {t.name for t in inputs}
    needs_grad = {t.name for t in inputs if training and t.requires_grad}
    schedule = CollectiveSchedule(tp, needs_grad, [], [], {}, {}, {}, [], [])
    from_inputs = set(input_names)  # computed from the inputs alone, with no communication on the way
    every: list[Need] = []  # every read, materializations of aliases included
    for step in steps:
        reads = _step_reads(step, schedule)
        schedule.needs.append([r[-1] for r in reads])
        every.extend(n for r in reads for n in r)
        tensors, outputs = _tensors(step.bsym.args, step.bsym.kwargs), _tensors(step.bsym.output)
        if any(t.name in schedule.needs_grad for t in _differentiable(step.bsym, tensors)) and outputs:
            schedule.needs_grad.update(o.name for o in outputs if dtypes.is_inexact_dtype(o.dtype))
        if reads and not step.strategy.issues and all(
                r[-1].value.name in from_inputs and layouts[r[-1].value.name] == r[-1].layout for r in reads):
            from_inputs.update(o.name for o in outputs)
    returned_reads = [schedule.resolved(t, REPLICATE) for t in _tensors(returned) if t.name not in input_names]
    schedule.returned = [r[-1] for r in returned_reads]
    every.extend(n for r in returned_reads for n in r)
    schedule.replica_sums = [t for t in inputs if t.name in schedule.needs_grad and _replicated_chunks(layouts[t.name])]
    schedule.redistributions = _redistributions(every, layouts, schedule.needs_grad, tp.size)
    schedule.grad_sums = _grad_sums(every, layouts, from_inputs)
    schedule.grad_sums |= {t.name: GradSum(t, coalesced=True) for t in schedule.replica_sums}
    schedule.issued = [issue for step in steps if _tensors(step.bsym.output) for issue in step.strategy.issues]
    with_grads = [step for step in steps if any(o.name in schedule.needs_grad for o in _tensors(step.bsym.output))]
    schedule.issued_backward = [issue for step in with_grads for issue in step.strategy.backward_issues]
    return schedule


def _step_reads(step: Step, schedule: CollectiveSchedule) -> list[list[Need]]:
    """For each tensor argument of `step`, the needs its read resolves to (the last one: what the op receives); an
    annotation reads nothing and makes its output an alias (a metadata query reads nothing either)."""
    tensors, outputs = _tensors(step.bsym.args, step.bsym.kwargs), _tensors(step.bsym.output)
    if not outputs:
        return []
    required = [normalize(r, t.ndim) for t, r in zip(tensors, step.strategy.inputs, strict=True)]
    if step.bsym.sym.id == tp_annotate.id:
        schedule.aliases[outputs[0].name] = Need(tensors[0], required[0])
        return []
    enters = step.strategy.enters_tp_region
    return [schedule.resolved(t, r, enters and isinstance(r, Replicate) and t.name in schedule.needs_grad)
            for t, r in zip(tensors, required, strict=True)]


def _redistributions(needs: list[Need], layouts: dict[str, Layout], needs_grad: set[str], size: int) -> dict:
    """One redistribution per (value, layout) that some need asks for in another layout than the value's, but for
    a value that a grad sum gathers (below)."""
    found: dict[tuple[str, Layout], Redistribution] = {}
    for n in needs:
        src = layouts[n.value.name]
        if src != n.layout and not _gathered_into_region(n, needs, layouts):
            found.setdefault((n.value.name, n.layout),
                             Redistribution(n.value, src, n.layout, n.value.name in needs_grad, size))
    return found


def _grad_sums(needs: list[Need], layouts: dict[str, Layout], from_inputs: set[str]) -> dict:
    """One grad sum per value that enters the TP region."""
    sums: dict[str, GradSum] = {}
    for n in needs:
        if n.into_tp_region and n.value.name not in sums:
            gathered = _gathered_into_region(n, needs, layouts)
            whole = n.value.name in from_inputs and layouts[n.value.name] == n.layout  # needs no communication
            sums[n.value.name] = GradSum(n.value, gathered, not gathered and whole, layouts[n.value.name])
    return sums


def _gathered_into_region(need: Need, needs: list[Need], layouts: dict[str, Layout]) -> bool:
    """Whether `need`'s value is Shard and needed whole only to enter the TP region (one gather_to_tp serves)."""
    name = need.value.name
    if not isinstance(layouts[name], Shard) or not isinstance(need.layout, Replicate):
        return False
    whole = [n for n in needs if n.value.name == name and isinstance(n.layout, Replicate)]
    return all(n.into_tp_region for n in whole)


def _returned_outputs(trace: TraceCtx) -> tuple:
    """What the program returns, less the inputs Thunder hands back as held ("flat_args": e.g. a KV cache)."""
    returned = trace.bound_symbols[-1].args
    if returned and isinstance(returned[0], dict) and "flat_args" in returned[0]:
        return ({k: v for k, v in returned[0].items() if k != "flat_args"}, *returned[1:])
    return returned


def _replicated_chunks(layout: Layout) -> bool:
    return isinstance(layout, Shard) and layout.is_replicated


def _differentiable(bsym, tensors: list[TensorProxy]) -> list[TensorProxy]:
    """The tensor arguments an op's result is differentiable in."""
    if bsym.sym.id in _NO_GRAD:
        return []
    return tensors[:1] if bsym.sym.id in _GRAD_FROM_FIRST else tensors


def _tensors(*trees) -> list[TensorProxy]:
    return [x for x in tree_flatten(trees)[0] if isinstance(x, TensorProxy)]
