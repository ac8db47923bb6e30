"""Generation with a litgpt KV cache, shared by the generation tests: tiny configs per architecture, a single-device
model and its copy for TP with caches set before thunder.jit, a greedy loop, and each rank's expected cache shapes."""

from __future__ import annotations

import torch
from litgpt import GPT, Config

from tests.litgpt_models import CONFIGS, VOCAB

PROMPT, NEW_TOKENS, MAX_SEQ = 8, 16, 32
LLAMA = CONFIGS["llama"]  # 8 heads, 4 K/V groups
ARCHITECTURES = {
    "gqa": LLAMA,
    "mqa": LLAMA | dict(n_query_groups=1),  # one K/V head, held by every rank
    "neox": CONFIGS["neox"],  # parallel residual: one all_reduce per block
    # a ring cache of 8 slots in the first block: 8 prompt tokens + 16 decoded wrap it twice
    "sliding_window": LLAMA | dict(sliding_window_size=PROMPT, sliding_window_indices=[1, 0]),
    "moe": LLAMA | dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=32),
}


def gen_config(arch: str) -> Config:
    """A tiny litgpt config of one architecture, with room for the prompt and the new tokens."""
    return Config(block_size=MAX_SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, **ARCHITECTURES[arch])


def models_with_cache(config: Config, batch: int, dtype: torch.dtype = torch.float64,
                      device: torch.device | None = None, max_seq: int = MAX_SEQ) -> tuple[GPT, GPT]:
    """The single-device model and an identical one for TP, both with a KV cache for `batch` sequences of up to
    `max_seq` tokens."""
    torch.manual_seed(0)
    reference = GPT(config).to(device=device, dtype=dtype)
    model = GPT(config).to(device=device, dtype=dtype)
    model.load_state_dict(reference.state_dict())
    for m in (reference, model):
        m.max_seq_length = max_seq
        m.set_kv_cache(batch_size=batch, dtype=dtype, device=device)
    return reference, model


@torch.inference_mode()
def greedy(model, prompt: torch.Tensor, steps: int, on_decode=None,
           decode=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill, then `steps` - 1 decode steps (the model's call, or `decode(tokens, position)`, e.g. a
    thunder_tp.generate.generation.Decoder): the greedy tokens and every step's last logits."""

    def call(tokens: torch.Tensor, position: int) -> torch.Tensor:
        return model(tokens, torch.tensor([position], device=prompt.device))

    decode = decode or call
    logits = model(prompt, torch.arange(prompt.shape[1], device=prompt.device))[:, -1]
    tokens, history = [logits.argmax(-1)], [logits]
    for i in range(steps - 1):
        logits = decode(tokens[-1][:, None], prompt.shape[1] + i)[:, -1]
        tokens.append(logits.argmax(-1))
        history.append(logits)
        if on_decode is not None:
            on_decode(i)
    return torch.stack(tokens, 1), history


def local_cache_shapes(config: Config, batch: int, size: int, rank: int) -> dict[str, tuple[int, ...]]:
    """Rank `rank`'s K/V cache: its K/V heads (a balanced share: the first ranks one more where the size does not
    divide them), or the one head its query heads share."""
    base, extra = divmod(config.n_query_groups, size)
    heads = base + (rank < extra) if base else 1
    return {f"transformer.h.{i}.attn.kv_cache.{kv}": (batch, heads, _cache_length(config, i), config.head_size)
            for i in range(config.n_layer) for kv in "kv"}


def _cache_length(config: Config, block: int) -> int:
    windowed = config.sliding_window_indices is not None and config.sliding_window_indices[block]
    return config.sliding_window_size if windowed else MAX_SEQ
