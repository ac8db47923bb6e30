"""Small litgpt GPT configs for the tests (a GQA llama-like one and a gpt-neox-like one) and a loss wrapper."""

from __future__ import annotations

import torch
from litgpt import GPT, Config

import thunder_tp
from thunder_tp.plans.litgpt import GPTWithLoss
from thunder_tp.styles.matching import match_plan

VOCAB, SEQ, BATCH = 256, 16, 2
#: the TP modes of plans.litgpt that the tests run, by name -> its keyword arguments
MODES = {"tp": {}, "tp_sp": {"sequence_parallel": True}, "tp_lp": {"loss_parallel": True}}

CONFIGS = {
    "llama": dict(
        n_layer=2, n_head=8, n_query_groups=4, n_embd=64, head_size=8, intermediate_size=128, bias=False,
        mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", parallel_residual=False, rotary_percentage=1.0,
    ),
    "neox": dict(
        n_layer=2, n_head=4, n_query_groups=4, n_embd=64, head_size=16, intermediate_size=256, bias=True,
        mlp_class_name="GptNeoxMLP", norm_class_name="LayerNorm", parallel_residual=True, rotary_percentage=0.25,
    ),
}


#: litgpt MoE configs (LLaMAMoE), scaled down with their head counts and MoE flags kept
MOE_BASE = dict(n_layer=2, n_embd=32, head_size=8, bias=False, mlp_class_name="LLaMAMoE", norm_class_name="RMSNorm",
                parallel_residual=False, n_expert=4, n_expert_per_token=2)
MOE_CONFIGS = {
    "mixtral": dict(n_head=4, n_query_groups=2, intermediate_size=32),
    "qwen3_moe": dict(n_head=4, n_query_groups=4, intermediate_size=64, moe_intermediate_size=16, norm_qk=True),
    # DeepSeek-V3-style routing (litgpt's model supports it; no litgpt 0.5.13 config uses it)
    "grouped_shared": dict(n_head=4, n_query_groups=4, intermediate_size=64, moe_intermediate_size=16,
                           n_shared_expert=1, n_expert_groups=2, n_topk_groups=1, n_topk_scores_per_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True),
}


def make_moe_model(name: str, dtype: torch.dtype = torch.float64, **overrides) -> GPTWithLoss:
    """A GPTWithLoss of a MoE config (float64 by default, `overrides` on top), seeded, with a router that does not
    tie."""
    sizes = dict(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB)
    config = Config(**sizes, **(MOE_BASE | MOE_CONFIGS[name] | overrides))
    torch.manual_seed(0)
    model = GPTWithLoss(config).to(dtype)
    for module in model.modules():
        if type(module).__name__ == "GroupedTopkRouter":  # litgpt leaves its weight uninitialized
            torch.nn.init.normal_(module.weight, std=0.2)
    return model


def make_config(name: str) -> Config:
    """A tiny litgpt Config of the given family."""
    return Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, **CONFIGS[name])


def expected_counts(config: Config, mode: str, size: int) -> tuple[dict[str, int], dict[str, int]]:
    """Megatron's minimum: 2 activation all_reduces per block each way (TP+SP: 2 all_gather + 2 reduce_scatter;
    a parallel-residual block's forward: 1 all_reduce, or under SP 1 reduce_scatter (backward: 1 all_gather), its
    attention and MLP outputs summed first), the
    embedding's and the head's, plus OLMo-2's q/k norm statistics (b*s numbers, each way) and the grads of
    the replicated parameters used on sharded values summed together, one all_reduce per dtype (_replicated_grads)."""
    layers = config.n_layer
    blocks = 2 * layers + 1
    olmo2 = 2 * layers if config.norm_qk and config.norm_qk_type == "olmo2" else 0
    grads = olmo2 + _replicated_grads(config, mode, size)
    # a norm output shared by attention and MLP (parallel residual) enters the TP region once for both
    gathers = blocks - layers * config.shared_attention_norm
    reduced = layers + 1 if config.parallel_residual else blocks
    if mode == "tp_sp":
        forward = {"reduce_scatter": reduced, "all_gather": gathers + 1, "all_reduce": olmo2}
        backward = {"reduce_scatter": gathers, "all_gather": reduced, "all_reduce": grads}
    else:  # one all_gather: of the logits, or (loss parallel) of each rank's log-sum-exp and target logit per token
        forward, backward = {"all_reduce": reduced + olmo2, "all_gather": 1}, {"all_reduce": gathers + grads}
    return _nonzero(forward), _nonzero(backward)


def _replicated_grads(config, mode: str, size: int) -> int:
    """All_reduces of the grads of replicated parameters used on sharded values, one per dtype: replicated K/V
    blocks, MoE routers, per-head q/k norm weights and, under SP, the norms and row-parallel biases. The models are
    float64, but litgpt's RMSNorm casts its weight to float32 first."""
    norm_dtype = "float32" if config.norm_class_name == "RMSNorm" else "float64"
    dtypes = {"float64"} if config.n_query_groups < size or config.mlp_class_name == "LLaMAMoE" else set()
    if config.norm_qk and config.norm_qk_type == "default":
        dtypes.add(norm_dtype)
    if mode == "tp_sp":
        dtypes |= _sequence_parallel_dtypes(config, norm_dtype)
    return len(dtypes)


def _sequence_parallel_dtypes(config, norm_dtype: str) -> set[str]:
    """The dtypes of the replicated parameters applied to sequence shards under SP: norm weights and biases (none
    for OLMo's parameter-free LayerNorm), row-parallel biases (except a parallel residual's, which the first rank
    adds to the Partial stream)."""
    with torch.device("meta"):
        model = GPT(config)
    styled = match_plan(model, thunder_tp.plans.litgpt(model, sequence_parallel=True))
    dtypes = set()
    for name, _ in model.named_parameters():
        style = styled.get(name.rpartition(".")[0])
        if isinstance(style, thunder_tp.SequenceParallel):
            dtypes.add(norm_dtype)
        elif name.endswith(".bias") and isinstance(style, thunder_tp.RowwiseParallel) and not config.parallel_residual:
            dtypes.add("float64")
    return dtypes


def _nonzero(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if v}


def batch(seed: int = 0, batch_size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return idx, torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def training_losses(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """The losses of one optimizer step on ``batch(step)`` for each of ``steps``."""
    losses = []
    for step in steps:
        loss = model(*batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# --- the litgpt zoo: one scaled-down representative per distinct architecture -------------------------------------

#: config fields that are sizes or names: architectures that differ only in these are the same architecture
SIZE_FIELDS = frozenset({
    "name", "hf_config", "block_size", "n_layer", "n_embd", "vocab_size", "padding_multiple", "padded_vocab_size",
    "intermediate_size", "moe_intermediate_size", "head_size", "norm_eps", "rope_base", "sliding_window_size",
})
#: the scaled-down sizes every representative gets (head counts and feature flags are kept)
ZOO_SIZES = dict(n_layer=2, n_embd=32, head_size=8, intermediate_size=64, moe_intermediate_size=32,
                 block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, sliding_window_size=4)


def _architecture_key(config: dict) -> tuple:
    from litgpt import Config

    full = Config(**config)
    return tuple((f, repr(getattr(full, f))) for f in sorted(full.__dataclass_fields__) if f not in SIZE_FIELDS)


def _two_layer_indicator(indices: list[int] | None) -> list[int] | None:
    """A per-layer 0/1 list cut to 2 layers, keeping both kinds of layer when the model has both."""
    if indices is None:
        return None
    return [1, 0] if len(set(indices)) > 1 else list(indices[:2])


def zoo() -> dict[str, dict]:
    """Config name of the first model of each distinct litgpt architecture -> its scaled-down config kwargs."""
    from litgpt.config import configs

    seen: dict[tuple, dict] = {}
    for config in configs:
        seen.setdefault(_architecture_key(config), config)
    scaled = {}
    for config in seen.values():
        kwargs = {k: v for k, v in config.items() if k != "hf_config"} | ZOO_SIZES
        for field in ("sliding_window_indices", "rope_indices"):
            kwargs[field] = _two_layer_indicator(config.get(field))
        if config.get("sliding_window_size") is None:
            kwargs["sliding_window_size"] = None
        if config.get("n_expert"):
            kwargs.update(n_expert=4, n_expert_per_token=min(2, config.get("n_expert_per_token", 2)))
        scaled[config["name"]] = kwargs
    return scaled


def zoo_config(name: str):
    """The scaled-down litgpt Config of one zoo architecture."""
    from litgpt import Config

    return Config(**zoo()[name])


def lora_config(enable: str, n_query_groups: int = 2):
    """A tiny LoRA config (LayerNorm, so float64 throughout) with LoRA on the q/k/v parts named in `enable`."""
    from litgpt.lora import Config

    return Config(
        name="tiny-lora", block_size=16, vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=4,
        n_query_groups=n_query_groups, n_embd=32, head_size=8, intermediate_size=64, bias=False,
        mlp_class_name="LLaMAMLP", norm_class_name="LayerNorm", parallel_residual=False, rotary_percentage=1.0,
        lora_r=2, lora_alpha=4, lora_query="q" in enable, lora_key="k" in enable, lora_value="v" in enable,
        lora_projection=True, lora_mlp=True, lora_head=True,
    )
