"""Compile time: the first training step of a litgpt model (pythia-14m's config at ``--layers`` layers) through
thunder_tp at TP = the world size against plain ``thunder.jit`` of the same model on one device, in one run, and the
share of it that thunder_tp's own passes take.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.bench_compile --layers 2 8

For each depth every rank first compiles its own one-device copy (side by side, so that both runs load the machine
alike), then the TP model over the ranks; both with thunder_tp's executors (``--executors default``: Thunder's),
Inductor's caches off (each compile cold). A step is litgpt pretrain's: forward (the model returns logits), the
cross-entropy outside, backward, an AdamW step. Reported, each rank's slowest: ``thunder.jit`` (for TP also the plan
and the sharding of the parameters), the first step (Thunder's interpretation and passes, ours, autodiff, the fusion
executor's compiles, which Thunder's torch_compile executor makes at each region's first run, and the run), a
compiled step (the median of ``--steps`` more), the fusion regions Inductor compiled (TP has more: every collective
ends one), and thunder_tp's passes: the plan (``plans.litgpt``), ``TensorParallel.transform_module`` (plan checks,
sharding) and its trace pass ``transform_traces_pre_prologue`` (constraints, propagation, prologue, rewrite), timed
around those entry points. Compilation = jit + first step - a compiled step.
``--profile DIR`` writes rank 0's cProfile of the TP jit and first step (``DIR/tp{layers}.prof``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # ranks compile side by side on few cores
os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # a cold compile every time

import argparse
import contextlib
import cProfile
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.lib.harness import EXECUTORS, init_distributed, log, pin_to_core, random_batch, slowest_rank, write_json

#: TensorParallel's entry points whose time is thunder_tp's own passes
PASSES = ("transform_module", "transform_traces_pre_prologue")


def timed_passes() -> dict[str, float]:
    """Seconds spent in each of TensorParallel's PASSES from now on (they accumulate in the returned dict)."""
    from thunder_tp.transform import TensorParallel

    spent = dict.fromkeys(PASSES, 0.0)
    for name in PASSES:
        method = getattr(TensorParallel, name)

        @functools.wraps(method)
        def timing(self, *args, _method=method, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _method(self, *args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(TensorParallel, name, timing)
    return spent


def first_steps(build: Callable[[], tuple[torch.nn.Module, dict[str, float]]], batch, steps: int,
                profile: Path | None) -> dict:
    """Seconds of jit (``build``: the jitted model and its own timings), of the first training step and of a compiled
    one (the median of `steps`), and the fusion regions Inductor compiled."""
    from torch._dynamo.utils import counters

    idx, targets = batch
    regions = counters["stats"]["unique_graphs"]
    with _profiled(profile):
        start = time.perf_counter()
        jm, inside = build()
        jitted = time.perf_counter()
        optimizer = torch.optim.AdamW(jm.parameters(), lr=1e-4)
        _step(jm, optimizer, idx, targets)
        first = time.perf_counter()
    compiled = []
    for _ in range(steps):
        start_step = time.perf_counter()
        _step(jm, optimizer, idx, targets)
        compiled.append(time.perf_counter() - start_step)
    return {"jit_s": jitted - start, "first_step_s": first - jitted, "step_s": statistics.median(compiled),
            "regions": counters["stats"]["unique_graphs"] - regions, **inside}


def _step(jm, optimizer, idx, targets) -> None:
    logits = jm(idx)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _profiled(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--model_name", default="pythia-14m")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="compiled steps after the first (their median is reported)")
    p.add_argument("--executors", choices=["thunder", "default"], default="thunder")
    p.add_argument("--profile", type=Path, default=None)
    p.add_argument("--json_path", type=Path, default=None)
    args = p.parse_args()
    pin_to_core()
    torch.set_num_threads(1)
    rank, world, device = init_distributed()
    passes = timed_passes()
    results = {}
    for layers in args.layers:
        results[layers] = compare_at(layers, args, passes, device)
        log(rank, _row(layers, world, results[layers]["one_device"], results[layers]["tp"]))
    if rank == 0 and args.json_path is not None:
        write_json(args.json_path, {"model": args.model_name, "world": world, "executors": args.executors,
                                    "batch": [args.batch, args.seq], "results": results})


def compare_at(layers: int, args: argparse.Namespace, passes: dict[str, float], device: torch.device) -> dict:
    """The one-device and the TP figures of the model at `layers` layers (each rank's slowest)."""
    import thunder
    from litgpt import GPT, Config

    import thunder_tp

    config = Config.from_name(args.model_name, n_layer=layers)
    executors = EXECUTORS["thunder_default" if args.executors == "default" else "thunder"]()
    batch = random_batch(args.batch, args.seq, config.vocab_size, seed=0, device=device)

    def one_device() -> tuple[torch.nn.Module, dict[str, float]]:
        torch.manual_seed(0)
        return thunder.jit(GPT(config).to(device), executors=executors), {}

    def tensor_parallel() -> tuple[torch.nn.Module, dict[str, float]]:
        torch.manual_seed(0)
        model = GPT(config).to(device)
        start = time.perf_counter()
        plan = thunder_tp.plans.litgpt(model)
        planned = time.perf_counter() - start
        transform = thunder_tp.TensorParallel(plan)
        return thunder.jit(model, transforms=[transform], executors=executors), {"plan_s": planned}

    single = first_steps(one_device, batch, args.steps, None)
    passes.update(dict.fromkeys(PASSES, 0.0))
    profile = args.profile / f"tp{layers}.prof" if args.profile is not None and dist.get_rank() == 0 else None
    tp = first_steps(tensor_parallel, batch, args.steps, profile) | {f"{name}_s": s for name, s in passes.items()}
    return {name: dict(zip(r, slowest_rank(list(r.values())), strict=True))
            for name, r in (("one_device", single), ("tp", tp))}


def _row(layers: int, world: int, single: dict, tp: dict) -> str:
    """One depth's figures, and thunder_tp's passes against the rest of the TP compile."""
    compile_one, compile_tp = (r["jit_s"] + r["first_step_s"] - r["step_s"] for r in (single, tp))
    ours = tp["plan_s"] + sum(tp[f"{name}_s"] for name in PASSES)
    return (f"{layers} layers: one device: jit {single['jit_s']:.2f} s, first step {single['first_step_s']:.1f} s, "
            f"step {single['step_s']:.2f} s, {single['regions']:.0f} regions; TP={world}: jit {tp['jit_s']:.2f} s, "
            f"first step {tp['first_step_s']:.1f} s, step {tp['step_s']:.2f} s, {tp['regions']:.0f} regions; "
            f"compilation TP/one device {compile_tp / compile_one:.2f}x; thunder_tp's passes {ours:.2f} s (plan "
            f"{tp['plan_s']:.2f}, transform_module {tp['transform_module_s']:.2f}, trace pass "
            f"{tp['transform_traces_pre_prologue_s']:.2f}) = {ours / compile_tp:.1%} of the TP compilation, "
            f"{ours / (compile_tp - ours):.1%} on top of the rest")


if __name__ == "__main__":
    main()
