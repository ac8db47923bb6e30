"""litgpt's generation loops sample with thunder_tp's sampler: inside the jitted program for a jitted GPT, so that
under TP the logits are never gathered (each rank's vocabulary shard gives a few candidates; ``ops/sampling.py``).

litgpt's ``generate_fn`` and ``batched_generate_fn`` call the model, then ``sample`` on what it returns (through
``next_token`` and ``batched_next_token``). Importing thunder_tp replaces those two functions of
``litgpt.generate.base`` with ``next_token`` and ``batched_next_token`` below, which take the same arguments:

- a ``thunder.jit``-ed litgpt GPT is called with the sampling arguments as two more keywords (``SAMPLING``, the
  arguments of each row, and ``KEYS``, the rows' noise keys); a lookaside of ``GPT.forward`` traces the model's
  forward followed by ``sample_tokens`` of the last position's logits, so the program returns the tokens, the same on
  every rank (under TP a decode step's only logits-sized work is each rank's shard; the rule is
  ``propagation/sampling.py``);
- any other model is called as litgpt calls it, and ``thunder_tp.ops.sampling.sample`` runs on its logits: one
  device's tokens, the reference of the TP ones (the same tokens for the same seed).

``set_sampling("gather")`` switches back to litgpt's own ``next_token`` (litgpt's ``sample``, ``torch.multinomial`` on
the logits, which a TP program then gathers); ``"shards"`` is the default. The keys come from torch's random number
generator, one (2,) key per row and step (none for greedy rows): seed every rank alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from thunder_tp.ops.sampling import Sampling, draw_keys, sample, sample_tokens
from thunder_tp.thunder_internals import patches
from thunder_tp.thunder_internals.private import interpret_call, original_module

__all__ = ["KEYS", "SAMPLERS", "SAMPLING", "batched_next_token", "current_sampler", "next_token",
           "next_tokens", "sampled_in_program", "samples_in_program", "sampling", "set_sampling"]

#: the keywords of a jitted GPT's call that make it return sampled tokens: each row's (temperature, top_k, top_p),
#: top_k None as 0
SAMPLING = "thunder_tp_sampling"
#: ... and the rows' (B, 2) int64 noise keys (None where every row is greedy)
KEYS = "thunder_tp_keys"
#: "shards": thunder_tp's sampler (in the jitted program); "gather": litgpt's own on the (gathered) logits
SAMPLERS = ("shards", "gather")
_current = {"sampler": "shards"}


def set_sampling(sampler: str) -> str:
    """Which sampler litgpt's loops use from now on (``SAMPLERS``); returns the previous one."""
    if sampler not in SAMPLERS:
        raise ValueError(f"thunder_tp.set_sampling: unknown sampler {sampler!r}; expected one of {SAMPLERS}")
    previous, _current["sampler"] = _current["sampler"], sampler
    return previous


def current_sampler() -> str:
    """The sampler generation loops use now (``SAMPLERS``)."""
    return _current["sampler"]


@contextlib.contextmanager
def sampling(sampler: str) -> Iterator[None]:
    """``set_sampling(sampler)`` inside the block, the previous sampler after it."""
    previous = set_sampling(sampler)
    try:
        yield
    finally:
        set_sampling(previous)


def samples_in_program(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the module Fabric wraps) is a litgpt GPT jitted for thunder_tp (whose forward takes
    ``SAMPLING``: the lookaside serves thunder_tp's compiles only)."""
    from thunder.core.module import ThunderModule

    model = getattr(model, "_forward_module", model)
    if _GPT is None or not isinstance(model, ThunderModule) or not patches.compiles_for_thunder_tp(model):
        return False
    return type(original_module(model)).forward is _GPT.forward


def next_tokens(call: Callable[..., Any], samplings: Sequence[Sampling], in_program: bool, x: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
    """The (B, 1) int64 next tokens of the rows of ``x`` (B, T), each sampled with its ``samplings``: those
    ``call(x, *args, **kwargs)`` returns when ``in_program`` (``call``: a jitted GPT, or a call of one such as a
    ``DecodeStep``, given the sampling keywords), else those of the logits it returns."""
    rows = x.shape[0]
    if len(samplings) != rows:
        raise ValueError(f"thunder_tp sampling: {len(samplings)} sampling arguments for {rows} rows")
    keys = None if all(s.greedy for s in samplings) else draw_keys(rows, x.device)
    if in_program:
        # top_k None as 0: Thunder's cache checks a number argument's value, not whether it is None
        per_row = tuple((s.temperature, s.top_k or 0, s.top_p) for s in samplings)
        return call(x, *args, **kwargs, **{SAMPLING: per_row, KEYS: keys})
    logits = call(x, *args, **kwargs)[:, -1]
    return _sampled_rows(logits, keys, tuple(s.args for s in samplings), sample)


def _sampled_rows(logits: Any, keys: Any, per_row: tuple[tuple, ...], sampler: Callable[..., Any]) -> Any:
    """``sampler`` on all rows at once where they share their arguments, else row by row, concatenated."""
    if all(args == per_row[0] for args in per_row):
        return sampler(logits, *per_row[0], key=keys)
    rows = [sampler(logits[i:i + 1], *args, key=None if keys is None else keys[i:i + 1])
            for i, args in enumerate(per_row)]
    return torch.cat(rows)


def next_token(model, input_pos: torch.Tensor, x: torch.Tensor, input_pos_maxp1: int | None = None,
               **sample_kwargs: Any) -> torch.Tensor:
    """litgpt's ``next_token`` (the (1,) token after ``x``), sampled with thunder_tp's sampler."""
    if _current["sampler"] == "gather":
        return _LITGPT["next_token"](model, input_pos, x, input_pos_maxp1=input_pos_maxp1, **sample_kwargs)
    tokens = next_tokens(model, [Sampling(**sample_kwargs)], samples_in_program(model), x, input_pos,
                         input_pos_maxp1=input_pos_maxp1)
    return tokens[0]


def batched_next_token(model, input_pos: torch.Tensor, x: torch.Tensor, kwargs: dict | list[dict]) -> torch.Tensor:
    """litgpt's ``batched_next_token`` (each row's (1,) token, stacked), sampled with thunder_tp's sampler."""
    if _current["sampler"] == "gather":
        return _LITGPT["batched_next_token"](model, input_pos, x, kwargs)
    per_row = kwargs if isinstance(kwargs, list) else [kwargs] * x.size(0)
    return next_tokens(model, [Sampling(**k) for k in per_row], samples_in_program(model), x, input_pos)


# --- inside the jitted program -----------------------------------------------------------------------------------


def _sampled_forward(model, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The GPT's forward, then the tokens of its last position's logits (the module doc)."""
    per_row, keys = kwargs.pop(SAMPLING), kwargs.pop(KEYS)
    return sampled_in_program(_gpt_forward(model, *args, **kwargs)[:, -1], per_row, keys)


def sampled_in_program(logits: torch.Tensor, per_row: tuple[tuple, ...], keys: torch.Tensor | None) -> torch.Tensor:
    """The (B, 1) tokens of (B, V) ``logits`` in a traced program, given ``SAMPLING``'s and ``KEYS``' values."""
    per_row = tuple((temperature, top_k or None, top_p) for temperature, top_k, top_p in per_row)
    return _sampled_rows(logits, keys, per_row, _sample_tokens_call)


def _sample_tokens_call(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float, *,
                        key: torch.Tensor | None) -> torch.Tensor:
    """``sample``'s call, as the traced symbol."""
    return sample_tokens(logits, key, temperature, top_k, top_p)


try:
    import litgpt.generate.base as _litgpt_base
    from litgpt.model import GPT as _GPT
except ImportError:  # litgpt is optional: without it there is nothing to divert
    _GPT = None

_LITGPT: dict[str, Callable[..., Any]] = {}

if _GPT is not None:
    _gpt_forward = patches.copy_of(_GPT.forward)

    @patches.register_lookaside(_GPT.forward)
    def _gpt_forward_lookaside(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """thunder.jit traces the forward, and with ``SAMPLING`` the tokens of its last position."""
        return interpret_call(_sampled_forward if SAMPLING in kwargs else _gpt_forward, model, *args, **kwargs)

    _LITGPT.update(next_token=_litgpt_base.next_token, batched_next_token=_litgpt_base.batched_next_token)
    _litgpt_base.next_token, _litgpt_base.batched_next_token = next_token, batched_next_token
