"""Cross-entropy as symbols of thunder_tp's own, each with its backward symbol: ``cross_entropy_stats`` (each row's
log-sum-exp and target logit over the columns a rank holds) and ``cross_entropy_of_stats`` (the loss from every
rank's stats); the rules of ``propagation/losses.py`` compute the loss with them. Upcast once to float32 (float64
stays), they compute in one precision whatever the logits'; and as symbols they stay whole up to the fusion executor,
which lowers them with Inductor even where nvFuser fuses the rest (``thunder_tp.execution.executor``: nvFuser 0.2.35's
segmenter asserts on these upcasts and reductions).
"""

from __future__ import annotations

import sys

import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.langctxs import Languages, langctx
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import Symbol
from thunder.core.transforms import register_grad


def _symbol(name: str, meta) -> Symbol:
    module = sys.modules[__name__]
    return Symbol(name=name, meta=langctx(Languages.TORCH)(meta), id=f"thunder_tp.{name}", _module=module)


def _upcast(a: TensorProxy) -> TensorProxy:
    """``a`` in the precision the loss computes in: float32 for half-precision logits, else their own."""
    return ltorch.to(a, dtypes.float32) if a.dtype.bytes < 4 else a


def _finite(a: TensorProxy) -> TensorProxy:
    return ltorch.where(ltorch.isinf(a), 0.0, a)


def finite_logsumexp(a: TensorProxy, dim: int) -> TensorProxy:
    """log(sum(exp(a))) along `dim`, -inf (not nan) over a slice of -inf only."""
    shift = _finite(ltorch.amax(a, dim, True))  # a slice of -inf only (a masked vocabulary shard) gives -inf, not nan
    summed = ltorch.sum(ltorch.exp(ltorch.sub(a, shift)), dim)
    return ltorch.add(ltorch.log(summed), ltorch.squeeze(shift, dim))


def _softmax(a: TensorProxy, log_sum_exp: TensorProxy, dim: int) -> TensorProxy:
    """``exp(a - log_sum_exp)`` along ``dim``: zero, not nan, over a slice of -inf only."""
    return ltorch.exp(ltorch.sub(a, _finite(ltorch.unsqueeze(log_sum_exp, dim))))


def _target_hit(target: TensorProxy, columns: int, device) -> TensorProxy:
    """(N, C) mask of each row's target column (none where the target is not one of the ``columns``): a one-hot
    mask, which fuses with the log-sum-exp's reduction (a gather would scatter into logits-sized zeros in the
    backward)."""
    return ltorch.eq(ltorch.unsqueeze(target, 1), ltorch.arange(columns, device=device))


def _stats(logits: TensorProxy, target: TensorProxy) -> TensorProxy:
    a = _upcast(logits)
    target_logit = ltorch.sum(ltorch.where(_target_hit(target, a.shape[1], a.device), a, 0.0), 1)
    return ltorch.stack((finite_logsumexp(a, 1), target_logit))


#: (N, C) logits, (N,) targets (column indices, any value outside 0..C-1 hits no column) -> (2, N): each row's
#: log-sum-exp and target logit (0 where the target is not a column), in the loss's precision
cross_entropy_stats = _symbol("cross_entropy_stats", _stats)


def _stats_backward(logits: TensorProxy, target: TensorProxy, stats: TensorProxy, grad: TensorProxy) -> TensorProxy:
    a = _upcast(logits)
    from_log_sum_exp = ltorch.mul(_softmax(a, stats[0], 1), ltorch.unsqueeze(grad[0], 1))
    from_target = ltorch.where(_target_hit(target, a.shape[1], a.device), ltorch.unsqueeze(grad[1], 1), 0.0)
    return ltorch.to(ltorch.add(from_log_sum_exp, from_target), logits.dtype)


cross_entropy_stats_backward = _symbol("cross_entropy_stats_backward", _stats_backward)


def _stats_grad(logits: TensorProxy, target: TensorProxy) -> TensorProxy:
    stats = cross_entropy_stats(logits, target)
    put_grad(logits, cross_entropy_stats_backward(logits, target, stats, get_grad(stats)))
    return stats


register_grad(cross_entropy_stats, _stats_grad)


def _loss_of_stats(stats: TensorProxy, target: TensorProxy, ignore_index: int, reduction: str, dtype) -> TensorProxy:
    ranks = ltorch.reshape(stats, (-1, 2, stats.shape[1]))
    losses = ltorch.sub(finite_logsumexp(ranks[:, 0], 0), ltorch.sum(ranks[:, 1], 0))
    valid = ltorch.ne(target, ignore_index)
    losses = ltorch.where(valid, losses, 0.0)
    if reduction != "none":
        losses = ltorch.sum(losses)
    if reduction == "mean":
        losses = ltorch.true_divide(losses, ltorch.sum(valid))
    return ltorch.to(losses, dtype)


#: (2R, N) stats of R ranks (``cross_entropy_stats`` of each, stacked), (N,) targets -> the loss in ``dtype`` (the
#: logits'), as torch's cross_entropy with that ignore_index and reduction
cross_entropy_of_stats = _symbol("cross_entropy_of_stats", _loss_of_stats)


def _loss_of_stats_backward(stats: TensorProxy, target: TensorProxy, grad: TensorProxy, ignore_index: int,
                            reduction: str) -> TensorProxy:
    ranks = ltorch.reshape(stats, (-1, 2, stats.shape[1]))
    valid = ltorch.ne(target, ignore_index)
    per_row = ltorch.to(grad, stats.dtype)
    if reduction == "mean":
        per_row = ltorch.true_divide(per_row, ltorch.sum(valid))
    per_row = ltorch.where(valid, per_row, 0.0)
    log_sum_exps = ranks[:, 0]
    from_log_sum_exp = ltorch.mul(_softmax(log_sum_exps, finite_logsumexp(log_sum_exps, 0), 0), per_row)
    from_target = ltorch.expand(ltorch.neg(per_row), from_log_sum_exp.shape)
    return ltorch.reshape(ltorch.stack((from_log_sum_exp, from_target), 1), stats.shape)


cross_entropy_of_stats_backward = _symbol("cross_entropy_of_stats_backward", _loss_of_stats_backward)


def _loss_of_stats_grad(stats: TensorProxy, target: TensorProxy, ignore_index: int, reduction: str,
                        dtype) -> TensorProxy:
    loss = cross_entropy_of_stats(stats, target, ignore_index, reduction, dtype)
    put_grad(stats, cross_entropy_of_stats_backward(stats, target, get_grad(loss), ignore_index, reduction))
    return loss


register_grad(cross_entropy_of_stats, _loss_of_stats_grad)

#: the symbols the loss runs as (the fusion executor keeps them off nvFuser)
CROSS_ENTROPY_SYMBOLS = (cross_entropy_stats, cross_entropy_stats_backward, cross_entropy_of_stats,
                         cross_entropy_of_stats_backward)
