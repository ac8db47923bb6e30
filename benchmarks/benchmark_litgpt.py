"""The trainer: a litgpt GPT under a mode of ``lib/modes.py``, flags as Thunder's benchmark_litgpt.

    torchrun --nproc-per-node 2 -m benchmarks.benchmark_litgpt --model_name pythia-14m --distributed_mode tp
    torchrun --nproc-per-node 2 -m benchmarks.benchmark_litgpt --compare thunder,tp,dtensor_tp   # side by side
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # ranks compile side by side on few cores

import argparse
import contextlib
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

from benchmarks.lib import harness, litgpt_setup
from benchmarks.lib.litgpt_options import parse_args
from benchmarks.lib.side_by_side import compare, compare_process

# the benchmark


def train(args: argparse.Namespace, groups: litgpt_setup.Groups, device: torch.device, jm: nn.Module,
          vocab: int) -> tuple[list[float], list[float], int | None]:
    """``--max_iters`` SGD iterations (checkpoints loaded first, saved last): losses, the slowest rank's times, the
    last one's memory (``--measure_step_memory``)."""
    import thunder_tp.checkpoint as ck
    optimizer = torch.optim.SGD(jm.parameters(), lr=args.learning_rate)
    if args.checkpoint:  # pretrained weights (a file), then --resume's model and optimizer (a DCP directory)
        ck.load(args.checkpoint, jm)
    if args.resume:
        ck.load(args.resume, jm, optimizer)
    steps = litgpt_setup.accumulation_steps(args, groups.dp_size)
    losses, times, step_bytes = [], [], None
    for it in range(args.max_iters):
        rows = steps * args.micro_batch_size
        idx, targets = litgpt_setup.make_batch(args, vocab, groups.dp_rank, it, device, rows=rows)
        # gradients accumulate over the micro-batches; timed waits for the device's work
        step = partial(harness.timed, partial(harness.train_step, jm, optimizer, idx, targets, args.micro_batch_size),
                       device)
        if args.measure_step_memory and it == args.max_iters - 1:
            (loss, dt), step_bytes = with_step_memory(step)
        else:
            loss, dt = step()
        losses.append(loss.item())
        times.append(dt)
        tag = " (warm-up)" if it < args.warmup_iters else ""
        harness.log(groups.rank, f"iter {it}: loss {losses[-1]:.4f}, iter time: {dt * 1000:.2f} ms{tag}")
    if args.save_checkpoint:
        ck.save(args.save_checkpoint, jm, optimizer)
        harness.log(groups.rank, f"checkpoint saved to {args.save_checkpoint}")
    return losses, harness.slowest_rank(times, device), step_bytes


def with_step_memory(step: Callable[[], Any]) -> tuple[Any, int | None]:
    """``step()`` and the memory it needed above what was live before it (``harness.peak_step_bytes``)."""
    results = []
    peak = harness.peak_step_bytes(lambda: results.append(step()))
    return results[0], peak


@record  # a failing rank's error and traceback go into torchrun's summary
def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or ``--simulate`` dry run); 0 on success."""
    args = parse_args(argv)
    if args.simulate:
        return simulate_dry_run(args)
    with compare_process(args) if args.compare else contextlib.nullcontext():
        rank, world, device = harness.init_distributed(args.timeout)
        try:
            return (compare if args.compare else run)(args, rank, world, device)
        finally:
            dist.destroy_process_group()


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    """Build, train and report on this rank."""
    groups = litgpt_setup.resolve_groups(args, rank, world)
    config, model, jm = litgpt_setup.build(args, groups, device)
    params, local = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in jm.parameters())
    harness.log(rank, f"model {config.name}: {config.n_layer} layers, n_embd {config.n_embd}, vocab "
                      f"{config.padded_vocab_size}, "
                      f"{params} parameters ({local} on rank 0); block_size {args.block_size}, micro_batch_size "
                      f"{args.micro_batch_size}; world {world}, tp {groups.tp_size}, cp {groups.cp_size}, dp "
                      f"{groups.dp_size}; mode {args.distributed_mode}, compile {args.compile}, loss_parallel "
                      f"{args.loss_parallel}, device {device}")
    losses, times, step_bytes = train(args, groups, device, jm, config.padded_vocab_size)
    if not all(math.isfinite(x) for x in losses):
        harness.log(rank, f"ERROR: non-finite loss: {losses}")
        return 1
    timed_times = times[args.warmup_iters:]
    avg_s = sum(timed_times) / len(timed_times)
    steps = litgpt_setup.accumulation_steps(args, groups.dp_size)
    tokens_per_iter = steps * args.micro_batch_size * args.block_size * groups.dp_size
    fp8, cp = args.use_torchao_fp8_linear, groups.cp_size > 1
    results: dict[str, Any] = {k: getattr(args, k) for k in (
        "block_size", "micro_batch_size", "checkpoint_activations", "dtype", "distributed_mode", "compile", "max_iters",
        "loss_parallel", "use_torchao_fp8_linear", "use_torchao_fp8_allgather", "tp_overlap", "warmup_iters")}
    results |= {
        "model_name": config.name, "n_layers": config.n_layer, "gradient_accumulation_steps": steps,
        "global_batch_size": steps * args.micro_batch_size * groups.dp_size, "world_size": world,
        "tp_size": groups.tp_size, "dp_size": groups.dp_size, "context_parallel_size": groups.cp_size,
        "cp_rotate": args.cp_rotate if cp else None, "cp_load_balance": args.cp_load_balance if cp else None,
        "torchao_fp8_recipe": args.torchao_fp8_recipe if fp8 else None, "device": str(device), "losses": losses,
        "float8_linears": litgpt_setup.count_float8_linears(model) if fp8 else 0,
        "loss_decreased": losses[-1] < losses[0], "iter_times_ms": [t * 1000 for t in times],
        "average_iter_time_ms": avg_s * 1000, "tokens_per_iter": tokens_per_iter,
        "tokens_per_sec": tokens_per_iter / avg_s,
        "param_bytes_per_rank": harness.param_bytes(jm),  # this rank's shards
        "param_bytes_full_model": harness.param_bytes(model),  # the unsharded model
        "peak_memory_bytes": harness.peak_memory_bytes(device),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "max RSS",
        "peak_step_memory_bytes": step_bytes,  # --measure_step_memory: the last iteration's, above what was live
    }
    if args.compile != "eager":
        import thunder
        results["saved_for_backward"] = harness.saved_for_backward(thunder.last_traces(jm)[-1])
        results["collectives"] = harness.collectives_per_iteration(jm)
    for key in ("peak_memory_bytes", "peak_step_memory_bytes"):  # every rank's (they differ, e.g. rank 0 prints)
        peaks = [None] * world
        dist.all_gather_object(peaks, results[key])
        results[f"{key}_per_rank"] = peaks
    if args.dump_thunder_traces and args.compile != "eager":
        dump(args, jm, rank)
    if args.json_path and rank == 0:
        harness.log(rank, f"results written to {harness.write_json(args.json_path, results)}")
    report(results, rank)  # last, so that the summary is the screen a run ends on
    return 0


def report(r: dict, rank: int) -> None:
    """Print the results (rank 0)."""
    if rank != 0:
        return
    lines = [
        "",
        f"Model name: {r['model_name']}",
        f"Seq Length: {r['block_size']}",
        f"Micro BS: {r['micro_batch_size']}",
        f"Global BS: {r['global_batch_size']} ({r['gradient_accumulation_steps']} micro-batches per step and DP rank)",
        f"Model dtype: {r['dtype']}" + (", activation checkpointing" if r["checkpoint_activations"] else ""),
        f"Number of Layers: {r['n_layers']}",
        f"Distributed Mode: {r['distributed_mode']} (world {r['world_size']}, tp {r['tp_size']}, cp "
        f"{r['context_parallel_size']}, dp {r['dp_size']})" + (", loss parallel" if r["loss_parallel"] else ""),
        *([f"Context parallel: ContextParallel over {r['context_parallel_size']} ranks, keys and values "
           f"{'all-gathered' if r['cp_rotate'] == 'allgather' else 'passed around the ring'}, sequence chunks "
           f"{'head-tail (load-balanced)' if r['cp_load_balance'] else 'in order'}"]
          if r["context_parallel_size"] > 1 else []),
        f"Compiler: {r['compile']}" + (f", TensorParallel(overlap={r['tp_overlap']!r})" if r["tp_size"] > 1 else ""),
        *([f"[torchao float8] linear{', all-gather' if r['use_torchao_fp8_allgather'] else ''} are enabled: recipe "
           f"{r['torchao_fp8_recipe']}, {r['float8_linears']} Float8Linear, gemms "
           f"{'torch._scaled_mm' if r['device'].startswith('cuda') else 'emulated in high precision (CPU)'}"]
          if r["use_torchao_fp8_linear"] else []),  # as Thunder's "[torchao float8] ... are enabled"
        f"Loss: {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} "
        f"({'decreased' if r['loss_decreased'] else 'did NOT decrease'})",
        f"Average iter time: {r['average_iter_time_ms']:.2f} ms (over {r['max_iters'] - r['warmup_iters']} iterations)",
        f"Tokens/s: {r['tokens_per_sec']:.2f}",
        f"Parameters per rank: {harness.fmt_bytes(r['param_bytes_per_rank'])} (full model: "
        f"{harness.fmt_bytes(r['param_bytes_full_model'])})",
        f"Peak memory ({r['peak_memory_kind']}, rank 0): {harness.fmt_bytes(r['peak_memory_bytes'])}",
        *(["Peak step memory (the last iteration, above what was live before it), per rank: "
           + ", ".join(harness.fmt_bytes(b) for b in r["peak_step_memory_bytes_per_rank"])]
          if r["peak_step_memory_bytes"] is not None else []),
    ]
    saved = r.get("saved_for_backward")
    if saved:
        lines.append(f"Saved for backward: {harness.fmt_bytes(saved['bytes'])} in {saved['count']} tensors "
                     f"({harness.fmt_bytes(saved['activation_bytes'])} without parameters and inputs)")
    if r.get("collectives"):
        lines += harness.collectives_lines(r["collectives"]["per_iteration"], "Collectives per iteration")
    print("\n".join(lines), flush=True)


def dump(args: argparse.Namespace, jm: nn.Module, rank: int) -> None:
    """Every rank's final traces into --trace_dir; one line (rank 0) says where."""
    import thunder_tp
    paths = thunder_tp.dump_traces(jm, args.trace_dir)
    dist.barrier()
    harness.log(rank, f"traces of every rank written to {Path(args.trace_dir).resolve()} "
                      f"({', '.join(p.name for p in paths)} for rank 0)")


# --simulate N: the TP plan on N ranks simulated in this process (LocalTensor), without N processes


def simulate_dry_run(args: argparse.Namespace) -> int:
    """One forward + backward of the TP=N program on N simulated ranks."""
    import thunder_tp
    n = args.simulate
    if args.tp_size not in (None, n):
        raise SystemExit(f"--simulate {n} simulates a TP group of {n} ranks; drop --tp_size or set it to {n}")
    # model and batch as plain tensors, before the simulation: inside it, factories make per-rank LocalTensors
    config = litgpt_setup.make_config(args)
    model = litgpt_setup.make_model(args, config, torch.device("cpu"))
    idx, targets = litgpt_setup.make_batch(args, config.padded_vocab_size, 0, 0, torch.device("cpu"))
    with thunder_tp.simulate(world_size=n):
        args.compile = "thunder"  # thunder_tp.executors(): Thunder's torch executor inside a simulation
        jm = litgpt_setup.wrap(model, args, litgpt_setup.Groups(0, n, n, 0, None, 1, 0, None))
        t0 = time.perf_counter()
        loss = jm(idx, targets)
        loss.backward()
        seconds = time.perf_counter() - t0
        collectives = harness.collectives_per_iteration(jm)
        if args.dump_thunder_traces:
            thunder_tp.dump_traces(jm, args.trace_dir)
    losses = thunder_tp.per_rank(loss)
    pieces = [thunder_tp.per_rank(p) for p in jm.parameters()]  # {rank: its piece} per parameter
    rank_bytes = {r: sum(piece[r].numel() * piece[r].element_size() for piece in pieces) for r in range(n)}
    full_bytes = harness.param_bytes(model)
    lines = [
        f"Simulated {n} ranks in one process (thunder_tp.simulate; Thunder's torch executor): model {config.name}, "
        f"{config.n_layer} layers, mode {args.distributed_mode}, loss_parallel {args.loss_parallel}, "
        f"block_size {args.block_size}, micro_batch_size {args.micro_batch_size}",
        f"forward + backward: {seconds:.2f} s (simulated, all ranks)",
        *(f"rank {r}: loss {losses[r].item():.6f}, parameters {harness.fmt_bytes(rank_bytes[r])}" for r in range(n)),
        f"full model: {harness.fmt_bytes(full_bytes)}",
    ]
    lines += harness.collectives_lines(collectives["per_iteration"], "Collectives per rank and iteration")
    if args.dump_thunder_traces:
        lines.append(f"traces of every simulated rank written to {Path(args.trace_dir).resolve()}")
    print("\n".join(lines), flush=True)
    if args.json_path:
        results = {"simulate": n, "model_name": config.name, "n_layers": config.n_layer,
                   "distributed_mode": args.distributed_mode, "loss_parallel": args.loss_parallel,
                   "losses": {r: v.item() for r, v in losses.items()}, "param_bytes_per_rank": rank_bytes,
                   "param_bytes_full_model": full_bytes, "collectives": collectives}
        harness.write_json(args.json_path, results)
    return 0


if __name__ == "__main__":
    harness.exit_without_teardown(main())
