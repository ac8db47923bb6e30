"""Compile time against depth: the first training step of a litgpt model at several depths, one device and TP, each
in a fresh process with Inductor's caches empty, then again on those caches (docs/design.md, "Compile once").

    python -m benchmarks.bench_compile --layers 2 8 32                 # one device and TP=2 (2 gloo ranks)
    python -m benchmarks.bench_compile --layers 2 8 --compile_once false   # every block interpreted and compiled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.harness import free_port, options, write_json


def child(args: argparse.Namespace) -> None:
    """One run: this process (one device) or this rank (TP)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.nn.functional as F

    from benchmarks.lib.harness import init_distributed, pin_to_core, random_batch, slowest_rank, time_steps
    pin_to_core()
    torch.set_num_threads(1)
    rank, world, device = init_distributed()
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    jm, model = _jitted(args, device)
    optimizer = torch.optim.AdamW(jm.parameters(), lr=1e-4)
    idx, targets = random_batch(args.batch, args.seq, model.config.vocab_size, seed=0, device=device)
    def step() -> None:
        logits = jm(idx)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step()
    first_s, cpu_s = time.perf_counter() - start, _cpu_seconds() - cpu_start
    step_s = statistics.median(time_steps(step, args.steps, distributed=False))
    first_s, cpu_s, step_s = slowest_rank([first_s, cpu_s, step_s])
    if rank == 0:
        print(json.dumps(_figures(model, first_s, cpu_s, step_s)), flush=True)


def _jitted(args: argparse.Namespace, device):
    import thunder
    import torch
    from litgpt import GPT, Config

    import thunder_tp
    torch.manual_seed(0)
    model = GPT(Config.from_name(args.model_name, n_layer=args.child_layers)).to(device)
    transforms = [thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))] if args.child == "tp" else []
    return thunder.jit(model, transforms=transforms, executors=thunder_tp.executors(),
                       compile_once=args.compile_once), model


def _figures(model, first_s: float, cpu_s: float, step_s: float) -> dict:
    from torch._dynamo.utils import counters

    from thunder_tp.tracing.repeated_blocks import stats_of
    stats = stats_of(model)
    return {"compile_s": first_s - step_s, "compile_cpu_s": cpu_s, "step_s": step_s,
            "regions": counters["stats"]["unique_graphs"], "blocks_interpreted": stats.interpreted,
            "blocks_replayed": stats.replayed}


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run(mode: str, layers: int, cache: Path, args: argparse.Namespace) -> dict:
    """One (mode, depth) run in a new process (torchrun for TP) on Inductor cache directory `cache`."""
    command = [sys.executable, "-m", "benchmarks.bench_compile", "--child", mode, "--child_layers", str(layers),
               "--model_name", args.model_name, "--batch", str(args.batch), "--seq", str(args.seq),
               "--steps", str(args.steps), "--compile_once", str(args.compile_once).lower()]
    if mode == "tp":
        command[1:3] = ["-m", "torch.distributed.run", "--nproc-per-node", str(args.tp), "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), "-m", "benchmarks.bench_compile"]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), OMP_NUM_THREADS="1",
               TORCHINDUCTOR_COMPILE_THREADS="1")
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} at {layers} layers failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = options(__doc__)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--modes", nargs="+", choices=["one_device", "tp"], default=["one_device", "tp"])
    p.add_argument("--tp", type=int, default=2, help="ranks of the TP runs")
    p.add_argument("--model_name", default="pythia-14m")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="compiled steps after the first (their median is reported)")
    p.add_argument("--compile_once", type=lambda s: s.lower() == "true", default=True,
                   help="thunder.jit(..., compile_once=...): false interprets every block, compiles every region")
    p.add_argument("--second", action="store_true", help="each run again in a second process on its warm caches")
    p.add_argument("--child", choices=["one_device", "tp"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--child_layers", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args)
        return
    results: dict = {}
    with tempfile.TemporaryDirectory() as caches:
        for mode in args.modes:
            for layers in args.layers:
                cache = Path(caches) / f"{mode}{layers}"
                runs = {"first": run(mode, layers, cache, args)}
                if args.second:
                    runs["second"] = run(mode, layers, cache, args)
                results.setdefault(mode, {})[layers] = runs
                print(_row(mode, layers, runs, results[mode]), flush=True)
    if args.json_path:
        write_json(args.json_path, {"model": args.model_name, "tp": args.tp, "compile_once": args.compile_once,
                                    "batch": [args.batch, args.seq], "results": results})


def _row(mode: str, layers: int, runs: dict, by_depth: dict) -> str:
    first = runs["first"]
    shallowest = by_depth[min(by_depth)]["first"]
    text = (f"{mode} {layers} layers: compilation {first['compile_s']:.1f} s ({first['compile_cpu_s']:.1f} s CPU; "
            f"x{first['compile_s'] / shallowest['compile_s']:.2f} of {min(by_depth)} layers, CPU "
            f"x{first['compile_cpu_s'] / shallowest['compile_cpu_s']:.2f}), step {first['step_s'] * 1e3:.0f} ms, "
            f"{first['regions']} regions compiled, blocks interpreted / replayed {first['blocks_interpreted']} / "
            f"{first['blocks_replayed']}")
    if "second" in runs:
        second = runs["second"]
        ratio, cpu_ratio = (second[k] / first[k] for k in ("compile_s", "compile_cpu_s"))
        text += (f"; second process {second['compile_s']:.1f} s ({second['compile_cpu_s']:.1f} s CPU: "
                 f"x{ratio:.2f}, CPU x{cpu_ratio:.2f})")
    return text


if __name__ == "__main__":
    main()
