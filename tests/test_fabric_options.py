"""ThunderTPStrategy's options (no ranks): TensorParallel's keyword options reach the TensorParallel that setup jits
the model with; a bad one raises when the strategy is built, with TensorParallel's own message."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import thunder_tp
from thunder_tp import ColwiseParallel, TensorParallel
from thunder_tp.data_parallel.mesh import Mesh
from thunder_tp.fabric import ThunderTPStrategy
from thunder_tp.fabric.model import jit
from thunder_tp.thunder_internals.private import applied_transforms

TENSOR_PARALLEL_OPTIONS = {"overlap": "never", "check_inputs": "every", "check_collectives": False,
                           "float8_all_gather": False}


def test_tensor_parallel_options_reach_the_transform():
    """What fabric.setup jits (thunder_tp.fabric.model.jit, on rank 0 of a 2-rank group that exchanges nothing:
    thunder_tp.one_rank) carries the options; TensorParallel's own weight check stays off (setup compares the
    weights over the world instead)."""
    strategy = ThunderTPStrategy(plan={"0": ColwiseParallel()}, check_weights=False, **TENSOR_PARALLEL_OPTIONS)
    with thunder_tp.one_rank(2, 0, "cpu"):
        mesh = Mesh(dp=1, tp=2, dp_group=None, tp_group=None, dp_rank=0, tp_rank=0, dp_ranks=(0,), tp_ranks=(0, 1))
        jitted, _ = jit(nn.Sequential(nn.Linear(4, 4)), strategy.options, mesh, torch.device("cpu"))
    tensor_parallel, = [t for t in applied_transforms(jitted) if isinstance(t, TensorParallel)]
    assert {name: getattr(tensor_parallel, name) for name in TENSOR_PARALLEL_OPTIONS} == TENSOR_PARALLEL_OPTIONS
    assert tensor_parallel.check_weights is False and strategy.options.check_weights is False


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"overlap": "sometimes"}, ValueError, "TensorParallel: overlap must be one of"),
    ({"check_inputs": "sometimes"}, ValueError, "TensorParallel: check_inputs must be one of"),
    ({"float8_all_gather": "yes"}, TypeError, "TensorParallel: float8_all_gather must be True or False"),
    ({"check_weights": 1}, TypeError, "TensorParallel: check_weights must be True or False"),
    ({"overlapp": "never"}, TypeError, r"unexpected keyword arguments \['overlapp'\].*'overlap'"),
    ({"process_group": None}, TypeError, r"unexpected keyword arguments \['process_group'\]"),
])
def test_bad_options_raise_when_the_strategy_is_built(options, error, message):
    with pytest.raises(error, match=message):
        ThunderTPStrategy(**options)
