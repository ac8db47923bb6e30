"""An automatic plan: the styles that minimize a training step's communication under a parameter-memory budget.

The model is traced once from example inputs (Thunder's interpreter, stopped before anything runs, so meta tensors
and meta-device models work). Every module that owns parameters is a decision; modules that differ only in their
block index (`transformer.h.3.mlp.fc`) are one decision, searched once. Each decision picks a style (or none) for
its modules; propagation lays out everything in between, and `communication.py` prices the result: the forward
and backward collectives of one step under reshard.py's alpha-beta cost. The search is coordinate descent from
"every weight matrix sharded" (plain column splits, by whole heads where the trace splits the output into heads),
deterministic, so every rank finds the same plan. The interpretation is kept: a compile of the same module whose
first call is like the example starts from it (`TensorParallel` hands it over).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product

import torch
import torch.nn as nn
import thunder
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import Transform, dce

from thunder_tp.communication import Communication, communication
from thunder_tp.constraints import constrain_styled_ops
from thunder_tp.layouts import REPLICATE, Layout, TPGroup, local_shape
from thunder_tp.prologue import flat_args, trace_body, unpacked_tensor_names
from thunder_tp.propagation import Propagation
from thunder_tp.styles import (
    ColwiseParallel,
    FeatureShardedNorm,
    KVCacheParallel,
    RowwiseParallel,
    Style,
    check_tied_layouts,
    match_plan,
    plan_key_matches,
    planned_tensors,
    tied_parameters,
)
from thunder_tp.thunder_private import Interpretation, interpretations_kept, meta_traced_on, original_module

_SWEEPS = 4
#: the default budget's slack over "every weight matrix sharded": room to keep a small matrix whole (a router)
#: where that saves communication
BUDGET_SLACK = 0.01


@dataclass(frozen=True)
class Decision:
    """Modules planned alike (one per block, or tied ones) and the styles they may get, one per module."""

    modules: tuple[str, ...]
    choices: tuple[tuple[Style | None, ...], ...]


class AutoPlan(dict):
    """A plan (module name or glob -> style) found by `auto`, with what the search measured."""

    def __init__(self, plan: dict[str, Style], pricing: _Pricing, *, comm: Communication, bytes_per_rank: int,
                 budget: int, seconds: float, trace_seconds: float):
        super().__init__(plan)
        self.tp_size, self.communication, self.bytes_per_rank, self.budget = pricing.tp.size, comm, bytes_per_rank, budget
        self.seconds, self.trace_seconds, self.evaluated = seconds, trace_seconds, pricing.evaluated
        self._pricing, self._handed = pricing, False

    @property
    def trace_reused(self) -> bool:
        """Whether a compile started from the search's trace instead of interpreting the model again."""
        interpretation = self._pricing.trace.interpretation
        return interpretation is not None and interpretation.reused

    def take_interpretation(self) -> Interpretation | None:
        """Thunder's interpretation of the traced call, once (a compile that starts from it rewrites it in place)."""
        handed, self._handed = self._handed, True
        return None if handed else self._pricing.trace.interpretation

    def price(self, plan: dict[str, Style]) -> tuple[Communication, int]:
        """Another plan's communication per step and parameter bytes per rank, priced on the same trace."""
        if self.trace_reused:
            raise RuntimeError("thunder_tp.plans.auto: price other plans before the first call of a model jitted with "
                               "this plan: its compile started from the search's trace and rewrote it for TP")
        return self._pricing.price_plan(plan)

    def __str__(self) -> str:
        head = (
            f"thunder_tp.plans.auto (TP={self.tp_size}): parameters {self.bytes_per_rank / 2**20:.2f} MiB per rank "
            f"(budget {self.budget / 2**20:.2f} MiB); per step {self.communication}; search {self.seconds:.2f} s "
            f"(trace {self.trace_seconds:.2f} s, {self.evaluated} plans priced)"
        )
        return "\n".join([head, *(f"  {k!r}: {v!r}" for k, v in self.items())])


def auto(model: nn.Module, *example_args, tp_size: int, memory: int | None = None, for_inference: bool = False,
         **example_kwargs) -> AutoPlan:
    """The plan with the least communication per step (forward and backward; forward only `for_inference`) whose
    parameters fit `memory` bytes per rank (default: every weight matrix sharded, K/V heads replicated where a
    block has fewer heads than ranks, 1-D parameters whole, plus 1%), searched on a trace of `model(*example_args,
    **example_kwargs)` (shapes only: meta tensors and meta-device models are fine)."""
    start = time.perf_counter()
    module = original_module(model)
    trace = traced(module, example_args, example_kwargs)
    trace_seconds = time.perf_counter() - start
    pricing = _Pricing(module, trace, TPGroup(None, tp_size, 0), training=not for_inference)
    decisions = _decisions(module, trace, tp_size)
    budget = memory if memory is not None else _default_budget(module, decisions, pricing)
    choice, (comm, used) = _search(decisions, pricing, budget)
    plan = _plan(module, decisions, choice)
    return AutoPlan(plan, pricing, comm=comm, bytes_per_rank=used, budget=budget,
                    seconds=time.perf_counter() - start, trace_seconds=trace_seconds)


# --- the trace ------------------------------------------------------------------------------------------------


@dataclass
class Traced:
    """The logical computation trace of a module call, parameter proxy name -> qualified parameter name, and the
    interpretation it came from (which the compile of the same call can start from)."""

    computation: TraceCtx
    names: dict[str, str]
    interpretation: Interpretation | None = None


class _Stop(Exception):
    pass


class _Capture(Transform):
    """Keeps the computation trace and stops the compile before anything else happens."""

    def transform_traces_pre_prologue(self, prologue, computation, epilogue, **kwargs):
        self.traced = Traced(dce(computation), unpacked_tensor_names(prologue))  # as TensorParallel propagates it
        raise _Stop


def traced(module: nn.Module, args: tuple, kwargs: dict) -> Traced:
    """Trace `module(*args, **kwargs)` with Thunder's interpreter, running nothing. Meta-device tensors are traced as
    CPU ones (HF's rotary embedding, for one, opens an autocast region on its inputs' device, which meta is not)."""
    from thunder_tp.plans.hf import register_lookasides

    register_lookasides(module)
    tensors = [*module.parameters(), *module.buffers()]
    args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, _off_meta, (args, kwargs))
    capture = _Capture()
    with meta_traced_on(tensors, torch.device("cpu")), interpretations_kept() as kept:
        try:
            thunder.jit(module, transforms=[capture])(*args, **kwargs)
        except _Stop:
            capture.traced.interpretation = kept[-1] if kept else None
            return capture.traced
    raise RuntimeError("thunder_tp.plans.auto: Thunder compiled the model without reaching the TP transform stage")


def _off_meta(t: torch.Tensor) -> torch.Tensor:
    """An example input on the CPU (a meta one becomes zeros of its shape: only shapes are traced)."""
    return torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t


# --- decisions ------------------------------------------------------------------------------------------------


def _decisions(module: nn.Module, trace: Traced, size: int) -> list[Decision]:
    """One decision per kind of parameter-owning module (modules differing only in block indices alike, tied
    modules together; KV caches too), in the order their parameters enter the trace."""
    owners: dict[str, list[str]] = {}
    for name, m in module.named_modules():
        if any(True for _ in m.parameters(recurse=False)) or _is_cache(m):
            owners.setdefault(_block_pattern(name), []).append(name)
    groups = _merge_tied(module, list(owners.values()))
    order = {n.rpartition(".")[0]: i for i, n in enumerate(trace.names.values())}
    groups.sort(key=lambda g: min(order.get(m, math.inf) for m in g))
    return [_decision(module, trace, g, size) for g in groups]


def _merge_tied(module: nn.Module, groups: list[list[str]]) -> list[list[str]]:
    """Groups sharing a parameter (a tied embedding and head) merged: one tensor has one layout."""
    merged: list[list[str]] = []
    index: dict[int, int] = {}  # parameter id -> its merged group
    for group in groups:
        ids = [id(p) for name in group for p in module.get_submodule(name).parameters(recurse=False)]
        i = next((index[p] for p in ids if p in index), len(merged))
        if i == len(merged):
            merged.append([])
        merged[i].extend(group)
        index.update((p, i) for p in ids)
    return merged


def _decision(module: nn.Module, trace: Traced, group: list[str], size: int) -> Decision:
    """The styles each module of `group` may get (a style per module; tied modules: the combinations that split
    their shared parameter one way)."""
    kinds = {}
    for name in group:
        kinds.setdefault(_signature(module.get_submodule(name)), name)
    per_kind = {sig: _choices(module.get_submodule(first), first, trace, size) for sig, first in kinds.items()}
    names = list(kinds)
    combos = []
    for combo in product(*(per_kind[n] for n in names)):
        by_kind = dict(zip(names, combo))
        combos.append(tuple(by_kind[_signature(module.get_submodule(m))] for m in group))
    return Decision(tuple(group), tuple(combos))


def _signature(m: nn.Module) -> tuple:
    return (type(m).__name__, tuple((n, tuple(p.shape)) for n, p in m.named_parameters(recurse=False)))


def _choices(m: nn.Module, name: str, trace: Traced, size: int) -> list[Style | None]:
    """The styles worth trying for one module (None: replicated), sharded ones first."""
    if isinstance(m, nn.Linear):
        column = _column_style(name, trace, size)
        gathered = ColwiseParallel(REPLICATE, REPLICATE, column.blocks, column.unit, column.replicable)
        return [column, RowwiseParallel(), RowwiseParallel(output_layout=None), gathered, None]
    if isinstance(m, nn.Embedding):
        return [RowwiseParallel(), ColwiseParallel(output_layout=None), RowwiseParallel(output_layout=None), None]
    if _is_cache(m):
        return [KVCacheParallel(), None]
    if all(p.ndim == 1 for p in m.parameters(recurse=False)):
        return [None, FeatureShardedNorm()]
    return [None]


def _is_cache(m: nn.Module) -> bool:
    """A module with no parameters that holds (batch, heads, positions, head size) buffers: a KV cache."""
    buffers = list(m.buffers(recurse=False))
    return not any(True for _ in m.parameters(recurse=False)) and bool(buffers) and all(b.ndim == 4 for b in buffers)


def _column_style(name: str, trace: Traced, size: int) -> ColwiseParallel:
    """Column-parallel by whole heads where the trace cuts the output into blocks (a split) and heads (a view to
    (..., heads, head_size)); a block with fewer heads than ranks may be replicated."""
    weight = next((p for p, n in trace.names.items() if n == f"{name}.weight"), None)
    blocks = _output_blocks(trace.computation, weight) if weight else None
    if blocks is None:
        return ColwiseParallel()
    sizes = tuple(n for n, _ in blocks)
    unit = math.gcd(*(d for _, (h, d) in blocks))
    replicable = tuple(h < size for _, (h, _d) in blocks)
    return ColwiseParallel(blocks=sizes, unit=unit, replicable=replicable)


def _output_blocks(trace: TraceCtx, weight: str) -> list[tuple[int, tuple[int, int]]] | None:
    """[(block size, (heads, head size))] of the first linear that uses `weight`, when its output is viewed as
    heads (after a split into blocks, if any)."""
    users: dict[str, list] = {}
    for b in trace.bound_symbols:
        for a in b.flat_proxy_args:
            users.setdefault(a.name, []).append(b)
    linear = next((b for b in users.get(weight, []) if b.sym.id == ltorch.linear.id), None)
    if linear is None:
        return None
    y = linear.output
    parts = [y]
    for b in users.get(y.name, []):
        if b.sym.id == ltorch.split.id and _last_dim(b, y):
            parts = [o for o in b.output if isinstance(o, TensorProxy)]
    heads = [_heads(p, users) for p in parts]
    if any(h is None for h in heads):
        return None
    return [(p.shape[-1], h) for p, h in zip(parts, heads)]


def _last_dim(split, t: TensorProxy) -> bool:
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    return dim in (-1, t.ndim - 1)


def _heads(t: TensorProxy, users: dict, depth: int = 12) -> tuple[int, int] | None:
    """(heads, head size) of the nearest view of `t` that cuts its last dim in two, through at most `depth`
    same-shape ops (a norm over all heads and its casts, as OLMo-2's, come before the view)."""
    frontier, seen = [t], {t.name}
    for _ in range(depth + 1):
        reached = []
        for x in frontier:
            for b in users.get(x.name, []):
                out = b.output
                if not isinstance(out, TensorProxy) or out.name in seen:
                    continue
                if b.sym.id in (ltorch.reshape.id, ltorch.view.id) and out.ndim == x.ndim + 1 and \
                        tuple(out.shape[: x.ndim - 1]) == tuple(x.shape[:-1]) and out.shape[-2] * out.shape[-1] == x.shape[-1]:
                    return out.shape[-2], out.shape[-1]
                if tuple(out.shape) == tuple(x.shape):
                    seen.add(out.name)
                    reached.append(out)
        frontier = reached
    return None


# --- pricing --------------------------------------------------------------------------------------------------


@dataclass
class _Pricing:
    """Prices a choice of styles: (communication per step, parameter bytes per rank), memoized."""

    module: nn.Module
    trace: Traced
    tp: TPGroup
    training: bool
    evaluated: int = 0
    _memo: dict = field(default_factory=dict)

    def styles(self, decisions: list[Decision], choice: tuple[int, ...]) -> dict[str, Style]:
        """Module name -> style for a choice (an index into each decision's combinations)."""
        styles = {}
        for d, i in zip(decisions, choice):
            styles.update((m, s) for m, s in zip(d.modules, d.choices[i]) if s is not None)
        return styles

    def price(self, decisions: list[Decision], choice: tuple[int, ...]) -> tuple[Communication, int] | None:
        """None where the choice cannot run (a split that does not divide, two layouts for a tied tensor)."""
        if choice not in self._memo:
            self._memo[choice] = self._price(self.styles(decisions, choice))
        return self._memo[choice]

    def memory_of(self, decisions: list[Decision], choice: tuple[int, ...]) -> int | None:
        """Parameter bytes per rank of a choice (no propagation); None where it does not split validly."""
        try:
            return self.memory(planned_tensors(self.module, self.styles(decisions, choice), self.tp.size).parameters)
        except (ValueError, TypeError):
            return None

    def price_plan(self, plan: dict[str, Style]) -> tuple[Communication, int]:
        """A plan's price; a ValueError if it cannot run on this model at this TP size."""
        priced = self._price(match_plan(self.module, plan))
        if priced is None:
            raise ValueError(f"thunder_tp.plans.auto: the plan does not run on this model over {self.tp.size} ranks")
        return priced

    def _price(self, styles: dict[str, Style]) -> tuple[Communication, int] | None:
        try:
            planned = planned_tensors(self.module, styles, self.tp.size)
            check_tied_layouts(tied_parameters(self.module), planned.parameters)
        except (ValueError, TypeError):
            return None
        self.evaluated += 1
        comm = self.communication(planned.parameters | planned.buffers, planned.weight_styles)
        return None if comm is None else (comm, self.memory(planned.parameters))

    def communication(self, layouts: dict[str, Layout], weight_styles: dict[str, Style]) -> Communication | None:
        """The collectives of one step with these tensor layouts and styles (None: propagation refuses)."""
        computation, names = self.trace.computation, self.trace.names
        inputs = flat_args(computation)
        initial = {a.name: layouts.get(names.get(a.name, ""), REPLICATE) for a in inputs}
        styled = {p: weight_styles[n] for p, n in names.items() if n in weight_styles}
        logical = constrain_styled_ops(computation, styled)
        propagation = Propagation(dict(initial), self.tp, frozenset(names))
        try:
            steps = propagation.run(trace_body(logical))
        except NotImplementedError:
            return None
        returned = logical.bound_symbols[-1].args
        if returned and isinstance(returned[0], dict) and "flat_args" in returned[0]:  # inputs handed back as held
            returned = ({k: v for k, v in returned[0].items() if k != "flat_args"}, *returned[1:])
        return communication(steps, returned, propagation.layouts, self.tp, inputs, training=self.training)

    def memory(self, layouts: dict[str, Layout], only: str | None = None) -> int:
        """Parameter bytes per rank (of parameter `only`, if given)."""
        return sum(
            math.prod(local_shape(p.shape, layouts.get(n, REPLICATE), self.tp.size)) * p.element_size()
            for n, p in self.module.named_parameters() if only in (None, n)
        )


def _default_budget(module: nn.Module, decisions: list[Decision], pricing: _Pricing) -> int:
    """Every weight matrix of a Linear / Embedding split by its first valid style (column / vocabulary first; K/V
    heads replicated where a block has fewer heads than ranks), every other parameter whole; plus BUDGET_SLACK."""
    layouts: dict[str, Layout] = {}
    for d in decisions:
        for j, name in enumerate(d.modules):
            if isinstance(module.get_submodule(name), (nn.Linear, nn.Embedding)):
                layouts |= next(filter(None, (_split_alone(pricing, name, c[j]) for c in d.choices)), {})
    return int(pricing.memory({n: x for n, x in layouts.items() if n.endswith(".weight")}) * (1 + BUDGET_SLACK))


def _split_alone(pricing: _Pricing, name: str, style: Style | None) -> dict[str, Layout] | None:
    """The layouts of module `name`'s parameters under `style`, if it shards them validly on its own."""
    if style is None:
        return None
    try:
        return planned_tensors(pricing.module, {name: style}, pricing.tp.size).parameters
    except (ValueError, TypeError):
        return None


def _search(decisions: list[Decision], pricing: _Pricing, budget: int) -> tuple[tuple[int, ...], tuple]:
    """Coordinate descent from two starts, the better end winning (ties: the first): from the most sharded plan in
    trace order, and from a greedy pass (`_built`) with the weight matrices first (norms then decide once the
    matrices around them have found their pattern)."""
    sharded = _most_sharded(decisions, pricing, budget)
    trace_order = list(range(len(decisions)))
    vectors = [all(s is None or isinstance(s, (FeatureShardedNorm, KVCacheParallel)) for c in d.choices for s in c)
               for d in decisions]
    matrices_first = sorted(trace_order, key=lambda i: vectors[i])
    ends = [_descended(decisions, pricing, budget, sharded, trace_order),
            _descended(decisions, pricing, budget, _built(decisions, pricing, budget, sharded, matrices_first), matrices_first)]
    choice = min(ends, key=lambda c: _score(pricing.price(decisions, c)))
    pairs = [i for i in range(len(decisions) - 1) if vectors[i] != vectors[i + 1]]
    while (better := _pair_moved(decisions, pricing, budget, choice, pairs)) != choice:
        choice = _descended(decisions, pricing, budget, better, trace_order)
    return choice, pricing.price(decisions, choice)


def _pair_moved(decisions: list[Decision], pricing: _Pricing, budget: int, choice: tuple[int, ...],
                pairs: list[int]) -> tuple[int, ...]:
    """The best change of a norm and the layer next to it in trace order (decisions i and i + 1 for i in `pairs`),
    which single changes cannot reach (a feature-split norm feeding a row-parallel head, against a replicated one
    feeding a column-parallel head); `choice` itself if none is cheaper."""
    best, moved = _score(pricing.price(decisions, choice)), choice
    for i in pairs:
        for a, b in product(range(len(decisions[i].choices)), range(len(decisions[i + 1].choices))):
            trial = (*choice[:i], a, b, *choice[i + 2:])
            priced = pricing.price(decisions, trial)
            if priced is not None and priced[1] <= budget and _score(priced) < best:
                best, moved = _score(priced), trial
    return moved


def _descended(decisions: list[Decision], pricing: _Pricing, budget: int, choice: tuple[int, ...],
               order: list[int]) -> tuple[int, ...]:
    """Each decision in turn (in `order`) takes its cheapest combination (communication cost, then memory, then the
    earlier choice), the others fixed, until nothing changes."""
    best = _score(pricing.price(decisions, choice))
    for _ in range(_SWEEPS):
        changed = False
        for i in order:
            for j in range(len(decisions[i].choices)):
                trial = (*choice[:i], j, *choice[i + 1:])
                priced = pricing.price(decisions, trial)
                if priced is not None and priced[1] <= budget and _score(priced) < best:
                    choice, best, changed = trial, _score(priced), True
        if not changed:
            break
    return choice


def _built(decisions: list[Decision], pricing: _Pricing, budget: int, sharded: tuple[int, ...],
           order: list[int]) -> tuple[int, ...]:
    """Each decision (in `order`) takes its cheapest choice given those before it, with those after it replicated
    (so that a column-parallel layer finds its row-parallel partner next, as Megatron pairs them); the budget is
    checked as if those after it were most sharded, so that it still holds at the end."""
    replicated = [d.choices.index((None,) * len(d.modules)) for d in decisions]
    chosen = list(sharded)
    for k, i in enumerate(order):
        later = set(order[k + 1:])
        best = None
        for j in range(len(decisions[i].choices)):
            at_most = tuple(sharded[x] if x in later else chosen[x] for x in range(len(decisions)))
            used = pricing.memory_of(decisions, (*at_most[:i], j, *at_most[i + 1:]))
            if used is None or used > budget:
                continue
            trial = tuple(replicated[x] if x in later else chosen[x] for x in range(len(decisions)))
            priced = pricing.price(decisions, (*trial[:i], j, *trial[i + 1:]))
            if priced is not None and (best is None or priced[0].cost < best[0]):
                best = (priced[0].cost, j)
        chosen[i] = best[1] if best else sharded[i]
    return tuple(chosen)


def _score(priced: tuple[Communication, int]) -> tuple[float, int]:
    return priced[0].cost, priced[1]


def _most_sharded(decisions: list[Decision], pricing: _Pricing, budget: int) -> tuple[int, ...]:
    """Each decision's first combination that splits its own parameters validly (column-parallel first: K/V heads
    replicated where they are too few); where that is over budget, each decision's combination with the fewest
    parameter bytes; an error if even that is over budget."""
    first = tuple(
        next((j for j, c in enumerate(d.choices) if all(s is None or _split_alone(pricing, m, s) is not None
                                                         for m, s in zip(d.modules, c))), len(d.choices) - 1)
        for d in decisions
    )
    choice = first
    if (pricing.memory_of(decisions, first) or 0) > budget:
        fewest = list(first)
        for i, d in enumerate(decisions):
            sizes = {j: pricing.memory_of(decisions, (*first[:i], j, *first[i + 1:])) for j in range(len(d.choices))}
            fewest[i] = min((j for j in sizes if sizes[j] is not None), key=lambda j: (sizes[j], j), default=first[i])
        choice = tuple(fewest)
    priced = pricing.price(decisions, choice)
    if priced is None:
        raise RuntimeError("thunder_tp.plans.auto: the plan with every weight matrix sharded does not run on this model "
                           "(propagation refused it); please report the model, and pass a hand plan meanwhile")
    if priced[1] > budget:
        raise MemoryError(_over_budget(pricing, pricing.styles(decisions, choice), priced[1], budget))
    return choice


def _over_budget(pricing: _Pricing, styles: dict[str, Style], used: int, budget: int) -> str:
    """Which parameters dominate when even the most sharded plan does not fit."""
    layouts = planned_tensors(pricing.module, styles, pricing.tp.size).parameters
    sizes = sorted(((pricing.memory({n: layouts.get(n, REPLICATE)}, only=n), n) for n, _ in pricing.module.named_parameters()),
                   reverse=True)
    top = ", ".join(f"{n} ({b / 2**20:.2f} MiB)" for b, n in sizes[:5])
    return (f"thunder_tp.plans.auto: no plan fits {budget / 2**20:.2f} MiB of parameters per rank on {pricing.tp.size} "
            f"ranks: the most sharded one needs {used / 2**20:.2f} MiB; the largest per rank: {top}. Raise memory=, use "
            "more ranks, or also shard the data-parallel way (FSDP)")


# --- the plan -------------------------------------------------------------------------------------------------


def _plan(module: nn.Module, decisions: list[Decision], choice: tuple[int, ...]) -> dict[str, Style]:
    """Module names -> styles, a glob per decision where it matches exactly its modules."""
    names = [n for n, _ in module.named_modules() if n]
    plan: dict[str, Style] = {}
    for d, i in zip(decisions, choice):
        styled = {m: s for m, s in zip(d.modules, d.choices[i]) if s is not None}
        for style in dict.fromkeys(styled.values()):
            members = [m for m, s in styled.items() if s == style]
            plan.update(_keys(members, style, names))
    return plan


def _keys(members: list[str], style: Style, names: list[str]) -> Iterator[tuple[str, Style]]:
    """One glob for modules that differ only in block indices, when it matches nothing else; else their names."""
    parts = [m.split(".") for m in members]
    pattern = ".".join(p[0] if len(set(p)) == 1 else "*" for p in zip(*parts)) if len({len(p) for p in parts}) == 1 else ""
    if len(members) > 1 and sorted(plan_key_matches(pattern, names)) == sorted(members):
        yield pattern, style
        return
    yield from ((m, style) for m in members)


def _block_pattern(name: str) -> str:
    """`name` with every block index a glob: transformer.h.3.mlp.fc -> transformer.h.*.mlp.fc."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)
