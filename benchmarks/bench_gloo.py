"""What one collective costs on this host's transport: all_reduce of 8 KiB and of one b*s*h activation (2 MiB),
synchronous and async + wait, and the 16 -> 32 MiB logits all_gather of benchmarks/compare.py's Llama; wall time
and the CPU time of the whole process (gloo's threads included, which run on the rank's own core). Then the 2 MiB
all_reduce right after a matmul (as in a TP forward) with gloo's threads at the default scheduling and at SCHED_FIFO 1
(``compare.py --transport_threads fifo``), alternating; the second where the process may (CAP_SYS_NICE).

    torchrun --nproc-per-node 2 -m benchmarks.bench_gloo          # each rank pinned to its own core
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from benchmarks.lib.harness import alternating_rounds, set_other_threads_scheduling


def _median_ms(step, repeats: int) -> tuple[float, float]:
    """Median wall and process CPU milliseconds of ``step``."""
    for _ in range(3):
        step()
    walls, cpus = [], []
    for _ in range(repeats):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return sorted(walls)[repeats // 2] * 1e3, sorted(cpus)[repeats // 2] * 1e3


def _after_matmul_ms(activation: torch.Tensor, rounds: int = 3, steps: int = 40) -> dict[str, float]:
    """Median ms of an async all_reduce + wait of ``activation`` right after a matmul, per scheduling of gloo's
    threads (default, and SCHED_FIFO 1 where allowed), alternating round by round; the default put back after."""
    a, b = torch.randn(1024, 512), torch.randn(512, 768)
    policies = {"default": (os.SCHED_OTHER, 0), "SCHED_FIFO 1": (os.SCHED_FIFO, 1)}
    try:
        set_other_threads_scheduling(*policies["SCHED_FIFO 1"])
    except PermissionError:
        del policies["SCHED_FIFO 1"]
    times: dict[str, list[float]] = {name: [] for name in policies}
    for _, name in alternating_rounds(list(policies), rounds):
        set_other_threads_scheduling(*policies[name])
        for _ in range(steps):
            dist.barrier()
            a @ b
            t = time.perf_counter()
            dist.all_reduce(activation, async_op=True).wait()
            times[name].append(time.perf_counter() - t)
    set_other_threads_scheduling(os.SCHED_OTHER)
    return {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}


def main() -> None:
    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    small, activation = torch.randn(2048), torch.randn(4 * 256 * 512)
    logits = torch.randn(4 * 256 * 4096)
    gathered = torch.empty(dist.get_world_size() * logits.numel())
    rows = {
        "all_reduce 8 KiB": lambda: dist.all_reduce(small),
        "all_reduce 2 MiB": lambda: dist.all_reduce(activation),
        "all_reduce 2 MiB, async + wait": lambda: dist.all_reduce(activation, async_op=True).wait(),
        "all_gather 16 MiB per rank": lambda: dist.all_gather_into_tensor(gathered, logits),
    }
    for name, step in rows.items():
        wall, cpu = _median_ms(step, 20)
        if rank == 0:
            print(f"{name}: {wall:.2f} ms, CPU {cpu:.2f} ms (medians of 20)", flush=True)
    after = _after_matmul_ms(activation)
    if rank == 0:
        print("all_reduce 2 MiB right after a matmul, gloo's threads at " +
              ", ".join(f"{name}: {ms:.2f} ms" for name, ms in after.items()) + " (medians of 3 x 40, alternating)",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
