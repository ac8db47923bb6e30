"""Sampling the next token as litgpt's ``sample`` does (top-k, then temperature, then top-p), from logits held whole
or split by vocabulary over the ranks, with the same token either way.

litgpt's ``sample`` draws with ``torch.multinomial`` over the whole vocabulary, a draw no split of the vocabulary can
reproduce. Here the draw is the Gumbel-max trick: the token is the argmax of ``logits / temperature + g``, where ``g``
is Gumbel noise that depends only on a per-row key and the token's vocabulary index (a keyed integer hash, so any rank
draws the noise of its own indices). That samples the distribution litgpt's ``sample`` samples; and every decision is
a maximum, which splits over the ranks:

- greedy (``temperature`` 0 or ``top_p`` 0): each rank's (largest logit, its index): 2 numbers a row;
- temperature alone: each rank's (largest ``logits / temperature + g``, its index);
- top-k: each rank's k largest logits and their indices (k x 2 numbers a row); every rank merges them into the k
  largest overall and applies temperature, top-p and the noise to those k, the same tensor on every rank;
- top-p without top-k: the nucleus can be the whole vocabulary, so the logits are gathered first (as without this
  module): set ``top_k`` to sample on shards.

So the sampler is three steps: ``candidates`` of the logits a rank holds (every row's (value, vocabulary index) pairs
that can win, as one float64 tensor), their gather over the ranks, and ``chosen``, the token from every rank's
candidates. One device is the same with one rank. Ties are decided by the lower vocabulary index everywhere (as
``torch.argmax`` decides them; litgpt's ``torch.topk`` and ``torch.sort`` leave them to the implementation).

Exactness: given the same logits, the split sampler returns bit for bit the token one device's does. Everything after
the gather runs on the same tensor on every rank and on one device, and the noise of temperature alone, computed on
each rank's indices, is computed in blocks aligned to 64 vocabulary indices and at most 16,384 elements, so that each
element goes through the same (vectorized) code on a shard as on the whole vocabulary (on a CPU, ATen's transcendental
functions may round differently in a loop's scalar tail). Greedy sampling is litgpt's ``argmax``.

The three steps are opaque symbols run by ``sampling_executor`` (eager torch, never fused); ``sample_tokens`` is the
logical op (whole logits), which ``thunder_tp.propagation.sampling`` runs on shards under TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.extend import OperatorExecutor, add_always_executor, register_executor

__all__ = ["Sampling", "chosen", "candidates", "draw_keys", "sample", "sample_tokens", "sampled_token",
           "sampling_candidates", "sampling_executor"]

#: Runs the sampling symbols (opaque: never fused). Always among a jit's executors, whatever list it was given.
sampling_executor = OperatorExecutor("thunder_tp_sampling", version="0.1")
register_executor(sampling_executor)
add_always_executor(sampling_executor)

_MASK32 = 0xFFFFFFFF
#: the noise of temperature alone is computed in blocks aligned to this many vocabulary indices (a multiple of any
#: CPU vector loop's step), in pieces of at most _PIECE elements (below ATen's grain size: one thread each)
_ALIGN, _PIECE = 64, 16384


@dataclass(frozen=True)
class Sampling:
    """litgpt's ``sample`` arguments: ``top_k`` largest logits kept (None: all), then ``temperature``, then the
    smallest set of them whose probability reaches ``top_p``; greedy where ``temperature`` or ``top_p`` is not
    positive (as litgpt)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"thunder_tp sampling: top_p must be in [0, 1], got {self.top_p}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"thunder_tp sampling: top_k must be a positive int or None, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        """Whether the token is the largest logit's (no draw)."""
        return not (self.temperature > 0.0 and self.top_p > 0.0)

    @property
    def splits(self) -> bool:
        """Whether each rank can reduce its vocabulary shard to a few candidates (all but top-p without top-k)."""
        return self.greedy or self.top_k is not None or self.top_p == 1.0

    def candidates_per_rank(self, columns: int) -> int:
        """How many candidates ``candidates`` gives per row from ``columns`` logits."""
        if self.greedy or (self.top_k is None and self.top_p == 1.0):
            return 1
        return self.top_k if self.top_k is not None else columns

    @property
    def args(self) -> tuple:
        """The arguments of the sampling symbols (trace constants)."""
        return self.temperature, self.top_k, self.top_p


def draw_keys(rows: int, device: torch.device) -> torch.Tensor:
    """A (rows, 2) int64 key per row from torch's random number generator (seed every rank alike)."""
    return torch.randint(0, 2**31, (rows, 2), dtype=torch.int64, device=device)


# --- the noise: a keyed hash of each vocabulary index ---------------------------------------------------------


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (C. Wellons' lowbias32) on int64 values below 2**32; its constants are below 2**31, so
    no product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def _gumbel(key: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gumbel noise (float64) of each row's key (``key``: (B, 2)) and vocabulary index (``indices``: (n,) or
    (B, n)): ``-log(-log(u))`` of a uniform ``u`` in (0, 1) hashed from the two."""
    hashed = _mix32(_mix32(indices ^ key[:, :1]) ^ key[:, 1:])
    uniform = (hashed.to(torch.float64) + 0.5) * 2.0**-32
    return -torch.log(-torch.log(uniform))


def _gumbel_of_range(key: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The noise of vocabulary indices ``start``..``stop`` - 1 (B, stop - start), computed in aligned blocks (the
    module doc: the same float code for an index on any rank)."""
    first, last = start - start % _ALIGN, stop + (-stop) % _ALIGN
    piece = max(_ALIGN, _PIECE // key.shape[0] // _ALIGN * _ALIGN)
    blocks = [_gumbel(key, torch.arange(at, min(at + piece, last), device=key.device))
              for at in range(first, last, piece)]
    return torch.cat(blocks, -1)[:, start - first:stop - first]


# --- the three steps ----------------------------------------------------------------------------------------


def candidates(logits: torch.Tensor, key: torch.Tensor | None, start: int, temperature: float,
               top_k: int | None, top_p: float) -> torch.Tensor:
    """The (B, C, 2) float64 candidates of (B, n) logits that hold vocabulary indices ``start``..``start + n - 1``:
    each row's (value, index) pairs that can win (value: the logit, or for temperature alone the perturbed one)."""
    sampling = Sampling(temperature, top_k, top_p)
    values = logits.to(torch.float64)
    if sampling.candidates_per_rank(logits.shape[1]) == 1:
        if not sampling.greedy:
            values = values / temperature + _gumbel_of_range(key, start, start + logits.shape[1])
        best = values.argmax(-1, keepdim=True)
        return _pairs(values.gather(-1, best), best + start)
    if top_k is None:  # top-p alone: every logit
        return _pairs(values, torch.arange(start, start + logits.shape[1], device=logits.device).expand_as(values))
    return _top_k(values, start, top_k)


def _pairs(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return torch.stack((values, indices.to(torch.float64)), -1)


def _top_k(values: torch.Tensor, start: int, k: int) -> torch.Tensor:
    """The k largest values of each row with their vocabulary indices, ties to the lower index; fewer than k values
    are padded with (-inf, an index past any real one)."""
    rows, n = values.shape
    taken = min(k, n)
    threshold = values.topk(taken, -1).values[:, -1:]
    above, at = values > threshold, values == threshold
    room = taken - above.sum(-1, keepdim=True)
    kept = above | (at & (at.cumsum(-1) <= room))  # exactly `taken` a row: the tied ones by position
    position = torch.arange(n, device=values.device)
    picked = torch.where(kept, n - position, 0).topk(taken, -1).values.neg().add(n)  # their positions, in order
    pairs = _pairs(values.gather(-1, picked), picked + start)
    if taken < k:
        padding = torch.full((rows, k - taken), torch.inf, dtype=torch.float64, device=values.device)
        pairs = torch.cat((pairs, torch.stack((-padding, padding), -1)), 1)
    return pairs


def chosen(gathered: torch.Tensor, key: torch.Tensor | None, vocab_size: int, temperature: float,
           top_k: int | None, top_p: float) -> torch.Tensor:
    """The (B, 1) int64 token of every rank's candidates ``gathered`` (B, R x C, 2), in the ranks' order (so in the
    order of the vocabulary)."""
    sampling = Sampling(temperature, top_k, top_p)
    values, indices = gathered[..., 0], gathered[..., 1]
    if gathered.shape[1] == 1 or sampling.candidates_per_rank(vocab_size) == 1:
        best = values.argmax(-1, keepdim=True)  # the first of equal values: the lower index
        return indices.gather(-1, best).to(torch.int64)
    values, indices = _in_order(values, indices)
    kept = min(top_k, vocab_size) if top_k is not None else vocab_size
    values, indices = values[:, :kept], indices[:, :kept].to(torch.int64)
    scaled = values / temperature
    if top_p < 1.0:
        scaled = _nucleus(scaled, top_p)
    best = (scaled + _gumbel(key, indices)).argmax(-1, keepdim=True)
    return indices.gather(-1, best)


def _in_order(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's candidates by value, largest first, ties by the lower index."""
    by_index = indices.argsort(stable=True, dim=-1)
    values, indices = values.gather(-1, by_index), indices.gather(-1, by_index)
    by_value = values.argsort(stable=True, dim=-1, descending=True)
    return values.gather(-1, by_value), indices.gather(-1, by_value)


def _nucleus(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """litgpt's top-p on values sorted largest first: from the smallest up, those whose cumulative probability is at
    most 1 - top_p become -inf, the largest is always kept."""
    rising = scaled.flip(-1)
    removed = rising.softmax(-1).cumsum(-1) <= 1 - top_p
    removed[:, -1] = False
    return rising.masked_fill(removed, -torch.inf).flip(-1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0, *,
           key: torch.Tensor | None = None) -> torch.Tensor:
    """The (B, 1) int64 next token of each row of (B, V) logits, as litgpt's ``sample`` with these arguments (a
    Gumbel-max draw; the module doc); ``key`` (B, 2) int64 defaults to ``draw_keys`` when the token is drawn."""
    if logits.ndim != 2:
        raise ValueError(f"thunder_tp sampling: expected (batch, vocabulary) logits, got shape {tuple(logits.shape)}")
    sampling = Sampling(temperature, top_k, top_p)
    if key is None and not sampling.greedy:
        key = draw_keys(logits.shape[0], logits.device)
    found = candidates(logits, key, 0, *sampling.args)
    return chosen(found, key, logits.shape[1], *sampling.args)


# --- as Thunder symbols ---------------------------------------------------------------------------------------


def _tokens(rows: TensorProxy) -> TensorProxy:
    return TensorProxy(like=rows, shape=(rows.shape[0], 1), dtype=dtypes.int64, requires_grad=False)


def _sample_tokens_meta(logits: TensorProxy, key, temperature, top_k, top_p) -> TensorProxy:
    """Named as ``sample``'s arguments: the propagation rule reads them by name."""
    return _tokens(logits)


def _sampled_token_meta(gathered: TensorProxy, key, vocab_size, temperature, top_k, top_p) -> TensorProxy:
    return _tokens(gathered)


def _candidates_meta(logits: TensorProxy, key, start, temperature, top_k, top_p) -> TensorProxy:
    count = Sampling(temperature, top_k, top_p).candidates_per_rank(logits.shape[1])
    return TensorProxy(like=logits, shape=(logits.shape[0], count, 2), dtype=dtypes.float64, requires_grad=False)


def _sample_tokens(logits: torch.Tensor, key: torch.Tensor | None, temperature: float, top_k: int | None,
                   top_p: float) -> torch.Tensor:
    return sample(logits, temperature, top_k, top_p, key=key)


#: (B, V) logits, (B, 2) keys or None, temperature, top_k, top_p -> (B, 1) int64 tokens: ``sample``
sample_tokens = sampling_executor.register_operator("tp_sample_tokens", meta=_sample_tokens_meta, fn=_sample_tokens)
#: (B, n) logits of vocabulary indices start.., keys, start, temperature, top_k, top_p -> (B, C, 2): ``candidates``
sampling_candidates = sampling_executor.register_operator("tp_sampling_candidates", meta=_candidates_meta,
                                                          fn=candidates)
#: (B, R x C, 2) candidates of R ranks, keys, vocabulary size, temperature, top_k, top_p -> (B, 1): ``chosen``
sampled_token = sampling_executor.register_operator("tp_sampled_token", meta=_sampled_token_meta, fn=chosen)
