"""Small litgpt GPT configs for the tests (a GQA llama-like one and a gpt-neox-like one) and a loss wrapper."""

from __future__ import annotations

import torch
from litgpt import Config

from thunder_tp.plans.litgpt import GPTWithLoss  # noqa: F401  (re-exported for the tests)

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


def make_config(name: str) -> Config:
    """A tiny litgpt Config of the given family."""
    return Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, **CONFIGS[name])


def expected_counts(name: str, mode: str) -> tuple[dict[str, int], dict[str, int]]:
    """Megatron's minimum per block, plus what the vocab-parallel embedding, head and loss need."""
    n_layer = make_config(name).n_layer
    if mode == "tp":  # embedding partials reduced; logits gathered for the loss; head input grad reduced
        return {"all_reduce": 2 * n_layer + 1, "all_gather": 1}, {"all_reduce": 2 * n_layer + 1}
    if mode == "tp_lp":  # instead, the loss gathers each rank's log-sum-exp and target logit per token
        return {"all_reduce": 2 * n_layer + 1, "all_gather": 1}, {"all_reduce": 2 * n_layer + 1}
    # SP: block 2 all_gather + 2 reduce_scatter each way; embedding reduce_scatter; head input and logits gather;
    # the grads of the replicated norm weights/biases (and neox's row-parallel biases) used on sequence shards are
    # summed over the ranks in one all_reduce at the end of the backward
    forward = {"reduce_scatter": 2 * n_layer + 1, "all_gather": 2 * n_layer + 2}
    backward = {"reduce_scatter": 2 * n_layer + 1, "all_gather": 2 * n_layer + 1, "all_reduce": 1}
    return forward, backward


def batch(seed: int = 0, batch_size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return idx, torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


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
