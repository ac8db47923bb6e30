"""Rules for embedding lookups: vocabulary-parallel (weight dim 0) and embedding-dim-parallel (dim 1)."""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy

from thunder_tp.collectives import rank_offset
from thunder_tp.layouts import PARTIAL, REPLICATE, Shard, TPGroup
from thunder_tp.propagation.engine import Op, Strategy, register_rule


def _vocab_parallel_lookup(tp: TPGroup):
    """Each rank looks up the ids in its vocabulary range; other rows are zero (a Partial sum)."""

    def lookup(ids: TensorProxy, weight: TensorProxy, *args, **kwargs) -> TensorProxy:
        rows = weight.shape[0]
        shifted = ltorch.sub(ids, rank_offset(tp, rows, ids))
        outside = ltorch.logical_or(ltorch.lt(shifted, 0), ltorch.ge(shifted, rows))
        found = ltorch.embedding(ltorch.where(outside, 0, shifted), weight)
        return ltorch.where(ltorch.unsqueeze(outside, -1), 0.0, found)

    return lookup


@register_rule(ltorch.embedding)
def embedding(op: Op) -> list[Strategy]:
    """Vocabulary shard -> Partial; embedding-dim shard -> last dim sharded; sharded ids -> sharded rows."""
    ids = op.tensors[0]
    strategies = [
        Strategy((REPLICATE, Shard(1)), (Shard(ids.ndim),)),
        *(Strategy((Shard(d), REPLICATE), (Shard(d),)) for d in range(ids.ndim)),
        op.replicated(),
    ]
    if op.arg("padding_idx") is None and op.arg("max_norm") is None:
        strategies.insert(0, Strategy((REPLICATE, Shard(0)), (PARTIAL,), _vocab_parallel_lookup(op.tp)))
    return strategies
