"""benchmarks/lib/alpha_beta.py: the alpha-beta formulas and the overlap a trace's schedule allows."""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.distributed as dist

import thunder_tp
from benchmarks.lib import alpha_beta as projection
from tests.tp_checks import FAST_EXECUTORS


def _link(latency_s: float = 1e-3, bus_bytes_per_s: float = 1e9):
    kinds = projection.KINDS
    return projection.Link("test", dict.fromkeys(kinds, latency_s), dict.fromkeys(kinds, bus_bytes_per_s))


def test_ring_formulas():
    link = _link()
    assert link.seconds("all_reduce", 8e6, 4) == pytest.approx(1e-3 + 2 * 3 / 4 * 8e-3)
    assert link.seconds("all_gather", 8e6, 4) == pytest.approx(1e-3 + 3 / 4 * 8e-3)
    assert link.seconds("reduce_scatter", 8e6, 8) == pytest.approx(1e-3 + 7 / 8 * 8e-3)
    assert link.seconds("all_reduce", 8e6, 1) == 0.0  # a group of one rank moves nothing


def test_a_shift_is_one_peer_transfer():
    """A decomposed collective's piece (send_recv: one rank's bytes to one peer) at the all_gather's numbers, or at
    its own once given them."""
    link = _link()
    assert link.seconds("send_recv", 8e6, 4) == pytest.approx(1e-3 + 8e-3)
    own = link.overridden("send_recv.latency_us=8")
    assert own.seconds("send_recv", 8e6, 4) == pytest.approx(8e-6 + 8e-3)
    assert own.seconds("all_gather", 8e6, 4) == link.seconds("all_gather", 8e6, 4)
    assert "send_recv" in own.table() and "send_recv" not in link.table()


def test_overrides_and_their_errors():
    link = projection.LINKS["h100_nvlink"].overridden("all_reduce.latency_us=18, all.bus_gbps=350")
    assert link.latency_s["all_reduce"] == pytest.approx(18e-6) and link.latency_s["all_gather"] == pytest.approx(22e-6)
    assert set(link.bus_bytes_per_s.values()) == {350e9}
    assert "command line" in link.table()
    for bad in ("all_reduce=3", "broadcast.latency_us=1", "all_reduce.speed=2", "all_reduce.latency_us=x"):
        with pytest.raises(ValueError, match="--link_override"):
            link.overridden(bad)


def test_extrapolation_through_two_depths():
    assert projection.extrapolate({0: 10.0, 2: 14.0}, 32) == pytest.approx(74.0)
    assert projection.extrapolate({0: 10.0, 1: 4.0}, 2) == 10.0  # a deeper step measured faster: noise, not -2.0


def _mlp_pass_traces() -> dict:
    """Forward and backward final traces of a Colwise -> Rowwise MLP at TP=2 (as rank 1, nothing exchanged): the
    backward all-reduces the input's grad and computes fc1's weight grad before waiting for it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(256, 64, bias=False))
    plan = {"0": thunder_tp.ColwiseParallel(), "2": thunder_tp.RowwiseParallel()}
    with thunder_tp.one_rank(2, 1, device="cpu"):
        jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan)], executors=FAST_EXECUTORS)
        x = torch.randn(32, 64, requires_grad=True)
        jm(x).sum().backward()
        return {"forward": thunder.last_traces(jm)[-1], "backward": thunder.last_backward_traces(jm)[-1]}


def test_overlap_follows_the_schedule():
    assert not dist.is_initialized()
    traces = _mlp_pass_traces()
    link = _link(latency_s=0.5)  # half the pass's compute per collective
    forward = projection.project_pass(traces["forward"], 1.0, link)
    backward = projection.project_pass(traces["backward"], 1.0, link)
    assert [r["kind"] for r in forward.collectives] == ["all_reduce"]
    assert [r["kind"] for r in backward.collectives] == ["all_reduce"]
    # forward: the all_reduce of the output is the last thing: nothing to hide it behind
    assert forward.overlap_s == pytest.approx(forward.no_overlap_s)
    # backward: fc1's weight-grad matmul (half the backward's matmul FLOPs) runs between issue and wait
    assert backward.comm_s == pytest.approx(0.5 + 2 * 1 / 2 * 32 * 64 * 4 / 1e9)
    assert 1.0 < backward.overlap_s < backward.no_overlap_s


def test_runtime_records_are_not_overlapped():
    recorded = projection.RecordedPass([["all_reduce", 2, 1000], ["all_gather", 2, 1000]])
    p = projection.project_pass(recorded, 1.0, _link())
    assert p.overlap_s == p.no_overlap_s == pytest.approx(1.0 + p.comm_s) and len(p.collectives) == 2

