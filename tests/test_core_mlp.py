"""Core TP on a Megatron ParallelMLP-shaped block and single Linear/Embedding layers, vs single device."""

import pytest
import torch
import torch.nn as nn

import thunder_tp
from tests.dist import run_ranks
from tests.tp_checks import compare_with_single_device

SEQ, BATCH, HIDDEN, FFN = 32, 4, 128, 512


class MLP(nn.Module):
    def __init__(self, hidden=HIDDEN, ffn=FFN, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _mlp_input():
    torch.manual_seed(2)
    return (torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True),)


PLAN = {"fc1": thunder_tp.ColwiseParallel(), "fc2": thunder_tp.RowwiseParallel()}


def _mlp(grad, fused=False):
    executors = thunder_tp.executors() if fused else None
    return compare_with_single_device(MLP, _mlp_input, thunder_tp.TensorParallel(PLAN), grad=grad, executors=executors)


@pytest.mark.parametrize("world", [2, 4])
def test_mlp_training(world):
    info = run_ranks(_mlp, world, True)[0]
    assert info["forward"] == {"all_reduce": 1}, info
    assert info["backward"] == {"all_reduce": 1}, info


def test_mlp_training_with_fusion_executor():
    info = run_ranks(_mlp, 2, True, True)[0]
    assert info["forward"] == {"all_reduce": 1}, info
    assert info["backward"] == {"all_reduce": 1}, info


def test_mlp_no_grad():
    info = run_ranks(_mlp, 2, False)[0]
    assert info["forward"] == {"all_reduce": 1}, info
