"""Rules for embedding lookups: vocabulary-parallel (weight dim 0) and embedding-dim-parallel (dim 1)."""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy

from thunder_tp.collectives import rank_value
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import PARTIAL, REPLICATE, Pieces, Shard, TPGroup, rank_pieces
from thunder_tp.propagation.engine import Op, Strategy, register_rule


def _vocab_parallel_lookup(tp: TPGroup, padding_idx: int | None, every: Pieces):
    """Each rank looks up the ids in its vocabulary range (`every`: each rank's); other rows are zero (a Partial sum).
    The padding row (whose grad stays zero) is padding on the rank that holds it. The ids are masked flat: nvFuser
    0.2.35 fails to compile the masking of (batch, 1) ids (a decode step's) against the looked-up rows' (batch, 1,
    dim)."""

    def lookup(ids: TensorProxy, weight: TensorProxy, *args, **kwargs) -> TensorProxy:
        offset = rank_value(tp, tuple(chunks[0][0] for chunks in every), ids)
        rows = rank_value(tp, tuple(chunks[0][1] for chunks in every), ids)
        shifted = ltorch.sub(ltorch.reshape(ids, (-1,)), offset)
        outside = ltorch.logical_or(ltorch.lt(shifted, 0), ltorch.ge(shifted, rows))
        found = ltorch.embedding(ltorch.where(outside, 0, shifted), weight, _local_row(padding_idx, offset, rows))
        masked = ltorch.where(ltorch.unsqueeze(outside, -1), 0.0, found)
        return ltorch.reshape(masked, (*ids.shape, weight.shape[1]))

    return lookup


def _local_row(row: int | None, offset: int, rows: int) -> int | None:
    """A global row index as this rank's local one, None where another rank holds it."""
    if row is None or not 0 <= row - offset < rows:
        return None
    return row - offset


@register_rule(ltorch.embedding)
def embedding(op: Op) -> list[Strategy]:
    """Vocabulary shard -> Partial; embedding-dim shard -> last dim sharded; sharded ids -> sharded rows."""
    ids = op.tensors[0]
    strategies = [
        Strategy((REPLICATE, Shard(1)), (Shard(ids.ndim),)),
        *(Strategy((op.shard_of(ids, d), REPLICATE), (op.shard_of(ids, d),)) for d in range(ids.ndim)),
        op.replicated(),
    ]
    padding_idx = op.arg("padding_idx")
    # a padding row needs the rank as a constant, which a simulation (one trace for every rank) does not have
    if op.arg("max_norm") is None and (padding_idx is None or not ranks_of(op.tp.group).one_trace_for_all):
        if padding_idx is not None and padding_idx < 0:
            padding_idx += op.tensors[1].shape[0]
        every = rank_pieces(Shard(0), op.tensors[1].shape[0], op.tp.size)
        lookup = _vocab_parallel_lookup(op.tp, padding_idx, every)
        strategies.insert(0, Strategy((REPLICATE, Shard(0)), (PARTIAL,), lookup))
    return strategies
