"""Rules for sum and mean over any dims."""

from __future__ import annotations

from collections.abc import Sequence

import thunder.core.prims as prims
import thunder.torch as ltorch

from thunder_tp.layouts import PARTIAL, Partial, Shard
from thunder_tp.propagation.engine import Op, Strategy, register_rule


def _reduced_dims(op: Op) -> tuple[set[int], bool]:
    x = op.tensors[0]
    if op.bsym.sym.id == prims.sum.id:
        dims, keepdim = op.bsym.args[1], False
    else:
        dims, keepdim = op.arg("dim"), bool(op.arg("keepdim", False))
    if dims is None:
        dims = range(x.ndim)
    elif not isinstance(dims, Sequence):
        dims = (dims,)
    return {d % max(x.ndim, 1) for d in dims}, keepdim


@register_rule(ltorch.sum, ltorch.mean, prims.sum)
def reduction(op: Op) -> list[Strategy]:
    """Reducing a sharded dim gives a Partial; a kept dim keeps its shard; Partial stays Partial."""
    layout = op.layouts[0]
    dims, keepdim = _reduced_dims(op)
    strategies = [op.replicated()]
    if isinstance(layout, Partial):
        strategies.insert(0, Strategy((PARTIAL,), (PARTIAL,)))
    elif isinstance(layout, Shard) and layout.dim in dims and not layout.is_replicated:
        local = _chunk_mean(op.tp.size) if op.bsym.sym.name == "mean" else None
        strategies.insert(0, Strategy((Shard(layout.dim),), (PARTIAL,), local))
    elif isinstance(layout, Shard) and layout.dim not in dims:
        out_dim = layout.dim if keepdim else layout.dim - sum(d < layout.dim for d in dims)
        strategies.insert(0, Strategy((layout,), (layout.moved(out_dim),)))
    return strategies


def _chunk_mean(size: int):
    """The mean of one of `size` equal chunks, weighted by its share: summed over ranks, the mean."""

    def local(x, *args, **kwargs):
        return ltorch.true_divide(ltorch.mean(x, *args, **kwargs), size)

    return local
