"""The litgpt family: litgpt's KV cache and mixture of experts in forms Thunder traces (jit lookasides).

KV cache. litgpt's sliding-window cache (Gemma-2/3, Mistral-like configs) is a ring buffer: it writes at `input_pos %
max_cache_len` (a tensor `%` that Thunder 0.2.6 has no method for) and then cuts the returned keys and values to
`input_pos.max().item() + 1` (a data-dependent shape). Here the write uses `torch.remainder` and the whole ring is
returned: the attention cuts its mask to the ring's length, and the mask row of a position before the ring first
wraps hides the slots not yet written, as the cut did; once it wraps, every slot holds one of the last
`max_cache_len` positions, as before. So the result is litgpt's.

Mixture of experts. `LLaMAMoE.forward` gathers each expert's tokens with `torch.where(mask)` (data-dependent shapes):
it is traced as one `moe_layer` op (`thunder_tp.models.moe`).

LoRA. A `litgpt.lora.LoRALinear`'s pair follows the style of its base `linear` (`thunder_tp.styles.LoRAPairParallel`),
and the family tells the automatic plan so (a wrapper rule), which decides the two together.

Repeated blocks. `block_idx` only numbers a block: litgpt reads it where it builds one (its sliding-window flag
is an attribute of its own), so blocks traced once (`thunder_tp.tracing.repeated_blocks`) ignore it.

So a plain `thunder.jit` of such models traces once thunder_tp is imported.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from thunder.core.dtypes import to_torch_dtype

from thunder_tp.families import Wrapper, register_index_attribute, register_wrapper_rule
from thunder_tp.models.moe import Routing, mlp_parameters, moe_layer
from thunder_tp.styles import LoRAPairParallel
from thunder_tp.thunder_internals import patches
from thunder_tp.thunder_internals.private import interpret_call

__all__ = ["kv_cache_forward", "llama_moe_forward"]


def kv_cache_forward(cache, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """litgpt's KVCache.forward without data-dependent shapes: new keys and values written at their positions (a
    sliding-window cache: modulo its length), the whole cache returned."""
    from litgpt.model import batched_index_copy_

    if cache.k.dtype != k.dtype or cache.v.dtype != v.dtype:
        cache_dtype, dtype = to_torch_dtype(cache.k.dtype), to_torch_dtype(k.dtype)
        raise TypeError(
            f"litgpt KV cache of dtype {cache_dtype} written with {dtype} keys: under thunder.jit the cache cannot "
            f"be converted in place as litgpt does eagerly; create it in the model's dtype: "
            f"model.set_kv_cache(batch_size, dtype={dtype}) before thunder.jit"
        )
    if k.size(0) > cache.k.size(0):
        raise ValueError(f"a batch of {k.size(0)} sequences, but the KV cache holds {cache.k.size(0)}: "
                         f"model.set_kv_cache(batch_size={k.size(0)}) before thunder.jit")
    positions = input_pos
    if cache.is_sliding_window:
        if input_pos.shape[-1] > cache.max_cache_len:
            raise ValueError(
                f"Prefill length ({input_pos.shape[-1]}) exceeds the sliding window size ({cache.max_cache_len}): the "
                f"ring-buffer KV cache would overwrite entries; prefill in chunks of at most {cache.max_cache_len} "
                "tokens"
            )
        positions = torch.remainder(input_pos, cache.max_cache_len)
    bs = k.size(0)
    return (batched_index_copy_(cache.k[:bs, ...], -2, positions, k),
            batched_index_copy_(cache.v[:bs, ...], -2, positions, v))


def _shared_parameters(module) -> tuple:
    """The shared experts' [fc_1, fc_2, proj] weights and biases (None where absent)."""
    if not module.config.n_shared_expert:
        return None, None
    fc_1, fc_2, proj, *biases = mlp_parameters([module.shared_experts])
    return [fc_1[0], fc_2[0], proj[0]], (None if biases[0] is None else [b[0] for b in biases])


def llama_moe_forward(module, x: torch.Tensor) -> torch.Tensor:
    """litgpt's LLaMAMoE.forward as one `moe_layer` call (same router, same result)."""
    gate = module.gate
    score_bias = getattr(gate, "e_score_correction_bias", None)
    return moe_layer(x, gate.weight, score_bias, *mlp_parameters(module.experts), *_shared_parameters(module), None,
                     Routing.of(module.config))


try:
    from litgpt.lora import LoRALinear
    from litgpt.model import KVCache, LLaMAMoE
except ImportError:  # litgpt is optional: without it there is nothing to divert
    KVCache = LLaMAMoE = LoRALinear = None


register_index_attribute("litgpt.", "block_idx")


@register_wrapper_rule
def _lora_pair(module: nn.Module) -> Wrapper | None:
    """A LoRALinear with a LoRA pair wraps its `linear`: the pair follows the linear's style."""
    if LoRALinear is None or not isinstance(module, LoRALinear) or module.r <= 0 or not hasattr(module, "lora_A"):
        return None
    return Wrapper("linear", LoRAPairParallel)

if KVCache is not None:

    @patches.register_lookaside(KVCache.forward)
    def _kv_cache_lookaside(cache, input_pos, k, v):
        """thunder.jit traces `kv_cache_forward` wherever litgpt's KVCache.forward is called."""
        return interpret_call(kv_cache_forward, cache, input_pos, k, v)

    @patches.register_lookaside(LLaMAMoE.forward)
    def _llama_moe_lookaside(module, x):
        """thunder.jit traces `llama_moe_forward` wherever litgpt's LLaMAMoE.forward is called."""
        return interpret_call(llama_moe_forward, module, x)
