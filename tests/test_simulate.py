"""thunder_tp.simulate: N ranks in this one process (LocalTensor) give what N real ranks give.

These run in the pytest process itself (it holds no process group: tests/dist.py's gloo groups live in pool workers).
"""

from __future__ import annotations

from functools import partial

import pytest
import thunder
import torch
import torch.distributed as dist
from litgpt import Config
from torch.distributed._local_tensor import local_tensor_mode

import thunder_tp
from tests.dist import free_port
from tests.litgpt_models import CONFIGS, MODES, SEQ, VOCAB, GPTWithLoss, batch, expected_counts, make_config
from tests.tp_checks import assert_close_scaled, assert_simulated_grads_are_shards, collective_counts
from thunder_tp import ColwiseParallel, RowwiseParallel, TensorParallel
from thunder_tp.execution.executor import fusion_executor

#: float64; litgpt's RMSNorm still runs in float32 (~5e-7 of a grad's largest entry)
RTOL = ATOL = 1e-6
LR = 0.5
#: GQA with 8 K/V groups (16 heads), so that TP=8 splits the K/V heads without replicating them
WIDE_GQA = CONFIGS["llama"] | dict(n_head=16, n_query_groups=8, head_size=4)


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not dist.is_initialized(), "simulate tests need a process without a process group"
    previous = torch.get_default_dtype()
    yield
    torch.set_default_dtype(previous)


def _gqa_config(world: int) -> Config:
    if world <= 4:
        return make_config("llama")  # 8 heads, 4 K/V groups
    return Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, **WIDE_GQA)


def _pieces(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    ranks = thunder_tp.per_rank(t)
    assert sorted(ranks) == list(range(world)), sorted(ranks)
    return [ranks[r] for r in range(world)]


@pytest.mark.parametrize(
    "world, mode", [pytest.param(4, "tp", marks=pytest.mark.slow),  # slow: tp_lp runs the same plan and its head
                    pytest.param(4, "tp_sp", marks=pytest.mark.slow), (4, "tp_lp"), (8, "tp_sp")]
)
def test_gqa_gpt_on_simulated_ranks_matches_single_device(world, mode, tmp_path):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    reference = GPTWithLoss(_gqa_config(world))
    model = GPTWithLoss(reference.config)
    model.load_state_dict(reference.state_dict())
    idx, targets = batch(0)
    expected = reference(idx, targets)
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=LR).step()

    with thunder_tp.simulate(world_size=world):
        transform = TensorParallel(thunder_tp.plans.litgpt(model, **MODES[mode]))
        jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors())
        loss = jm(idx, targets)  # plain tensors: replicated to every simulated rank
        loss.backward()
        torch.optim.SGD(jm.parameters(), lr=LR).step()
        forward, backward = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
        files = thunder_tp.dump_traces(jm, tmp_path)

    for rank, value in enumerate(_pieces(loss, world)):
        assert_close_scaled(value, expected, rtol=RTOL, atol=ATOL, what=f"loss of simulated rank {rank}")
    # each rank's grad (first reference step) is its shard; so is each parameter after an SGD step
    assert_simulated_grads_are_shards(reference, jm, transform.parameter_layouts, world, rtol=RTOL, atol=ATOL)
    assert_simulated_grads_are_shards(reference, jm, transform.parameter_layouts, world, rtol=RTOL, atol=ATOL,
                                      what="after an SGD step:", parameters=True)
    # the simulated program issues what real ranks issue (Megatron's minimum; tests/test_litgpt.py)
    assert (collective_counts(forward), collective_counts(backward)) == expected_counts(reference.config, mode, world)
    names = sorted(p.name for p in files)
    assert names == sorted(f"rank{r}_{f}" for r in range(world) for f in ("forward.py", "backward.py",
                                                                          "collectives.md"))
    assert f"rank {world - 1} (world size {world})" in (tmp_path / f"rank{world - 1}_forward.py").read_text()
    assert not dist.is_initialized() and local_tensor_mode() is None


def test_checkpointed_blocks_recompute_their_collectives():
    """torch.utils.checkpoint around each block: same loss and grads, the attention's all_reduce again backward."""
    from torch.utils.checkpoint import checkpoint

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    reference = GPTWithLoss(make_config("llama"))
    model = GPTWithLoss(reference.config)
    model.load_state_dict(reference.state_dict())
    for block in model.gpt.transformer.h:
        block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    idx, targets = batch(0)
    expected = reference(idx, targets)
    expected.backward()
    with thunder_tp.simulate(world_size=2):
        transform = TensorParallel(thunder_tp.plans.litgpt(model))
        jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors())
        loss = jm(idx, targets)
        loss.backward()
    assert_close_scaled(thunder_tp.per_rank(loss)[1], expected, rtol=RTOL, atol=ATOL, what="loss")
    assert_simulated_grads_are_shards(reference, jm, transform.parameter_layouts, 2, rtol=RTOL, atol=ATOL)
    _, backward = expected_counts(make_config("llama"), "tp", 2)
    n_layer = reference.config.n_layer
    assert collective_counts(thunder.last_backward_traces(jm)[-1]) == {"all_reduce": backward["all_reduce"] + n_layer}


def _mlp() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    return model, {"0": ColwiseParallel(), "2": RowwiseParallel()}


def test_mlp_input_grad_and_replicated_outputs():
    model, plan = _mlp()
    x = torch.randn(3, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    expected = model(x_ref)
    expected.sum().backward()
    with thunder_tp.simulate(world_size=2):
        jm = thunder.jit(model, transforms=[TensorParallel(plan)], executors=thunder_tp.executors())
        y = jm(x)
        y.sum().backward()
    for rank in range(2):
        torch.testing.assert_close(thunder_tp.per_rank(y)[rank], expected)
        torch.testing.assert_close(thunder_tp.per_rank(x.grad)[rank], x_ref.grad)


def test_leaving_the_context_restores_everything():
    model, plan = _mlp()
    fusion = fusion_executor()
    with pytest.raises(ZeroDivisionError):
        with thunder_tp.simulate(world_size=4):
            assert dist.get_world_size() == 4 and local_tensor_mode() is not None
            assert fusion not in thunder_tp.executors()  # LocalTensor runs on Thunder's torch executor
            raise ZeroDivisionError
    assert not dist.is_initialized() and local_tensor_mode() is None
    assert fusion in thunder_tp.executors()
    # a real process group works afterwards
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        torch.testing.assert_close(t, torch.ones(3))
        with pytest.raises(RuntimeError, match="already initialized"):
            with thunder_tp.simulate(world_size=2):
                pass
    finally:
        dist.destroy_process_group()


def test_what_cannot_be_simulated_is_a_clear_error():
    model, plan = _mlp()
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        with thunder_tp.simulate(world_size=0):
            pass
    with thunder_tp.simulate(world_size=4):
        with pytest.raises(RuntimeError, match="do not nest"):
            with thunder_tp.simulate(world_size=2):
                pass
        with pytest.raises(NotImplementedError, match="cannot compile LocalTensor"):
            thunder.jit(model, transforms=[TensorParallel(plan)], executors=[fusion_executor()])
        mesh = thunder_tp.init_mesh(dp=2, tp=2)
        with pytest.raises(NotImplementedError, match="2-D meshes are not simulated"):
            thunder_tp.parallelize(model, plan, mesh, "ddp")
    with pytest.raises(RuntimeError, match="needs an active simulation"):
        thunder_tp.per_rank(torch.ones(2))


def test_sliding_window_mask_built_inside_forward():
    """litgpt builds the sliding-window mask inside forward, through torch ops Thunder has no symbol for
    (``Tensor.bool``): Thunder's fake tensors for those stay fake under the simulation's LocalTensorMode, and the
    simulated program matches one device (loss, every grad) and issues what real ranks issue."""
    from tests.litgpt_models import zoo_config
    from tests.zoo_checks import simulated_check

    name = "Mathstral-7B-v0.1"  # GQA with 8 K/V groups and a sliding window
    assert zoo_config(name).sliding_window_size is not None
    forward, backward = expected_counts(zoo_config(name), "tp", 4)
    counts = simulated_check(name, 4, thunder_tp.plans.litgpt, "tp")
    assert counts == {"forward": forward, "backward": backward}
