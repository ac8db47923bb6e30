"""``benchmark_litgpt --compare``: modes of ``modes.py`` trained side by side, each gated against one device first
(every gradient, the first two losses), then timed in alternating rounds."""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.lib.compare_report import report, summary_line
from benchmarks.lib.eager_counts import comm_mode, hooked_saved_bytes, summarize_records
from benchmarks.lib.harness import (
    EXECUTORS,
    add_round,
    alternating_rounds,
    on_ranks,
    param_bytes,
    peak_step_bytes,
    pin_to_core,
    random_batch,
    saved_for_backward,
    seeded_model,
    slowest_rank,
    step_context,
    steps_per_round,
    sync,
    time_stats,
    time_steps,
    train_step,
)
from benchmarks.lib.llama import Llama, LlamaConfig, WithLoss, hf_config, litgpt_config
from benchmarks.lib.modes import MODES, How, Mode

#: --compare all: every mode on the benchmark Llama, and litgpt's and HF's Llama of the same dims (``family:mode``)
ALL = ("eager,thunder,thunder_defaults,thunder_inductor,tp,tp_auto,tp_sp,tp_lp,dtensor_tp_lp,dtensor_tp_default,"
       "dtensor_tp,dtensor_sp,dtensor_tp_compile,litgpt:thunder,litgpt:tp,litgpt:tp_sp,hf:thunder,hf_tp,hf:tp,hf:tp_lp")


@dataclass(frozen=True)
class Entry:
    """A mode of the registry on one of the compared models: ``[family:]mode``, the benchmark Llama without one."""

    name: str
    mode: Mode
    family: str
    how: How

    @property
    def ranks(self) -> int:
        """1: rank 0 alone; 0: every rank."""
        return 0 if self.mode.distributed else 1

    @property
    def runtime(self) -> str:
        return self.mode.runtime

    @property
    def description(self) -> str:
        return f"{self.family} Llama, {self.mode.description}" if self.family != "llama" else self.mode.description

    def build(self, model: nn.Module) -> nn.Module:
        return self.mode.wrap(model, self.how)


def entries(names: str, skip: str, how: How) -> list[Entry]:
    """The entries of ``names`` (comma-separated, or 'all') but not in ``skip``; unknown modes are an error."""
    out = []
    for name in (ALL if names == "all" else names).split(","):
        family, _, mode = name.rpartition(":")
        if name not in skip.split(",") and name:
            if mode not in MODES:
                raise SystemExit(f"unknown mode {mode!r} in --compare; choose from {list(MODES)}")
            out.append(Entry(name, MODES[mode], family or MODES[mode].family or "llama", how))
    return out


def make_model(family: str, cfg: LlamaConfig, seed: int) -> nn.Module:
    """The compared model of ``family`` with its loss: the Llama, or litgpt's or HF's Llama of the same dims."""
    if family == "hf":
        from transformers import LlamaForCausalLM

        from thunder_tp.plans.hf import CausalLMLoss

        return seeded_model(lambda: CausalLMLoss(LlamaForCausalLM(hf_config(cfg))), seed)
    if family == "litgpt":
        from thunder_tp.plans.litgpt import GPTWithLoss

        return seeded_model(lambda: GPTWithLoss(litgpt_config(cfg)), seed)
    return seeded_model(lambda: WithLoss(Llama(cfg)), seed)


class GradientMismatch(AssertionError):
    """A mode's gradient differs from the single-device run's: the mode computes something else."""


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, by parameter name of the original model (collective in a distributed mode:
    DTensor gradients are gathered with ``full_tensor``, thunder_tp's shards through its transforms' reverse of the
    state dict, as ``ThunderModule.original_state_dict`` does)."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in module.named_parameters():
        if p.grad is None:
            raise GradientMismatch(f"parameter {name!r} got no gradient")
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.removeprefix("_orig_mod.")] = grad.detach()  # torch.compile's wrapper
    from thunder.core.module import ThunderModule

    if isinstance(module, ThunderModule):  # its transforms gather what they sharded
        import thunder

        for transform in reversed(thunder.list_transforms(module)):
            grads = transform.reverse_transform_state_dict_for_submodule(module, "", grads)
    return grads


def check_gradients(mode_name: str, grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                    rtol: float) -> float:
    """The largest gradient error relative to its reference's largest entry; GradientMismatch above ``rtol``."""
    if set(grads) != set(reference):
        raise GradientMismatch(f"{mode_name}: parameters {sorted(set(grads) ^ set(reference))} are not in both "
                               "this mode and the single-device model")
    worst = 0.0
    for name, ref in reference.items():
        if grads[name].shape != ref.shape:
            raise GradientMismatch(f"{mode_name}: gradient of {name!r} has shape {tuple(grads[name].shape)}, the "
                                   f"single-device run's {tuple(ref.shape)} (a shard not gathered?)")
        grad = grads[name].to(ref.device, torch.float64)
        error, largest = (grad - ref).abs().max().item(), ref.abs().max().item()
        bound = rtol * largest
        worst = max(worst, error / largest if largest else error)
        if not error <= bound:
            raise GradientMismatch(f"{mode_name}: gradient of {name!r} differs from the single-device run by "
                                   f"{error:.3e} (allowed {bound:.3e} = {rtol:g} x its largest entry); not timed")
    return worst


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """The compared Llama's dims: ``--llama_config`` over the defaults, ``--n_layers`` and ``--block_size``."""
    import json

    fields = json.loads(args.llama_config or "{}") | {"max_seq": args.block_size}
    if args.n_layers is not None:
        fields["n_layers"] = args.n_layers
    return LlamaConfig(**fields)


def reference_run(kind: str, cfg: LlamaConfig, state: dict, idx, targets, lr: float) -> dict:
    """Eager single-device first and second-step losses and first-step gradients (float64 copies)."""
    model = make_model(kind, cfg, 0)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss1 = train_step(model, opt, idx, targets).item()
    grads = {name: p.grad.detach().to(torch.float64) for name, p in model.named_parameters()}
    return {"losses": [loss1, train_step(model, opt, idx, targets).item()], "grads": grads}


def prepare_mode(mode: Entry, model: nn.Module, idx, targets, args, reference: dict) -> tuple[dict, Any]:
    """Build, check every gradient and the first two losses, warm up; this rank's result and (jm, opt, params)."""
    distributed = mode.ranks != 1
    result: dict = {"description": mode.description, "ranks": dist.get_world_size() if distributed else 1,
                    "runtime": mode.runtime, "times_s": [], "round_medians_s": [], "minor_faults": []}
    if distributed:
        dist.barrier()
    t0 = time.perf_counter()
    jm = mode.build(model)
    opt = torch.optim.SGD(list(jm.parameters()), lr=args.learning_rate)
    loss1 = train_step(jm, opt, idx, targets)
    sync()
    result["first_iter_s"] = time.perf_counter() - t0
    result["grad_error"] = check_gradients(mode.name, full_grads(jm), reference[mode.family]["grads"], args.grad_rtol)
    loss2 = train_step(jm, opt, idx, targets)
    result["loss_step1"], result["loss_step2"] = loss1.item(), loss2.item()
    ref1, ref2 = reference[mode.family]["losses"]
    ok = math.isclose(loss1.item(), ref1, rel_tol=args.rtol) and math.isclose(loss2.item(), ref2,
                                                                              rel_tol=10 * args.rtol)
    result |= {"reference_losses": [ref1, ref2], "param_bytes": param_bytes(jm)}
    if distributed:
        agreed = torch.tensor([float(ok)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        ok = bool(agreed.item())
        result["first_iter_s"] = slowest_rank([result["first_iter_s"]])[0]
    result["loss_ok"] = ok
    if not ok:
        result["error"] = (f"first/second-step loss {loss1.item():.7f}/{loss2.item():.7f} differs from single-device "
                           f"{ref1:.7f}/{ref2:.7f}; not timed")
        return result, None
    for _ in range(max(args.warmup_iters - 2, 0)):  # the first two steps were warm-up too
        train_step(jm, opt, idx, targets)
    return result, (jm, opt, list(jm.parameters()))


def finish_mode(mode: Entry, state, idx, targets, args, result: dict) -> None:
    """Statistics of the timed steps, traces, peak memory, saved-for-backward bytes and collectives of more steps."""
    jm, opt, params = state
    step = partial(train_step, jm, opt, idx, targets)
    result.update(time_stats(result["times_s"]))
    result["minor_faults_per_step"] = statistics.median(result["minor_faults"])
    result["tokens_per_s"] = idx.numel() / result["median_s"]
    if args.dump_thunder_traces and mode.runtime == "thunder":
        import thunder_tp

        thunder_tp.dump_traces(jm, os.path.join(args.trace_dir, mode.name))
    result["peak_step_bytes"] = peak_step_bytes(step)
    measure_memory_and_comm(mode, jm, params, idx, targets, result)


def measure_memory_and_comm(mode: Entry, jm, params, idx, targets, result: dict) -> None:
    """Saved-for-backward bytes and collectives of one more forward/backward; after timing, since a dispatch mode
    (CommDebugMode) makes Dynamo give up on compiled code (Inductor regions and torch.compile run eagerly after)."""
    jm.zero_grad(set_to_none=True)
    with step_context(jm):
        saved, loss = hooked_saved_bytes(lambda: jm(idx, targets), params)
        loss.backward()
    result["saved_bytes_hooks"] = saved
    result["saved_bytes"] = saved
    if mode.runtime == "thunder":
        import thunder

        from thunder_tp.tools.debug import collective_calls

        fwd_t, bwd_t = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
        result["saved_bytes"] = (saved_for_backward(fwd_t) or {}).get("activation_bytes")
        for name, trace in (("forward", fwd_t), ("backward", bwd_t)):
            result[f"comm_{name}_trace"] = summarize_records([(c["kind"], c["bytes"]) for c in collective_calls(trace)])
        result["fusion_regions"] = [sum(b.sym.is_fusion for b in t.bound_symbols) for t in (fwd_t, bwd_t)]
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


def prepare_all(modes: list[Entry], cfg: LlamaConfig, idx, targets, args, results: dict) -> dict:
    """Build, gate and warm up every mode; each ready mode's (jm, opt, params)."""
    kinds = sorted({m.family for m in modes})
    initial = {k: make_model(k, cfg, 0).state_dict() for k in kinds}
    # every rank runs the reference itself: each checks the full gradients it gathered
    reference = {k: reference_run(k, cfg, initial[k], idx, targets, args.learning_rate) for k in kinds}
    states: dict = {}

    def prepare(mode: Entry) -> None:
        model = make_model(mode.family, cfg, 0)
        model.load_state_dict(initial[mode.family])
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


def time_rounds(modes: list[Entry], states: dict, idx, targets, args, results: dict) -> list[Entry]:
    """The timed steps of every ready mode in alternating rounds; the modes timed."""
    ready = torch.tensor([m.name in states for m in modes], dtype=torch.int32)
    dist.broadcast(ready, 0)  # rank 0 knows the single-device modes; a distributed mode's check is collective
    timed_modes = [m for m, ok in zip(modes, ready.tolist(), strict=True) if ok]
    per_round = steps_per_round(args.max_iters - args.warmup_iters, args.rounds)
    for r, mode in alternating_rounds(timed_modes, len(per_round)):  # every mode a few steps per round
        def run(mode=mode, steps=per_round[r]):
            jm, opt, _ = states[mode.name]
            times, faults = time_steps(partial(train_step, jm, opt, idx, targets), steps, distributed=mode.ranks != 1)
            add_round(results[mode.name], times, faults)

        on_ranks(mode.ranks, run)
    return timed_modes


def compare(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    """Run the modes of ``--compare`` side by side on this rank and report (rank 0); 0 on success."""
    torch.set_num_threads(1)
    if device.type == "cuda":
        torch.set_default_device(device)
    cfg = llama_config(args)
    idx, targets = random_batch(args.micro_batch_size, args.block_size, cfg.vocab, 1234, device)
    how = How(EXECUTORS[args.compile], batch=(args.micro_batch_size, args.block_size))
    modes = entries(args.compare, args.skip, how)
    results: dict = {}
    states = prepare_all(modes, cfg, idx, targets, args, results)
    for mode in time_rounds(modes, states, idx, targets, args, results):
        state = states.pop(mode.name, None)  # on a one-rank mode's other ranks: none
        on_ranks(mode.ranks, partial(finish_mode, mode, state, idx, targets, args, results[mode.name]))
        if rank == 0:
            print(f"[compare] {mode.name}: {summary_line(results[mode.name])}", file=sys.stderr, flush=True)
        gc.collect()
    if rank == 0:
        report(args, cfg, world, results)
    dist.barrier()
    return 0


@contextlib.contextmanager
def compare_process(args: argparse.Namespace):
    """What a side-by-side run sets up before its process group: ranks pinned one per core (CPU) and an empty
    Inductor cache (honest first-iteration times), removed after."""
    if args.pin_cores and not torch.cuda.is_available():
        pin_to_core()
    cache_dir = None
    if args.fresh_inductor_cache:
        cache_dir = tempfile.mkdtemp(prefix=f"compare_inductor_{os.environ.get('RANK', '0')}_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        yield
    finally:
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
