"""litgpt mixture of experts (LLaMAMoE): plain thunder.jit equals eager litgpt; TP equals the single-device run."""

import pytest
import thunder
import torch
from litgpt import Config

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import MOE_BASE, MOE_CONFIGS, SEQ, VOCAB, GPTWithLoss, batch, make_moe_model
from tests.tp_checks import (
    FAST_EXECUTORS,
    assert_close_scaled,
    assert_grads_are_shards,
    collective_counts,
    rank_and_size,
)
from thunder_tp import TensorParallel

# litgpt's RMSNorm (and the grouped router) compute in float32 even for float64 models
RTOL, ATOL = 1e-5, 1e-5


def _reference_and_copy(name: str, dtype: torch.dtype = torch.float64) -> tuple[GPTWithLoss, GPTWithLoss]:
    reference = make_moe_model(name, dtype)
    model = make_moe_model(name, dtype)
    model.load_state_dict(reference.state_dict())
    return reference, model


def _check_loss_and_grads(reference, jm, layouts: dict, rank: int = 0, size: int = 1) -> None:
    idx, targets = batch(0)
    expected, actual = reference(idx, targets), jm(idx, targets)
    assert_close_scaled(actual, expected, rtol=RTOL, atol=ATOL, what="loss")
    expected.backward()
    actual.backward()
    assert_grads_are_shards(reference, jm, layouts, rank, size, rtol=RTOL, atol=ATOL)


# slow: the same lookaside as mixtral's; its layer under TP: the TP case below
@pytest.mark.parametrize("name", ["mixtral", pytest.param("grouped_shared", marks=pytest.mark.slow)])
def test_one_device_jit_matches_eager_litgpt(name):
    reference, model = _reference_and_copy(name)
    jm = thunder.jit(model, executors=FAST_EXECUTORS)  # no TP; thunder_tp's compiles (its collectives executor listed)
    _check_loss_and_grads(reference, jm, {})  # no TP: one rank holding everything
    names = [b.sym.name for b in thunder.last_traces(jm)[-1].bound_symbols]
    assert names.count("moe_layer") == 2, names


def _tp(name, sequence_parallel, dtype):
    rank, size = rank_and_size()
    reference, model = _reference_and_copy(name, dtype)
    transform = TensorParallel(thunder_tp.plans.litgpt(model, sequence_parallel=sequence_parallel))
    jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)
    _check_loss_and_grads(reference, jm, transform.parameter_layouts, rank, size)
    expert = next(n for n in transform.parameter_layouts if "experts.1.proj" in n)
    assert jm.get_parameter(expert).shape[1] * size == reference.get_parameter(expert).shape[1]
    return {"forward": collective_counts(thunder.last_traces(jm)[-1]),
            "backward": collective_counts(thunder.last_backward_traces(jm)[-1])}


# float32 too: there the residual add after the MoE layer (Partial) feeds RMSNorm's x * x with no cast between.
# Slow-marked: Mixtral in float64 (the float32 case runs the same layer) and Qwen3-MoE at TP=4 (experts split over 4
# ranks as over 2; per-head q/k norm grads summed as in test_litgpt_zoo's Gemma-3 case)
CASES = [(2, "mixtral", False, torch.float64, "slow"), (2, "mixtral", False, torch.float32, ""),
         (2, "grouped_shared", True, torch.float64, ""), (4, "qwen3_moe", False, torch.float64, "slow")]


@pytest.mark.parametrize("world, name, sequence_parallel, dtype", [
    pytest.param(w, n, sp, d, id=f"tp{w}-{n}{'-sp' * sp}-{str(d)[6:]}", marks=[pytest.mark.slow] if slow else [])
    for w, n, sp, d, slow in CASES
])
def test_tp_matches_single_device_with_one_reduction_per_moe_layer(world, name, sequence_parallel, dtype):
    counts = run_ranks(_tp, world, name, sequence_parallel, dtype)[0]
    blocks = 2 * MOE_BASE["n_layer"] + 1  # attention and MoE layer of each block, and the embedding
    # the grads of the replicated parameters used on sharded values are summed in one all_reduce per dtype: every MoE
    # layer's router weight (n_expert x C, used by every rank's experts; float64) and, in float32 (litgpt's RMSNorm
    # casts its weight), Qwen3's per-head q/k norm weights and, under SP, the norms applied to sequence shards
    grads = 1 + bool(sequence_parallel or MOE_CONFIGS[name].get("norm_qk"))
    if sequence_parallel:  # as a dense llama with SP: the MoE layer (shared experts included) reduce-scattered once
        assert counts["forward"] == {"reduce_scatter": blocks, "all_gather": blocks + 1}, counts
        assert counts["backward"] == {"reduce_scatter": blocks, "all_gather": blocks, "all_reduce": grads}, counts
    else:  # as a dense llama: per block one all_reduce after attention and ONE after the MoE layer; logits gathered
        assert counts["forward"] == {"all_reduce": blocks, "all_gather": 1}, counts
        assert counts["backward"] == {"all_reduce": blocks + grads}, counts


def test_moe_with_biased_experts_is_a_clear_error():
    config = Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, **{**MOE_BASE, "bias": True},
                    **MOE_CONFIGS["mixtral"])
    with pytest.raises(NotImplementedError, match="bias=False"):
        thunder_tp.plans.litgpt(GPTWithLoss(config))
