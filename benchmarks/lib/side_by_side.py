"""``benchmark_litgpt --compare``: modes of ``modes.py`` trained side by side, each gated against one device first
(every gradient, the first two losses), then timed in alternating rounds."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.lib import harness
from benchmarks.lib.llama import Llama, LlamaConfig, WithLoss
from benchmarks.lib.modes import MODES, How, Selected

#: the first-step loss's tolerance against one device (10x for the second step)
LOSS_RTOL = 1e-4
#: --compare all: every mode of the registry for the benchmark Llama
ALL = ("eager,thunder,thunder_defaults,thunder_inductor,tp,tp_auto,tp_sp,tp_lp,dtensor_tp_lp,dtensor_tp_default,"
       "dtensor_tp,dtensor_sp,dtensor_tp_compile")


def entries(names: str, skip: str, how: How) -> list[Selected]:
    """The entries of ``names`` (comma-separated, or 'all') but not in ``skip``; unknown modes are an error."""
    out = []
    for name in (ALL if names == "all" else names).split(","):
        if name not in skip.split(",") and name:
            if name not in MODES:
                raise SystemExit(f"unknown mode {name!r} in --compare; choose from {list(MODES)}")
            mode = MODES[name]
            ranks = dist.get_world_size() if mode.distributed else 1
            out.append(Selected(name, mode.description, mode.runtime, ranks, partial(mode.wrap, how=how)))
    return out


def make_model(cfg: LlamaConfig, seed: int) -> nn.Module:
    """The compared Llama with its loss, seeded."""
    return harness.seeded_model(lambda: WithLoss(Llama(cfg)), seed)


class GradientMismatch(AssertionError):
    """A mode's gradient differs from the single-device run's: the mode computes something else."""


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient by the original model's names (collective: shards are gathered)."""
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
    fields = json.loads(args.llama_config or "{}") | {"max_seq": args.block_size}
    if args.n_layers is not None:
        fields["n_layers"] = args.n_layers
    return LlamaConfig(**fields)


def reference_run(cfg: LlamaConfig, state: dict, idx, targets, lr: float) -> dict:
    """Eager single-device first and second-step losses and first-step gradients (float64 copies)."""
    model = make_model(cfg, 0)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss1 = harness.train_step(model, opt, idx, targets).item()
    grads = {name: p.grad.detach().to(torch.float64) for name, p in model.named_parameters()}
    return {"losses": [loss1, harness.train_step(model, opt, idx, targets).item()], "grads": grads}


def prepare_mode(mode: Selected, model: nn.Module, idx, targets, args, reference: dict) -> tuple[dict, Any]:
    """Build, check every gradient and the first two losses, warm up; this rank's result and (jm, opt, params)."""
    distributed = mode.ranks != 1
    result: dict = {"description": mode.description, "ranks": mode.ranks, "runtime": mode.runtime, "times_s": [],
                    "round_medians_s": []}
    if distributed:
        dist.barrier()
    t0 = time.perf_counter()
    jm = mode.build(model)
    opt = torch.optim.SGD(list(jm.parameters()), lr=args.learning_rate)
    loss1 = harness.train_step(jm, opt, idx, targets)
    harness.sync()
    result["first_iter_s"] = time.perf_counter() - t0
    result["grad_error"] = check_gradients(mode.name, full_grads(jm), reference["grads"], args.grad_rtol)
    loss2 = harness.train_step(jm, opt, idx, targets)
    result["loss_step1"], result["loss_step2"] = loss1.item(), loss2.item()
    ref1, ref2 = reference["losses"]
    ok = math.isclose(loss1.item(), ref1, rel_tol=LOSS_RTOL) and math.isclose(loss2.item(), ref2,
                                                                                   rel_tol=10 * LOSS_RTOL)
    result |= {"reference_losses": [ref1, ref2], "param_bytes": harness.param_bytes(jm)}
    if distributed:
        ok = harness.agreed(ok)
        result["first_iter_s"] = harness.slowest_rank([result["first_iter_s"]])[0]
    result["loss_ok"] = ok
    if not ok:
        result["error"] = (f"first/second-step loss {loss1.item():.7f}/{loss2.item():.7f} differs from single-device "
                           f"{ref1:.7f}/{ref2:.7f}; not timed")
        return result, None
    for _ in range(max(args.warmup_iters - 2, 0)):  # the first two steps were warm-up too
        harness.train_step(jm, opt, idx, targets)
    return result, (jm, opt, list(jm.parameters()))


def finish_mode(mode: Selected, state, idx, targets, args, result: dict) -> None:
    """Statistics of the timed steps, traces, peak memory, saved-for-backward bytes and collectives of more steps."""
    jm, opt, params = state
    times = result["times_s"]
    result.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times))
    result["tokens_per_s"] = idx.numel() / result["median_s"]
    if args.dump_thunder_traces and mode.runtime == "thunder":
        import thunder_tp
        thunder_tp.dump_traces(jm, os.path.join(args.trace_dir, mode.name))
    result["peak_step_bytes"] = harness.peak_step_bytes(partial(harness.train_step, jm, opt, idx, targets))
    jm.zero_grad(set_to_none=True)
    with harness.step_context(jm):
        saved, loss = hooked_saved_bytes(lambda: jm(idx, targets), params)
        loss.backward()
    result["saved_bytes_hooks"] = result["saved_bytes"] = saved
    if mode.runtime == "thunder":
        import thunder

        from thunder_tp.tools.debug import collective_calls
        fwd_t, bwd_t = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
        result["saved_bytes"] = (harness.saved_for_backward(fwd_t) or {}).get("activation_bytes")
        for name, trace in (("forward", fwd_t), ("backward", bwd_t)):
            result[f"comm_{name}_trace"] = summarize_records([(c["kind"], c["bytes"]) for c in collective_calls(trace)])
        result["fusion_regions"] = [sum(b.sym.is_fusion for b in t.bound_symbols) for t in (fwd_t, bwd_t)]
    jm.zero_grad(set_to_none=True)
    try:
        result["comm_forward"], result["comm_backward"] = map(summarize_records, counted_step(jm, idx, targets))
    except Exception as e:
        result["comm_note"] = f"runtime comm measurement failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    jm.zero_grad(set_to_none=True)


def prepare_all(modes: list[Selected], cfg: LlamaConfig, idx, targets, args, results: dict) -> dict:
    """Build, gate and warm up every mode; each ready mode's (jm, opt, params)."""
    initial = make_model(cfg, 0).state_dict()
    # every rank runs the reference itself: each checks the full gradients it gathered
    reference = reference_run(cfg, initial, idx, targets, args.learning_rate)
    states: dict = {}
    def prepare(mode: Selected) -> None:
        model = make_model(cfg, 0)
        model.load_state_dict(initial)
        try:
            results[mode.name], state = prepare_mode(mode, model, idx, targets, args, reference)
            if state is not None:
                states[mode.name] = state
        except Exception as e:
            msg = harness.error_line(e)
            if mode.runtime != "compile" or isinstance(e, GradientMismatch):
                traceback.print_exc()
                raise
            results[mode.name] = {"description": mode.description, "skipped": f"torch.compile failed: {msg}"}
            print(f"[compare] {mode.name} skipped: {msg}", file=sys.stderr, flush=True)
    for mode in modes:
        if dist.get_rank() == 0:
            print(f"[compare] {mode.name}: {mode.description}", file=sys.stderr, flush=True)
        results[mode.name] = {"description": mode.description}
        harness.on_ranks(mode.ranks, partial(prepare, mode))
    return states


def time_rounds(modes: list[Selected], states: dict, idx, targets, args, results: dict) -> list[Selected]:
    """The timed steps of every ready mode in alternating rounds; the modes timed."""
    ready = torch.tensor([m.name in states for m in modes], dtype=torch.int32)
    dist.broadcast(ready, 0)  # rank 0 knows the single-device modes; a distributed mode's check is collective
    timed_modes = [m for m, ok in zip(modes, ready.tolist(), strict=True) if ok]
    steps = args.max_iters - args.warmup_iters
    rounds = max(1, min(args.rounds, steps))
    per_round = [steps // rounds + (r < steps % rounds) for r in range(rounds)]  # the first ones one more
    for r, mode in harness.alternating_rounds(timed_modes, len(per_round)):  # every mode a few steps per round
        def run(mode=mode, steps=per_round[r]):
            jm, opt, _ = states[mode.name]
            step = partial(harness.train_step, jm, opt, idx, targets)
            times = harness.time_steps(step, steps, distributed=mode.ranks != 1)
            results[mode.name]["times_s"] += times
            results[mode.name]["round_medians_s"].append(statistics.median(times))
        harness.on_ranks(mode.ranks, run)
    return timed_modes


def compare(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    """Run the modes of ``--compare`` side by side on this rank and report (rank 0); 0 on success."""
    torch.set_num_threads(1)
    if device.type == "cuda":
        torch.set_default_device(device)
    cfg = llama_config(args)
    idx, targets = harness.random_batch(args.micro_batch_size, args.block_size, cfg.vocab, 1234, device)
    how = How(harness.EXECUTORS[args.compile], batch=(args.micro_batch_size, args.block_size))
    modes = entries(args.compare, args.skip, how)
    results: dict = {}
    states = prepare_all(modes, cfg, idx, targets, args, results)
    for mode in time_rounds(modes, states, idx, targets, args, results):
        state = states.pop(mode.name, None)  # on a one-rank mode's other ranks: none
        harness.on_ranks(mode.ranks, partial(finish_mode, mode, state, idx, targets, args, results[mode.name]))
        if rank == 0:
            print(f"[compare] {mode.name}: {summary_line(results[mode.name])}", file=sys.stderr, flush=True)
        gc.collect()
    if rank == 0:
        report(args, cfg, world, results)
    dist.barrier()
    return 0


@contextlib.contextmanager
def compare_process(args: argparse.Namespace):
    """Ranks pinned one per core (CPU) and an empty Inductor cache (honest first iterations), removed after."""
    if args.pin_cores and not torch.cuda.is_available():
        harness.pin_to_core()
    with (tempfile.TemporaryDirectory(prefix=f"compare_inductor_{os.environ.get('RANK', '0')}_",
                                      ignore_cleanup_errors=True)
          if args.fresh_inductor_cache else contextlib.nullcontext()) as cache_dir:
        if cache_dir:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        yield


_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def _kind(name: str) -> str:
    """Collective kind of an op schema name such as 'c10d::allreduce_' or '_c10d_functional::all_gather_into_tensor'."""
    short = name.split("::")[-1].lstrip("_")
    spelled = short.replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    spelled = spelled.replace("alltoall", "all_to_all")
    return next((kind for kind in _KINDS if spelled.startswith(kind)), short)


def _payload(name: str, args, out) -> int:
    """Bytes of the full tensor of a collective: all_reduce's tensor, all_gather's output, reduce_scatter's input."""
    tensors = [t for t in torch.utils._pytree.tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    kind, short = _kind(name), name.split("::")[-1]
    if "c10d_functional" in name:
        if kind == "all_gather":
            outs = torch.utils._pytree.tree_flatten(out)[0]
            return sum(harness.tensor_bytes(t) for t in outs if isinstance(t, torch.Tensor))
        return harness.tensor_bytes(tensors[0]) if tensors else 0
    if short in ("_allgather_base_", "_reduce_scatter_base_"):  # (output, input, ...)
        return harness.tensor_bytes(tensors[0] if kind == "all_gather" else tensors[1])
    if short == "allgather_":  # (output lists, input list)
        return sum(harness.tensor_bytes(t) for t in tensors[:-1])
    return sum(harness.tensor_bytes(t) for t in tensors)


def counted_step(model: nn.Module, idx, targets) -> tuple[list, list]:
    """The (kind, bytes) collectives of one more forward and of its backward, as ``comm_mode`` counts them."""
    forward, backward = comm_mode(), comm_mode()
    with harness.step_context(model):
        with forward:
            loss = model(idx, targets)
        with backward:
            loss.backward()
    return forward.records, backward.records


def comm_mode():
    """A CommDebugMode that also records (kind, bytes) of each funcol and c10d collective."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops
    class CommBytesMode(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.records: list[tuple[str, int]] = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = func._overloadpacket
            if out is not NotImplemented and (packet in self.comm_registry or packet in c10d_collective_ops):
                name = func._schema.name
                self.records.append((_kind(name), _payload(name, (args, kwargs), out)))
            return out
    return CommBytesMode()


def summarize_records(records: list[tuple[str, int]]) -> dict:
    """Counts per kind, the number of calls and the bytes of (kind, bytes) records."""
    return {"counts": dict(Counter(k for k, _ in records)), "total": len(records), "bytes": sum(b for _, b in records)}


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside ``t`` (DTensor's local shard, AsyncCollectiveTensor's result, ...)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [x for a in attrs for x in plain_tensors(getattr(t, a))]
    return [t]


def hooked_saved_bytes(fn: Callable[[], torch.Tensor], params) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves for backward while running ``fn``, parameters excluded."""
    param_ptrs = {x.untyped_storage().data_ptr() for p in params for x in plain_tensors(p)}
    seen: dict[int, int] = {}
    def pack(t):
        for x in plain_tensors(t):
            storage = x.untyped_storage()
            if storage.data_ptr() not in param_ptrs:
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return sum(seen.values()), loss


def _mb(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


ABBREVIATIONS = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}


def _comm_cell(r: dict) -> str:
    """A mode's collectives per pass ('1AG 9AR / 9AR'): from its traces, or else counted at runtime; '-' without."""
    passes = [r.get(f"comm_{p}_trace") or r.get(f"comm_{p}") for p in ("forward", "backward")]
    if None in passes:
        return "-"
    return " / ".join(" ".join(f"{n}{ABBREVIATIONS.get(k, k)}" for k, n in sorted(c["counts"].items())) or "0"
                      for c in passes)


def parallel_efficiency(results: dict, name: str) -> float | None:
    """Mode ``name``'s speed-up over its 1-rank run of the same runtime, per rank; None without one."""
    baseline = "thunder" if name.startswith(("tp", "thunder")) else "eager"
    base = results.get(baseline, {}).get("median_s")
    return base / results[name]["median_s"] / results[name]["ranks"] if base else None


def markdown_table(results: dict) -> str:
    """One row per mode: step times, speed-ups, memory, fusion regions and collectives, or why it was not timed."""
    ref = results.get("dtensor_tp", {}).get("median_s")
    cells = []
    for name, r in results.items():
        first = _fmt(r.get("first_iter_s"), ".1f")
        if "median_s" not in r:
            cells.append([name, r.get("ranks", "–"), *["–"] * 5, first, *["–"] * 5,
                          r.get("error") or r.get("skipped") or "not run"])
            continue
        saved = _mb(r.get("saved_bytes"))
        if r.get("runtime") == "thunder" and r.get("saved_bytes_hooks") is not None:
            saved += f" ({_mb(r['saved_bytes_hooks'])})"
        cells.append([
            name, r["ranks"], f"{r['median_s'] * 1e3:.0f}", f"{r['min_s'] * 1e3:.0f}–{r['max_s'] * 1e3:.0f}",
            f"{r['tokens_per_s']:.0f}", _fmt(r["median_s"] / ref if ref else None, ".2f"),
            _fmt(parallel_efficiency(results, name), ".2f"), first, _mb(r.get("param_bytes")), saved,
            _mb(r.get("peak_step_bytes")), " / ".join(map(str, r.get("fusion_regions", ["–"]))), _comm_cell(r),
            "yes" if r.get("loss_ok") else "NO"])
    return "\n".join(harness.table(
        "mode | ranks> | step median (ms)> | min–max (ms)> | tokens/s> | × DTensor TP> | parallel eff.> | "
        "first iter (s)> | params/rank (MB)> | saved for bwd (MB)> | peak step mem (MB)> | "
        "fusion regions fwd / bwd> | collectives fwd / bwd | loss ok", cells))


def summary_line(r: dict) -> str:
    """One mode's result in a line (the progress log)."""
    if "median_s" not in r:
        return r.get("error") or r.get("skipped") or "not run"
    return (f"median {r['median_s'] * 1e3:.0f} ms (min {r['min_s'] * 1e3:.0f}, max {r['max_s'] * 1e3:.0f}), "
            f"first iter {r['first_iter_s']:.1f} s, loss {r['loss_step1']:.6f}, comm {_comm_cell(r)}")


def paired_ratio(a: dict, b: dict) -> float | None:
    """Median over the rounds of a's step time over b's in the same round (both medians of their round's steps): the
    modes of a round run minutes apart at most, so the host's drift between rounds cancels."""
    pairs = [x / y for x, y in zip(a.get("round_medians_s", []), b.get("round_medians_s", []), strict=True)]
    return statistics.median(pairs) if pairs else None


#: the run's targets: name -> (mode, the mode it is held against, target); against "thunder": parallel efficiency
TARGETS = {"tp_vs_dtensor": ("tp", "dtensor_tp", 0.85), "parallel_efficiency": ("tp", "thunder", 0.9),
           "tp_vs_dtensor_loss_parallel": ("tp_lp", "dtensor_tp_lp", 0.85),
           "parallel_efficiency_loss_parallel": ("tp_lp", "thunder", 0.9)}


def targets_summary(results: dict, world: int) -> dict:
    """The run against its targets: ratios of the medians over all steps, and paired by round."""
    out: dict = {}
    for key, (a, b, target) in TARGETS.items():
        ra, rb = results.get(a, {}), results.get(b, {})
        if "median_s" not in ra or "median_s" not in rb:
            continue
        if b == "thunder":  # the single device's step time over world times the TP mode's
            paired = paired_ratio(rb, ra)
            out[key] = {"value": rb["median_s"] / (world * ra["median_s"]),
                        "value_paired_by_round": None if paired is None else paired / world, "target": target}
        else:
            out[key] = {"ratio": ra["median_s"] / rb["median_s"], "ratio_paired_by_round": paired_ratio(ra, rb),
                        "target": target}
    tp, single = results.get("tp", {}), results.get("thunder", {})
    if "first_iter_s" in tp and "first_iter_s" in single:
        out["first_iter_vs_thunder_jit"] = {"ratio": tp["first_iter_s"] / single["first_iter_s"], "target": 1.3}
    if "comm_forward_trace" in tp:
        out["tp_collectives"] = {"forward": tp["comm_forward_trace"]["counts"],
                                 "backward": tp["comm_backward_trace"]["counts"]}
    return out


def report(args, cfg, world: int, results: dict) -> None:
    """Print the run's header, the table and the targets; write the JSON."""
    table = markdown_table(results)
    print(f"\nLlama dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} ffn={cfg.ffn_hidden} "
          f"vocab={cfg.vocab}, batch={args.micro_batch_size} seq={args.block_size}; {world} ranks x "
          f"{torch.get_num_threads()} thread, "
          f"{'NCCL' if torch.cuda.is_available() else 'gloo'}; "
          f"median of {args.max_iters - args.warmup_iters} steps after {args.warmup_iters} warm-up\n")
    summary = targets_summary(results, world)
    print(table, "", json.dumps(summary, indent=1), sep="\n")
    if args.json_path:
        harness.write_json(args.json_path, {
            "command": " ".join(sys.argv), "config": asdict(cfg), "world_size": world, "batch": args.micro_batch_size,
            "seq": args.block_size, "steps": args.max_iters, "warmup": args.warmup_iters, "modes": results,
            "targets": summary, "table": table})
