"""Attention heads the TP size does not divide: a litgpt llama with 28 query heads in 4 K/V groups (Qwen2.5-7B's) at
TP 8 (simulated) and TP 3 (3 gloo ranks), pythia-160m's 12 heads at TP 8 (simulated); TP, TP+SP and loss parallel,
the loss and every grad over two optimizer steps equal to one device's (float64), the collectives Megatron's."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
from litgpt import Config

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import MODES, SEQ, VOCAB, batch, expected_counts
from tests.tp_checks import (
    FAST_EXECUTORS,
    assert_close_scaled,
    assert_grads_are_shards,
    assert_simulated_grads_are_shards,
    collective_counts,
    rank_and_size,
)
from thunder_tp import TensorParallel
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.plans.litgpt import GPTWithLoss, tp_sizes

#: head counts kept, widths tiny; 44 MLP features and 256 vocabulary entries split unevenly at TP 3 (and 44 at 8)
CONFIGS = {
    "qwen28": dict(n_layer=1, n_head=28, n_query_groups=4, n_embd=32, head_size=4, intermediate_size=44, bias=False,
                   attn_bias=True, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", parallel_residual=False,
                   rotary_percentage=1.0),
    "pythia12": dict(n_layer=1, n_head=12, n_query_groups=12, n_embd=32, head_size=8, intermediate_size=44, bias=True,
                     mlp_class_name="GptNeoxMLP", norm_class_name="LayerNorm", parallel_residual=True,
                     rotary_percentage=0.25),
}
#: litgpt's RMSNorm computes in float32 even for float64 inputs
ATOL = {"RMSNorm": 2e-6, "LayerNorm": 1e-9}
STEPS, LR = 2, 0.5


def _config(name: str) -> Config:
    return Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, **CONFIGS[name])


def _pair(name: str) -> tuple[GPTWithLoss, GPTWithLoss]:
    torch.manual_seed(0)
    reference = GPTWithLoss(_config(name)).double()
    model = GPTWithLoss(_config(name)).double()
    model.load_state_dict(reference.state_dict())
    return reference, model


def _reference_steps(reference: GPTWithLoss) -> list[tuple[torch.Tensor, torch.nn.Module]]:
    """STEPS SGD steps of the single-device model: each step's loss and a copy of the model holding that step's grads,
    and last a copy holding the parameters after the steps."""
    recorded = []
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):
        loss = reference(*batch(step))
        loss.backward()
        recorded.append((loss.detach(), _snapshot(reference)))
        optimizer.step()
        optimizer.zero_grad()
    recorded.append((None, _snapshot(reference)))
    return recorded


def _snapshot(model: GPTWithLoss) -> GPTWithLoss:
    """A copy of `model` with its parameters' grads."""
    copied = copy.deepcopy(model)
    for p, q in zip(model.parameters(), copied.parameters(), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()
    return copied


def _tp_steps(name: str, mode: str, jm, recorded, batches, check_grads) -> dict:
    """The same steps on the TP model `jm`: every loss, every grad (`check_grads(reference, step, atol)`) and at the
    end every parameter equal to one device's; the collectives of the traces."""
    atol = ATOL[_config(name).norm_class_name]
    optimizer = torch.optim.SGD(jm.parameters(), lr=LR)
    for step in range(STEPS):
        loss = jm(*batches[step])
        expected, reference = recorded[step]
        for rank, value in thunder_tp.per_rank(loss).items() if ranks_of().one_trace_for_all else [(None, loss)]:
            assert_close_scaled(value, expected, rtol=0, atol=atol, what=f"{name} {mode} step {step} loss ({rank})")
        loss.backward()
        check_grads(reference, step, atol)
        optimizer.step()
        optimizer.zero_grad()
    check_grads(recorded[-1][1], None, atol)
    return {"forward": collective_counts(thunder.last_traces(jm)[-1]),
            "backward": collective_counts(thunder.last_backward_traces(jm)[-1])}


def _on_ranks(name: str, mode: str) -> dict:
    rank, size = rank_and_size()
    reference, model = _pair(name)
    recorded = _reference_steps(reference)
    transform = TensorParallel(thunder_tp.plans.litgpt(model, **MODES[mode]))
    jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)

    def check(reference, step, atol):
        assert_grads_are_shards(reference, jm, transform.parameter_layouts, rank, size, rtol=0, atol=atol,
                                what=f"{name} {mode} step {step}", parameters=step is None)

    return _tp_steps(name, mode, jm, recorded, [batch(step) for step in range(STEPS)], check)


def _simulated(name: str, mode: str, world: int) -> dict:
    reference, model = _pair(name)
    recorded = _reference_steps(reference)
    batches = [batch(step) for step in range(STEPS)]  # made outside the simulation: its random draws differ by rank
    with thunder_tp.simulate(world_size=world):
        transform = TensorParallel(thunder_tp.plans.litgpt(model, **MODES[mode]))
        jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors())

        def check(reference, step, atol):
            assert_simulated_grads_are_shards(reference, jm, transform.parameter_layouts, world, rtol=0, atol=atol,
                                              what=f"{name} {mode} step {step}", parameters=step is None)

        return _tp_steps(name, mode, jm, recorded, batches, check)


def _expected(name: str, mode: str, world: int) -> dict:
    forward, backward = expected_counts(_config(name), mode, world)
    return {"forward": forward, "backward": backward}


#: the default run: the 28 heads under TP (under SP on 3 ranks below; loss parallel: test_uneven_vocab); the other
#: modes and pythia's 12 heads slow-marked (the same rules)
SLOW = [("qwen28", "tp_sp"), ("qwen28", "tp_lp"), ("pythia12", "tp"), ("pythia12", "tp_sp"), ("pythia12", "tp_lp")]
SIMULATED = [("qwen28", "tp"), *(pytest.param(n, m, marks=pytest.mark.slow) for n, m in SLOW)]


@pytest.mark.parametrize("name,mode", SIMULATED)
def test_heads_at_tp8_simulated(name, mode):
    """28 heads: 4, 3, 4, 3, ... (each K/V group's 7 query heads over its 2 ranks, the K/V head on both); 12 heads:
    2, 2, 2, 2, 1, 1, 1, 1 with their K/V heads."""
    assert _simulated(name, mode, 8) == _expected(name, mode, 8)


@pytest.mark.parametrize("mode", ["tp_sp", *(pytest.param(m, marks=pytest.mark.slow) for m in ("tp", "tp_lp"))])
def test_qwen_heads_at_tp3_on_three_ranks(mode):
    """28 heads in 4 K/V groups over 3 ranks: whole groups 2, 1, 1 with their 14, 7, 7 query heads; the MLP's 44
    features 15, 15, 14; the vocabulary 86, 85, 85; under SP the 16 tokens 6, 5, 5."""
    assert run_ranks(_on_ranks, 3, "qwen28", mode)[0] == _expected("qwen28", mode, 3)


def test_more_ranks_than_heads_is_refused_naming_the_sizes_that_work():
    config = Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, **(CONFIGS["qwen28"] | dict(
        n_head=4, n_query_groups=2, head_size=8)))
    with torch.device("meta"):
        model = GPTWithLoss(config)
    with pytest.raises(ValueError, match=r"cannot be split over 8 ranks: every rank needs at least one; TP sizes that "
                                         r"work for this module: 1, 2, 3, 4"):
        with thunder_tp.simulate(world_size=8):
            thunder.jit(model, transforms=[TensorParallel(thunder_tp.plans.litgpt(model))])
    assert tp_sizes(config) == [1, 2, 3, 4]


def test_sequence_parallel_with_fewer_tokens_than_ranks_runs_as_tp():
    """A sequence the ranks do not divide is split unevenly (test_qwen_heads_at_tp3_on_three_ranks: 16 tokens as
    6, 5, 5); one shorter than the ranks cannot give each a token: the norms then run replicated and the block
    reduces as under TP (Megatron's all_reduces), still exact."""
    reference, model = _pair("qwen28")
    idx, targets = (t[:, :2] for t in batch(0))
    expected = reference(idx, targets)
    with thunder_tp.simulate(world_size=3):
        jm = thunder.jit(model, transforms=[TensorParallel(thunder_tp.plans.litgpt(model, sequence_parallel=True))],
                         executors=thunder_tp.executors())
        loss = jm(idx, targets)
        for rank, value in thunder_tp.per_rank(loss).items():
            assert_close_scaled(value, expected, rtol=0, atol=ATOL["RMSNorm"], what=f"loss of simulated rank {rank}")
        assert collective_counts(thunder.last_traces(jm)[-1]) == expected_counts(_config("qwen28"), "tp", 3)[0]
