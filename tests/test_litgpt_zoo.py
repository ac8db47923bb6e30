"""Every litgpt architecture (one scaled-down representative each) under TP / TP+SP / TP+loss parallel.

Loss and every gradient equal the single-device run (float64, Thunder's torch executor) and the collectives
per block equal Megatron's minimum. The default run checks a fast subset covering the zoo's special features;
`python -m pytest -q -m slow tests/test_litgpt_zoo.py` (or THUNDER_TP_SLOW=1) runs the full sweep at TP=2 and TP=4.
"""

from __future__ import annotations

import pytest
import thunder
import torch

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import MODES, batch, expected_counts, zoo, zoo_config
from tests.tp_checks import (
    FAST_EXECUTORS,
    assert_close_scaled,
    assert_grads_are_shards,
    collective_counts,
    rank_and_size,
)
from tests.zoo_checks import reference_and_copy, simulated_at_tp8, tolerance
from thunder_tp import TensorParallel
from thunder_tp.pieces import shard_tensor
from thunder_tp.plans.litgpt import GPTWithLoss, tp_sizes

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
    reference, model = reference_and_copy(name)
    transform = TensorParallel(thunder_tp.plans.litgpt(model, **MODES[mode]))
    jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)
    idx, targets = batch(0)
    expected, actual = reference(idx, targets), jm(idx, targets)
    atol = tolerance(reference.config)
    assert_close_scaled(actual, expected, rtol=0, atol=atol, what=f"{name} {mode} loss")
    expected.backward()
    actual.backward()
    assert_grads_are_shards(reference, jm, transform.parameter_layouts, rank, size, rtol=0, atol=atol,
                            what=f"{name} {mode}")
    return {"forward": collective_counts(thunder.last_traces(jm)[-1]),
            "backward": collective_counts(thunder.last_backward_traces(jm)[-1])}


def _run_and_compare(name: str, world: int, mode: str) -> None:
    config = zoo_config(name)
    counts = run_ranks(_check, world, name, mode)[0]
    forward, backward = expected_counts(config, mode, world)
    assert counts == {"forward": forward, "backward": backward}, (name, world, mode, counts)


@pytest.mark.parametrize("name,world,mode", FAST, ids=[f"{n}-tp{w}-{m}" for n, w, m in FAST])
def test_zoo_feature_subset_matches_single_device(name, world, mode):
    _run_and_compare(name, world, mode)


def _refused(name: str) -> str:
    config = zoo_config(name)
    model = GPTWithLoss(config)
    with pytest.raises(ValueError) as excinfo:
        thunder.jit(model, transforms=[TensorParallel(thunder_tp.plans.litgpt(model))])
    return str(excinfo.value)


SWEEP = [(n, w, m) for n in zoo() for w in (2, 4) for m in MODES]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,mode", SWEEP, ids=[f"{n}-tp{w}-{m}" for n, w, m in SWEEP])
def test_zoo_sweep_matches_single_device(name, world, mode):
    config = zoo_config(name)
    if world not in tp_sizes(config):
        if mode == "tp":
            message = run_ranks(_refused, world, name)[0]
            assert f"cannot be split over {world} ranks" in message and "TP sizes that work" in message, message
        return
    _run_and_compare(name, world, mode)


def test_replicated_kv_layout_round_trips():
    """q split over 4 ranks, 2 K/V heads each held by 2 ranks: pieces, chunks and full tensor agree."""
    from thunder_tp.layouts import Shard, Split, held_chunks
    from thunder_tp.pieces import shard_chunks, unshard_tensor

    kv = Split(2, replicated=True)
    layout = Shard(0, blocks=(8, 2, 2), splits=(None, kv, kv))
    full = torch.arange(12.0).reshape(12, 1)
    pieces = [shard_tensor(full, layout, rank, 4) for rank in range(4)]
    assert [p.flatten().tolist() for p in pieces] == [[0, 1, 8, 10], [2, 3, 8, 10], [4, 5, 9, 11], [6, 7, 9, 11]]
    assert held_chunks(layout, 12, 3, 4) == [(6, 2), (9, 1), (11, 1)]
    assert torch.equal(unshard_tensor(pieces, layout), full)
    assert shard_chunks((12, 1), layout, 3, 4) == [((6, 0), (2, 1)), ((9, 0), (1, 1)), ((11, 0), (1, 1))]


# --- TP=8 on simulated ranks (thunder_tp.simulate: PyTorch's LocalTensor in this one process) -----------------

SIMULATED = [(n, m) for n in zoo() for m in MODES if 8 in tp_sizes(zoo_config(n))]


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", SIMULATED, ids=[f"{n}-tp8-{m}" for n, m in SIMULATED])
def test_zoo_sweep_at_tp8_on_simulated_ranks(name, mode):
    """The sweep's TP=8 leg without 8 processes: what 8 real ranks would compute and issue."""
    counts = simulated_at_tp8(name, lambda model: thunder_tp.plans.litgpt(model, **MODES[mode]), mode)
    forward, backward = expected_counts(zoo_config(name), mode, 8)
    assert counts == {"forward": forward, "backward": backward}, (name, mode, counts)
