"""The litgpt zoo's comparison with one device, shared by test_litgpt_zoo, test_auto_plan and test_simulate: each
architecture's float64 model pair, its tolerance, and the check on simulated ranks (TP=8 without 8 processes)."""

from __future__ import annotations

from collections.abc import Callable

import thunder
import torch
from litgpt import Config

import thunder_tp
from tests.litgpt_models import batch, zoo_config
from tests.tp_checks import assert_close_scaled, assert_simulated_grads_are_shards, collective_counts
from thunder_tp import TensorParallel
from thunder_tp.plans.litgpt import GPTWithLoss

#: litgpt's RMSNorm computes in float32 even for float64 inputs; everything else is exact to ~1e-12
TOLERANCE = {"RMSNorm": 2e-6, "LayerNorm": 1e-9}


def tolerance(config: Config) -> float:
    """The atol (relative to each tensor's largest entry) of a zoo model's loss and grads against one device."""
    return TOLERANCE.get(config.norm_class_name, 2e-6)


def reference_and_copy(name: str) -> tuple[GPTWithLoss, GPTWithLoss]:
    """The float64 single-device model of a zoo architecture and an identical copy to parallelize."""
    config = zoo_config(name)
    torch.manual_seed(0)
    reference = GPTWithLoss(config).double()
    model = GPTWithLoss(config).double()
    model.load_state_dict(reference.state_dict())
    return reference, model


def simulated_check(name: str, world: int, plan_for: Callable[[torch.nn.Module], dict], what: str) -> dict:
    """The zoo comparison on `world` simulated ranks with the plan `plan_for(model)` (`what` names it in messages):
    every rank's loss and every rank's piece of every grad vs one device; the collectives of both traces."""
    reference, model = reference_and_copy(name)
    idx, targets = batch(0)
    expected = reference(idx, targets)
    expected.backward()
    atol = tolerance(reference.config)
    with thunder_tp.simulate(world_size=world):
        transform = TensorParallel(plan_for(model))
        jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors())
        loss = jm(idx, targets)
        loss.backward()
        counts = {"forward": collective_counts(thunder.last_traces(jm)[-1]),
                  "backward": collective_counts(thunder.last_backward_traces(jm)[-1])}
        losses = thunder_tp.per_rank(loss)
    for rank, value in losses.items():
        assert_close_scaled(value, expected, rtol=0, atol=atol, what=f"{name} {what} loss of simulated rank {rank}")
    assert_simulated_grads_are_shards(reference, jm, transform.parameter_layouts, world, rtol=0, atol=atol,
                                      what=f"{name} {what} (TP={world})")
    return counts


def simulated_at_tp8(name: str, plan_for: Callable[[torch.nn.Module], dict], what: str) -> dict:
    """simulated_check at TP=8."""
    return simulated_check(name, 8, plan_for, what)
