"""The projection checked where it can run: predicted from gloo's alpha-beta (each kind's small collective after the
link sat idle, docs/gpu.md) and a rank's compute alone, against the real 2-rank gloo step here.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.projection.calibrate --json_path calibration.json
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.projection.calibrate --workloads ""  # the link alone
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.lib import harness, llama
from benchmarks.lib.alpha_beta import KINDS, Link, project_step
from benchmarks.lib.modes import MODES, How, llama_on_meta, tp_decode, unstepped

CPU = torch.device("cpu")
#: the training Llama's flags (LlamaConfig fields)
DIMS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "ffn_hidden")
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
    """The mean seconds of ``step`` after the link sat idle ``idle_s`` (a barrier, then compute on every rank)."""
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        _busy(idle_s)
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.fmean(harness.slowest_rank(times))


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.options(__doc__)
    cfg = llama.LlamaConfig()
    for f in DIMS:
        p.add_argument(f"--{f}", type=int, default=getattr(cfg, f), help="training Llama (lib/llama.py's defaults)")
    for name, default in (("batch", 4), ("seq", 256), ("steps", 10), ("warmup", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--plan", choices=["tp", "tp_lp", "tp_sp"], default="tp_lp")
    p.add_argument("--workloads", default="training,decode", help="'': gloo's alpha-beta alone")
    p.add_argument("--executors", choices=list(harness.EXECUTORS), default="thunder")
    p.add_argument("--tolerance", type=float, default=0.25)
    return p.parse_args(argv)


def training_config(args: argparse.Namespace) -> llama.LlamaConfig:
    return llama.LlamaConfig(**{k: getattr(args, k) for k in DIMS}, max_seq=args.seq)


def training_module(args: argparse.Namespace, alone: bool) -> torch.nn.Module:
    """The registry's mode of ``--plan`` on the Llama: meta-built with random weights (alone), or seeded."""
    cfg = training_config(args)
    model = (llama_on_meta(cfg, torch.float32) if alone
             else harness.seeded_model(lambda: llama.WithLoss(llama.Llama(cfg)), 0))
    return MODES[args.plan].wrap(model, How(harness.EXECUTORS[args.executors], materialize=CPU if alone else None))


def decode_module(gen: argparse.Namespace, alone: bool) -> torch.nn.Module:
    """bench_generate.py's tp mode: meta-built with random weights, through a DecodeStep (alone), or seeded."""
    if not alone:
        return MODES["tp"].wrap(llama.set_cache(llama.new_gpt(gen, CPU), gen, CPU), How(harness.EXECUTORS[gen.compile]))
    strategy = "bound" if gen.compile == "thunder_default" else "compiled"
    how = How(harness.EXECUTORS[gen.compile], materialize=CPU)
    return tp_decode(llama.decode_config(gen), _position(gen), gen.batch, torch.float32, how, strategy)


def _position(gen: argparse.Namespace) -> int:
    """The decoded token's position: the last slot of bench_generate's cache (prompt + new tokens)."""
    return gen.prompt_len + gen.new_tokens - 1


def measure(workload: str, args: argparse.Namespace, gen: argparse.Namespace, alone: bool) -> dict:
    """One workload's medians (alone: with its final traces; in the group: the slowest rank's step)."""
    barrier = (lambda: None) if alone else dist.barrier
    if workload == "training":
        jm = training_module(args, alone)
        optimizer = torch.optim.SGD(jm.parameters(), lr=1e-2)
        batch = harness.random_batch(args.batch, args.seq, args.vocab, 1234, CPU)
        result = harness.timed_training(jm, batch, optimizer, args.steps, args.warmup, CPU, barrier)
    else:
        jm = decode_module(gen, alone)
        result = harness.timed_decode(jm, gen.batch, _position(gen), args.steps, args.warmup, CPU, barrier)
    if alone:
        result.update(harness.thunder_structure(unstepped(jm)))
    else:
        result["step_s"] = statistics.median(harness.slowest_rank([s["step_s"] for s in result["samples"]]))
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
    gen = llama.generate_args(["--compile", args.executors])
    workloads = [w for w in args.workloads.split(",") if w]
    torch.set_num_threads(1)
    harness.pin_to_core()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with thunder_tp.one_rank(world, rank, "cpu"):
        alone = {w: measure(w, args, gen, alone=True) for w in workloads}
    harness.init_distributed(timeout_s=600)
    link = measure_link()
    real = {w: measure(w, args, gen, alone=False) for w in workloads}
    rows = {w: {**predict(w, alone[w], link), "measured_s": real[w]["step_s"]} for w in workloads}
    for row in rows.values():
        row["error_no_overlap"] = row["no_overlap_s"] / row["measured_s"] - 1
        row["error_overlap"] = row["overlap_s"] / row["measured_s"] - 1
    missed = [w for w, r in rows.items() if abs(r["error_overlap"]) > args.tolerance]
    if rank == 0:
        _print(rows, link, args, world)
        if args.json_path:
            link_json = {"latency_s": link.latency_s, "bus_bytes_per_s": link.bus_bytes_per_s}
            harness.write_json(args.json_path, {"args": vars(args), "decode": vars(gen), "world_size": world,
                                                "link": link_json, "rows": rows})
    dist.barrier()
    dist.destroy_process_group()
    return 1 if missed else 0


def _print(rows: dict, link: Link, args: argparse.Namespace, world: int) -> None:
    print(f"\nCalibration on this machine: {world} gloo ranks, --plan {args.plan}, --executors {args.executors}, "
          f"medians of {args.steps} steps\n")
    print(link.table(), "", sep="\n")
    cells = [[w, *(f"{r[k] * 1e3:.1f}" for k in ("compute_s", "comm_s", "no_overlap_s", "overlap_s", "measured_s")),
              f"{r['error_no_overlap']:+.1%}", f"{r['error_overlap']:+.1%}"] for w, r in rows.items()]
    print(*harness.table("workload | compute alone (ms)> | + communication (ms)> | predicted, no overlap (ms)> | "
                         "predicted, overlap (ms)> | measured (ms)> | error, no overlap> | error, overlap>", cells),
          sep="\n")
    print(f"(within ±{args.tolerance:.0%}: " + ", ".join(
        f"{w} {'yes' if abs(r['error_overlap']) <= args.tolerance else 'NO'}" for w, r in rows.items()) + ")")


if __name__ == "__main__":
    harness.exit_without_teardown(main())
