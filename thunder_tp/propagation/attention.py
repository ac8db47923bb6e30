"""Rules for scaled_dot_product_attention: heads (dim 1) or batch (dim 0) sharded; or the queries' sequence (context
parallelism): each rank attends its queries to every key and value, gathered. Context parallelism's blockwise
attention (its causal attention on CPU) keeps heads or batch sharded too, so TP inside CP splits its heads."""

from __future__ import annotations

import functools
import math

import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.trace import get_tracectx

from thunder_tp.collectives import rank_value, tp_gather_to_tp, tp_shift
from thunder_tp.collectives.labels import label_collectives
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import REPLICATE, Layout, Pieces, Shard, Split, TPGroup, rank_pieces
from thunder_tp.ops.blockwise_attention import blockwise_attention
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


@register_rule(blockwise_attention)
def blockwise_attention_rule(op: Op) -> list[Strategy]:
    """q, every key block and value block sharded alike on heads or batch (their query and key positions, which the
    op takes as constants, unchanged); the output and log-sum-exp follow."""
    q = op.tensors[0]
    strategies = [op.replicated()]
    for d in range(min(2, q.ndim - 2)):
        shard = op.shard_of(q, d)
        if all(t.shape[d] == q.shape[d] for t in op.tensors):
            strategies.insert(0, Strategy((shard,) * len(op.tensors), (shard,) * len(op.outputs)))
    return strategies


#: how keys and values reach every rank's queries under context parallelism (TensorParallel's `Op.options`):
#: "auto" asks `Op.options["ring_pays"]`
ROTATIONS = ("auto", "allgather", "ring")


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
    rotate = _rotation(op, q, k)
    attention = _ring_attention if rotate == "ring" else _gathered_attention
    local = functools.partial(attention, tp=op.tp, pieces=pieces)
    kv_bytes = 2 * k.numel * k.dtype.bytes
    issues = (("all_gather", kv_bytes),) if rotate == "allgather" else (("send_recv", kv_bytes),)
    return Strategy((held, keys, keys, *rows), (held.moved(out.ndim - 2),), local, issues=issues,
                    backward_issues=(("reduce_scatter", kv_bytes),))


def _rotation(op: Op, q: TensorProxy, k: TensorProxy) -> str:
    """The rotation asked for; for "auto", the ring where the cost model says it pays and the ring can run: not on
    simulated ranks, nor with dropout, nor where causal attention runs blockwise (one fused call over every key
    block: nothing to overlap with the transfers)."""
    rotate = op.options.get("rotate", "allgather")
    if rotate != "auto":
        return rotate
    blockwise = op.arg("is_causal") and _blockwise(q, op.arg("attn_mask"), op.arg("dropout_p"), op.tp)
    if blockwise or op.arg("dropout_p") or ranks_of(op.tp.group).one_trace_for_all:
        return "allgather"
    return "ring" if op.options["ring_pays"](q, k, op.tp) else "allgather"


def _gathered_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, tp: TPGroup,
                        pieces: Pieces):
    """Every rank's queries over all keys and values, gathered (their grads reduce-scattered back)."""
    start = len(get_tracectx().peek_scope())
    k, v = (tp_gather_to_tp(t, t.ndim - 2, pieces, tp.group) for t in (k, v))
    label_collectives(get_tracectx().peek_scope()[start:], "context parallel: keys and values gathered (all-gather)")
    if is_causal and _blockwise(q, attn_mask, dropout_p, tp):  # each query chunk: the keys before it, and its own
        pairs = []
        for qs, length, at in _local_chunks(pieces[tp.rank]):
            pairs += [(qs, length, 0, 0, at, False)] if at else []
            pairs.append((qs, length, 0, at, length, True))
        return blockwise_attention(q, (k,), (v,), tuple(pairs), _scale(q, scale))[0]
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
    scale = _scale(q, scale)
    start = len(get_tracectx().peek_scope())
    passed = [(k, v), *((tp_shift(k, step, tp.group), tp_shift(v, step, tp.group)) for step in range(1, tp.size))]
    label_collectives(get_tracectx().peek_scope()[start:], "context parallel: keys and values passed (ring)")
    if is_causal and _blockwise(q, attn_mask, dropout_p, tp):
        held = [(step, *chunk) for step in range(tp.size)
                for chunk in _local_chunks(pieces[(tp.rank - step) % tp.size])]
        pairs = _visible_pairs(_local_chunks(pieces[tp.rank]), held)
        if pairs is not None:
            keys, values = zip(*passed, strict=True)
            return blockwise_attention(q, keys, values, pairs, scale)[0]
    queries = ltorch.unsqueeze(_positions(q, tp, pieces, 0), 1)
    best = total = out = None
    for step, (k_s, v_s) in enumerate(passed):
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


def _scale(q: TensorProxy, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _blockwise(q: TensorProxy, attn_mask, dropout_p: float, tp: TPGroup) -> bool:
    """Whether causal attention runs as `blockwise_attention` (torch's fused CPU kernel, no mask tensor): on CPU
    tensors of a kernel's dtype, without a mask or dropout, on real ranks (a simulation's ranks differ in their
    chunks' positions, which the op takes as constants)."""
    kernel_dtypes = (dtypes.float32, dtypes.float64, dtypes.bfloat16, dtypes.float16)
    return (q.device.type == "cpu" and q.dtype in kernel_dtypes and attn_mask is None and not dropout_p
            and not ranks_of(tp.group).one_trace_for_all)


def _local_chunks(chunks: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """(start in the local tensor, length, start in the sequence) of each piece a rank holds."""
    local, at = [], 0
    for start, length in chunks:
        local.append((at, length, start))
        at += length
    return local


def _visible_pairs(queries: list[tuple[int, int, int]], keys: list[tuple[int, int, int, int]]) -> tuple | None:
    """The blockwise attention pairs of query chunks over key chunks ((tensor, local start, length, start)): keys
    all before the queries (full), at the same positions (causal) or after (none); None where a key chunk is partly
    visible to a query chunk (a mask then)."""
    pairs = []
    for qs, length, at in queries:
        for tensor, ks, n, start in keys:
            if start + n <= at:
                pairs.append((qs, length, tensor, ks, n, False))
            elif (start, n) == (at, length):
                pairs.append((qs, length, tensor, ks, n, True))
            elif start < at + length:
                return None
    return tuple(pairs)


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
