"""Float8 training (torchao) against high precision under TP: benchmark_litgpt's training step, side by side in one run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.bench_float8 --model_name tiny-llama-1.1b \\
        --n_layers 2 --distributed_mode tp_sp --use_torchao_fp8_allgather true --json_path float8.json

The flags are benchmark_litgpt's (``--dtype bfloat16`` unless given) and ``--rounds``: the float8 run is them with
``--use_torchao_fp8_linear true``, the high-precision run them without the float8 flags. Both models are built from
the same seed and jitted as benchmark_litgpt jits them (``--compile``), each runs ``--warmup_iters`` steps, then
``--max_iters - --warmup_iters`` timed steps each, spread over ``--rounds`` rounds in which the two alternate (the
slowest rank's step; medians). Each rank is pinned to its own core, one thread. Printed (rank 0): each run's step,
float8 against high precision, the first steps' losses and the collectives of a step. On the CPU torchao emulates the
float8 gemms (``lib/float8.py``), so the figure is the cost of the casts and an fp32 gemm, not a GPU's.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # ranks compile side by side on few cores

import argparse
import statistics
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from benchmarks.lib.harness import (
    alternating_rounds,
    collectives_lines,
    collectives_per_iteration,
    exit_without_teardown,
    init_distributed,
    pin_to_core,
    steps_per_round,
    time_steps,
    timed,
    train_step,
    write_json,
)
from benchmarks.lib.litgpt_options import parse_args as litgpt_args
from benchmarks.lib.litgpt_setup import Groups, build, make_batch, model_info, resolve_groups


def parse_args(argv: list[str] | None = None) -> tuple[dict[str, argparse.Namespace], int]:
    """The runs' options (name -> benchmark_litgpt's options) and the rounds."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--rounds", type=int, default=5, help="rounds over which the timed steps are spread")
    ours, rest = own.parse_known_args(argv)
    float8 = litgpt_args(["--dtype", "bfloat16", *rest, "--use_torchao_fp8_linear", "true"])
    high = argparse.Namespace(**vars(float8) | {"use_torchao_fp8_linear": False, "use_torchao_fp8_allgather": False})
    return {float8.dtype: high, "float8": float8}, ours.rounds


def prepare(args: argparse.Namespace, groups: Groups, device: torch.device) -> dict:
    """The jitted model, its optimizer and training step on a fixed batch, after ``--warmup_iters`` steps."""
    config, _, jm = build(args, groups, device)
    optimizer = torch.optim.SGD(jm.parameters(), lr=args.learning_rate)
    idx, targets = make_batch(args, model_info(args, config).vocab_size, groups.dp_rank, 0, device)
    step = partial(train_step, jm, optimizer, idx, targets)
    warmup = [timed(step, device) for _ in range(args.warmup_iters)]
    return {"jm": jm, "step": step, "losses": [loss.item() for loss, _ in warmup], "first_step_s": warmup[0][1],
            "times_s": []}


def time_runs(runs: dict[str, dict], steps: int, rounds: int) -> None:
    """``steps`` timed steps of each run, spread over alternating rounds, into its ``times_s``."""
    per_round = steps_per_round(steps, rounds)
    for r, name in alternating_rounds(list(runs), len(per_round)):
        runs[name]["times_s"] += time_steps(runs[name]["step"], per_round[r], distributed=True)[0]


def report(runs: dict[str, dict], args: argparse.Namespace, groups: Groups) -> dict:
    """Each run's figures (printed by rank 0) and float8's step against the high-precision one's."""
    results = {name: {"median_step_ms": statistics.median(run["times_s"]) * 1e3,
                      "step_ms": [t * 1e3 for t in run["times_s"]], "warmup_losses": run["losses"],
                      "first_step_s": run["first_step_s"],
                      "collectives": collectives_per_iteration(run["jm"])["per_iteration"]}
               for name, run in runs.items()}
    high, float8 = results.values()
    ratio = float8["median_step_ms"] / high["median_step_ms"]
    lines = [f"{args.model_name}, {args.n_layers or 'all'} layers, {args.micro_batch_size} x {args.block_size} tokens, "
             f"{args.distributed_mode} (tp {groups.tp_size}, dp {groups.dp_size}), compile {args.compile}, float8 "
             f"recipe {args.torchao_fp8_recipe}, float8 all-gather {args.use_torchao_fp8_allgather}; "
             f"medians of {len(high['step_ms'])} steps each", "",
             "| run | step (ms), median | first steps' losses | first step, compile included (s) |",
             "|---|---:|---|---:|"]
    for name, r in results.items():
        losses = ", ".join(f"{x:.4f}" for x in r["warmup_losses"])
        lines.append(f"| {name} | {r['median_step_ms']:.1f} | {losses} | {r['first_step_s']:.1f} |")
    lines += [f"| float8 / {args.dtype} | {ratio:.3f} | | |", ""]
    for name, r in results.items():
        lines += collectives_lines(r["collectives"], f"{name}: collectives per step")
    if groups.rank == 0:
        print("\n".join(lines), flush=True)
    return {"args": vars(args), "runs": results, "float8_over_high_precision": ratio}


@record  # a failing rank's error and traceback go into torchrun's summary
def main(argv: list[str] | None = None) -> int:
    """Build, warm up and time both runs; 0 on success."""
    options, rounds = parse_args(argv)
    args = options["float8"]
    torch.set_num_threads(1)
    rank, world, device = init_distributed(args.timeout)
    if device.type == "cpu":
        pin_to_core()
    try:
        results = run(options, rounds, rank, world, device)
        if args.json_path and rank == 0:
            write_json(args.json_path, results)
        return 0
    finally:
        dist.destroy_process_group()


def run(options: dict[str, argparse.Namespace], rounds: int, rank: int, world: int, device: torch.device) -> dict:
    """Both runs on this rank, side by side: their figures."""
    args = options["float8"]
    groups = resolve_groups(args, rank, world)
    runs = {name: prepare(run_args, groups, device) for name, run_args in options.items()}
    time_runs(runs, args.max_iters - args.warmup_iters, rounds)
    return report(runs, args, groups)


if __name__ == "__main__":
    exit_without_teardown(main())
