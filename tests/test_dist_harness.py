"""Tests of the multi-process harness in tests/dist.py (kept fast: no thunder here)."""

import os
import socket
import time

import pytest
import torch

from tests import dist
from tests.dist import RanksFailed, assert_close, free_port, run_ranks

# -- functions run on the ranks (module level, so workers can import them) -----


def _whoami(tag, *, scale=1):
    import torch.distributed as tdist

    return {
        "rank": tdist.get_rank(),
        "world_size": tdist.get_world_size(),
        "tag": tag * scale,
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "backend": tdist.get_backend(),
        "pid": os.getpid(),
    }


def _all_reduce_ranks():
    import torch.distributed as tdist

    torch.manual_seed(0)
    t = torch.full((3,), float(tdist.get_rank()))
    tdist.all_reduce(t)
    return t


def _fail_on_rank_1_while_rank_0_waits():
    import torch.distributed as tdist

    if tdist.get_rank() == 1:
        raise ValueError("boom on purpose")
    t = torch.ones(1)
    tdist.all_reduce(t)  # never completes: rank 1 does not join
    return t


def _fail_everywhere():
    import torch.distributed as tdist

    raise KeyError(f"no such thing on rank {tdist.get_rank()}")


def _sleep(seconds):
    time.sleep(seconds)


def _set_float64_and_no_grad():
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return os.getpid()


def _defaults():
    return os.getpid(), torch.get_default_dtype(), torch.is_grad_enabled()


def _assert_close_on_rank():
    import torch.distributed as tdist

    x = torch.zeros(2)
    if tdist.get_rank() == 1:
        x[0] = 1.0
    assert_close(x, torch.zeros(2), name="weight")


# -- tests ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_in_rank_order_and_worker_setup(world_size):
    out = run_ranks(_whoami, world_size, "ab", scale=2)
    assert [o["rank"] for o in out] == list(range(world_size))
    for o in out:
        assert o["world_size"] == world_size
        assert o["tag"] == "abab"
        assert o["omp"] == "1"
        assert o["threads"] == 1
        assert o["backend"] == "gloo"
    # the pool is persistent: same processes on the next call
    again = run_ranks(_whoami, world_size, "x")
    assert [o["pid"] for o in again] == [o["pid"] for o in out]
    assert len({o["pid"] for o in out}) == world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce(world_size):
    out = run_ranks(_all_reduce_ranks, world_size)
    expected = torch.full((3,), float(sum(range(world_size))))
    assert len(out) == world_size
    for t in out:
        assert_close(t, expected)


def test_failure_with_stuck_rank_reports_and_recovers(monkeypatch):
    monkeypatch.setattr(dist, "FAILURE_GRACE_S", 2.0)
    pids_before = dist._pool_pids(2) or [o["pid"] for o in run_ranks(_whoami, 2, "")]

    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_fail_on_rank_1_while_rank_0_waits, 2)
    elapsed = time.monotonic() - t0
    assert elapsed < 20, f"took {elapsed:.1f} s"

    msg = str(excinfo.value)
    assert "_fail_on_rank_1_while_rank_0_waits" in msg
    assert "rank 1: ValueError: boom on purpose" in msg
    assert "Traceback (most recent call last)" in msg
    assert "rank 0" in msg and "stuck" in msg
    assert set(excinfo.value.errors) == {0, 1}
    assert "all_reduce" in excinfo.value.errors[0]  # faulthandler stack of the stuck rank
    assert isinstance(excinfo.value, AssertionError)

    # the pool was killed and is recreated on next use
    out = run_ranks(_all_reduce_ranks, 2)
    assert_close(out[0], torch.ones(3))
    assert set(dist._pool_pids(2)).isdisjoint(pids_before)


def test_failure_on_all_ranks_keeps_pool():
    pids_before = [o["pid"] for o in run_ranks(_whoami, 2, "")]
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_fail_everywhere, 2)
    assert set(excinfo.value.errors) == {0, 1}
    assert "KeyError: 'no such thing on rank 1'" in str(excinfo.value)
    # every rank answered and the post-task barrier succeeded: same processes
    assert [o["pid"] for o in run_ranks(_whoami, 2, "")] == pids_before


def test_timeout_kills_and_recreates_pool():
    pids_before = [o["pid"] for o in run_ranks(_whoami, 2, "")]
    with pytest.raises(RanksFailed, match="timed out after 1 s") as excinfo:
        run_ranks(_sleep, 2, 60, timeout=1)
    assert "_sleep" in excinfo.value.errors[0]
    out = run_ranks(_whoami, 2, "")
    assert set(o["pid"] for o in out).isdisjoint(pids_before)


def test_a_task_does_not_leak_its_defaults_into_the_next():
    """A test body's torch.set_default_dtype on a rank ends with its task (litgpt's default init draws other
    numbers in float64: the next test on the same rank would build another model)."""
    pids = run_ranks(_set_float64_and_no_grad, 2)
    assert run_ranks(_defaults, 2) == [(pid, torch.float32, True) for pid in pids]  # the same processes, reset


def test_assert_close_names_tensor_and_rank():
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_assert_close_on_rank, 2)
    assert set(excinfo.value.errors) == {1}
    assert "weight (rank 1):" in excinfo.value.errors[1]


def test_assert_close_local():
    assert_close(torch.ones(2), torch.ones(2) + 1e-8, name="x")
    with pytest.raises(AssertionError, match="^bias: "):
        assert_close(torch.ones(2), torch.zeros(2), name="bias")


def test_unpicklable_fn_is_rejected_in_parent():
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda: 0, 2)


def test_free_port():
    port = free_port()
    assert isinstance(port, int) and 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))

