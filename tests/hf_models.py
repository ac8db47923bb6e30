"""Tiny HuggingFace transformers models (2 layers, hidden 64, vocab 256; float64) of each architecture thunder_tp
plans from the model's own tp_plan, and Megatron's minimum of collectives for them."""

from __future__ import annotations

import torch

from tests.litgpt_models import MODES, SEQ, VOCAB  # noqa: F401  (MODES re-exported for the tests)
from tests.tp_checks import assert_close_scaled, assert_grads_are_shards, rank_and_size

LAYERS, BATCH = 2, 2
_BASE = dict(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64)
#: architecture name -> (model_type, config overrides); several names may share a model_type
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_kv2": ("qwen2", dict(num_key_value_heads=2)),  # fewer K/V heads than TP=4 ranks: replicated
    "qwen3": ("qwen3", {}),  # per-head q/k norms
    "gemma": ("gemma", {}),  # tied embeddings, scaled embedding
    "gemma2": ("gemma2", dict(sliding_window=8)),  # soft-capping, sliding window, pre/post norms
    "gemma3_text": ("gemma3_text", dict(sliding_window=8)),
    "olmo2": ("olmo2", dict(num_key_value_heads=8)),  # q/k norms over all heads
    "gpt_neox": ("gpt_neox", dict(num_key_value_heads=None, head_dim=None)),  # parallel residual, fused qkv
    "starcoder2": ("starcoder2", {}),  # HF's plan lists mlp.c_proj as colwise
    "cohere": ("cohere", {}),  # parallel residual with one norm, tied embeddings
    "granite": ("granite", {}),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64)),
    # per-head q/k norms, no shared expert, renormalized top-k (as Qwen3-MoE checkpoints set it)
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True)),
}
#: the sparse-MoE architectures (hf_moe.py), and the dense ones
MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
DENSE = [name for name in ARCHITECTURES if name not in MOE]


def make_config(name: str):
    """The tiny config of an architecture."""
    from transformers import AutoConfig

    model_type, overrides = ARCHITECTURES[name]
    kwargs = {k: v for k, v in (_BASE | overrides).items() if v is not None}
    return AutoConfig.for_model(model_type, **kwargs)


def make_model(name: str) -> torch.nn.Module:
    """A float64 CausalLM of the architecture, seeded (the same weights on every rank)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(name), torch_dtype=torch.float64)


#: HF GPT-2 (Conv1D layers, fused q|k|v, learned positions, tied head; no tp_plan in its config: plans.hf has one),
#: with a vocabulary no TP size divides, as GPT-2's 50,257; dropout off, so that TP and one device compute alike
GPT2 = dict(vocab_size=VOCAB + 1, n_positions=64, n_embd=32, n_layer=LAYERS, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


def make_gpt2() -> torch.nn.Module:
    """A float64 GPT2LMHeadModel of the GPT2 config, seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**GPT2)).to(torch.float64)


def batch(seed: int = 0, length: int = SEQ) -> torch.Tensor:
    """Random token ids (also the labels: HF shifts them inside its loss)."""
    return torch.randint(0, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def tp_sizes(name: str, up_to: int = 8) -> list[int]:
    """TP sizes the plan can shard the architecture over (heads split whole, K/V heads replicated)."""
    config = make_config(name)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return [s for s in range(2, up_to + 1) if heads % s == 0 and (kv % s == 0 or s % kv == 0)]


def expected_counts(name: str, mode: str, size: int) -> tuple[dict[str, int], dict[str, int]]:
    """Megatron's minimum, as tests/litgpt_models.expected_counts: 2 activation all_reduces per block each way
    (TP+SP: 2 all_gather + 2 reduce_scatter), the embedding's and the head's; a parallel-residual block's forward
    reduces once (Cohere), and Cohere's attention and MLP read one norm (one entry into the TP region);
    OLMo-2's q/k norm statistics (b*s numbers, each way); the grads of the replicated parameters used on sharded
    values summed in one all_reduce per dtype. Loss parallel: the logits are still gathered, as the model returns
    them, besides the loss's (log-sum-exp, target logit) per token."""
    model_type = ARCHITECTURES[name][0]
    # GPT-NeoX's parallel residual applies dropout to each branch (reduced apart); under SP, Cohere's too (plans.hf)
    parallel = model_type == "cohere" and mode != "tp_sp"
    blocks = 2 * LAYERS + 1
    olmo2 = 2 * LAYERS if model_type == "olmo2" else 0
    gathers = blocks - LAYERS * (model_type == "cohere")
    reduced = LAYERS + 1 if parallel else blocks
    grads = olmo2 + len(_replicated_grad_dtypes(name, mode, size))
    # known gap: Gemma-3's sliding-window attention mask is sliced on the batch dim and gathered back (b*s*s
    # numbers per sliding layer, both layers here), beyond Megatron's minimum
    mask = LAYERS if model_type == "gemma3_text" else 0
    if mode == "tp_sp":
        forward = {"reduce_scatter": reduced, "all_gather": gathers + 1 + mask, "all_reduce": olmo2}
        backward = {"reduce_scatter": gathers, "all_gather": reduced, "all_reduce": grads}
    else:
        forward = {"all_reduce": reduced + olmo2, "all_gather": 1 + (mode == "tp_lp") + mask}
        backward = {"all_reduce": gathers + grads}
    return _nonzero(forward), _nonzero(backward)


#: the dtype in which a model type's norms apply their weight (Gemma's and Cohere's in float32, others as the model)
_NORM_DTYPES = {"gemma": "float32", "gemma2": "float32", "gemma3_text": "float32", "cohere": "float32"}


def _replicated_grad_dtypes(name: str, mode: str, size: int) -> set[str]:
    """Dtypes of the replicated parameters applied to sharded values: replicated K/V projections, MoE routers,
    per-head q/k norms and, under SP, the residual norms and the row-parallel biases (but a parallel residual's)."""
    config = make_config(name)
    model_type = ARCHITECTURES[name][0]
    norm = _NORM_DTYPES.get(model_type, "float64")
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dtypes = {"float64"} if kv < size or name in MOE else set()
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        dtypes.add(norm)
    if mode == "tp_sp":
        dtypes.add(norm)
        biased = getattr(config, "use_bias", False) or getattr(config, "attention_bias", False)
        if biased and model_type != "cohere":
            dtypes.add("float64")
    return dtypes


def _nonzero(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if v}


#: a TP step of a float64 HF model against one device: the loss's tolerance; the logits' and grads' (of their
#: largest entry)
LOSS_RTOL, GRAD_ATOL = 1e-6, 1e-5


def assert_step_matches(reference: torch.nn.Module, jm: torch.nn.Module, layouts: dict, idx: torch.Tensor,
                        labels: torch.Tensor) -> None:
    """One step of the jitted TP model and of the single-device `reference` on (idx, labels): loss, logits and each
    grad (this rank's shard of it, `layouts`) equal."""
    rank, size = rank_and_size()
    expected = reference(input_ids=idx.clone(), labels=labels.clone(), use_cache=False)
    actual = jm(input_ids=idx, labels=labels, use_cache=False)
    assert_close_scaled(actual.loss, expected.loss, rtol=LOSS_RTOL, atol=LOSS_RTOL, what="loss")
    assert_close_scaled(actual.logits, expected.logits, rtol=GRAD_ATOL, atol=GRAD_ATOL, what="logits")
    expected.loss.backward()
    actual.loss.backward()
    assert_grads_are_shards(reference, jm, layouts, rank, size, rtol=GRAD_ATOL, atol=GRAD_ATOL)
