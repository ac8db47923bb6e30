"""Per-region wall time of a thunder_tp HF step (2 ranks): each fusion region, attention kernel and collective wait
of the final traces wrapped with a timer; rank 0 prints the regions by total time, with what each one computes.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.region_times [--loss_parallel 1] [--steps 6]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from benchmarks.lib.breakdown import _compiled, _unwrapped
from benchmarks.compare_hf import build, save_model, step
from benchmarks.lib.harness import exit_without_teardown, init_distributed, pin_to_core, random_batch
from benchmarks.lib.litgpt_setup import HF_SIZES


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--loss_parallel", type=int, default=0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--n_layers", type=int, default=HF_SIZES["num_hidden_layers"])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    pin_to_core()
    rank, _, device = init_distributed()
    torch.set_num_threads(1)
    directory = save_model(args, rank)
    idx, targets = random_batch(args.batch, args.seq, HF_SIZES["vocab_size"], 0, device)
    idx, targets = idx.contiguous(), targets.contiguous()
    module = build("thunder_tp_lp" if args.loss_parallel else "thunder_tp", directory, "thunder")
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    for _ in range(3):
        step(module, optimizer, idx, targets)
    times: dict[str, list[float]] = defaultdict(list)
    what: dict[str, str] = {}
    restore = []
    for phase, fn, trace in _compiled(module):
        namespace = _unwrapped(fn).__globals__
        for bsym in trace.bound_symbols:
            name = bsym.sym.name
            if name not in namespace or not callable(namespace[name]) or name in ("clear_mutable_collection",):
                continue
            key = f"{phase[:3]}:{name}"
            if bsym.sym.is_fusion:
                ops = [s.sym.name for s in bsym.subsymbols]
                what[key] = f"{len(ops)} ops: " + ",".join(sorted(set(ops)))[:150]
            original = namespace[name]
            if getattr(original, "_timed", False):
                continue

            def timed(*a, _f=original, _k=key, **k):
                t = time.perf_counter()
                out = _f(*a, **k)
                times[_k].append(time.perf_counter() - t)
                return out

            timed._timed = True
            namespace[name] = timed
            restore.append((namespace, name, original))
    steps = []
    for _ in range(args.steps):
        dist.barrier()
        t = time.perf_counter()
        step(module, optimizer, idx, targets)
        steps.append(time.perf_counter() - t)
    for namespace, name, original in restore:
        namespace[name] = original
    if rank == 0:
        total = {k: sum(v) / args.steps for k, v in times.items()}
        print(f"step median {1000 * statistics.median(steps):.1f} ms; timed calls {1000 * sum(total.values()):.1f} ms")
        for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:40]:
            print(f"{1000 * v:8.2f} ms  {len(times[k]) / args.steps:.0f}x  {k}  {what.get(k, '')}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
