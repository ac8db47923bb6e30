"""Rules for cross_entropy: on replicated logits, and vocabulary-parallel (loss parallel)."""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy

from thunder_tp.collectives import rank_offset, tp_all_reduce_max, tp_reduce_from_tp
from thunder_tp.layouts import REPLICATE, Shard, TPGroup
from thunder_tp.propagation.engine import Op, Strategy, register_rule


def _vocab_parallel_cross_entropy(tp: TPGroup, ignore_index: int, reduction: str):
    """Cross-entropy of (N, C) logits sharded on C: only (N,)-sized statistics cross ranks."""

    def loss(logits: TensorProxy, target: TensorProxy, *_, **__) -> TensorProxy:
        n_local, group = logits.shape[1], tp.group
        shift = tp_all_reduce_max(ltorch.amax(logits, 1, True), group)
        sum_exp = tp_reduce_from_tp(ltorch.sum(ltorch.exp(ltorch.sub(logits, shift)), 1), group)
        log_sum_exp = ltorch.add(ltorch.log(sum_exp), ltorch.squeeze(shift, 1))
        local_target = ltorch.sub(target, rank_offset(tp, n_local, target))
        inside = ltorch.logical_and(ltorch.ge(local_target, 0), ltorch.lt(local_target, n_local))
        index = ltorch.unsqueeze(ltorch.where(inside, local_target, 0), 1)
        picked = ltorch.squeeze(ltorch.take_along_dim(logits, index, 1), 1)
        target_logit = tp_reduce_from_tp(ltorch.where(inside, picked, 0.0), group)
        valid = ltorch.ne(target, ignore_index)
        losses = ltorch.where(valid, ltorch.sub(log_sum_exp, target_logit), 0.0)
        if reduction == "none":
            return losses
        total = ltorch.sum(losses)
        return total if reduction == "sum" else ltorch.true_divide(total, ltorch.sum(valid))

    return loss


@register_rule(ltorch.cross_entropy)
def cross_entropy(op: Op) -> list[Strategy]:
    """Logits (N, C) sharded on C -> replicated loss, without gathering the logits."""
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
    local = _vocab_parallel_cross_entropy(op.tp, op.arg("ignore_index"), op.arg("reduction"))
    return [Strategy((Shard(1), REPLICATE), (REPLICATE,), local), op.replicated()]
