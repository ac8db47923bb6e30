"""thunder_tp vs HuggingFace's own TP on the same HF Llama (CPU/gloo or CUDA/NCCL), side by side in one run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.compare_hf [--steps 10 --json_path out.json]

Rank 0 writes a seeded HF Llama (default: dim 512, 4 layers, 8 / 4 heads, FFN 1536, vocab 8192, fp32) with
``save_pretrained``; every mode loads that directory and trains it with the same step (forward with ``labels``,
backward, SGD) on the same batch (4 x 256 by default):

- ``hf_tp``: ``AutoModelForCausalLM.from_pretrained(dir, tp_plan="auto")``, HF's DTensor TP, eager (needs accelerate);
- ``thunder_tp`` / ``thunder_tp_lp``: ``thunder.jit`` of ``plans.CausalLMLoss(model)`` (only the loss returned)
  with ``TensorParallel(plans.hf(model))`` (loss parallel for the second), ``thunder_tp.executors()`` (or
  ``--executors thunder_default``).

Before timing, each mode's first-step loss and gradients (gathered to full tensors) are gated against one device's
eager step (``gate.py``, as ``compare.py`` does: every gradient within ``--grad_rtol`` of its largest entry), and its
second-step loss against one device's second step. Then the modes' timed steps run in ``--rounds`` alternating rounds
(every mode a few steps per round, the order reversed every other round, as ``compare.py`` does), so that a change
of the machine's load hits every mode alike; each step starts at a barrier and lasts until its slowest rank is done,
and ranks are pinned one per core (``--pin_cores``). Reported per mode: median step time and quartiles over every
timed step, the median of the per-round ratios to HF's TP, collectives per step (thunder: from the traces; HF:
counted with CommDebugMode), saved-for-backward bytes and peak step memory. ``--dump_traces DIR`` writes the thunder
modes' final traces (``thunder_tp.dump_traces``), ``--profile DIR`` a torch.profiler table of two steps per mode,
``--breakdown N`` times N steps of each thunder mode region by region (``breakdown.py``), ``--without_transport 1``
runs every mode's steps of each round again with collectives that move nothing (``transport.py``): the step
without communication (the compute both sides do) and what communication adds, paired by round.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import statistics
import sys
import tempfile
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.lib.eager_counts import comm_mode, hooked_saved_bytes, summarize_records
from benchmarks.lib.gate import check_gradients, full_grads
from benchmarks.lib.harness import (
    EXECUTORS,
    Mode,
    add_round,
    alternating_rounds,
    collectives_per_iteration,
    exit_without_teardown,
    init_distributed,
    log,
    peak_step_bytes,
    pin_to_core,
    profile_steps,
    random_batch,
    saved_for_backward,
    steps_per_round,
    time_stats,
    time_steps,
    write_json,
)
from benchmarks.lib.litgpt_setup import HF_SIZES
from benchmarks.lib.transport import prioritize_transport_threads

LR = 1e-3


def _hf_tp(directory: str, executors: str) -> nn.Module:
    """HF's own TP of the saved Llama (its DTensor plan, eager), with the loss."""
    from transformers import AutoModelForCausalLM

    from thunder_tp.plans.hf import CausalLMLoss

    return CausalLMLoss(AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", torch_dtype=torch.float32))


def _thunder_tp(directory: str, executors: str, loss_parallel: bool = False) -> nn.Module:
    """thunder.jit of the saved Llama with its loss, TensorParallel(plans.hf), ``--executors``."""
    import thunder
    from transformers import AutoModelForCausalLM

    import thunder_tp
    from thunder_tp.plans.hf import CausalLMLoss

    model = CausalLMLoss(AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32))
    plan = thunder_tp.plans.hf(model, loss_parallel=loss_parallel)
    return thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan)], executors=EXECUTORS[executors]())


#: each mode's module is ``mode.build(directory, executors)``, called as module(idx, targets) -> loss
MODES = {m.name: m for m in (
    Mode("hf_tp", "HF tp_plan='auto' (DTensor), eager", 0, _hf_tp),
    Mode("thunder_tp", "thunder_tp, plans.hf", 0, _thunder_tp, runtime="thunder"),
    Mode("thunder_tp_lp", "thunder_tp, plans.hf, loss parallel", 0, partial(_thunder_tp, loss_parallel=True),
         runtime="thunder"),
)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode, spread over --rounds")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (every mode a few steps in each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode after the gated ones")
    p.add_argument("--pin_cores", type=int, default=1, help="CPU runs: pin local rank r to core r")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--n_layers", type=int, default=HF_SIZES["num_hidden_layers"])
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--grad_rtol", type=float, default=1e-4, help="gate: grads within this of their largest entry")
    p.add_argument("--executors", default="thunder", choices=sorted(EXECUTORS),
                   help="thunder: thunder_tp.executors(); thunder_default: Thunder's defaults + thunder_tp's comm "
                        "executor")
    p.add_argument("--json_path", default="")
    p.add_argument("--dump_traces", default="", help="directory for each thunder mode's final traces (every rank)")
    p.add_argument("--profile", default="", help="directory for a torch.profiler table of two steps per mode (rank 0)")
    p.add_argument("--breakdown", type=int, default=0, help="steps of each thunder mode timed region by region")
    p.add_argument("--transport_threads", choices=("default", "fifo"), default="default",
                   help="fifo: once every mode is built, each rank's threads other than its main one (gloo's) get "
                        "real-time priority SCHED_FIFO 1, every mode alike (needs CAP_SYS_NICE; CPU only)")
    p.add_argument("--without_transport", type=int, default=0,
                   help="1: every mode's steps of each round run again with collectives that move nothing "
                        "(transport.py): what communication adds to a step, paired by round")
    args = p.parse_args(argv)
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    return args


def save_model(args: argparse.Namespace, rank: int) -> str:
    """Rank 0 writes the seeded Llama with save_pretrained into a directory every rank reads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = [tempfile.mkdtemp(prefix="compare_hf_") if rank == 0 else None]
    dist.broadcast_object_list(directory)
    if rank == 0:
        config = LlamaConfig(**(HF_SIZES | {"num_hidden_layers": args.n_layers, "max_position_embeddings": args.seq}))
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(directory[0])
    dist.barrier()
    return directory[0]


def step(module: nn.Module, optimizer, idx, targets) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = module(idx, targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def prepare_mode(mode: Mode, directory: str, idx, targets, reference: dict, args) -> tuple[dict, tuple]:
    """Build, gate the first step's loss and gradients and the second step's loss against one device, warm up."""
    module = mode.build(directory, args.executors)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    optimizer.zero_grad(set_to_none=True)
    loss = module(idx, targets)
    loss.backward()
    torch.testing.assert_close(loss.detach(), reference["losses"][0], rtol=1e-4, atol=1e-5)
    grad_error = check_gradients(mode.name, full_grads(module), reference["grads"], args.grad_rtol)
    optimizer.step()
    loss2 = step(module, optimizer, idx, targets)
    torch.testing.assert_close(loss2, reference["losses"][1], rtol=1e-4, atol=1e-5)
    for _ in range(args.warmup):
        step(module, optimizer, idx, targets)
    result = {"loss": loss.item(), "loss_step2": loss2.item(), "grad_error": grad_error, "times_s": [],
              "round_medians_s": []}
    return result, (module, optimizer)


def time_rounds(states: dict, idx, targets, args, results: dict) -> None:
    """Every mode's timed steps in alternating rounds (order reversed every other round); a step starts at a barrier
    and lasts until its slowest rank is done. With ``--without_transport 1`` each mode's steps of every round run
    again right after, with collectives that move nothing (``transport.py``)."""
    from benchmarks.lib.transport import steps_without_transport

    runs = [(name, transport) for name in states for transport in (True, False)
            if transport or args.without_transport]
    per_round = steps_per_round(args.steps, args.rounds)
    for r, (name, transport) in alternating_rounds(runs, len(per_round)):
        module, optimizer = states[name]
        around = contextlib.nullcontext() if transport else steps_without_transport(list(module.parameters()))
        with around:
            times, _ = time_steps(partial(step, module, optimizer, idx, targets), per_round[r], distributed=True)
        add_round(results[name], times, transport)


def finish_mode(mode: Mode, state: tuple, idx, targets, args, result: dict) -> None:
    """Statistics of the timed steps; diagnostics asked for; memory and collectives of more steps."""
    import thunder

    module, optimizer = state
    result |= time_stats(result["times_s"])
    result["step_ms"] = 1000 * result["median_s"]
    if "without_transport" in result:
        from benchmarks.lib.transport import communication_cost

        without = result.pop("without_transport")
        without["minor_faults"] = [0.0]
        result["transport"] = communication_cost(result, without)
    if args.profile:
        profile_steps(mode.name, partial(step, module, optimizer, idx, targets),
                      args.profile if dist.get_rank() == 0 else None)
    if args.breakdown and mode.runtime == "thunder":
        from benchmarks.lib.breakdown import step_breakdown

        result["breakdown"] = step_breakdown(module, lambda: step(module, optimizer, idx, targets), args.breakdown,
                                             distributed=True)
    if args.dump_traces and mode.runtime == "thunder":
        import thunder_tp

        thunder_tp.dump_traces(module, os.path.join(args.dump_traces, mode.name))
    result["peak_step_bytes"] = peak_step_bytes(lambda: step(module, optimizer, idx, targets))
    # saved for backward as saved-tensor hooks see it (distinct storages, parameters left out), every mode alike
    saved_hooks, loss = hooked_saved_bytes(lambda: module(idx, targets), list(module.parameters()))
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    result["saved_bytes_hooks"] = saved_hooks
    if mode.runtime != "thunder":  # HF's TP: what CommDebugMode counts
        with comm_mode() as comm:
            loss = module(idx, targets)
            loss.backward()
        result |= {"saved_bytes": saved_hooks, "collectives": summarize_records(comm.records)}
    else:
        saved = saved_for_backward(thunder.last_traces(module)[-1])
        # the forward trace's saved tensors without its inputs (parameters, batch), and with them
        result |= {"saved_bytes": saved["activation_bytes"], "saved_bytes_with_inputs": saved["bytes"],
                   "collectives": collectives_per_iteration(module)["per_iteration"],
                   "fusion_regions": [sum(b.sym.is_fusion for b in t.bound_symbols)
                                      for t in (thunder.last_traces(module)[-1],
                                                thunder.last_backward_traces(module)[-1])]}


def reference_step(directory: str, idx, targets) -> dict:
    """One device's eager first-step loss and grads and its second-step loss (the same SGD step)."""
    from transformers import AutoModelForCausalLM

    from thunder_tp.plans.hf import CausalLMLoss

    model = CausalLMLoss(AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters()}
    optimizer.step()
    return {"losses": [loss.detach(), step(model, optimizer, idx, targets)], "grads": grads}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pin_cores and not torch.cuda.is_available():
        pin_to_core()
    rank, world, device = init_distributed()
    torch.set_num_threads(1)
    directory = save_model(args, rank)
    idx, targets = random_batch(args.batch, args.seq, HF_SIZES["vocab_size"], 0, device)
    reference = reference_step(directory, idx, targets)
    results = {"world": world, "batch": args.batch, "seq": args.seq, "rounds": args.rounds, "steps": args.steps,
               "load_before": os.getloadavg(), "modes": {}}
    states = {}
    modes = [MODES[name] for name in args.modes.split(",")]
    for mode in modes:
        results["modes"][mode.name], states[mode.name] = prepare_mode(mode, directory, idx, targets, reference, args)
        log(rank, f"{mode.name}: gated (loss {results['modes'][mode.name]['loss']:.6f}, worst grad error "
                  f"{results['modes'][mode.name]['grad_error']:.2e} of the largest entry)")
    if args.transport_threads == "fifo":
        count = prioritize_transport_threads(device)
        log(rank, f"--transport_threads fifo: {count} threads besides the main one at SCHED_FIFO 1 (rank 0)")
    results["transport_threads"] = args.transport_threads
    time_rounds(states, idx, targets, args, results["modes"])
    results["load_after"] = os.getloadavg()
    for mode in modes:
        finish_mode(mode, states.pop(mode.name), idx, targets, args, results["modes"][mode.name])
    base = results["modes"].get("hf_tp")
    for mode, r in results["modes"].items():
        r["vs_hf_tp"] = r["median_s"] / base["median_s"] if base else None
        r["vs_hf_tp_per_round"] = ([a / b for a, b in zip(r["round_medians_s"], base["round_medians_s"], strict=True)]
                                   if base else None)
        per_round = statistics.median(r["vs_hf_tp_per_round"]) if base else 0
        log(rank, f"{mode}: {r['step_ms']:.1f} ms (q1 {1000 * r['q1_s']:.0f}, q3 {1000 * r['q3_s']:.0f}; "
                  f"{r['vs_hf_tp'] or 0:.3f} x hf_tp, per-round ratios' median {per_round:.3f}), "
                  f"saved {r['saved_bytes']} B (hooks {r['saved_bytes_hooks']} B), peak step {r['peak_step_bytes']} B, "
                  f"collectives {r['collectives']}"
                  + (f", fusion regions fwd/bwd {r['fusion_regions']}" if "fusion_regions" in r else "")
                  + (f"; without communication {1000 * r['transport']['without_transport_s']:.1f} ms, communication "
                     f"adds {1000 * r['transport']['exposed_s']:.1f} ms (paired by round)" if "transport" in r else ""))
    log(rank, f"{len(results['modes'])} modes x {args.steps} steps in {args.rounds} alternating rounds; "
              f"load average before {results['load_before'][0]:.1f}, after {results['load_after'][0]:.1f}")
    if args.json_path and rank == 0:
        write_json(args.json_path, results)
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
