"""Every litgpt architecture (one scaled-down representative each) under TP / TP+SP / TP+loss parallel.

Loss and every gradient equal the single-device run (float64, Thunder's torch executor) and the collectives
per block equal Megatron's minimum. The default run checks a fast subset covering the zoo's special features;
`THUNDER_TP_ZOO=1 pytest -m slow tests/test_litgpt_zoo.py` runs the full sweep at TP=2 and TP=4.
"""

from __future__ import annotations

import os

import pytest
import thunder
import torch

import thunder_tp
from thunder_tp import TensorParallel
from thunder_tp.layouts import REPLICATE, shard_tensor
from thunder_tp.plans.litgpt import GPTWithLoss
from tests.dist import run_ranks
from tests.litgpt_models import batch, zoo, zoo_config
from tests.tp_checks import FAST_EXECUTORS, assert_close_scaled, collective_counts, rank_and_size

MODES = {"tp": {}, "tp_sp": {"sequence_parallel": True}, "tp_lp": {"loss_parallel": True}}
#: litgpt's RMSNorm computes in float32 even for float64 inputs; everything else is exact to ~1e-12
TOLERANCE = {"RMSNorm": 2e-6, "LayerNorm": 1e-9}
#: a handful of architectures that cover the features beyond plain GQA/MHA, for the default test run
FAST = [
    ("Qwen2.5-1.5B", 4, "tp"),  # 2 K/V groups over 4 ranks: K/V heads replicated; attention biases
    ("Gemma-2-9b", 2, "tp_sp"),  # soft-capping, sliding window, post norms, scaled embeddings
    ("OLMo-2-1124-7B", 2, "tp_sp"),  # post-norm blocks (norm_1 is an Identity), q/k norm over all heads
    ("Gemma-3-1b-it", 2, "tp_lp"),  # multi-query, per-head q/k norm, local/global rope
]


def _check(name: str, mode: str) -> dict:
    """Loss and every grad of the TP run vs single device (float64); the collectives of both traces."""
    rank, size = rank_and_size()
    config = zoo_config(name)
    torch.manual_seed(0)
    reference = GPTWithLoss(config).double()
    model = GPTWithLoss(config).double()
    model.load_state_dict(reference.state_dict())
    transform = TensorParallel(thunder_tp.plans.litgpt(model, **MODES[mode]))
    jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)
    idx, targets = batch(0)
    expected, actual = reference(idx, targets), jm(idx, targets)
    tolerance = TOLERANCE.get(config.norm_class_name, 2e-6)
    assert_close_scaled(actual, expected, rtol=0, atol=tolerance, what=f"{name} {mode} loss")
    expected.backward()
    actual.backward()
    for n, p in reference.named_parameters():
        want = shard_tensor(p.grad, transform.parameter_layouts.get(n, REPLICATE), rank, size)
        assert_close_scaled(jm.get_parameter(n).grad, want, rtol=0, atol=tolerance, what=f"{name} {mode} grad of {n}")
    return {"forward": collective_counts(thunder.last_traces(jm)[-1]),
            "backward": collective_counts(thunder.last_backward_traces(jm)[-1])}
