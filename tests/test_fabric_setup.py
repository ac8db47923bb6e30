"""The Fabric idioms of Lightning's docs with ThunderTPStrategy train exactly or stop with the cause (real gloo
ranks, float64): `model, optimizer = fabric.setup(model, optimizer)` with the optimizer built before setup (two
param groups of their own options) from a model built normally, under `fabric.init_module()` and on the meta device
equals one-device Fabric; per-rank seeds raise at setup on every rank; a different batch on one rank at step 3
raises on every rank at that call."""

from __future__ import annotations

import functools

import pytest
import torch

from tests import fabric_loops
from tests.dist import run_ranks

RTOL = 1e-9  # float64 through Thunder's torch executor: ~1e-12 in practice
TIMEOUT_S = 600
FAST = {"executors": "fast"}


@functools.cache
def _one_device(init: str, rows: int = 2) -> dict:
    """The same loop with Fabric on one device (this process)."""
    return fabric_loops.train_as_in_the_docs(None, init, rows=rows)


def _check_equal_to_one_device(results: list[dict], init: str, rows: int = 2) -> None:
    expected = _one_device(init, rows)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected["losses"]), rtol=RTOL, atol=0)
        assert r["losses"][-1] < r["losses"][0] - 0.05, r["losses"]  # it trains: a stepped-on-nothing run fails here
        assert r["groups"] == expected["groups"]  # lr, weight_decay, betas, ... of each group kept
        assert r["moments"] == r["held"] and r["held"] != expected["held"]  # the optimizer steps the shards
        assert r["params"].keys() == expected["params"].keys()
        for name, full in expected["params"].items():
            torch.testing.assert_close(r["params"][name], full, rtol=RTOL, atol=1e-12, msg=name)


@pytest.mark.parametrize("init", [
    pytest.param("plain", marks=pytest.mark.slow),  # slow: test_fabric's pretrain sets up a plain model
    pytest.param("init_module", marks=pytest.mark.slow),  # slow: on CPU the same path as "plain" (the root device)
    "meta",
])
def test_setup_model_and_optimizer_tp2_equals_one_device(init):
    """fabric.setup(model, optimizer), AdamW with two param groups: the losses of 3 steps and the final parameters
    equal one device's; each param group keeps its options; the optimizer's state is sharded like its parameter."""
    results = run_ranks(fabric_loops.train_as_in_the_docs, 2, FAST, init, timeout=TIMEOUT_S)
    _check_equal_to_one_device(results, init)


@pytest.mark.slow  # reason: four ranks (a 2 x 2 mesh, DDP and FSDP over the data-parallel group); TP=2 is the default
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_setup_model_and_optimizer_on_a_2x2_mesh_equals_one_device(data_parallel):
    strategy = FAST | {"tensor_parallel_size": 2, "data_parallel": data_parallel}
    results = run_ranks(fabric_loops.train_as_in_the_docs, 4, strategy, "meta", rows=4, timeout=TIMEOUT_S)
    _check_equal_to_one_device(results, "meta", rows=4)  # each data-parallel rank 2 of one device's 4 rows


def _setup_with_rank_seeds(init: str, check_weights: bool = True) -> str:
    """fabric.seed_everything(42 + rank) before the model is built: setup raises (unless the check is off)."""
    import torch.distributed as dist

    f = fabric_loops.fabric(FAST | {"check_weights": check_weights}, fabric_loops.Losses())
    f.seed_everything(42 + dist.get_rank())
    model = fabric_loops.build_gpt(f, init)
    try:
        f.setup(model, fabric_loops.two_group_adamw(model))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("init", ["plain", "meta"])
def test_per_rank_seeds_raise_at_setup_on_every_rank(init):
    for m in run_ranks(_setup_with_rank_seeds, 2, init, timeout=TIMEOUT_S):
        assert "ThunderTPStrategy setup:" in m and "tensors differ across the ranks" in m, m
        assert "lm_head.weight, transformer.h.0.attn.proj.bias" in m, m  # the parameters
        assert "fabric.seed_everything(seed)" in m, m  # the fix
        assert "ThunderTPStrategy(check_weights=False)" in m, m  # the switch


def test_check_weights_false_sets_up_ranks_seeded_apart():
    assert run_ranks(_setup_with_rank_seeds, 2, "plain", False, timeout=TIMEOUT_S) == ["no error", "no error"]


def test_different_batches_at_step_3_raise_on_every_rank_at_that_call():
    """The first two steps alike, then each rank its own batch: the third call raises on every rank (the default
    check_inputs="training" compares every training call), before the call's first collective."""
    for r in run_ranks(fabric_loops.train_as_in_the_docs, 2, FAST, "plain", steps=4, rank_batches_from=2,
                       timeout=TIMEOUT_S):
        assert r.get("failed_step") == 2 and len(r["losses"]) == 2, r
        assert "were handed different inputs (same shapes, different values" in r["error"], r


def _optimizer_of_another_model() -> str:
    f = fabric_loops.fabric(FAST, fabric_loops.Losses())
    f.seed_everything(5)
    model, other = fabric_loops.build_gpt(f, "plain"), fabric_loops.build_gpt(f, "plain")
    try:
        f.setup(model, torch.optim.AdamW(other.parameters()))
    except ValueError as e:
        return str(e)
    return "no error"


def test_optimizer_of_other_tensors_raises_at_setup():
    for m in run_ranks(_optimizer_of_another_model, 2, timeout=TIMEOUT_S):
        assert "that are no parameter of the model set up by this strategy" in m, m
        assert "fabric.setup(model, optimizer)" in m, m


def _setup_with_two_optimizers(init: str) -> list[bool]:
    """fabric.setup(model, opt1, opt2), each over part of the parameters: each steps its part's shards."""
    f = fabric_loops.fabric(FAST, fabric_loops.Losses())
    f.seed_everything(5)
    model = fabric_loops.build_gpt(f, init)
    matrices = torch.optim.SGD([p for p in model.parameters() if p.dim() >= 2], lr=0.1)
    vectors = torch.optim.AdamW([p for p in model.parameters() if p.dim() < 2], lr=0.01)
    model, matrices, vectors = f.setup(model, matrices, vectors)
    shards = {id(p): p.dim() for p in f.strategy.models[0].parameters()}
    held = [[shards.get(id(p)) for g in o.param_groups for p in g["params"]] for o in (matrices, vectors)]
    return [all(d is not None and d >= 2 for d in held[0]), all(d is not None and d < 2 for d in held[1]),
            len(held[0]) + len(held[1]) == len(shards)]


@pytest.mark.parametrize("init", ["plain", "meta"])
def test_setup_with_two_optimizers_points_each_at_its_shards(init):
    assert run_ranks(_setup_with_two_optimizers, 2, init, timeout=TIMEOUT_S) == [[True] * 3] * 2


def _state_from_before_setup() -> list[str]:
    """An optimizer that stepped the full model before fabric.setup: after setup each state tensor is this rank's
    shard of the full one (as its parameter), the step counts kept; returns what differs."""
    import thunder
    import torch.distributed as dist
    import torch.nn.functional as F

    from thunder_tp.layouts import REPLICATE
    from thunder_tp.pieces import shard_tensor
    from thunder_tp.transform import TensorParallel

    f = fabric_loops.fabric(FAST, fabric_loops.Losses(), precision="32-true")
    f.seed_everything(3)
    model = fabric_loops.build_gpt(f, "plain")
    optimizer = fabric_loops.two_group_adamw(model)
    idx, targets = fabric_loops.token_batch()
    F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
    optimizer.step()
    before = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
    model, optimizer = f.setup(model, optimizer)
    jitted = f.strategy.models[0]
    layouts = next(t for t in thunder.list_transforms(jitted) if isinstance(t, TensorParallel)).parameter_layouts
    rank, size = dist.get_rank(), dist.get_world_size()
    differing = []
    for name, shard in jitted.named_parameters():
        state = optimizer.state[shard]
        for key, full in before[name].items():
            want = full if full.dim() == 0 else shard_tensor(full, layouts.get(name, REPLICATE), rank, size)
            if not torch.equal(state[key], want) or (full.dim() and state[key].shape != shard.shape):
                differing.append(f"{name}.{key}")
    return differing


def test_optimizer_state_from_before_setup_is_sharded_like_its_parameter():
    assert run_ranks(_state_from_before_setup, 2, timeout=TIMEOUT_S) == [[], []]
