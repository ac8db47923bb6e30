"""HuggingFace's ``generate`` through a TP program: a static KV cache split by heads, and the next token sampled on
the vocabulary shards (``thunder_tp.ops.sampling``), so that a decode step never gathers the logits.

- ``set_kv_cache(model, batch_size, max_length)`` gives each attention module of an HF model a ``KVCacheBuffers``
  submodule (buffers ``k``, ``v``: (batch, K/V heads, max_length, head dim)) before ``thunder.jit``; ``plans.hf``
  then splits it like the K/V heads (``KVCacheParallel``) and leaves the lm_head's output vocabulary-sharded.
- ``generate(jm, input_ids, **kwargs)`` runs HF's own ``generate`` (its loop, stopping criteria, attention masks,
  cache positions) with every model call routed to the jitted program ``jm`` and the cache ``ProgramCache``: HF's
  ``StaticCache`` bookkeeping on the host, the buffers inside the program. ``jm.generate`` is the same (the
  transform routes it). A lookaside of ``ProgramCache.update`` writes the cache through the module being traced
  (so the program reads and writes each rank's piece of the buffers), and one of the model's forward, with the
  sampling keywords of ``litgpt_sampling``, returns the tokens of the last position instead of the logits.
- HF then "samples" from logits that are 0 at the program's token and -inf elsewhere, which every warper (temperature,
  top-k, top-p) keeps as they are and ``torch.multinomial`` / ``argmax`` return: HF's token is the program's.
  Settings that change the logits otherwise (repetition penalty, min length, bad words, beams, ...) are refused
  with the fix: ``set_sampling("gather")``, under which the program returns the (gathered) last logits and HF
  samples from them itself.

Every rank seeds torch alike: the noise keys are drawn from torch's generator on every rank (``draw_keys``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from transformers import GenerationConfig, StaticCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from thunder_tp.models import litgpt_sampling
from thunder_tp.models.hf.attention import head_dim, kv_heads
from thunder_tp.ops.sampling import Sampling
from thunder_tp.thunder_internals import patches
from thunder_tp.thunder_internals.private import interpret_call, original_module
from thunder_tp.thunder_internals.replay import unwrap, wrap_const

__all__ = ["KVCacheBuffers", "ProgramCache", "cache_names", "generate", "set_kv_cache"]

#: generation settings that change the logits between the model and the draw, with their neutral values: with the
#: sampler on shards the program returns tokens, so any of these set is an error naming set_sampling("gather")
LOGITS_CHANGING: dict[str, Any] = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0, "min_new_tokens": None,
    "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "sequence_bias": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "guidance_scale": None,
    "renormalize_logits": False, "num_beams": 1, "penalty_alpha": None, "dola_layers": None,
    "watermarking_config": None, "output_scores": False, "output_logits": False, "num_return_sequences": 1,
}


class KVCacheBuffers(nn.Module):
    """One attention module's static cache: buffers ``k`` and ``v`` (batch, K/V heads, max length, head dim)."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device | None = None):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def reset_parameters(self) -> None:
        """Empty the cache (under TP the transform zeroes each rank's pieces instead)."""
        self.k.zero_()
        self.v.zero_()


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of an HF model, in layer order (the modules with a ``layer_idx`` and a ``config``)."""
    found = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "config")
             and type(m).__name__.endswith("Attention")]
    return sorted(found, key=lambda m: m.layer_idx)


def set_kv_cache(model: nn.Module, batch_size: int, max_length: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> nn.Module:
    """Give every attention module of HF ``model`` a static cache of ``batch_size`` rows and ``max_length``
    positions (call before ``thunder.jit``, as litgpt's ``set_kv_cache``); returns the model."""
    attentions = attention_modules(model)
    if not attentions:
        raise TypeError(f"thunder_tp.models.hf.set_kv_cache: {type(model).__name__} has no HF attention modules "
                        "(modules with a layer_idx); it needs a HuggingFace transformers decoder")
    config = attentions[0].config
    parameter = next(model.parameters())
    dtype = dtype or parameter.dtype
    device = torch.device("cpu") if parameter.is_meta and device is None else device or parameter.device
    for attention in attentions:
        attention.kv_cache = KVCacheBuffers((batch_size, kv_heads(config), max_length, head_dim(config)), dtype, device)
    register_lookaside(model)
    return model


def cache_names(model: nn.Module) -> tuple[str, ...]:
    """The names of the model's cache modules, in layer order (``plans.hf`` gives them ``KVCacheParallel``)."""
    return tuple(name for name, m in model.named_modules() if isinstance(m, KVCacheBuffers))


class ProgramCache(StaticCache):
    """HF's ``StaticCache`` over the model's cache buffers: on the host the length generated so far (counted, never
    read from the cache) and the shape; in a traced forward its writes go to the program's buffers (each rank's
    pieces under TP) through the module being traced."""

    def __init__(self, model: nn.Module):
        self.names = cache_names(model)
        if not self.names:
            raise ValueError("thunder_tp.models.hf.generate: the model has no cache; call "
                             "thunder_tp.models.hf.set_kv_cache(model, batch_size, max_length) before thunder.jit")
        self.caches = [model.get_submodule(name) for name in self.names]
        self.max_batch_size, _, self.max_cache_len, self.head_dim = self.caches[0].k.shape
        self.seen = 0
        self.traced_module = None  # the (wrapped) module a traced forward writes the buffers through

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """The positions written so far."""
        return self.seen

    def reset(self) -> None:
        """Empty the cache: each cache module's ``reset_parameters`` (under TP, each rank's pieces)."""
        for cache in self.caches:
            cache.reset_parameters()
        self.seen = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values at ``cache_kwargs["cache_position"]``; the layer's whole cache."""
        return _written(self.caches[layer_idx], key_states, value_states, cache_kwargs)


def _written(cache: KVCacheBuffers, key_states: torch.Tensor, value_states: torch.Tensor,
             cache_kwargs: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's static-cache update on ``cache``'s buffers: the new positions written in place, the whole buffers."""
    position = cache_kwargs["cache_position"]
    cache.k.index_copy_(2, position, key_states.to(cache.k.dtype))
    cache.v.index_copy_(2, position, value_states.to(cache.v.dtype))
    return cache.k, cache.v


# --- inside the program ------------------------------------------------------------------------------------------

_registered: dict[type, Any] = {}


def register_lookaside(model: nn.Module) -> None:
    """Make thunder.jit trace ``type(model).forward`` called with a ``ProgramCache`` as the module doc says."""
    cls = type(model)
    if cls in _registered:
        return
    forward = _registered[cls] = patches.copy_of(cls.forward)

    @patches.register_lookaside(cls.forward)
    def _forward_lookaside(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        cache = unwrap(kwargs.get("past_key_values"))
        if not isinstance(cache, ProgramCache):
            return interpret_call(forward, module, *args, **kwargs)
        cache.traced_module = module
        try:
            return interpret_call(_last_position, module, *args, **kwargs)
        finally:
            cache.traced_module = None


def _last_position(model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The forward's last (B, V) logits, or with ``SAMPLING``'s rows its (B, 1) tokens."""
    per_row, keys = kwargs.pop(litgpt_sampling.SAMPLING, None), kwargs.pop(litgpt_sampling.KEYS, None)
    logits = _registered[type(model)](model, *args, **kwargs).logits[:, -1]
    return logits if per_row is None else litgpt_sampling.sampled_in_program(logits, per_row, keys)


@patches.register_lookaside(ProgramCache.update)
def _update_lookaside(cache, key_states, value_states, layer_idx, cache_kwargs=None):
    """The write traced through the module (whose buffers are the program's), not through the cache argument."""
    program_cache = unwrap(cache)
    name = wrap_const(program_cache.names[unwrap(layer_idx)])
    return interpret_call(_written_in, program_cache.traced_module, name, key_states, value_states,
                          wrap_const(None) if cache_kwargs is None else cache_kwargs)


def _written_in(model: nn.Module, name: str, key_states: torch.Tensor, value_states: torch.Tensor,
                cache_kwargs: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _written(model.get_submodule(name), key_states, value_states, cache_kwargs)


# --- on the host -------------------------------------------------------------------------------------------------


class _Routed:
    """The calls of HF's generation loop, made to ``model`` (jitted, or the plain one-device reference) on ``cache``,
    with the sampling of ``samplings`` (None: the last logits, for HF to sample)."""

    def __init__(self, model: nn.Module, cache: ProgramCache, samplings: list[Sampling] | None, vocab_size: int):
        self.model, self.cache, self.samplings, self.vocab_size = model, cache, samplings, vocab_size
        self.jitted = original_module(model) is not model

    def __call__(self, *, input_ids: torch.Tensor, return_dict: bool = True, **inputs: Any) -> CausalLMOutputWithPast:
        for name in ("inputs_embeds", "output_attentions", "output_hidden_states"):
            value = inputs.pop(name, None)
            if value is not None and value is not False:
                raise ValueError(f"thunder_tp.models.hf.generate: {name} is not supported")
        inputs["past_key_values"] = self.cache
        if self.samplings is None:
            logits = self._logits(input_ids, **inputs)[:, 0]
        else:
            call = self.model if self.jitted else self._logits
            tokens = litgpt_sampling.next_tokens(lambda x, **kw: call(input_ids=x, **kw), self.samplings, self.jitted,
                                                 input_ids, **inputs)
            logits = torch.full((tokens.shape[0], self.vocab_size), -torch.inf, device=tokens.device)
            logits.scatter_(1, tokens, 0.0)
        self.cache.seen += input_ids.shape[1]
        return CausalLMOutputWithPast(logits=logits[:, None], past_key_values=self.cache)

    def _logits(self, input_ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The (B, 1, V) last logits: the program's, or the plain model's forward on its buffers."""
        if self.jitted:
            return self.model(input_ids=input_ids, **inputs)[:, None]
        return self.model(input_ids=input_ids, **inputs).logits[:, -1:]


def generate(model: nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """HF's ``model.generate(input_ids, **kwargs)`` run by the jitted ``model`` (or a plain HF model: the one-device
    reference), on the model's static cache (``set_kv_cache``), sampled as the module doc says."""
    hf_model = original_module(model)
    if hf_model is not model and not patches.compiles_for_thunder_tp(model):
        raise ValueError("thunder_tp.models.hf.generate: the model is jitted without thunder_tp; jit it with "
                         "executors=thunder_tp.executors() or a thunder_tp.TensorParallel transform")
    cache = ProgramCache(hf_model)
    if input_ids.shape[0] != cache.max_batch_size:
        raise ValueError(f"thunder_tp.models.hf.generate: {input_ids.shape[0]} prompts for a cache of "
                         f"{cache.max_batch_size} rows; set_kv_cache(model, batch_size={input_ids.shape[0]}, ...)")
    config = copy.deepcopy(kwargs.pop("generation_config", None) or hf_model.generation_config)
    kwargs = config.update(**kwargs)
    config.disable_compile = True  # HF would torch.compile the calls: they run the Thunder program
    samplings = None if litgpt_sampling.current_sampler() == "gather" else [_sampling(config, kwargs)] * len(input_ids)
    cache.reset()
    routed = _Routed(model, cache, samplings, hf_model.get_output_embeddings().weight.shape[0])
    return _routed_view(hf_model, routed).generate(input_ids, generation_config=config, past_key_values=cache,
                                                   **kwargs)


def _sampling(config: GenerationConfig, kwargs: dict) -> Sampling:
    """The rows' ``Sampling`` from HF's settings, or a clear error for a setting the sampler on shards lacks."""
    changing = sorted(name for name, neutral in LOGITS_CHANGING.items()
                      if getattr(config, name, None) not in (None, neutral))
    changing += sorted({"logits_processor", "prefix_allowed_tokens_fn"} & {k for k, v in kwargs.items() if v})
    if changing:
        raise ValueError(f"thunder_tp.models.hf.generate: {', '.join(changing)} change the logits before the draw, "
                         "which the sampler on vocabulary shards does not see; sample from the gathered logits "
                         "instead: thunder_tp.set_sampling('gather')")
    if not config.do_sample:
        return Sampling(temperature=0.0)
    return Sampling(temperature=config.temperature, top_k=config.top_k or None, top_p=config.top_p)


def _routed_view(model: nn.Module, routed: _Routed) -> nn.Module:
    """A view of HF ``model`` (a subclass of its class sharing its state) whose calls are ``routed``: HF's
    ``generate`` on it runs the model's loop and the program's calls."""
    view_class = type(type(model).__name__, (type(model),), {"__call__": lambda self, **inputs: routed(**inputs)})
    view = object.__new__(view_class)
    view.__dict__ = model.__dict__
    return view
