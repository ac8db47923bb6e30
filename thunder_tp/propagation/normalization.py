"""Rules for normalizations and softmax: any dim outside the normalized ones may stay sharded."""

from __future__ import annotations

import thunder.torch as ltorch
import torch

from thunder_tp.layouts import REPLICATE, Partial, Shard
from thunder_tp.propagation.engine import Op, Strategy, register_rule
from thunder_tp.thunder_internals.private import symbol_of


def _batch_dim_strategies(op: Op, normalized: set[int]) -> list[Strategy]:
    x, current = op.tensors[0], op.layouts[0]
    if isinstance(current, Partial):  # a reduce_scatter here would need an all_gather later: one all_reduce
        return [op.replicated()]
    rest = (REPLICATE,) * (len(op.tensors) - 1)
    shards = [current if isinstance(current, Shard) and current.dim == d else Shard(d) for d in range(x.ndim)]
    return [*(Strategy((s, *rest), (s,)) for s in shards if s.dim not in normalized), op.replicated()]


@register_rule(ltorch.layer_norm, ltorch.rms_norm)
def norm(op: Op) -> list[Strategy]:
    """Weight and bias replicated; the input sharded on a dim it is not normalized over."""
    x = op.tensors[0]
    n = len(op.arg("normalized_shape"))
    return _batch_dim_strategies(op, set(range(x.ndim - n, x.ndim)))


@register_rule(ltorch.softmax, symbol_of(torch.softmax), ltorch.log_softmax)
def softmax(op: Op) -> list[Strategy]:
    """Sharded on any dim but the softmax dim."""
    x = op.tensors[0]
    return _batch_dim_strategies(op, {op.arg("dim") % x.ndim})
