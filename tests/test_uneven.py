"""Shards the TP size does not divide: features, a sequence, every rank's piece of a different length, exact against
one device (float64) on 2 and 3 gloo ranks, and in a simulation of 8."""

import pytest
import thunder
import torch
import torch.nn as nn

import thunder_tp
from tests.dist import run_ranks
from tests.tp_checks import (
    assert_close_scaled,
    assert_simulated_grads_are_shards,
    collective_counts,
    compare_with_single_device,
)
from thunder_tp import ColwiseParallel, Replicate, RowwiseParallel, Shard

#: no TP size from 2 to 8 divides any of them
SEQ, BATCH, HIDDEN, FFN = 11, 2, 23, 37


class MLP(nn.Module):
    """fc2(gelu(fc1(x))): hidden -> ffn -> hidden, with biases."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def _inputs() -> tuple[torch.Tensor]:
    torch.manual_seed(2)
    return (torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, requires_grad=True),)


def _model() -> MLP:
    return MLP().to(torch.float64)


PLANS = {
    # Megatron's MLP: fc1's 37 features split 19 / 18 (13 / 12 / 12 at TP 3), one all_reduce each way
    "megatron": ({"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, {"all_reduce": 1}, {"all_reduce": 1}),
    # both column-parallel with gathered outputs: all_gathers of unequal pieces (37 and 23 features)
    "gathered": ({"fc1": ColwiseParallel(output_layout=Replicate()), "fc2": ColwiseParallel(output_layout=Replicate())},
                 {"all_gather": 2}, {"all_reduce": 2}),
    # the output reduce-scattered over the 11 tokens (6 / 5, or 4 / 4 / 3), then gathered: uneven sequence shards
    "scattered": ({"fc1": ColwiseParallel(), "fc2": RowwiseParallel(output_layout=Shard(0))},
                  {"reduce_scatter": 1, "all_gather": 1}, {"all_gather": 1, "all_reduce": 1}),
}


def _forward_table(jm) -> list[dict]:
    return thunder_tp.collectives_table(thunder.last_traces(jm)[-1])


def _mlp(plan_name: str) -> dict:
    plan = PLANS[plan_name][0]
    return compare_with_single_device(_model, _inputs, thunder_tp.TensorParallel(plan), rtol=1e-12, atol=1e-12,
                                      inspect=_forward_table)


#: the default run: each plan once; the other world sizes slow-marked (the same collectives, other piece lengths)
CASES = [(p, w) if (p, w) in {("megatron", 3), ("gathered", 2), ("scattered", 3)} else
         pytest.param(p, w, marks=pytest.mark.slow) for p in PLANS for w in (2, 3)]


@pytest.mark.parametrize("plan,world", CASES)
def test_mlp_whose_features_no_size_divides(plan, world):
    info = run_ranks(_mlp, world, plan)[0]
    _, forward, backward = PLANS[plan]
    assert info["forward"] == forward, info
    assert info["backward"] == backward, info
    if plan == "gathered":  # pieces padded to the longest: 37 features as 19 + 19 (13 * 3), 23 as 12 + 12 (8 * 3)
        entry = SEQ * BATCH * 8  # bytes of one feature of every token, float64
        padding = [row["padding_per_call"] for row in info["inspected"] if row["kind"] == "all_gather"]
        assert sorted(padding) == sorted(entry * (-n % world) for n in (FFN, HIDDEN)), info["inspected"]


#: the gathered and scattered plans' collectives on padded pieces run by default on real ranks
SIMULATED = ["megatron", *(pytest.param(p, marks=pytest.mark.slow) for p in ("gathered", "scattered"))]


@pytest.mark.parametrize("plan", SIMULATED)
def test_mlp_simulated_at_tp8(plan):
    """8 simulated ranks: every rank's piece padded to the longest in the one simulated program; the grads each
    rank's true piece."""
    from torch.distributed._local_tensor import LocalTensor

    with thunder_tp.simulate(world_size=8):
        torch.manual_seed(0)
        reference, model = _model(), _model()
        model.load_state_dict(reference.state_dict())
        transform = thunder_tp.TensorParallel(PLANS[plan][0])
        jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors())
        (x,) = _inputs()
        x_tp = x.detach().clone().requires_grad_()
        expected = reference(x)
        actual = jm(x_tp)
        assert isinstance(actual, LocalTensor)
        for value in thunder_tp.per_rank(actual).values():
            assert_close_scaled(value, expected.detach(), rtol=1e-12, atol=1e-12, what="output")
        expected.sum().backward()
        actual.sum().backward()
        for value in thunder_tp.per_rank(x_tp.grad).values():
            assert_close_scaled(value, x.grad, rtol=1e-12, atol=1e-12, what="input grad")
        assert collective_counts(thunder.last_traces(jm)[-1]) == PLANS[plan][1]
        assert collective_counts(thunder.last_backward_traces(jm)[-1]) == PLANS[plan][2]
        assert [p.shape[0] for p in thunder_tp.per_rank(jm.get_parameter("fc1.weight")).values()] == [5] * 5 + [4] * 3
        assert_simulated_grads_are_shards(reference, jm, transform.parameter_layouts, 8, rtol=1e-12, atol=1e-12)
