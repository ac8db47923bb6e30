"""benchmarks/lib/breakdown.py on one process: regions, and the matmul kernels Inductor's regions call out to."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from benchmarks.lib import breakdown

thunder = pytest.importorskip("thunder")


def test_matmuls_timed_inside_inductor_regions():
    """Two bias-free linears under thunder_tp's executors (Inductor regions): 2 matmuls in the forward's regions and
    3 in the backward's (two weight grads, one input grad), within their regions' time; a matmul outside a region
    is not counted, and the kernels are put back afterwards."""
    from torch._inductor.select_algorithm import extern_kernels

    import thunder_tp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 32, bias=False))
    jm = thunder.jit(model, executors=thunder_tp.executors())
    x = torch.randn(16, 64)

    def step():
        jm(x).square().sum().backward()
        extern_kernels.mm(x, x.t())  # outside any region: not a region's matmul

    step()
    original_mm = extern_kernels.mm
    b = breakdown.step_breakdown(jm, step, steps=2, distributed=False)
    assert extern_kernels.mm is original_mm
    for phase, expected in (("forward", 2), ("backward", 3)):
        matmuls, regions = b["calls"][f"{phase} matmul"], b["calls"][f"{phase} region"]
        assert matmuls["count"] == expected, (phase, b["calls"])
        assert 0 < matmuls["wall_s"] <= regions["wall_s"], (phase, b["calls"])
    row = breakdown.breakdown_rows("mlp", b)[0]
    assert row.count("|") == breakdown.BREAKDOWN_HEADER.splitlines()[0].count("|"), row
