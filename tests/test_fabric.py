"""litgpt's own pretrain loop, unmodified, through Lightning Fabric with ThunderTPStrategy on real gloo ranks: the
losses equal the same loop on one device (float64), replicated parameters stay bitwise equal across the TP group, a
checkpoint saved at one TP size resumes at another."""

from __future__ import annotations

import functools

import pytest
import torch

from tests import fabric_loops
from tests.dist import run_ranks

RTOL = 1e-6  # float64 through Inductor and a reordered clipping norm: ~1e-9 in practice
TIMEOUT_S = 900


@functools.cache
def _one_device(iters: int, accumulate: int, config: str, tmp: str, micro_batch_size: int = 2) -> tuple[float, ...]:
    """The same loop with Fabric on one device (this process)."""
    config = getattr(fabric_loops, f"{config}_config")()
    return tuple(fabric_loops.pretrain(tmp, None, iters=iters, accumulate=accumulate, config=config,
                                       micro_batch_size=micro_batch_size))


def _pretrain_ranks(directory: str, strategy: dict, iters: int, accumulate: int, config: str,
                    data_parallel: int = 1) -> dict:
    import torch.distributed as dist

    config_ = getattr(fabric_loops, f"{config}_config")()
    fabrics: list = []
    losses = fabric_loops.pretrain(f"{directory}/rank{dist.get_rank()}", strategy, iters=iters, accumulate=accumulate,
                                   config=config_, data_parallel=data_parallel, fabrics=fabrics)
    return {"losses": losses, "replicas": _replicated_checksums(fabrics[0].strategy.models[-1])}


def _pretrain_saving(directory: str, iters: int) -> list[float]:
    """TP over the pool's ranks, a checkpoint after every step (accumulating nothing)."""
    import torch.distributed as dist

    return fabric_loops.pretrain(f"{directory}/rank{dist.get_rank()}", {}, iters=iters,
                                 config=fabric_loops.gqa_config(),
                                 save_interval=1)


def _pretrain_resuming(directory: str, checkpoint: str, iters: int) -> list[float]:
    from pathlib import Path

    import torch.distributed as dist

    return fabric_loops.pretrain(f"{directory}/rank{dist.get_rank()}", {}, iters=iters,
                                 config=fabric_loops.gqa_config(),
                                 resume=Path(checkpoint))


def _replicated_checksums(jitted) -> list[int]:
    """Checksums of every replicated parameter of the model the strategy set up, in name order."""
    import thunder

    from thunder_tp.layouts import Shard
    from thunder_tp.runtimes.divergence import checksum
    from thunder_tp.transform import TensorParallel

    tp = next(t for t in thunder.list_transforms(jitted) if isinstance(t, TensorParallel))
    return [checksum(p) for name, p in sorted(jitted.named_parameters())
            if not isinstance(tp.parameter_layouts.get(name), Shard)]


def _check(results: list[dict], expected: tuple[float, ...], tp: int) -> None:
    """Each rank's logged losses (averaged over the data-parallel ranks, which log their own micro-batches) equal
    one device's; every TP group holds bitwise equal replicas."""
    dp = len(results) // tp
    losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).view(dp, tp, -1).mean(0)
    for rank_losses in losses:
        torch.testing.assert_close(rank_losses, torch.tensor(expected, dtype=torch.float64), rtol=RTOL, atol=0)
    for start in range(0, len(results), tp):
        group = results[start : start + tp]
        assert all(r["replicas"] == group[0]["replicas"] for r in group)


def test_pretrain_tp2_with_accumulation_equals_one_device(tmp_path):
    """TP=2, 2 micro-batches per step, max_norm=1.0: litgpt.pretrain.main's losses equal one device's (Thunder's
    default executors: the fusion executor's compile is left to the slow runs)."""
    expected = _one_device(4, 2, "neox", str(tmp_path / "one"))
    results = run_ranks(_pretrain_ranks, 2, str(tmp_path), {"executors": "fast"}, 4, 2, "neox", timeout=TIMEOUT_S)
    _check(results, expected, 2)


@pytest.mark.slow  # reason: four ranks compiling two programs each (minutes on 2 cores)
@pytest.mark.parametrize("strategy", [
    {"tensor_parallel_size": 4},                            # 2 K/V groups on 4 ranks: K/V heads replicated
    {"tensor_parallel_size": 2, "data_parallel": "fsdp"},   # 2 x 2 mesh, FSDP over the data-parallel group
    {"tensor_parallel_size": 2, "data_parallel": "ddp"},    # 2 x 2 mesh, DDP: accumulation under no_backward_sync
])
def test_pretrain_four_ranks_equals_one_device(tmp_path, strategy):
    """2 micro-batches per step. Each data-parallel rank takes its share of every micro-batch: one device's micro-
    batches are dp times larger (litgpt's learning-rate schedule counts micro-batches, so their number stays)."""
    tp = strategy["tensor_parallel_size"]
    dp = 4 // tp
    expected = _one_device(4, 2, "gqa", str(tmp_path / "one"), 2 * dp)
    results = run_ranks(_pretrain_ranks, 4, str(tmp_path), strategy, 4, 2, "gqa", dp, timeout=TIMEOUT_S)
    _check(results, expected, tp)


@pytest.mark.slow  # reason: a TP=2 run saving every step, then a TP=4 run resuming from its second step
def test_save_at_tp2_resume_at_tp4_equals_an_uninterrupted_run(tmp_path):
    """litgpt's pretrain saves (fabric.save: a sharded DCP directory) at TP=2 and resumes (fabric.load: model,
    optimizer, iter_num, step_count, the dataloader's position) at TP=4: the losses after the resume equal the
    uninterrupted run's."""
    uninterrupted = run_ranks(_pretrain_saving, 2, str(tmp_path / "a"), 4, timeout=TIMEOUT_S)[0]
    checkpoint = tmp_path / "a" / "rank0" / "out" / "step-00000002" / "lit_model.pth"
    assert (checkpoint / ".metadata").is_file() and (checkpoint / "meta.pt").is_file()
    resumed = run_ranks(_pretrain_resuming, 4, str(tmp_path / "b"), str(checkpoint), 4, timeout=TIMEOUT_S)
    for losses in resumed:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted[2:]), rtol=RTOL, atol=0)
