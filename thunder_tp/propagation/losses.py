"""Rules for cross_entropy: on replicated logits, and vocabulary-parallel (loss parallel)."""

from __future__ import annotations

import sys
from dataclasses import replace

import thunder.torch as ltorch
from thunder.core.langctxs import Languages, langctx
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import Symbol
from thunder.core.transforms import register_grad

from thunder_tp.collectives import rank_offset, tp_gather
from thunder_tp.layouts import REPLICATE, Shard, TPGroup
from thunder_tp.propagation.engine import Op, Strategy, register_rule


def _finite(a: TensorProxy) -> TensorProxy:
    return ltorch.where(ltorch.isinf(a), 0.0, a)


def _logsumexp(a: TensorProxy, dim: int) -> TensorProxy:
    shift = _finite(ltorch.amax(a, dim, True))  # a slice of -inf only (a masked vocabulary shard) gives -inf, not nan
    summed = ltorch.sum(ltorch.exp(ltorch.sub(a, shift)), dim)
    return ltorch.add(ltorch.log(summed), ltorch.squeeze(shift, dim))


#: logsumexp whose grad is the softmax itself (zero on a slice of -inf only): no gradient through the shift, whose
#: contributions cancel exactly
softmax_logsumexp = Symbol(
    name="softmax_logsumexp", meta=langctx(Languages.TORCH)(_logsumexp), id="thunder_tp.softmax_logsumexp",
    _module=sys.modules[__name__],
)


def _softmax_logsumexp_grad(a: TensorProxy, dim: int) -> TensorProxy:
    out = _logsumexp(a, dim)
    softmax = ltorch.exp(ltorch.sub(a, _finite(ltorch.unsqueeze(out, dim))))
    put_grad(a, ltorch.mul(softmax, ltorch.unsqueeze(get_grad(out), dim)))
    return out


register_grad(softmax_logsumexp, _softmax_logsumexp_grad)


def _target_logit(logits: TensorProxy, local_target: TensorProxy) -> TensorProxy:
    """Each row's logit at its target column (0 where the target is not a column of ``logits``): a one-hot mask,
    which fuses with the log-sum-exp's reduction (a gather would scatter into logits-sized zeros in the backward)."""
    hit = ltorch.eq(ltorch.unsqueeze(local_target, 1), ltorch.arange(logits.shape[1], device=logits.device))
    return ltorch.sum(ltorch.where(hit, logits, 0.0), 1)


def _reduce_losses(log_sum_exp: TensorProxy, target_logit: TensorProxy, target: TensorProxy, ignore_index: int,
                   reduction: str) -> TensorProxy:
    valid = ltorch.ne(target, ignore_index)
    losses = ltorch.where(valid, ltorch.sub(log_sum_exp, target_logit), 0.0)
    if reduction == "none":
        return losses
    total = ltorch.sum(losses)
    return total if reduction == "sum" else ltorch.true_divide(total, ltorch.sum(valid))


def _replicated_cross_entropy(ignore_index: int, reduction: str):
    """Cross-entropy of replicated (N, C) logits as log-sum-exp minus target logit: nothing logits-sized is
    written but the grad, which a gather's grad (the rank's columns) slices inside the same fusion."""

    def loss(logits: TensorProxy, target: TensorProxy, *_, **__) -> TensorProxy:
        target_logit = _target_logit(logits, target)
        return _reduce_losses(softmax_logsumexp(logits, 1), target_logit, target, ignore_index, reduction)

    return loss


def _vocab_parallel_cross_entropy(tp: TPGroup, ignore_index: int, reduction: str):
    """Cross-entropy of (N, C) logits sharded on C: each rank's (log-sum-exp, target logit) per token, gathered in
    one collective of 2N numbers, is all the other ranks need."""

    def loss(logits: TensorProxy, target: TensorProxy, *_, **__) -> TensorProxy:
        local_target = ltorch.sub(target, rank_offset(tp, logits.shape[1], target))
        local_stats = ltorch.stack((softmax_logsumexp(logits, 1), _target_logit(logits, local_target)))
        stats = ltorch.reshape(tp_gather(local_stats, 0, None, tp.group), (tp.size, 2, -1))
        log_sum_exp = softmax_logsumexp(stats[:, 0], 0)
        return _reduce_losses(log_sum_exp, ltorch.sum(stats[:, 1], 0), target, ignore_index, reduction)

    return loss


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
    vocab_parallel = _vocab_parallel_cross_entropy(op.tp, ignore_index, reduction)
    replicated = _replicated_cross_entropy(ignore_index, reduction)
    stats = ("all_gather", 2 * logits.shape[0] * logits.dtype.bytes * op.tp.size)  # (log-sum-exp, target logit) pairs
    return [Strategy((Shard(1), REPLICATE), (REPLICATE,), vocab_parallel, issues=(stats,)),
            replace(op.replicated(), local=replicated)]
