"""HF attention under thunder.jit:

- `repeat_kv` (expand + reshape of the K/V heads) traced as `repeat_interleave`, the same values, whose propagation
  rule keeps K/V heads replicated over the ranks whose query heads share them;
- GPT-2's `Conv1D` (y = addmm(b, x.view(-1, in), w), weight in x out) traced as `x @ w + b` on `x` as it comes: the
  flattening of batch and sequence into one dim would merge sequence shards (SP) into pieces no layout describes;
- `AttentionMaskConverter._ignore_causal_mask_sdpa` answered as in eager mode: without a user mask, a causal
  attention over the whole sequence runs SDPA with `is_causal=True` instead of a (batch, 1, seq, seq + 1) float mask.
  HF asks whether it is tracing (Thunder's interpreter says it compiles) and then always builds the mask, because an
  exported graph would hard-code `is_causal` for one shape; Thunder's trace is specialized to its input shapes (its
  prologue checks them), so the eager answer is right for it. The mask costs its construction, a saved tensor and,
  on CPU, the flash kernel's causal block skipping (it computes every key block with a mask).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from thunder_tp.thunder_internals import patches
from thunder_tp.thunder_internals.private import interpret_call
from thunder_tp.thunder_internals.transformers import ignore_causal_mask_check

_registered: set = set()


def kv_heads(config) -> int:
    """An HF config's number of K/V heads (each shared by the same number of query heads)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim(config) -> int:
    """An HF config's size of one attention head."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, K/V heads, seq, head dim) -> each head repeated n_rep times, consecutively (HF's repeat_kv)."""
    return hidden_states if n_rep == 1 else torch.repeat_interleave(hidden_states, n_rep, dim=1)


def conv1d_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's Conv1D.forward (GPT-2's linear layers): the same product, without flattening x's leading dims."""
    return torch.add(torch.matmul(x, module.weight), module.bias)


def ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length: int, sliding_window=None,
                            is_training: bool = False) -> bool:
    """HF's `AttentionMaskConverter._ignore_causal_mask_sdpa` as it answers in eager mode (not tracing), for shapes a
    trace is specialized to: True (SDPA's `is_causal` instead of a mask) when no mask is given and every query sees
    the whole sequence; with a mask, False (build it), as HF answers while tracing (it never reads a mask's values
    then)."""
    if attention_mask is not None:
        return False
    query_length = inputs_embeds.shape[1]
    key_value_length = query_length + past_key_values_length
    return (query_length == 1 or key_value_length == query_length) and (
        sliding_window is None or key_value_length < sliding_window
    )


def register_lookasides(model: nn.Module) -> None:
    """Make thunder.jit trace `repeat_kv` wherever HF's sdpa attention, or the model's own module, calls theirs, GPT-2's
    Conv1D as `conv1d_forward`, and answer `_ignore_causal_mask_sdpa` as in eager mode."""
    import transformers.integrations.sdpa_attention as sdpa
    from transformers.pytorch_utils import Conv1D

    if Conv1D.forward not in _registered:
        patches.register_lookaside(Conv1D.forward)(lambda module, x: interpret_call(conv1d_forward, module, x))
        _registered.add(Conv1D.forward)

    ignore = ignore_causal_mask_check()
    if ignore not in _registered:
        patches.register_lookaside(ignore)(
            lambda *args, **kwargs: interpret_call(ignore_causal_mask_sdpa, *args, **kwargs)
        )
        _registered.add(ignore)

    modules = [sdpa, *(sys.modules[type(m).__module__] for m in model.modules())]
    for fn in {getattr(module, "repeat_kv", None) for module in modules} - {None}:
        if fn not in _registered:
            patches.register_lookaside(fn)(lambda x, n_rep: interpret_call(repeat_kv, x, n_rep))
            _registered.add(fn)
