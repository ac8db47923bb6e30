"""Small litgpt GPT configs for the tests (a GQA llama-like one and a gpt-neox-like one) and a loss wrapper."""

from __future__ import annotations

import torch
from litgpt import Config

from thunder_tp.plans.litgpt import GPTWithLoss  # noqa: F401  (re-exported for the tests)

VOCAB, SEQ, BATCH = 256, 16, 2

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


def batch(seed: int = 0, batch_size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return idx, torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
