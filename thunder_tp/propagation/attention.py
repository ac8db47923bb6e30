"""Rules for scaled_dot_product_attention: heads (dim 1) or batch (dim 0) sharded."""

from __future__ import annotations

import thunder.torch as ltorch

from thunder_tp.layouts import REPLICATE, Layout, Shard
from thunder_tp.propagation.engine import Op, Strategy, register_rule


@register_rule(ltorch.scaled_dot_product_attention)
def scaled_dot_product_attention(op: Op) -> list[Strategy]:
    """q, k, v sharded alike on heads or batch; the mask follows where it is not broadcast."""
    q = op.tensors[0]
    out = op.outputs[0]
    strategies = [op.replicated()]
    for d in range(min(2, q.ndim - 2)):
        layouts: list[Layout] = []
        for t in op.tensors:
            td = d - (out.ndim - t.ndim)
            layouts.append(Shard(td) if td >= 0 and t.shape[td] == out.shape[d] else REPLICATE)
        strategies.insert(0, Strategy(tuple(layouts), (Shard(d),)))
    return strategies
