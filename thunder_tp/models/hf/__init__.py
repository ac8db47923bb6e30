"""The HuggingFace transformers family: HF models traced as TP needs them (attention, sparse MoE blocks), and HF's
``generate`` through a TP program (``set_kv_cache``, ``generate``)."""

from __future__ import annotations

import types

import torch.nn as nn

from thunder_tp.families import register_family, register_index_attribute, register_jit_hook
from thunder_tp.models.hf import attention, moe
from thunder_tp.models.hf.generation import cache_names, generate, set_kv_cache

__all__ = ["generate", "register_lookasides", "route_generate", "set_kv_cache"]

# a decoder layer's attention reads `layer_idx` only with a KV cache, an object its call's arguments then hold (a
# call thunder_tp.tracing.repeated_blocks does not trace once)
register_index_attribute("transformers.", "layer_idx")


@register_family
def register_lookasides(model: nn.Module) -> None:
    """Make thunder.jit trace a HuggingFace transformers model as TP needs it (HF's `repeat_kv` as
    `repeat_interleave`, its causal-mask question answered as in eager mode, sparse MoE blocks as one `moe_layer`);
    nothing for other models. Registered as a family, so every plan (hf, auto, a hand-written one) sees the same
    program."""
    if any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        attention.register_lookasides(model)
        moe.register_lookasides(model)


@register_jit_hook
def route_generate(jitted: nn.Module, model: nn.Module) -> None:
    """``jitted.generate`` (HF's idiom) runs ``generate(jitted, ...)`` where the model has a cache (``set_kv_cache``);
    otherwise Thunder forwards it to the model's own method, which runs eagerly."""
    if cache_names(model):
        jitted.generate = types.MethodType(generate, jitted)
