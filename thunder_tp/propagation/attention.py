"""Rules for scaled_dot_product_attention: heads (dim 1) or batch (dim 0) sharded; or the queries' sequence (context
parallelism): each rank attends its queries to every key and value, gathered."""

from __future__ import annotations

import functools
import math

import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.trace import get_tracectx

from thunder_tp.collectives import rank_value, tp_gather_to_tp, tp_shift
from thunder_tp.collectives.labels import label_collectives
from thunder_tp.layouts import REPLICATE, Layout, Pieces, Shard, Split, TPGroup, rank_pieces
from thunder_tp.propagation.engine import Op, Strategy, register_rule
from thunder_tp.run_mode import ranks_of


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


#: how keys and values reach every rank's queries under context parallelism (TensorParallel's `Op.options`)
ROTATIONS = ("allgather", "ring")


def _queries_sharded(op: Op, held: Shard) -> Strategy:
    """q sharded on its sequence (dim -2) as it is held, keys and values alike; a mask's rows as q's. Every rank's
    queries attend to every key: all keys and values gathered ("allgather"), or passed around the ring of ranks, one
    rank's at a time, each chunk's scores merged by their running maximum and sum ("ring"); a causal attention's
    mask made of each query's and key's true position."""
    q, k, out = op.tensors[0], op.tensors[1], op.outputs[0]
    keys = held.moved(k.ndim - 2)
    rows = [REPLICATE if t.ndim < 2 or t.shape[-2] != q.shape[-2] else held.moved(t.ndim - 2)
            for t in op.tensors[3:]]
    pieces = rank_pieces(held, q.shape[-2], op.tp.size)
    rotate = op.options.get("rotate", "allgather")
    attention = _ring_attention if rotate == "ring" else _gathered_attention
    local = functools.partial(attention, tp=op.tp, pieces=pieces)
    kv_bytes = 2 * k.numel * k.dtype.bytes
    issues = (("all_gather", kv_bytes),) if rotate == "allgather" else (("send_recv", kv_bytes),)
    return Strategy((held, keys, keys, *rows), (held.moved(out.ndim - 2),), local, issues=issues,
                    backward_issues=(("reduce_scatter", kv_bytes),))


def _gathered_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, tp: TPGroup,
                        pieces: Pieces):
    """Every rank's queries over all keys and values, gathered (their grads reduce-scattered back)."""
    start = len(get_tracectx().peek_scope())
    k, v = (tp_gather_to_tp(t, t.ndim - 2, pieces, tp.group) for t in (k, v))
    label_collectives(get_tracectx().peek_scope()[start:], "context parallel: keys and values gathered (all-gather)")
    if is_causal:
        attn_mask, is_causal = ltorch.ge(ltorch.unsqueeze(_positions(q, tp, pieces, 0), 1),
                                         ltorch.unsqueeze(ltorch.arange(k.shape[-2], device=q.device), 0)), False
    return ltorch.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)


def _ring_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, tp: TPGroup,
                    pieces: Pieces):
    """Every rank's queries over one rank's keys and values at a time, passed around the ring (rank r's at step s
    from rank r - s), each chunk's softmax merged into the others' by their running maxima and sums."""
    if dropout_p or ranks_of(tp.group).one_trace_for_all:
        raise NotImplementedError("thunder_tp.ContextParallel(rotate=\"ring\"): attention with dropout, or on "
                                  "simulated ranks, is not supported; use rotate=\"allgather\"")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    queries = ltorch.unsqueeze(_positions(q, tp, pieces, 0), 1)
    best = total = out = None
    for step in range(tp.size):
        start = len(get_tracectx().peek_scope())
        k_s, v_s = (t if step == 0 else tp_shift(t, step, tp.group) for t in (k, v))
        label_collectives(get_tracectx().peek_scope()[start:], "context parallel: keys and values passed (ring)")
        keys = _positions(q, tp, pieces, step)
        scores = ltorch.mul(ltorch.matmul(q, ltorch.transpose(k_s, -2, -1)), scale)
        if attn_mask is not None:
            columns = ltorch.index_select(attn_mask, -1, keys)
            scores = (ltorch.where(columns, scores, -math.inf) if columns.dtype is dtypes.bool8
                      else ltorch.add(scores, columns))
        if is_causal:
            scores = ltorch.where(ltorch.ge(queries, ltorch.unsqueeze(keys, 0)), scores, -math.inf)
        top = ltorch.amax(scores, -1, True)
        top = ltorch.where(ltorch.isinf(top), 0.0, top)  # rows that see no key of this chunk add nothing
        weights = ltorch.exp(ltorch.sub(scores, top))
        chunk_total, chunk_out = ltorch.sum(weights, -1, True), ltorch.matmul(weights, v_s)
        if out is None:
            best, total, out = top, chunk_total, chunk_out
            continue
        merged = ltorch.maximum(best, top)
        old, new = ltorch.exp(ltorch.sub(best, merged)), ltorch.exp(ltorch.sub(top, merged))
        total = ltorch.add(ltorch.mul(total, old), ltorch.mul(chunk_total, new))
        out = ltorch.add(ltorch.mul(out, old), ltorch.mul(chunk_out, new))
        best = merged
    return ltorch.true_divide(out, total)


def _positions(like: TensorProxy, tp: TPGroup, pieces: Pieces, step: int) -> TensorProxy:
    """The sequence positions of rank r - `step`'s pieces, on rank r."""
    def block(i: int, length: int) -> TensorProxy:
        offsets = ltorch.arange(length, device=like.device)
        starts = tuple(pieces[(rank - step) % tp.size][i][0] for rank in range(tp.size))
        return ltorch.add(offsets, rank_value(tp, starts, offsets))

    return ltorch.cat([block(i, length) for i, (_, length) in enumerate(pieces[0])], 0)


def _held_whole_by_all(layout: Layout, dim: int, size: int) -> bool:
    """A size-1 dim split as one chunk replicated on all `size` ranks: every rank holds the whole tensor."""
    return (isinstance(layout, Shard) and layout.dim == dim and layout.blocks is None
            and layout.block_splits() == (Split(1, replicated=True),))
