"""Rules for linear and matmul: column-, row- and batch-parallel strategies."""

from __future__ import annotations

import thunder.core.prims as prims
import thunder.torch as ltorch

from thunder_tp.layouts import PARTIAL, REPLICATE, Shard
from thunder_tp.propagation.engine import Op, Strategy, register_rule


@register_rule(ltorch.linear, prims.linear)
def linear(op: Op) -> list[Strategy]:
    """y = x @ w.T + b: Colwise (w dim 0) -> y sharded on features; Rowwise (w dim 1) -> Partial."""
    x, w = op.tensors[0], op.tensors[1]
    has_bias = len(op.tensors) == 3
    last = x.ndim - 1
    w_layout = op.layout_of(w)
    column = w_layout if isinstance(w_layout, Shard) and w_layout.dim == 0 else Shard(0)
    bias_col = (column,) if has_bias else ()
    bias_rep = (REPLICATE,) if has_bias else ()
    row = w_layout if isinstance(w_layout, Shard) and w_layout.dim == 1 else Shard(1)
    strategies = [
        Strategy((REPLICATE, column, *bias_col), (column.moved(last),)),
        *(Strategy((op.shard_of(x, d), REPLICATE, *bias_rep), (op.shard_of(x, d),)) for d in range(last)),
        op.replicated(),
    ]
    if not has_bias:  # a bias would be added once per rank
        strategies.insert(1, Strategy((row.moved(last), row), (PARTIAL,)))
        strategies.append(Strategy((PARTIAL, REPLICATE), (PARTIAL,)))
    return strategies


@register_rule(ltorch.matmul, prims.matmul)
def matmul(op: Op) -> list[Strategy]:
    """a @ b for a, b of rank >= 2 (batch dims broadcast): shard rows of a, columns of b, K, or a batch dim."""
    a, b = op.tensors
    out = op.outputs[0]
    if a.ndim < 2 or b.ndim < 2:
        return [op.replicated()]
    rows, columns = op.shard_of(a, a.ndim - 2), op.shard_of(b, b.ndim - 1)
    inner = op.shard_of(a, a.ndim - 1)  # the contracted dim, split as the operand sharded on it splits it
    if inner == Shard(a.ndim - 1):
        inner = op.shard_of(b, b.ndim - 2).moved(a.ndim - 1)
    strategies = [
        Strategy((rows, REPLICATE), (rows.moved(out.ndim - 2),)),
        Strategy((REPLICATE, columns), (columns.moved(out.ndim - 1),)),
        Strategy((inner, inner.moved(b.ndim - 2)), (PARTIAL,)),
        Strategy((PARTIAL, REPLICATE), (PARTIAL,)),
        Strategy((REPLICATE, PARTIAL), (PARTIAL,)),
    ]
    for d in range(out.ndim - 2):
        shard = _batch_shard(op, d)
        layouts = []
        for t in (a, b):
            td = d - (out.ndim - t.ndim)
            layouts.append(shard.moved(td) if td >= 0 and t.shape[td] == out.shape[d] else REPLICATE)
        strategies.append(Strategy(tuple(layouts), (shard.moved(d),)))
    return [*strategies, op.replicated()]


def _batch_shard(op: Op, d: int) -> Shard:
    """How the first operand sharded on batch dim `d` of the output splits it, else plainly."""
    out = op.outputs[0]
    for t in op.tensors:
        td = d - (out.ndim - t.ndim)
        if td >= 0 and t.shape[td] == out.shape[d] and isinstance(op.layout_of(t), Shard) and op.layout_of(t).dim == td:
            return op.layout_of(t)
    return Shard(d)
