"""The TP plan for a litgpt.GPT: vocab-parallel embedding, head-parallel attention, Megatron MLP, parallel head."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from thunder_tp.layouts import REPLICATE, Layout, Shard
from thunder_tp.styles import (
    ColwiseParallel,
    FeatureShardedNorm,
    KVCacheParallel,
    LoRAPairParallel,
    RowwiseParallel,
    SequenceParallel,
    Style,
)
from thunder_tp.styles.expert import expert_parallel_plan
from thunder_tp.styles.matching import checked_plan, plan_key_matches

_MLP_PLANS = {
    "LLaMAMLP": {"fc_1": "col", "fc_2": "col", "proj": "row"},
    "GemmaMLP": {"fc_1": "col", "fc_2": "col", "proj": "row"},
    "GptNeoxMLP": {"fc": "col", "proj": "row"},
}
SEQUENCE_DIM = 1


def _moe_plan(config) -> dict[str, str]:
    """LLaMAMoE: every expert (and the shared experts) sharded like a dense MLP; router replicated. All of them
    are consumed by one `moe_layer` op, whose rule reduces the layer's output once."""
    _check_unbiased(config)
    plan = {f"experts.*.{name}": kind for name, kind in _MLP_PLANS["LLaMAMLP"].items()}
    if config.n_shared_expert:
        plan |= {f"shared_experts.{name}": kind for name, kind in _MLP_PLANS["LLaMAMLP"].items()}
    return plan


def _check_unbiased(config) -> None:
    if config.bias:
        raise NotImplementedError(
            f"thunder_tp.plans.litgpt: LLaMAMoE experts with biases (config.bias=True) would add each proj bias once "
            f"per rank; no litgpt config has them. Use bias=False for {config.name or 'this config'}"
        )


class GPTWithLoss(nn.Module):
    """A litgpt GPT and its next-token cross-entropy in one module, so the loss is inside the jitted program."""

    def __init__(self, config):
        super().__init__()
        from litgpt import GPT

        self.gpt = GPT(config)
        self.config = config

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _gpt_prefix(model: nn.Module) -> str:
    """Where the litgpt GPT sits in `model` ("" for the GPT itself, "gpt." inside GPTWithLoss)."""
    from litgpt import GPT

    for name, module in model.named_modules():
        if isinstance(module, GPT):
            return f"{name}." if name else ""
    raise TypeError("thunder_tp.plans.litgpt needs a litgpt.GPT (or a module containing one), got "
                    f"{type(model).__name__}")


def litgpt(
    model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = False, expert_parallel: bool = False,
    tp_size: int | None = None,
) -> dict[str, Style]:
    """Plan for a litgpt GPT, or a module containing one (keys then carry its prefix); globs cover every block.

    sequence_parallel: norms and the residual stream sharded on the sequence dim (all_gather into each TP
    region, reduce_scatter out of it; a parallel-residual stream stays Partial, reduce-scattered where a norm
    reads it). loss_parallel: lm_head's output stays vocab-sharded, for a
    cross-entropy inside the jitted program. expert_parallel: each rank holds n_expert / TP experts of every MoE
    layer whole, its tokens sent to them by all_to_all (thunder_tp.models.expert_parallel; router and shared experts
    replicated); otherwise every expert is split like a dense MLP. With fewer K/V groups than ranks, each K/V head is
    replicated on the ranks whose query heads use it (see `tp_sizes` for the sizes that work).
    A KV cache (`set_kv_cache` called before the plan is made) is split like the K/V heads it caches, and lm_head's
    output stays vocab-sharded for a sampler inside the program (thunder_tp.models.litgpt_sampling).
    tp_size: the TP size the plan is for, checked now (an error naming the module and the sizes that work) rather
    than when TensorParallel applies it.
    """
    prefix = _gpt_prefix(model)
    config = model.get_submodule(prefix.rstrip(".")).config if prefix else model.config
    _check_supported(config)
    reduced = Shard(SEQUENCE_DIM) if sequence_parallel else REPLICATE
    # a parallel-residual block adds its attention and MLP outputs before anything needs them whole: left Partial,
    # they are reduced together, one all_reduce per block instead of two; under SP the whole residual stream stays
    # Partial from the embedding on, reduce-scattered once per block where the next norm reads it
    block_output = None if config.parallel_residual else reduced
    embedding_output = None if config.parallel_residual and sequence_parallel else reduced
    block = "transformer.h.*."
    plan: dict[str, Style] = {
        "transformer.wte": RowwiseParallel(output_layout=embedding_output),
        f"{block}attn.qkv": _qkv_style(config),
        f"{block}attn.proj": RowwiseParallel(output_layout=block_output, unit=config.head_size,
                                             groups=config.n_query_groups),
        # left vocabulary-sharded for a loss, or a sampler (a KV cache), inside the program; the program's output
        # is gathered where it returns the logits
        "lm_head": ColwiseParallel(output_layout=None if loss_parallel or _has_kv_cache(model) else REPLICATE),
    }
    if config.mlp_class_name == "LLaMAMoE" and expert_parallel:
        _check_unbiased(config)
        moe = expert_parallel_plan(config.n_expert, ("fc_1", "fc_2", "proj"), reduced)
        plan |= {f"{block}mlp.{name}": style for name, style in moe.items()}
    else:
        mlp_plan = _moe_plan(config) if config.mlp_class_name == "LLaMAMoE" else _MLP_PLANS[config.mlp_class_name]
        plan |= {f"{block}mlp.{name}": _mlp_style(kind, block_output) for name, kind in mlp_plan.items()}
    for i in range(config.first_k_dense_replace or 0):  # MoE models whose first blocks have a dense LLaMAMLP
        plan |= {f"transformer.h.{i}.mlp.{name}": _mlp_style(kind, reduced)
                 for name, kind in _MLP_PLANS["LLaMAMLP"].items()}
    if config.norm_qk and config.norm_qk_type == "olmo2":  # a norm over all heads of q (of k): split like them
        heads = FeatureShardedNorm(unit=config.head_size, groups=config.n_query_groups)
        plan.update({f"{block}attn.norm_q": heads, f"{block}attn.norm_k": heads})
    if _has_kv_cache(model):  # set_kv_cache was called: each rank caches the K/V heads its attention computes
        plan[f"{block}attn.kv_cache"] = KVCacheParallel()
    if sequence_parallel:
        plan.update({f"{block}{n}": SequenceParallel(SEQUENCE_DIM) for n in _block_norms(config)})
        plan["transformer.ln_f"] = SequenceParallel(SEQUENCE_DIM)
    return checked_plan(model, _with_lora(model, {prefix + key: style for key, style in plan.items()}), tp_size)


def _with_lora(model: nn.Module, plan: dict[str, Style]) -> dict[str, Style]:
    """litgpt.lora models: a style planned for a LoRALinear goes to its base `linear`, and its LoRA pair follows it
    (LoRAPairParallel); a row-parallel base keeps its output Partial, so that the base and LoRA sums are reduced
    together (one all_reduce, as without LoRA)."""
    try:
        from litgpt.lora import LoRALinear
    except ImportError:  # pragma: no cover - litgpt without LoRA
        return plan
    modules = dict(model.named_modules())
    names = list(modules)
    lora: dict[str, Style] = {}
    for key, style in plan.items():
        hits = [modules[n] for n in plan_key_matches(key, names)]
        if not hits or not isinstance(hits[0], LoRALinear):
            lora[key] = style
            continue
        has_pair = hits[0].r > 0 and hasattr(hits[0], "lora_A")
        if has_pair and isinstance(style, RowwiseParallel):
            style = replace(style, output_layout=None)
        lora[f"{key}.linear"] = style
        if has_pair:
            lora[key] = LoRAPairParallel(style)
    return lora


def _has_kv_cache(model: nn.Module) -> bool:
    """Whether the model's blocks hold a KV cache (`set_kv_cache` was called)."""
    from litgpt.model import KVCache

    return any(isinstance(m, KVCache) for m in model.modules())


def _mlp_style(kind: str, reduced: Layout | None) -> Style:
    """An MLP linear's style: "col" column-parallel, "row" row-parallel with its output in `reduced` (None: left
    Partial)."""
    return ColwiseParallel() if kind == "col" else RowwiseParallel(output_layout=reduced)


def _qkv_style(config) -> ColwiseParallel:
    """Fused q|k|v split by whole heads, each rank's query heads with their K/V heads where the counts allow; K/V
    blocks replicable (grouped-query attention with fewer K/V groups than ranks)."""
    hs = config.head_size
    q, kv = config.n_head * hs, config.n_query_groups * hs
    return ColwiseParallel(blocks=(q, kv, kv), unit=hs, replicable=(False, True, True), groups=config.n_query_groups)


def _block_norms(config) -> list[str]:
    """The norms a block really has (post-norm blocks have an Identity norm_1 / norm_2)."""
    present = {
        "norm_1": config.norm_1,
        "norm_2": config.norm_2 and not config.shared_attention_norm,
        "post_attention_norm": config.post_attention_norm,
        "post_mlp_norm": config.post_mlp_norm,
    }
    return [name for name, exists in present.items() if exists]


def _check_supported(config) -> None:
    """A clear error for what the plan cannot shard."""
    if config.mlp_class_name != "LLaMAMoE" and config.mlp_class_name not in _MLP_PLANS:
        raise NotImplementedError(f"thunder_tp.plans.litgpt has no plan for {config.mlp_class_name} ({config.name})")
    if config.latent_attention is not None:
        raise NotImplementedError(f"thunder_tp.plans.litgpt has no plan for latent attention ({config.name})")


def tp_sizes(config, up_to: int = 8) -> list[int]:
    """TP sizes (at most `up_to`) that the plan can shard `config` over: every rank gets at least one query head
    (K/V heads replicated where there are fewer K/V groups than ranks)."""
    return _qkv_style(config).tp_sizes(up_to)
