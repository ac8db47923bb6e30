"""Step time of a Mixtral-style MoE layer (litgpt LLaMAMoE) under TP vs the dense LLaMAMLP of the same active size.

    torchrun --nproc-per-node 1 benchmarks/bench_moe.py   # single device
    torchrun --nproc-per-node 2 benchmarks/bench_moe.py   # TP=2
    [--tokens 512 --embd 512 --experts 8 --top-k 2 --expert-size 1024 --steps 20]

The dense MLP has intermediate size top_k x expert_size: the same matmul FLOPs per token as the MoE layer.
Every expert's fc_1/fc_2 is column-parallel and proj row-parallel (the dense MLP's plan), router replicated.
A step is forward + backward; the reported time is the median over ``--steps`` steps after ``--warmup``
warm-up steps (rank 0's clock, every step starting after a barrier). CPU (gloo) or one GPU per rank (NCCL).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import thunder
import torch
import torch.distributed as dist
from litgpt import Config
from litgpt.model import LLaMAMLP, LLaMAMoE

import thunder_tp
from harness import exit_without_teardown
from thunder_tp.collectives import comm_executor

MLP_PLAN = {"fc_1": thunder_tp.ColwiseParallel(), "fc_2": thunder_tp.ColwiseParallel(), "proj": thunder_tp.RowwiseParallel()}
MOE_PLAN = {f"experts.*.{name}": style for name, style in MLP_PLAN.items()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="batch x sequence length")
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=1024, help="intermediate size of one expert")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    return parser.parse_args()


def build(kind: str, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The MoE layer or the dense MLP of the same active size, jitted with TP over the whole world."""
    config = Config(n_embd=args.embd, n_head=1, bias=False, mlp_class_name="LLaMAMoE", n_expert=args.experts,
                    n_expert_per_token=args.top_k, intermediate_size=args.top_k * args.expert_size,
                    moe_intermediate_size=args.expert_size)
    torch.manual_seed(0)
    model = (LLaMAMoE(config) if kind == "moe" else LLaMAMLP(config)).to(device)
    plan = MOE_PLAN if kind == "moe" else MLP_PLAN
    executors = [comm_executor, *thunder.get_default_executors()]
    return thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan)], executors=executors)


def time_steps(jm: torch.nn.Module, x: torch.Tensor, steps: int, warmup: int) -> list[float]:
    """Seconds per step (forward + backward), after warm-up."""
    times = []
    for i in range(warmup + steps):
        for p in jm.parameters():
            p.grad = None
        dist.barrier()
        start = time.perf_counter()
        jm(x).square().mean().backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(1)
    x = torch.randn(1, args.tokens, args.embd, device=device)
    for kind in ("moe", "dense"):
        median = statistics.median(time_steps(build(kind, args, device), x, args.steps, args.warmup))
        if rank == 0:
            print(f"{kind:5s} TP={world}: {median * 1e3:8.2f} ms per step (median of {args.steps})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
