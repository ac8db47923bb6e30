"""thunder_tp vs PyTorch DTensor TP vs single device, side by side in one run (CPU/gloo or CUDA/NCCL).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.compare --json_path out.json --png_path out.png

Every mode (``compare_modes.py``) trains the same Llama (``llama.py``: separate q/k/v, RMSNorm, RoPE, SwiGLU, GQA,
causal SDPA, untied embedding and lm_head) from the same weights on the same batch with the same step (forward,
cross-entropy, backward, SGD step):

- single device (rank 0 only, the other ranks wait at a barrier): eager, ``thunder.jit`` with
  ``thunder_tp.executors()`` and with Thunder's default executors;
- thunder_tp: TP (Megatron) and TP+SP (sequence parallel), ``thunder.jit(model, transforms=[TensorParallel(plan)],
  executors=thunder_tp.executors())``;
- DTensor: ``parallelize_module`` with the default Colwise/Rowwise plan, the best eager plan (one
  ``PrepareModuleInput`` per attention/MLP, so q/k/v and w1/w3 share one input and one backward all_reduce),
  the sequence-parallel plan, and the best plan under ``torch.compile`` (skipped, with the reason, if it fails);
- litgpt GPT of the same dims, single-device thunder and thunder_tp TP/SP with ``thunder_tp.plans.litgpt``.

``--executors thunder_default`` runs the thunder modes with Thunder's default executors instead (no Inductor
fusions: quick, for smoke tests).

Before any timing, each mode's first-step gradients (every parameter, gathered to full tensors) are compared
with the single-device eager run's (``gate.py``), each within ``--grad_rtol`` of that tensor's largest entry: a
mismatch raises ``GradientMismatch`` naming the mode and the parameter. Its first and second-step losses are
compared too; a mode whose losses disagree is reported and not timed.
After timing, ``--breakdown N`` times N more steps of each thunder mode region by region and collective by collective
(``breakdown.py``). With ``--without_transport 1`` each multi-rank mode (not the compiled one) runs its steps of every
round twice, with its collectives and, right before or after, with local stand-ins that move no data
(``transport.py``): paired by round, what communication adds to the step.
Every rank uses one thread (``torch.set_num_threads(1)``). Outputs (``compare_report.py``): a markdown table on
stdout, ``--json_path`` and ``--png_path`` (step time and communication per mode, and transform time vs depth).

Its length (past 300 lines) is one run's phases in order (gate, alternating rounds, memory and communication
counts, profile, transport); the modes live in ``compare_modes.py``, the report in ``compare_report.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # ranks compile side by side on few cores

import argparse
import contextlib
import gc
import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

from benchmarks.lib.breakdown import step_breakdown
from benchmarks.lib.compare_modes import all_modes, make_model, select_modes
from benchmarks.lib.compare_report import report, summary_line
from benchmarks.lib.eager_counts import comm_mode, hooked_saved_bytes, summarize_records
from benchmarks.lib.gate import GradientMismatch, check_gradients, full_grads
from benchmarks.lib.harness import (
    Mode,
    add_round,
    alternating_rounds,
    exit_without_teardown,
    init_distributed,
    on_ranks,
    param_bytes,
    peak_step_bytes,
    pin_to_core,
    profile_steps,
    random_batch,
    saved_for_backward,
    slowest_rank,
    step_context,
    steps_per_round,
    sync,
    time_stats,
    time_steps,
    train_step,
)
from benchmarks.lib.llama import LlamaConfig, transform_scaling
from benchmarks.lib.transport import communication_cost, prioritize_transport_threads, steps_without_transport

# --- one mode: build, gate, time, measure ---------------------------------------------------------------------


def reference_run(kind: str, cfg: LlamaConfig, state: dict, idx, targets, lr: float) -> dict:
    """Eager single-device first and second-step losses and first-step gradients (float64 copies)."""
    model = make_model(kind, cfg, 0)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss1 = train_step(model, opt, idx, targets).item()
    grads = {name: p.grad.detach().to(torch.float64) for name, p in model.named_parameters()}
    return {"losses": [loss1, train_step(model, opt, idx, targets).item()], "grads": grads}


def prepare_mode(mode: Mode, model: nn.Module, idx, targets, args, reference: dict) -> tuple[dict, Any]:
    """Build, check every gradient and the first two losses, warm up; this rank's result and (jm, opt, params)."""
    distributed = mode.ranks != 1
    result: dict = {"description": mode.description, "ranks": dist.get_world_size() if distributed else 1,
                    "runtime": mode.runtime, "times_s": [], "round_medians_s": [], "minor_faults": []}
    if distributed:
        dist.barrier()
    t0 = time.perf_counter()
    jm = mode.build(model)
    opt = torch.optim.SGD(list(jm.parameters()), lr=args.lr)
    loss1 = train_step(jm, opt, idx, targets)
    sync()
    result["first_iter_s"] = time.perf_counter() - t0
    result["grad_error"] = check_gradients(mode.name, full_grads(jm), reference[mode.model]["grads"], args.grad_rtol)
    loss2 = train_step(jm, opt, idx, targets)
    result["loss_step1"], result["loss_step2"] = loss1.item(), loss2.item()
    ref1, ref2 = reference[mode.model]["losses"]
    ok1 = math.isclose(loss1.item(), ref1, rel_tol=args.rtol)
    ok2 = math.isclose(loss2.item(), ref2, rel_tol=10 * args.rtol)
    result["loss_ok"] = ok1 and ok2
    result["reference_losses"] = [ref1, ref2]
    result["param_bytes"] = param_bytes(jm)
    if distributed:
        ok = torch.tensor([float(result["loss_ok"])])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        result["loss_ok"] = bool(ok.item())
        result["first_iter_s"] = slowest_rank([result["first_iter_s"]])[0]
    if not result["loss_ok"]:
        result["error"] = (f"first/second-step loss {loss1.item():.7f}/{loss2.item():.7f} differs from single-device "
                           f"{ref1:.7f}/{ref2:.7f}; not timed")
        return result, None
    for _ in range(max(args.warmup - 2, 0)):  # the first two steps were warm-up too
        train_step(jm, opt, idx, targets)
    return result, (jm, opt, list(jm.parameters()))


def finish_mode(mode: Mode, state, idx, targets, args, result: dict) -> None:
    """Statistics of the timed steps, then the diagnostics asked for (profile, breakdown, communication's cost, traces),
    peak memory, saved-for-backward bytes and collectives of more steps."""
    jm, opt, params = state
    step = partial(train_step, jm, opt, idx, targets)
    result.update(time_stats(result["times_s"]))
    result["minor_faults_per_step"] = statistics.median(result["minor_faults"])
    result["tokens_per_s"] = idx.numel() / result["median_s"]
    if args.profile_dir and mode.name in args.profile:  # every rank steps (collectives), rank 0 writes
        profile_steps(mode.name, step, args.profile_dir if dist.get_rank() == 0 else None)
    if args.breakdown and mode.runtime == "thunder":
        result["breakdown"] = step_breakdown(jm, step, args.breakdown, distributed=mode.ranks != 1)
    if "without_transport" in result:
        result["transport"] = communication_cost(result, result.pop("without_transport"))
    if args.dump_traces and mode.runtime == "thunder":
        import thunder_tp

        thunder_tp.dump_traces(jm, os.path.join(args.dump_traces, mode.name))
    result["peak_step_bytes"] = peak_step_bytes(step)
    measure_memory_and_comm(mode, jm, params, idx, targets, result)


def measure_memory_and_comm(mode: Mode, jm, params, idx, targets, result: dict) -> None:
    """Saved-for-backward bytes and collectives of one more forward/backward; after timing, since a dispatch mode
    (CommDebugMode) makes Dynamo give up on compiled code (Thunder's Inductor regions and torch.compile run eagerly
    from then on)."""
    jm.zero_grad(set_to_none=True)
    with step_context(jm):
        saved, loss = hooked_saved_bytes(lambda: jm(idx, targets), params)
        loss.backward()
    result["saved_bytes_hooks"] = saved
    if mode.runtime == "thunder":
        import thunder

        from thunder_tp.tools.debug import collective_calls

        fwd_t, bwd_t = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
        result["saved_bytes"] = (saved_for_backward(fwd_t) or {}).get("activation_bytes")
        for name, trace in (("forward", fwd_t), ("backward", bwd_t)):
            result[f"comm_{name}_trace"] = summarize_records([(c["kind"], c["bytes"]) for c in collective_calls(trace)])
        result["fusion_regions"] = [sum(b.sym.is_fusion for b in t.bound_symbols) for t in (fwd_t, bwd_t)]
    else:
        result["saved_bytes"] = saved
    fwd_mode, bwd_mode = comm_mode(), comm_mode()
    jm.zero_grad(set_to_none=True)
    try:
        with step_context(jm):
            with fwd_mode:
                loss = jm(idx, targets)
            with bwd_mode:
                loss.backward()
        result["comm_forward"] = summarize_records(fwd_mode.records)
        result["comm_backward"] = summarize_records(bwd_mode.records)
    except Exception as e:
        result["comm_note"] = f"runtime comm measurement failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    jm.zero_grad(set_to_none=True)


# --- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cfg = LlamaConfig()
    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "ffn_hidden"):
        p.add_argument(f"--{f}", type=int, default=getattr(cfg, f))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode (after warm-up)")
    p.add_argument("--rounds", type=int, default=5,
                   help="the timed steps are spread over this many rounds, modes alternating within each")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps, the first (compile) and second (checked) included")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-4, help="first-step loss tolerance (10x for the second step)")
    p.add_argument("--grad_rtol", type=float, default=1e-4,
                   help="first-step gradient tolerance, relative to each gradient's largest entry (fp32)")
    p.add_argument("--modes", default="all", help="comma-separated mode names, or 'all'")
    p.add_argument("--executors", default="thunder", choices=["thunder", "thunder_default"],
                   help="the thunder modes' executors: thunder_tp.executors() (Inductor fusions on CPU), or Thunder's "
                        "defaults + thunder_tp's comm executor (no fusion compile: quick)")
    p.add_argument("--skip", default="", help="comma-separated mode names to leave out")
    p.add_argument("--scaling_layers", default="2,4,8", help="depths for the transform-time scaling ('' to skip)")
    p.add_argument("--scaling_repeats", type=int, default=3)
    p.add_argument("--fresh_inductor_cache", type=int, default=1,
                   help="1: compile into an empty Inductor cache (honest first-iteration times)")
    p.add_argument("--pin_cores", type=int, default=1, help="CPU runs: pin local rank r to core r (every mode)")
    p.add_argument("--transport_threads", choices=("default", "fifo"), default="default",
                   help="fifo: before and after building the modes, the threads of each rank other than its main one "
                        "(gloo's) get real-time priority SCHED_FIFO 1, every mode alike (needs CAP_SYS_NICE; CPU only)")
    p.add_argument("--timeout", type=float, default=600,
                   help="process-group timeout in seconds (a hung peer fails after it)")
    p.add_argument("--json_path", default="")
    p.add_argument("--png_path", default="")
    p.add_argument("--profile", default="", help="comma-separated modes to profile (torch.profiler, rank 0)")
    p.add_argument("--profile_dir", default="")
    p.add_argument("--breakdown", type=int, default=0,
                   help="steps of each thunder mode timed region by region and collective by collective (breakdown.py)")
    p.add_argument("--without_transport", type=int, default=0,
                   help="1: each eager or thunder multi-rank mode's steps of every round run again with collectives "
                        "that move no data, right before or after: what communication adds to a step (transport.py)")
    p.add_argument("--dump_traces", default="", help="directory for each thunder mode's final traces (every rank)")
    args = p.parse_args(argv)
    args.profile = [m for m in args.profile.split(",") if m]
    return args


def prepare_all(modes: list[Mode], cfg: LlamaConfig, idx, targets, args, results: dict) -> dict:
    """Build, gate and warm up every mode; each ready mode's (jm, opt, params)."""
    kinds = sorted({m.model for m in modes})
    initial = {k: make_model(k, cfg, 0).state_dict() for k in kinds}
    # every rank runs the reference itself: each checks the full gradients it gathered
    reference = {k: reference_run(k, cfg, initial[k], idx, targets, args.lr) for k in kinds}
    states: dict = {}

    def prepare(mode: Mode) -> None:
        model = make_model(mode.model, cfg, 0)
        model.load_state_dict(initial[mode.model])
        try:
            results[mode.name], state = prepare_mode(mode, model, idx, targets, args, reference)
            if state is not None:
                states[mode.name] = state
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            if mode.runtime != "compile" or isinstance(e, GradientMismatch):
                traceback.print_exc()
                raise
            results[mode.name] = {"description": mode.description, "skipped": f"torch.compile failed: {msg}"}
            print(f"[compare] {mode.name} skipped: {msg}", file=sys.stderr, flush=True)

    for mode in modes:
        if dist.get_rank() == 0:
            print(f"[compare] {mode.name}: {mode.description}", file=sys.stderr, flush=True)
        results[mode.name] = {"description": mode.description}
        on_ranks(mode.ranks, partial(prepare, mode))
    return states


def time_rounds(modes: list[Mode], states: dict, idx, targets, args, results: dict) -> list[Mode]:
    """The timed steps of every ready mode in alternating rounds; the modes timed."""
    ready = torch.tensor([m.name in states for m in modes], dtype=torch.int32)
    dist.broadcast(ready, 0)  # rank 0 knows the single-device modes; a distributed mode's check is collective
    timed_modes = [m for m, ok in zip(modes, ready.tolist(), strict=True) if ok]
    runs = [(m, transport) for m in timed_modes for transport in (True, False)
            if transport or (args.without_transport and measures_transport(m))]
    per_round = steps_per_round(args.steps, args.rounds)
    for r, (mode, transport) in alternating_rounds(runs, len(per_round)):  # every mode a few steps per round
        def run(mode=mode, transport=transport, steps=per_round[r]):
            jm, opt, params = states[mode.name]
            around = contextlib.nullcontext() if transport else steps_without_transport(params)
            with around:
                times, faults = time_steps(partial(train_step, jm, opt, idx, targets), steps,
                                           distributed=mode.ranks != 1)
            add_round(results[mode.name], times, transport, faults)

        on_ranks(mode.ranks, run)
    return timed_modes


def measures_transport(mode: Mode) -> bool:
    """True for the modes ``--without_transport`` measures: multi-rank, eager or thunder (a compiled graph holds its
    collectives, out of ``transport.py``'s reach)."""
    return mode.ranks != 1 and mode.runtime != "compile"


@record  # a failing rank's error and traceback go into torchrun's summary
def main(argv: list[str] | None = None) -> int:
    """Run every selected mode (see the module docstring); 0 on success."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    cache_dir = None
    if args.fresh_inductor_cache:
        cache_dir = tempfile.mkdtemp(prefix=f"compare_inductor_{os.environ.get('RANK', '0')}_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    if args.pin_cores and not torch.cuda.is_available():
        pin_to_core()
    rank, world, device = init_distributed(args.timeout)
    if device.type == "cuda":
        torch.set_default_device(device)
    cfg = LlamaConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                      vocab=args.vocab, ffn_hidden=args.ffn_hidden, max_seq=args.seq)
    idx, targets = random_batch(args.batch, args.seq, cfg.vocab, 1234, device)
    modes = select_modes(all_modes(args.executors), args.modes, args.skip)

    results: dict = {}
    fifo = args.transport_threads == "fifo"
    if fifo:
        prioritize_transport_threads(device)  # fails before the modes are built where it cannot be done
    states = prepare_all(modes, cfg, idx, targets, args, results)
    if fifo:  # again: the process groups that building the modes made have threads of their own
        count = prioritize_transport_threads(device)
        if rank == 0:
            print(f"[compare] --transport_threads fifo: {count} threads besides the main one at SCHED_FIFO 1 (rank 0)",
                  file=sys.stderr, flush=True)
    for mode in time_rounds(modes, states, idx, targets, args, results):
        def finish(mode: Mode = mode) -> None:
            finish_mode(mode, states.pop(mode.name), idx, targets, args, results[mode.name])

        on_ranks(mode.ranks, finish)
        if rank == 0:
            print(f"[compare] {mode.name}: {summary_line(results[mode.name])}", file=sys.stderr, flush=True)
        gc.collect()

    depths = [int(d) for d in args.scaling_layers.split(",") if d]
    scaling = transform_scaling(cfg, depths, args.scaling_repeats) if depths else {}
    if rank == 0:
        report(args, cfg, world, results, scaling)
    dist.barrier()
    dist.destroy_process_group()
    if cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
