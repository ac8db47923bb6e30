"""Core TP on a Megatron ParallelMLP-shaped block (tests/parallel_mlp.py) vs single device."""

import pytest

import thunder_tp
from tests.dist import run_ranks
from tests.parallel_mlp import MLP, PLAN, mlp_input
from tests.tp_checks import compare_with_single_device


def _mlp(grad, fused=False):
    executors = thunder_tp.executors() if fused else None
    return compare_with_single_device(MLP, mlp_input, thunder_tp.TensorParallel(PLAN), grad=grad, executors=executors)


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
