"""Expert parallelism against experts split like dense MLPs: one MoE layer (litgpt's LLaMAMoE), per-rank step time,
peak memory and bytes moved per step, the two modes alternating (docs/results.md, "Mixture of experts").

    torchrun --nproc-per-node 2 -m benchmarks.bench_moe                  # mixtral and fine, TP=2, on the CPU (gloo)
    torchrun --nproc-per-node 4 -m benchmarks.bench_moe --configs fine   # TP=4
    python -m benchmarks.bench_moe --one_rank 8 --configs qwen3-30b-a3b --dtype bfloat16   # a GPU: one rank of 8
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from functools import partial

import thunder
import torch
import torch.distributed as dist
from litgpt import Config
from litgpt.model import LLaMAMoE
from thunder.transforms import MaterializationTransform

import thunder_tp
from benchmarks.lib.harness import (
    DTYPES,
    alternating_rounds,
    collectives_per_iteration,
    exit_without_teardown,
    fmt_bytes,
    init_distributed,
    log,
    options,
    param_bytes,
    peak_step_bytes,
    steps_per_round,
    thunder_default_executors,
    time_steps,
    write_json,
)
from thunder_tp.layouts import REPLICATE
from thunder_tp.styles.expert import expert_parallel_plan

EXPERT_LAYERS = ("fc_1", "fc_2", "proj")
TP_PLAN = {"experts.*.fc_1": thunder_tp.ColwiseParallel(), "experts.*.fc_2": thunder_tp.ColwiseParallel(),
           "experts.*.proj": thunder_tp.RowwiseParallel()}
MODES = ("tp", "ep")


@dataclass(frozen=True)
class Shape:
    """A MoE layer: experts, experts per token, one expert's width, the hidden size, tokens per step."""

    experts: int
    top_k: int
    width: int
    embd: int
    tokens: int


CONFIGS = {
    "mixtral": Shape(experts=8, top_k=2, width=1024, embd=512, tokens=512),
    "fine": Shape(experts=64, top_k=8, width=256, embd=512, tokens=512),
    "qwen3-30b-a3b": Shape(experts=128, top_k=8, width=768, embd=2048, tokens=8192),
}


def parse_args() -> argparse.Namespace:
    parser = options(__doc__, dtype="float32")
    parser.add_argument("--configs", default="mixtral,fine", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default: the config's)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--one_rank", type=int, default=0, help="run one rank of a fake group of this size")
    return parser.parse_args()


def layer_config(shape: Shape) -> Config:
    return Config(n_embd=shape.embd, n_head=1, bias=False, mlp_class_name="LLaMAMoE", n_expert=shape.experts,
                  n_expert_per_token=shape.top_k, intermediate_size=shape.top_k * shape.width,
                  moe_intermediate_size=shape.width)


def build(mode: str, shape: Shape, device: torch.device, dtype: torch.dtype, meta: bool) -> torch.nn.Module:
    """The layer, seeded (or on the meta device, materialized shard by shard), jitted with the mode's plan."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else device):
        model = LLaMAMoE(layer_config(shape)).to(dtype)
    plan = expert_parallel_plan(shape.experts, EXPERT_LAYERS, REPLICATE) if mode == "ep" else TP_PLAN
    transforms = [thunder_tp.TensorParallel(plan)]
    if meta:
        init = MaterializationTransform.init_from_original_module_init()
        transforms.append(MaterializationTransform(device, init=init))
    return thunder.jit(model, transforms=transforms, executors=thunder_default_executors())


def step(jm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward and backward (grads cleared first); the output."""
    for p in jm.parameters():
        p.grad = None
    y = jm(x)
    y.float().square().mean().backward()
    return y.detach()


def compare(shape: Shape, args: argparse.Namespace, device: torch.device, meta: bool) -> dict:
    """Both modes on one config: built, checked against each other, timed in alternating rounds, measured."""
    dtype = DTYPES[args.dtype]
    torch.manual_seed(1)
    x = torch.randn(1, args.tokens or shape.tokens, shape.embd, device=device, dtype=dtype)
    modules = {mode: build(mode, shape, device, dtype, meta) for mode in MODES}
    outputs = {mode: [step(jm, x) for _ in range(args.warmup)][-1] for mode, jm in modules.items()}
    if not meta:  # the same layer, the same result (fp32: summation order only)
        scale = outputs["tp"].abs().max().item()
        torch.testing.assert_close(outputs["ep"], outputs["tp"], rtol=1e-3, atol=1e-3 * scale)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    per_round = steps_per_round(args.steps, args.rounds)
    distributed = dist.is_initialized() and not meta  # a fake group (one rank of N) has no peers to wait for
    for r, mode in alternating_rounds(MODES, len(per_round)):
        times[mode] += time_steps(partial(step, modules[mode], x), per_round[r], distributed=distributed,
                                  device=device)[0]
    results = {}
    for mode, jm in modules.items():
        peak = torch.tensor([peak_step_bytes(lambda jm=jm: step(jm, x)) or 0], device=device)
        if dist.is_initialized() and not meta:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        moved = collectives_per_iteration(jm)["per_iteration"]
        results[mode] = {"median_s": statistics.median(times[mode]),
                         "peak_step_bytes": int(peak.item()), "param_bytes": param_bytes(jm),
                         "collectives": moved}
    return results


def table(results: dict, tp: int) -> str:
    lines = ["| config | TP | experts | step (ms) | EP / TP | peak step memory | parameters per rank | moved per step "
             "(forward + backward) | collectives |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for name, modes in results.items():
        for mode, r in modes.items():
            c = r["collectives"]
            moved = c["forward"]["bytes"] + c["backward"]["bytes"]
            kinds = " + ".join(f"{v['count']} {k}" for p in ("forward", "backward") for k, v in c[p]["by_kind"].items())
            ratio = f"{r['median_s'] / modes['tp']['median_s']:.2f}x" if mode == "ep" else ""
            lines.append(f"| {name} | {tp} | {'whole (EP)' if mode == 'ep' else 'split (TP)'} | "
                         f"{r['median_s'] * 1e3:.1f} | {ratio} | {fmt_bytes(r['peak_step_bytes'])} | "
                         f"{fmt_bytes(r['param_bytes'])} | {fmt_bytes(moved)} | "
                         f"{kinds} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    if args.one_rank:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        with thunder_tp.one_rank(args.one_rank, args.one_rank - 1, device):
            results = {n: compare(CONFIGS[n], args, device, meta=True) for n in names}
        tp, rank = args.one_rank, 0
    else:
        rank, tp, device = init_distributed()
        results = {n: compare(CONFIGS[n], args, device, meta=False) for n in names}
    log(rank, table(results, tp))
    if args.json_path and rank == 0:
        write_json(args.json_path, {"args": vars(args), "tp": tp, "device": str(device), "results": results})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
