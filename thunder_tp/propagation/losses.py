"""Rules for cross_entropy: on replicated logits, vocabulary-parallel (loss parallel), and rows-parallel (the tokens
of context parallelism).

Both run as the two symbols of ``thunder_tp/ops/cross_entropy.py`` (each with its backward symbol):
``cross_entropy_stats`` (each row's log-sum-exp and target logit over the columns a rank holds) and
``cross_entropy_of_stats`` (the loss from every rank's stats).
"""

from __future__ import annotations

from dataclasses import replace

import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy

from thunder_tp.collectives import rank_value, tp_gather, tp_padding_filled, tp_reduce_from_tp
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import PARTIAL, REPLICATE, Pieces, Shard, TPGroup, is_even, rank_pieces
from thunder_tp.ops.cross_entropy import cross_entropy_of_stats, cross_entropy_stats, finite_logsumexp
from thunder_tp.propagation.engine import Op, Strategy, register_rule


def _replicated_cross_entropy(ignore_index: int, reduction: str):
    """Cross-entropy of replicated (N, C) logits as log-sum-exp minus target logit: nothing logits-sized is
    written but the grad, which a gather's grad (the rank's columns) slices inside the same fusion."""

    def loss(logits: TensorProxy, target: TensorProxy, *_, **__) -> TensorProxy:
        stats = cross_entropy_stats(logits, target)
        return cross_entropy_of_stats(stats, target, ignore_index, reduction, logits.dtype)

    return loss


def _vocab_parallel_cross_entropy(tp: TPGroup, ignore_index: int, reduction: str, every: Pieces):
    """Cross-entropy of (N, C) logits sharded on C (`every`: each rank's columns): each rank's (log-sum-exp, target
    logit) per token, gathered in one collective of 2N numbers, is all the other ranks need. In a simulation a
    shorter piece is padded to the longest: its padding columns count as -inf, and no target hits them."""

    def loss(logits: TensorProxy, target: TensorProxy, *_, **__) -> TensorProxy:
        stats = _every_ranks_stats(logits, target, tp, every)
        return cross_entropy_of_stats(stats, target, ignore_index, reduction, logits.dtype)

    return loss


def _every_ranks_stats(logits: TensorProxy, target: TensorProxy, tp: TPGroup, every: Pieces) -> TensorProxy:
    """(2R, N): every rank's ``cross_entropy_stats`` of its columns of the (N, C) logits, gathered."""
    local_target = ltorch.sub(target, rank_value(tp, tuple(chunks[0][0] for chunks in every), target))
    if ranks_of(tp.group).one_trace_for_all and not is_even(every):
        logits = tp_padding_filled(logits, 1, every, -float("inf"), tp.group)
        columns = rank_value(tp, tuple(chunks[0][1] for chunks in every), target)
        local_target = ltorch.where(ltorch.lt(local_target, columns), local_target, -1)
    stats = cross_entropy_stats(logits, local_target)
    return tp_gather(stats, 0, rank_pieces(Shard(0), 2 * tp.size, tp.size), tp.group)


def _vocab_parallel_stats(tp: TPGroup, every: Pieces):
    """``cross_entropy_stats`` of logits sharded on C: every rank's stats gathered and merged into the whole
    vocabulary's (log-sum-exp of the ranks' log-sum-exps, sum of their target logits)."""

    def stats(logits: TensorProxy, target: TensorProxy) -> TensorProxy:
        ranks = ltorch.reshape(_every_ranks_stats(logits, target, tp, every), (tp.size, 2, logits.shape[0]))
        return ltorch.stack((finite_logsumexp(ranks[:, 0], 0), ltorch.sum(ranks[:, 1], 0)))

    return stats


def _rows_parallel_cross_entropy(tp: TPGroup, ignore_index: int, reduction: str):
    """Cross-entropy of (N, C) logits sharded on N (the tokens of a sequence split by context parallelism): each
    rank's rows' losses; summed, their sum is Partial; averaged, the sum and the count of counted rows of every rank
    are summed in one all_reduce first."""

    def loss(logits: TensorProxy, target: TensorProxy, *_, **__) -> TensorProxy:
        stats = cross_entropy_stats(logits, target)
        if reduction != "mean":
            return cross_entropy_of_stats(stats, target, ignore_index, reduction, logits.dtype)
        summed = cross_entropy_of_stats(stats, target, ignore_index, "sum", stats.dtype)
        counted = ltorch.to(ltorch.sum(ltorch.ne(target, ignore_index)), stats.dtype)
        totals = tp_reduce_from_tp(ltorch.stack((summed, counted)), tp.group)
        return ltorch.to(ltorch.true_divide(totals[0], totals[1]), logits.dtype)

    return loss


def _stats_bytes(logits: TensorProxy) -> int:
    """A number's bytes in the loss's precision (float32 at least)."""
    return max(logits.dtype.bytes, 4)


def _stats_gathered(logits: TensorProxy, size: int) -> tuple[str, int]:
    """The all_gather of every rank's (log-sum-exp, target logit) pair per row of the (N, C) logits."""
    return "all_gather", 2 * logits.shape[0] * _stats_bytes(logits) * size


@register_rule(cross_entropy_stats)
def cross_entropy_stats_rule(op: Op) -> list[Strategy]:
    """Logits (N, C) sharded on C (context parallelism's loss under loss parallel) -> replicated stats, the ranks'
    stats of their columns gathered (2N numbers each); rows sharded -> each rank its rows'."""
    logits = op.tensors[0]
    every = rank_pieces(Shard(1), logits.shape[1], op.tp.size)
    strategies = [Strategy((Shard(1), REPLICATE), (REPLICATE,), _vocab_parallel_stats(op.tp, every),
                           issues=(_stats_gathered(logits, op.tp.size),)), op.replicated()]
    rows = op.layouts[0]
    if isinstance(rows, Shard) and rows.dim == 0:
        strategies.insert(0, Strategy((rows, rows), (rows.moved(1),)))
    return strategies


@register_rule(ltorch.cross_entropy)
def cross_entropy(op: Op) -> list[Strategy]:
    """Logits (N, C) sharded on C -> replicated loss, without gathering the logits; replicated logits -> the same
    formula on every rank."""
    logits = op.tensors[0]
    supported = (
        logits.ndim == 2
        and len(op.tensors) == 2
        and op.arg("label_smoothing") == 0.0
        and op.arg("reduction") in ("mean", "sum", "none")
        and op.arg("size_average") is None
        and op.arg("reduce") is None
    )
    if not supported:
        return [op.replicated()]
    ignore_index, reduction = op.arg("ignore_index"), op.arg("reduction")
    every = rank_pieces(Shard(1), logits.shape[1], op.tp.size)
    vocab_parallel = _vocab_parallel_cross_entropy(op.tp, ignore_index, reduction, every)
    replicated = _replicated_cross_entropy(ignore_index, reduction)
    strategies = [Strategy((Shard(1), REPLICATE), (REPLICATE,), vocab_parallel,
                           issues=(_stats_gathered(logits, op.tp.size),)),
                  replace(op.replicated(), local=replicated)]
    rows = op.layouts[0]
    if isinstance(rows, Shard) and rows.dim == 0:  # context parallelism: each rank its tokens' losses
        rows_parallel = _rows_parallel_cross_entropy(op.tp, ignore_index, reduction)
        output = {"none": rows, "sum": PARTIAL}.get(reduction, REPLICATE)
        summed = (("all_reduce", 2 * _stats_bytes(logits)),) if reduction == "mean" else ()
        strategies.insert(0, Strategy((rows, rows), (output,), rows_parallel, issues=summed))
    return strategies
