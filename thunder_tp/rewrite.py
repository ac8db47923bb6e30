"""Local-shape rewrite: re-run every op on local pieces, with collectives wherever layouts change."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from thunder.core import prims
from thunder.core.proxies import NumberProxy, Proxy, TensorProxy
from thunder.core.pytree import tree_flatten, tree_map, tree_unflatten
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from thunder_tp import collectives as C
from thunder_tp.layouts import REPLICATE, Layout, Replicate, Shard, TPGroup
from thunder_tp.propagation.engine import Step
from thunder_tp.reshard import is_differentiable, redistribute


@dataclass
class LocalValues:
    """Local value of every logical proxy, and the collectives that produce other layouts of it (memoized)."""

    tp: TPGroup
    layouts: dict[str, Layout]
    only_sharded_consumers: set[str]
    values: dict[str, Any] = field(default_factory=dict)
    _memo: dict[tuple[str, Layout, bool], TensorProxy] = field(default_factory=dict)

    def get(self, t: TensorProxy, layout: Layout, *, into_tp_region: bool = False) -> TensorProxy:
        """`t` in `layout`; `into_tp_region`: a Replicate value used by sharded compute (its grad is Partial)."""
        into_tp_region = into_tp_region and isinstance(layout, Replicate) and is_differentiable(t)
        key = (t.name, layout, into_tp_region)
        if key not in self._memo:
            self._memo[key] = self._make(t, layout, into_tp_region)
        return self._memo[key]

    def _make(self, t: TensorProxy, layout: Layout, into_tp_region: bool) -> TensorProxy:
        src, group = self.layouts[t.name], self.tp.group
        if into_tp_region and isinstance(src, Shard) and t.name in self.only_sharded_consumers:
            return C.tp_gather_to_tp(self.values[t.name], src.dim, src.blocks, group)  # grad: reduce_scatter
        if into_tp_region:
            return C.tp_copy_to_tp(self.get(t, layout), group)
        return redistribute(self.values[t.name], src, layout, group)


def _consumers_of_gathers(steps: list[Step], layouts: dict[str, Layout], returned: set[str]) -> set[str]:
    """Sharded values gathered to Replicate only by sharded compute (their gather's grad is a reduce_scatter)."""
    kinds: dict[str, set[bool]] = defaultdict(set)
    for step in steps:
        for t, req in zip(_tensors(step.bsym), step.strategy.inputs):
            if isinstance(req, Replicate) and isinstance(layouts.get(t.name), Shard):
                kinds[t.name].add(step.strategy.is_sharded)
    return {name for name, k in kinds.items() if k == {True} and name not in returned}


def _tensors(bsym) -> list[TensorProxy]:
    return [x for x in tree_flatten((bsym.args, bsym.kwargs))[0] if isinstance(x, TensorProxy)]


def rewrite(trace: TraceCtx, steps: list[Step], layouts: dict[str, Layout], tp: TPGroup) -> TraceCtx:
    """The local program of `trace`: each step re-run on local pieces; outputs returned Replicate."""
    ret = trace.bound_symbols[-1]
    assert ret.sym.id == prims.PrimIDs.RETURN, "a computation trace ends with its return"
    arg_names = {a.name for a in tree_flatten((trace.args, trace.kwargs))[0] if isinstance(a, Proxy)}
    returned = {t.name for t in _tensors(ret)} - arg_names
    local = LocalValues(tp, layouts, _consumers_of_gathers(steps, layouts, returned))
    new = from_trace(trace)
    with tracectx(new):
        for bsym in trace.bound_symbols:
            if bsym.sym.id == prims.PrimIDs.UNPACK_TRIVIAL:
                new.bound_symbols.append(bsym.from_bsym())
                local.values[bsym.output.name] = bsym.output
        for step in steps:
            _emit(step, local)
        outputs = tree_map(lambda x: _returned(x, local, arg_names), ret.args)
        prims.python_return(*outputs)
    new.set_provenance(TraceProvenance("thunder_tp: tensor-parallel rewrite"))
    return new


def _returned(x: Any, local: LocalValues, arg_names: set[str]) -> Any:
    if isinstance(x, TensorProxy):
        return local.values[x.name] if x.name in arg_names else local.get(x, REPLICATE)
    if isinstance(x, Proxy):
        return local.values.get(x.name, x)
    return x


def _emit(step: Step, local: LocalValues) -> None:
    bsym, strategy = step.bsym, step.strategy
    outputs = tree_flatten(bsym.output)[0]
    if not any(isinstance(o, TensorProxy) for o in outputs):
        _emit_metadata_query(bsym, local)
        return
    flat, spec = tree_flatten((bsym.args, bsym.kwargs))
    required = iter(strategy.inputs)
    local_flat = [
        local.get(x, next(required), into_tp_region=strategy.is_sharded) if isinstance(x, TensorProxy)
        else local.values.get(x.name, x) if isinstance(x, Proxy)
        else x
        for x in flat
    ]
    args, kwargs = tree_unflatten(local_flat, spec)
    result = (strategy.local or bsym.sym)(*args, **kwargs)
    for logical, value in zip(outputs, tree_flatten(result)[0]):
        if isinstance(logical, Proxy):
            local.values[logical.name] = value


def _emit_metadata_query(bsym, local: LocalValues) -> None:
    """Shape/dtype queries: on replicated inputs re-run them; on sharded ones use the logical (global) answer."""
    tensors = _tensors(bsym)
    if all(isinstance(local.layouts[t.name], Replicate) for t in tensors):
        args, kwargs = tree_map(lambda x: local.values.get(x.name, x) if isinstance(x, Proxy) else x,
                                (bsym.args, bsym.kwargs))
        result = bsym.sym(*args, **kwargs)
        for logical, value in zip(tree_flatten(bsym.output)[0], tree_flatten(result)[0]):
            if isinstance(logical, Proxy):
                local.values[logical.name] = value
        return
    for logical in tree_flatten(bsym.output)[0]:
        if isinstance(logical, NumberProxy):
            local.values[logical.name] = logical.value
