"""Rules for scaled_dot_product_attention: heads (dim 1) or batch (dim 0) sharded."""

from __future__ import annotations

import thunder.torch as ltorch

from thunder_tp.layouts import REPLICATE, Layout, Shard, Split
from thunder_tp.propagation.engine import Op, Strategy, register_rule


@register_rule(ltorch.scaled_dot_product_attention)
def scaled_dot_product_attention(op: Op) -> list[Strategy]:
    """q, k, v sharded alike on heads or batch; the mask follows where it is not broadcast. A single K/V head
    broadcast over the query heads (multi-query attention with a KV cache) may be held whole by every rank, as
    a head replicated on all of them."""
    q = op.tensors[0]
    out = op.outputs[0]
    strategies = [op.replicated()]
    for d in range(min(2, q.ndim - 2)):
        shard = op.shard_of(q, d)  # heads split unevenly stay as they are
        layouts: list[Layout] = []
        for t, current in zip(op.tensors, op.layouts, strict=True):
            td = d - (out.ndim - t.ndim)
            if td >= 0 and t.shape[td] == out.shape[d]:
                layouts.append(shard.moved(td))
            elif td >= 0 and t.shape[td] == 1 and _held_whole_by_all(current, td, op.tp.size):
                layouts.append(current)
            else:
                layouts.append(REPLICATE)
        strategies.insert(0, Strategy(tuple(layouts), (shard.moved(d),)))
    return strategies


def _held_whole_by_all(layout: Layout, dim: int, size: int) -> bool:
    """A size-1 dim split as one chunk replicated on all `size` ranks: every rank holds the whole tensor."""
    return (isinstance(layout, Shard) and layout.dim == dim and layout.blocks is None
            and layout.block_splits() == (Split(1, replicated=True),))
