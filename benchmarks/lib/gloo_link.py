"""gloo's alpha-beta on this machine, per collective kind, as ``projection.Link`` (run on every rank of a group).

gloo's latency depends on how long its threads slept before a call: a small all_reduce takes about 0.2 ms back to
back and 1.3-4 ms after a matmul (docs/gpu.md, the calibration). So each kind's small collective (8 KiB) is timed
after the link sat idle for each of ``IDLE_S`` (every rank busy computing in between, as in a TP step), giving
``Link.latency_after_idle``; the bus bandwidth comes from a large one (2 MiB) against the small one after 1 ms idle
(ring formulas of projection.py, bytes of the full tensor). Each point is the mean over ``repeats`` calls of the
slowest rank's time per call: a step's communication is the sum of many collectives, so the projection needs each
one's expected time, and gloo's wake-up makes that distribution bimodal (~0.2 ms or ~3-4 ms, a scheduler tick): its
median flips between the modes from run to run (an 8 KiB all_reduce after 1 ms idle: 1.35 ms in one run, 2.51 ms
in the next), which put the decode step's prediction 28 % over the measured step.

``python -m benchmarks.projection.gloo_link`` under torchrun prints the table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.lib.alpha_beta import KINDS, Link
from benchmarks.lib.harness import slowest_rank

SMALL, LARGE = 8 << 10, 2 << 20  # bytes of the full tensor
#: idle times of the link before a small collective (seconds); the bandwidth is measured after BANDWIDTH_IDLE_S
IDLE_S, BANDWIDTH_IDLE_S = (0.0, 0.5e-3, 1e-3, 2e-3, 4e-3, 16e-3), 1e-3


def _collective(kind: str, nbytes: int) -> Callable[[], None]:
    """One ``kind`` of a full tensor of ``nbytes`` float32 bytes over the default group."""
    n = dist.get_world_size()
    numel = nbytes // 4 // n * n
    full, piece = torch.randn(numel), torch.randn(numel // n)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, piece)
    return lambda: dist.reduce_scatter_tensor(piece, full)


def _busy(seconds: float) -> None:
    """Compute (small matmuls) for ``seconds``: the core busy, gloo's threads idle."""
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def after_idle_s(step: Callable[[], None], idle_s: float, repeats: int) -> float:
    """The mean seconds of ``step`` after the link sat idle ``idle_s`` (a barrier, then compute on every rank;
    each call's slowest rank)."""
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        _busy(idle_s)
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.fmean(slowest_rank(times))


def measure_link(repeats: int = 40) -> Link:
    """gloo's Link on this machine and group (every rank calls it)."""
    n = dist.get_world_size()
    latency, bandwidth, idle, sources = {}, {}, {}, {}
    for kind in KINDS:
        small = {gap: after_idle_s(_collective(kind, SMALL), gap, repeats) for gap in IDLE_S}
        large = after_idle_s(_collective(kind, LARGE), BANDWIDTH_IDLE_S, repeats)
        factor = (2 if kind == "all_reduce" else 1) * (n - 1) / n
        base = small[BANDWIDTH_IDLE_S]
        bandwidth[kind] = factor * (LARGE - SMALL) / max(large - base, 1e-4)  # noise: at most ~20 GB/s
        transfer = factor * SMALL / bandwidth[kind]
        idle[kind] = tuple((gap, max(t - transfer, 0.0)) for gap, t in sorted(small.items()))
        latency[kind] = max(base - transfer, 0.0)
        sources[kind] = (f"measured here: {kind} of {SMALL >> 10} KiB after " +
                         ", ".join(f"{g * 1e3:g}" for g in IDLE_S) + " ms idle: " +
                         " / ".join(f"{t * 1e3:.2f}" for _, t in sorted(small.items())) +
                         f" ms; of {LARGE >> 20} MiB after {BANDWIDTH_IDLE_S * 1e3:g} ms: {large * 1e3:.2f} ms "
                         f"(means of {repeats} calls, each call's slowest rank)")
    return Link(f"gloo on this machine, {n} ranks", latency, bandwidth, sources, idle)
