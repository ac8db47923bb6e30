"""What thunder_tp reaches in HF transformers by a private name: the check whose answer a lookaside replaces
(``thunder_tp.models.hf.attention``). Imported when asked, as transformers is optional.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ignore_causal_mask_check"]


def ignore_causal_mask_check() -> Callable[..., bool]:
    """``AttentionMaskConverter._ignore_causal_mask_sdpa``: HF's SDPA attention asks it whether a causal mask can be
    left to SDPA's ``is_causal``."""
    from transformers.modeling_attn_mask_utils import AttentionMaskConverter

    return AttentionMaskConverter._ignore_causal_mask_sdpa
