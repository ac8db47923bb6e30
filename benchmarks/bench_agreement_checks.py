"""What TensorParallel's compile-agreement checks cost (``check_collectives`` and ``check_weights``, both on by
default): a litgpt model on 2 ranks, jitted, compiled and stepped once (forward, backward) with both checks and with
neither, alternating, ``--repeats`` fresh jits each, the slowest rank's time, medians; and the checks' own parts,
medians of ``--repeats`` on this rank: the weights' checksums taken at jit (every full parameter), the collectives'
fingerprint of the compiled program's final traces, and the compile agreement's all_gather with the two
fingerprints and without.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.bench_agreement_checks --model pythia-14m
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import thunder
import torch
import torch.distributed as dist
from litgpt import Config

import thunder_tp
from benchmarks.lib.harness import init_distributed, log, random_batch, seeded_model, slowest_rank, timed
from thunder_tp.collectives.calls import collective_calls
from thunder_tp.plans.litgpt import GPTWithLoss
from thunder_tp.runtimes.agreement import gathered
from thunder_tp.runtimes.divergence import SameWeights
from thunder_tp.runtimes.same_collectives import SameCollectives


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="pythia-14m", help="a litgpt config name")
    p.add_argument("--layers", type=int, default=None, help="n_layer (default: the config's)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args(argv)


def first_step(config: Config, checks: bool, batch: tuple, device: torch.device) -> tuple[float, float, object]:
    """A fresh model jitted (s), its first call and backward: compile and step (s); the jitted model."""
    model = seeded_model(lambda: GPTWithLoss(config), 0, device)
    plan = {f"gpt.{k}": v for k, v in thunder_tp.plans.litgpt(model.gpt).items()}
    tensor_parallel = thunder_tp.TensorParallel(plan, check_collectives=checks, check_weights=checks)
    jm, jit_s = timed(lambda: thunder.jit(model, transforms=[tensor_parallel], executors=thunder_tp.executors()),
                      device)
    _, step_s = timed(lambda: jm(*batch).backward(), device)
    return jit_s, step_s, jm


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``fn()`` over ``repeats`` calls."""
    return statistics.median(timed(fn)[1] for _ in range(repeats))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rank, world, device = init_distributed()
    overrides = {"n_layer": args.layers} if args.layers else {}
    config = Config.from_name(args.model, block_size=args.seq, **overrides)
    batch = random_batch(args.rows, args.seq, config.padded_vocab_size, 0, device)
    log(rank, f"{args.model} ({config.n_layer} layers), {world} ranks, {dist.get_backend()}, {device}; "
              f"{args.rows} x {args.seq} tokens; medians of {args.repeats}")
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    jm = first_step(config, True, batch, device)[2]  # warm-up: Inductor's compiles, the first trace of a block
    for _ in range(args.repeats):
        for checks in (True, False):
            jit_s, step_s, jm = first_step(config, checks, batch, device)
            runs[checks].append(tuple(slowest_rank([jit_s, step_s], device)))
    log(rank, "| checks | jit (s) | first call: compile + step (s) |\n|---|---:|---:|")
    for checks, times in runs.items():
        jit_s, step_s = (statistics.median(t[i] for t in times) for i in range(2))
        log(rank, f"| {'both' if checks else 'neither'} | {jit_s:.3f} | {step_s:.3f} |")
    module = seeded_model(lambda: GPTWithLoss(config), 0, device)
    weights = SameWeights(n for n, _ in module.named_parameters())
    checksums_s = median_s(lambda: [weights.saw_whole(n, p.detach()) for n, p in module.named_parameters()],
                           args.repeats)
    traces = (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
    collectives = SameCollectives(dist.group.WORLD)
    fingerprint_s = median_s(lambda: collectives.fingerprint(traces), args.repeats)
    calls = sum(len(collective_calls(t)) for t in traces)
    gather = {width: median_s(lambda width=width: gathered([0] * width, dist.group.WORLD), args.repeats)
              for width in (1, 3)}
    params = sum(p.numel() for p in module.parameters())
    log(rank, f"weights' checksums at jit ({params / 1e6:.1f} M parameters): {checksums_s * 1e3:.1f} ms; "
              f"collectives' fingerprint ({calls} collectives): {fingerprint_s * 1e3:.2f} ms; "
              f"agreement all_gather of 1 / 3 int64s: {gather[1] * 1e3:.2f} / {gather[3] * 1e3:.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
