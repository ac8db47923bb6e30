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
    strategies = [
        Strategy((REPLICATE, column, *bias_col), (column.moved(last),)),
        *(Strategy((Shard(d), REPLICATE, *bias_rep), (Shard(d),)) for d in range(last)),
        op.replicated(),
    ]
    if not has_bias:  # a bias would be added once per rank
        strategies.insert(1, Strategy((Shard(last), Shard(1)), (PARTIAL,)))
        strategies.append(Strategy((PARTIAL, REPLICATE), (PARTIAL,)))
    return strategies


@register_rule(ltorch.matmul, prims.matmul)
def matmul(op: Op) -> list[Strategy]:
    """a @ b for a, b of rank >= 2 (batch dims broadcast): shard rows of a, columns of b, K, or a batch dim."""
    a, b = op.tensors
    out = op.outputs[0]
    if a.ndim < 2 or b.ndim < 2:
        return [op.replicated()]
    strategies = [
        Strategy((Shard(a.ndim - 2), REPLICATE), (Shard(out.ndim - 2),)),
        Strategy((REPLICATE, Shard(b.ndim - 1)), (Shard(out.ndim - 1),)),
        Strategy((Shard(a.ndim - 1), Shard(b.ndim - 2)), (PARTIAL,)),
        Strategy((PARTIAL, REPLICATE), (PARTIAL,)),
        Strategy((REPLICATE, PARTIAL), (PARTIAL,)),
    ]
    for d in range(out.ndim - 2):
        layouts = []
        for t in (a, b):
            td = d - (out.ndim - t.ndim)
            layouts.append(Shard(td) if td >= 0 and t.shape[td] == out.shape[d] else REPLICATE)
        strategies.append(Strategy(tuple(layouts), (Shard(d),)))
    return [*strategies, op.replicated()]
