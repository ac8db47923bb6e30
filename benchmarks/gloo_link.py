"""gloo's alpha-beta on this machine, per collective kind, as ``projection.Link`` (run on every rank of a group).

Each collective is timed right after a matmul of about a millisecond on every rank (as in a TP step, where a
collective follows compute; bench_gloo.py shows gloo's latency after compute is several times its back-to-back
latency), at a small and a large size: the bus bandwidth from the difference, the latency from the small size
(ring formulas of projection.py, bytes of the full tensor). Medians over ``repeats`` per size, the slowest rank's.

    torchrun --nproc-per-node 2 benchmarks/gloo_link.py      # prints the table
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from harness import pin_to_core, slowest_rank
from projection import KINDS, Link

SMALL, LARGE = 8 << 10, 2 << 20  # bytes of the full tensor


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


def after_compute_s(step: Callable[[], None], repeats: int) -> float:
    """The median seconds of ``step`` right after a ~1 ms matmul on every rank (the slowest rank's)."""
    a, b = torch.randn(512, 512), torch.randn(512, 1024)
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        a @ b
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return slowest_rank([statistics.median(times)])[0]


def measure_link(repeats: int = 20) -> Link:
    """gloo's Link on this machine and group (every rank calls it)."""
    n = dist.get_world_size()
    latency, bandwidth, sources = {}, {}, {}
    for kind in KINDS:
        small = after_compute_s(_collective(kind, SMALL), repeats)
        large = after_compute_s(_collective(kind, LARGE), repeats)
        factor = (2 if kind == "all_reduce" else 1) * (n - 1) / n
        bandwidth[kind] = factor * (LARGE - SMALL) / max(large - small, 1e-4)  # noise: at most ~20 GB/s
        latency[kind] = max(small - factor * SMALL / bandwidth[kind], 0.0)
        sources[kind] = (f"measured here: {kind} of {SMALL >> 10} KiB and {LARGE >> 20} MiB after a matmul, "
                         f"{small * 1e3:.2f} / {large * 1e3:.2f} ms (medians of {repeats}, slowest rank)")
    return Link(f"gloo on this machine, {n} ranks", latency, bandwidth, sources)


def main() -> None:
    pin_to_core()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    link = measure_link()
    if dist.get_rank() == 0:
        print(link.table())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
