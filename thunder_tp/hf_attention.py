"""HF attention's `repeat_kv` (expand + reshape of the K/V heads) traced as `repeat_interleave`, the same values,
whose propagation rule keeps K/V heads replicated over the ranks whose query heads share them."""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
from thunder.core.interpreter import _interpret_call
from thunder.core.jit_ext import register_general_jit_lookaside

_registered: set = set()


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, K/V heads, seq, head dim) -> each head repeated n_rep times, consecutively (HF's repeat_kv)."""
    return hidden_states if n_rep == 1 else torch.repeat_interleave(hidden_states, n_rep, dim=1)


def register_lookasides(model: nn.Module) -> None:
    """Make thunder.jit trace `repeat_kv` wherever HF's sdpa attention, or the model's own module, calls theirs."""
    import transformers.integrations.sdpa_attention as sdpa

    modules = [sdpa, *(sys.modules[type(m).__module__] for m in model.modules())]
    for fn in {getattr(module, "repeat_kv", None) for module in modules} - {None}:
        if fn not in _registered:
            register_general_jit_lookaside(fn)(lambda x, n_rep: _interpret_call(repeat_kv, x, n_rep))
            _registered.add(fn)
