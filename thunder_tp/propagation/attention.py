"""Rules for scaled_dot_product_attention: heads (dim 1) or batch (dim 0) sharded; or the queries' sequence (context
parallelism): each rank attends its queries to every key and value, gathered."""

from __future__ import annotations

import functools

import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy

from thunder_tp.collectives import rank_value
from thunder_tp.layouts import REPLICATE, Layout, Pieces, Shard, Split, TPGroup, rank_pieces
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
    held = op.layouts[0]
    if isinstance(held, Shard) and held.dim == q.ndim - 2:
        strategies.insert(len(strategies) - 1, _queries_sharded(op, held))
    return strategies


def _queries_sharded(op: Op, held: Shard) -> Strategy:
    """q sharded on its sequence (dim -2) as it is held; keys and values whole; a mask's rows as q's (its keys
    whole); a causal attention's mask made of each query's and key's position."""
    q, out = op.tensors[0], op.outputs[0]
    rows = [REPLICATE if t.ndim < 2 or t.shape[-2] != q.shape[-2] else held.moved(t.ndim - 2)
            for t in op.tensors[3:]]
    pieces = rank_pieces(held, q.shape[-2], op.tp.size)
    local = functools.partial(_attention_of_sharded_queries, tp=op.tp, pieces=pieces)
    return Strategy((held, REPLICATE, REPLICATE, *rows), (held.moved(out.ndim - 2),), local)


def _attention_of_sharded_queries(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                  tp: TPGroup, pieces: Pieces):
    if is_causal:
        attn_mask, is_causal = _causal_rows(q, k, tp, pieces), False
    return ltorch.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)


def _causal_rows(q: TensorProxy, k: TensorProxy, tp: TPGroup, pieces: Pieces) -> TensorProxy:
    """The causal mask of this rank's queries (their positions: its pieces of the sequence) over every key."""
    def positions_of(i: int, length: int) -> TensorProxy:
        offsets = ltorch.arange(length, device=q.device)
        return ltorch.add(offsets, rank_value(tp, tuple(chunks[i][0] for chunks in pieces), offsets))

    positions = ltorch.cat([positions_of(i, length) for i, (_, length) in enumerate(pieces[0])], 0)
    keys = ltorch.arange(k.shape[-2], device=q.device)
    return ltorch.ge(ltorch.unsqueeze(positions, 1), ltorch.unsqueeze(keys, 0))


def _held_whole_by_all(layout: Layout, dim: int, size: int) -> bool:
    """A size-1 dim split as one chunk replicated on all `size` ranks: every rank holds the whole tensor."""
    return (isinstance(layout, Shard) and layout.dim == dim and layout.blocks is None
            and layout.block_splits() == (Split(1, replicated=True),))
