"""The projection checked where it can run: predicted from gloo's alpha-beta and the compute of a rank alone, against
the real 2-rank gloo step on this machine.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.projection.calibrate --json_path calibration.json

Workloads: compare.py's Llama training step (llama.py at compare.py's default dims, batch 4 x seq 256, fp32, forward
+ cross-entropy + backward + SGD; thunder_tp's plan ``--plan``: tp, tp_lp or tp_sp) and bench_generate.py's
thunder_tp decode step (its default llama, fp32, batch 1; one token with ``prompt_len + new_tokens - 1`` positions
cached). Each rank, pinned to its own core as in compare.py:
1. alone, as its rank of a fake group of 2 (``thunder_tp.one_rank``; built on the meta device, random weights): the
   medians of the forward, backward and optimizer (decode: the step) and the final traces; both ranks at once, so
   they share the machine as the real run does;
2. in the real gloo group: gloo's alpha-beta per kind (``gloo_link.py``: each collective after a matmul), then the
   same program's real steps (a barrier before each; the slowest rank's).
Printed: the prediction without and with overlap (``projection.py``) against the measured median, and the error.
Exit 1 where the overlap prediction misses by more than ``--tolerance``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse
import statistics

import torch
import torch.distributed as dist

from benchmarks.lib.alpha_beta import Link, project_step
from benchmarks.lib.gloo_link import measure_link
from benchmarks.lib.harness import (
    EXECUTORS,
    exit_without_teardown,
    init_distributed,
    options,
    pin_to_core,
    random_batch,
    seeded_model,
    slowest_rank,
    write_json,
)
from benchmarks.lib.llama import (
    Llama,
    LlamaConfig,
    WithLoss,
    decode_config,
    generate_args,
    new_gpt,
    set_cache,
)
from benchmarks.lib.modes import MODES, How, llama_on_meta, tp_decode
from benchmarks.lib.rank_timing import thunder_structure, timed_decode, timed_training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options(__doc__)
    cfg = LlamaConfig()
    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "ffn_hidden"):
        p.add_argument(f"--{f}", type=int, default=getattr(cfg, f), help="training Llama (compare.py's defaults)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--plan", choices=["tp", "tp_lp", "tp_sp"], default="tp_lp")
    p.add_argument("--decode_args", default="", help="bench_generate.py's flags for the decode model (quoted)")
    p.add_argument("--workloads", default="training,decode")
    p.add_argument("--executors", choices=list(EXECUTORS), default="thunder")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--link_repeats", type=int, default=40)
    p.add_argument("--tolerance", type=float, default=0.25)
    return p.parse_args(argv)


# --- the programs ---------------------------------------------------------------------------------------------


def training_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                       vocab=args.vocab, ffn_hidden=args.ffn_hidden, max_seq=args.seq)


def training_module(args: argparse.Namespace, alone: bool) -> torch.nn.Module:
    """The registry's mode of ``--plan`` on the Llama: built on the meta device with random weights (alone), or
    seeded."""
    cfg, device = training_config(args), torch.device("cpu")
    model = llama_on_meta(cfg, torch.float32) if alone else seeded_model(lambda: WithLoss(Llama(cfg)), 0)
    return MODES[args.plan].wrap(model, How(EXECUTORS[args.executors], materialize=device if alone else None))


def decode_module(gen: argparse.Namespace, alone: bool) -> torch.nn.Module:
    """bench_generate.py's tp mode: meta-built with random weights, through a DecodeStep (alone), or seeded."""
    device = torch.device("cpu")
    if not alone:
        return MODES["tp"].wrap(set_cache(new_gpt(gen, device), gen, device), How(EXECUTORS[gen.compile]))
    strategy = "bound" if gen.compile == "thunder_default" else "compiled"
    how = How(EXECUTORS[gen.compile], materialize=device)
    return tp_decode(decode_config(gen), _position(gen), gen.batch, torch.float32, how, strategy)


def _position(gen: argparse.Namespace) -> int:
    """The decoded token's position: the last slot of bench_generate's cache (prompt + new tokens)."""
    return gen.prompt_len + gen.new_tokens - 1


# --- measuring ------------------------------------------------------------------------------------------------


def measure(workload: str, args: argparse.Namespace, gen: argparse.Namespace, alone: bool) -> dict:
    """One workload's medians (alone: with its final traces; in the group: the slowest rank's step)."""
    barrier = (lambda: None) if alone else dist.barrier
    if workload == "training":
        jm = training_module(args, alone)
        optimizer = torch.optim.SGD(jm.parameters(), lr=1e-2)
        batch = random_batch(args.batch, args.seq, args.vocab, 1234, torch.device("cpu"))
        result = timed_training(jm, batch, optimizer, args.steps, args.warmup, torch.device("cpu"), barrier)
    else:
        jm = decode_module(gen, alone)
        result = timed_decode(jm, gen.batch, _position(gen), args.steps, args.warmup, torch.device("cpu"), barrier)
    if alone:
        result.update(thunder_structure(jm))
    else:
        result["step_s"] = statistics.median(slowest_rank([s["step_s"] for s in result["samples"]]))
    return result


def predict(workload: str, alone: dict, link: Link) -> dict:
    """The projected step on ``link`` from the rank's compute alone and its final traces."""
    if workload == "training":
        compute = {"forward": alone["forward_s"], "backward": alone["backward_s"]}
        step = project_step(alone["traces"], compute, link, other_s=alone["optimizer_s"])
    else:
        step = project_step(alone["traces"], {"forward": alone["step_s"]}, link)
    return {"compute_s": alone["step_s"], "comm_s": step.comm_s, "no_overlap_s": step.no_overlap_s,
            "overlap_s": step.overlap_s}


def main(argv: list[str] | None = None) -> int:
    """Measure alone, then in the group; print predicted against measured (rank 0); 1 where a prediction misses."""
    import thunder_tp

    args = parse_args(argv)
    gen = generate_args(args.decode_args.split() + ["--compile", args.executors])
    workloads = [w for w in args.workloads.split(",") if w]
    torch.set_num_threads(1)
    pin_to_core()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with thunder_tp.one_rank(world, rank, "cpu"):
        alone = {w: measure(w, args, gen, alone=True) for w in workloads}
    init_distributed(timeout_s=600)
    link = measure_link(args.link_repeats)
    real = {w: measure(w, args, gen, alone=False) for w in workloads}
    rows = {w: {**predict(w, alone[w], link), "measured_s": real[w]["step_s"]} for w in workloads}
    for row in rows.values():
        row["error_no_overlap"] = row["no_overlap_s"] / row["measured_s"] - 1
        row["error_overlap"] = row["overlap_s"] / row["measured_s"] - 1
    missed = [w for w, r in rows.items() if abs(r["error_overlap"]) > args.tolerance]
    if rank == 0:
        _print(rows, link, args, world)
        if args.json_path:
            write_json(args.json_path, {"args": vars(args), "decode_args": vars(gen), "world_size": world,
                                        "link": {"latency_s": link.latency_s, "bus_bytes_per_s": link.bus_bytes_per_s},
                                        "rows": rows})
    dist.barrier()
    dist.destroy_process_group()
    return 1 if missed else 0


def _print(rows: dict, link: Link, args: argparse.Namespace, world: int) -> None:
    print(f"\nCalibration on this machine: {world} gloo ranks, --plan {args.plan}, --executors {args.executors}, "
          f"medians of {args.steps} steps\n")
    print(link.table(), "", sep="\n")
    print("| workload | compute alone (ms) | + communication (ms) | predicted, no overlap (ms) | predicted, overlap "
          "(ms) | measured (ms) | error, no overlap | error, overlap |", "|---|---:|---:|---:|---:|---:|---:|---:|",
          sep="\n")
    for w, r in rows.items():
        print(f"| {w} | {r['compute_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | {r['no_overlap_s'] * 1e3:.1f} | "
              f"{r['overlap_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {r['error_no_overlap']:+.1%} | "
              f"{r['error_overlap']:+.1%} |")
    print(f"(within ±{args.tolerance:.0%}: " + ", ".join(
        f"{w} {'yes' if abs(r['error_overlap']) <= args.tolerance else 'NO'}" for w, r in rows.items()) + ")")


if __name__ == "__main__":
    exit_without_teardown(main())
