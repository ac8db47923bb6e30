"""What the default input check costs per training call (TensorParallel's and ThunderTPStrategy's
check_inputs="training"): the fingerprint of a batch of token ids (a checksum of its bytes, on this rank) and the
whole check (the fingerprint and one all_gather of two int64s per rank over the TP group, then the comparison),
back to back and after the link sat idle for a training step's compute (gloo's threads asleep, as between two
steps); the mean over ``--repeats`` calls of each call's slowest rank. On CUDA (NCCL, one GPU per rank) the batch
is on the GPU and the times include the host syncs the check makes.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.bench_input_check
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

from benchmarks.lib.gloo_link import after_idle_s
from benchmarks.lib.harness import init_distributed, log, pin_to_core
from thunder_tp.runtimes.divergence import InputAgreement, fingerprint

#: batches of token ids (rows, tokens): a decode-sized call, litgpt pretrain's micro-batch at 2k, a large one
SHAPES = ((1, 256), (4, 2048), (16, 4096))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--step_ms", type=float, default=100.0, help="idle time before a call: a training step's compute")
    args = p.parse_args()
    pin_to_core()
    torch.set_num_threads(1)
    rank, world, device = init_distributed()
    agreement = InputAgreement(dist.group.WORLD)
    log(rank, f"{world} ranks, {dist.get_backend()}, {device}; means of {args.repeats} calls, each call's slowest rank")
    log(rank, "| batch (int64 token ids) | fingerprint (ms) | check, back to back (ms) | "
              f"check after {args.step_ms:g} ms of compute (ms) |")
    log(rank, "|---|---:|---:|---:|")
    for rows, tokens in SHAPES:
        idx = torch.randint(0, 50_000, (rows, tokens), device=device)
        dist.broadcast(idx, 0)
        local = after_idle_s(functools.partial(fingerprint, (idx,), {}), 0.0, args.repeats)
        check = functools.partial(agreement.check, (idx,), {})
        awake, asleep = (after_idle_s(check, idle_s, args.repeats) for idle_s in (0.0, args.step_ms / 1e3))
        log(rank, f"| {rows} x {tokens} | {local * 1e3:.3f} | {awake * 1e3:.3f} | {asleep * 1e3:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
