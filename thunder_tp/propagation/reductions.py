"""Rules for sum and mean over any dims."""

from __future__ import annotations

import math
from collections.abc import Sequence

import thunder.core.prims as prims
import thunder.torch as ltorch

from thunder_tp.collectives import tp_padding_filled
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import PARTIAL, Partial, Shard, is_even, rank_pieces
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
        split = layout if layout.blocks is None else Shard(layout.dim)
        strategies.insert(0, Strategy((split,), (PARTIAL,), _summand(op, split, dims)))
    elif isinstance(layout, Shard) and layout.dim not in dims:
        out_dim = layout.dim if keepdim else layout.dim - sum(d < layout.dim for d in dims)
        strategies.insert(0, Strategy((layout,), (layout.moved(out_dim),)))
    return strategies


def _summand(op: Op, layout: Shard, dims: set[int]):
    """This rank's summand of a sum or mean over the sharded dim (None: the op itself, a sum over the piece): a mean
    over a piece weighted by its share of the reduced entries, so that the summands add up to the mean. In a
    simulation a piece shorter than the longest is padded: its padding is zeroed first."""
    x, tp = op.tensors[0], op.tp
    n = x.shape[layout.dim]
    every = rank_pieces(layout, n, tp.size)
    mean = op.bsym.sym.name == "mean"
    if is_even(every) and not mean:
        return None
    if is_even(every):  # the mean of an equal share, divided by their number (as before uneven splits existed)
        return lambda a, *args, **kwargs: ltorch.true_divide(ltorch.mean(a, *args, **kwargs), tp.size)
    count = math.prod(x.shape[d] for d in dims)

    def local(a, *args, **kwargs):
        if ranks_of(tp.group).one_trace_for_all:
            a = tp_padding_filled(a, layout.dim, every, 0.0, tp.group)
        summed = ltorch.sum(a, *args, **kwargs) if mean else op.bsym.sym(a, *args, **kwargs)
        return ltorch.true_divide(summed, count) if mean else summed

    return local
