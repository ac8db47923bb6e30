"""The rule of ``sample_tokens`` (``thunder_tp/ops/sampling.py``): on vocabulary-sharded logits each rank reduces its
shard to a few candidates, one all_gather of those replaces the gather of the logits, and every rank picks the same
token from them."""

from __future__ import annotations

from functools import partial

from thunder.core.proxies import TensorProxy
from thunder.core.trace import get_tracectx

from thunder_tp.collectives import rank_value, tp_gather
from thunder_tp.collectives.labels import label_collectives
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import REPLICATE, Shard, TPGroup, rank_pieces
from thunder_tp.ops.sampling import Sampling, sample_tokens, sampled_token, sampling_candidates
from thunder_tp.propagation.engine import Op, Strategy, register_rule

__all__ = ["sample_tokens_rule"]


def _on_shards(tp: TPGroup, starts: tuple[int, ...], vocab_size: int, logits: TensorProxy, key: TensorProxy | None,
               temperature: float, top_k: int | None, top_p: float) -> TensorProxy:
    """The token from this rank's logits (vocabulary indices from ``starts[rank]`` on): its candidates, gathered."""
    found = sampling_candidates(logits, key, rank_value(tp, starts, logits), temperature, top_k, top_p)
    count, emitted_from = found.shape[1], len(get_tracectx().bound_symbols)
    gathered = tp_gather(found, 1, rank_pieces(Shard(1), count * tp.size, tp.size), tp.group)
    label_collectives(get_tracectx().bound_symbols[emitted_from:], "the sampler: every rank's candidates gathered")
    return sampled_token(gathered, key, vocab_size, temperature, top_k, top_p)


@register_rule(sample_tokens)
def sample_tokens_rule(op: Op) -> list[Strategy]:
    """Logits (B, V) split on V (one run of the vocabulary per rank) -> the replicated token, the ranks exchanging
    only their candidates; top-p without top-k, and a simulation (one trace for every rank), on replicated logits."""
    logits = op.tensors[0]
    sampling = Sampling(*(op.arg(name) for name in ("temperature", "top_k", "top_p")))
    if not sampling.splits or ranks_of(op.tp.group).one_trace_for_all:
        return [op.replicated()]
    vocab_size, size = logits.shape[1], op.tp.size
    starts = tuple(chunks[0][0] for chunks in rank_pieces(Shard(1), vocab_size, size))
    local = partial(_on_shards, op.tp, starts, vocab_size)
    count = sampling.candidates_per_rank(vocab_size)
    issues = (("all_gather", logits.shape[0] * count * 2 * 8 * size),)  # float64 (value, index) pairs
    inputs = (Shard(1), *(REPLICATE for _ in op.tensors[1:]))
    return [Strategy(inputs, (REPLICATE,), local, issues=issues), op.replicated()]
