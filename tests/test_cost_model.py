"""thunder_tp/costs.py is the one cost model: its tables feed every price (the overlap decision's Costs for NCCL and
gloo, the automatic plan's collective_cost, the projection's LINKS), and the prices are those from before the tables
moved there (pinned on a handful of inputs: the plan search's choices, overlap's decisions and the projection's
figures follow from them).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.lib import alpha_beta
from thunder_tp import costs
from thunder_tp.collectives.reshard import collective_cost
from thunder_tp.execution.overlap_cost import Linears, device_costs, gather_pays, reduce_chunks, scatter_pays
from thunder_tp.rewriting import communication


@pytest.mark.parametrize(("backend", "device_type", "dtype", "link", "device"), [
    ("nccl", "cuda", torch.bfloat16, "h100_nvlink", "h100_sxm"),
    ("nccl", "cuda", torch.float32, "h100_nvlink", "h100_sxm"),
    ("gloo", "cpu", torch.float32, "cpu_gloo", "cpu_core"),
    ("gloo", "cpu", torch.float64, "cpu_gloo", "cpu_core"),
    ("fake", "cuda", torch.float16, "h100_nvlink", "h100_sxm"),  # another backend: the device's usual link
    ("fake", "meta", torch.int8, "cpu_gloo", "cpu_core"),
])
def test_overlap_costs_are_the_tables(backend: str, device_type: str, dtype: torch.dtype, link: str, device: str):
    c, lf, df = device_costs(backend, device_type, dtype), costs.LINKS[link], costs.DEVICES[device]
    assert (c.latency_s, c.bus_bytes_per_s, c.concurrent) == (lf.latency_s, lf.bus_bytes_per_s, lf.concurrent)
    assert (c.flops_per_s, c.matmul_call_s, c.tile, c.units) == (df.matmul_rate(dtype), df.matmul_call_s, df.tile,
                                                                  df.units)


def test_overlap_reads_the_tables_when_it_decides(monkeypatch):
    slower = dataclasses.replace(costs.LINKS["cpu_gloo"], latency_s=5e-3)
    monkeypatch.setitem(costs.LINKS, "cpu_gloo", slower)
    assert device_costs("gloo", "cpu", torch.float32).latency_s == 5e-3


def test_the_plan_prices_a_call_at_the_tables_alpha_bytes():
    assert communication.ALPHA_BYTES == costs.ALPHA_BYTES
    assert collective_cost("all_gather", 0, 4) == costs.ALPHA_BYTES


@pytest.mark.parametrize("name", ["h100_nvlink", "h100_nvlink_graph"])
def test_projection_links_are_the_tables(name: str):
    link, figures = alpha_beta.LINKS[name], costs.LINKS[name]
    assert link.name == figures.description and link.sources["all_reduce"] == figures.source
    assert set(link.latency_s.values()) == {figures.latency_s}
    assert set(link.bus_bytes_per_s.values()) == {figures.bus_bytes_per_s}


def test_every_figure_names_its_source():
    for figures in (*costs.LINKS.values(), *costs.DEVICES.values()):
        assert figures.description and figures.source, figures


# --- the prices before the tables moved, pinned ------------------------------------------------------------------

PLAN_PRICES = [(("all_reduce", 2**20, 4), 1638400.0), (("all_gather", 1000, 3), 66202.66666666667),
               (("reduce_scatter", 3 * 2**24 + 7, 8), 44105734.125), (("all_to_all", 2**20, 8), 180224.0)]


@pytest.mark.parametrize(("args", "want"), PLAN_PRICES)
def test_plan_prices_are_unchanged(args: tuple, want: float):
    assert collective_cost(*args) == pytest.approx(want, rel=1e-12)


MLP = Linears(8192, ((4096, 7168), (4096, 7168)))  # Llama-3-8B's up / gate at TP 2
TINY = Linears(32, ((32, 64),))
#: (backend, device type, dtype, linears, size): an all_reduce's seconds, whether a gather / a scatter pays, the
#: forward all_reduce's chunks
OVERLAP_DECISIONS = [
    (("nccl", "cuda", torch.bfloat16, MLP, 2), (0.0002033753081081081, True, True, 4)),
    (("nccl", "cuda", torch.bfloat16, MLP, 8), (0.0003394067891891892, False, False, 4)),
    (("gloo", "cpu", torch.float32, TINY, 2), (0.00100256, False, False, 1)),
]


@pytest.mark.parametrize(("args", "want"), OVERLAP_DECISIONS)
def test_overlap_decisions_are_unchanged(args: tuple, want: tuple):
    backend, device_type, dtype, linears, size = args
    c, nbytes = device_costs(backend, device_type, dtype), linears.rows * linears.shapes[0][0] * 2
    got = (c.collective_s("all_reduce", nbytes, size), gather_pays(c, size, nbytes, linears),
           scatter_pays(c, size, nbytes, linears),
           reduce_chunks(c, size, nbytes, linears, backward=False, at_least_two=False))
    assert got[0] == pytest.approx(want[0], rel=1e-12) and got[1:] == want[1:]


PROJECTED_SECONDS = [(("h100_nvlink", "all_reduce", 2**20, 8), 2.695948108108108e-05),
                     (("h100_nvlink_graph", "all_gather", 4096, 2), 1.8005535135135136e-05),
                     (("h100_nvlink", alpha_beta.SEND_RECV, 3 * 2**26, 4), 0.0005661259243243243)]


@pytest.mark.parametrize(("args", "want"), PROJECTED_SECONDS)
def test_projected_seconds_are_unchanged(args: tuple, want: float):
    name, kind, nbytes, size = args
    assert alpha_beta.LINKS[name].seconds(kind, nbytes, size) == pytest.approx(want, rel=1e-12)
