"""Step time of a Colwise -> Rowwise MLP block under TP: thunder_tp's fusion executor vs Thunder's defaults.

    torchrun --nproc-per-node 2 -m benchmarks.bench_executor_mlp [--tokens 512 --hidden 512 --steps 30]

Runs on CPU (gloo) or, when CUDA is available, on one GPU per rank (NCCL). A step is forward + backward;
the reported time is the median over ``--steps`` steps after ``--warmup`` warm-up steps (rank 0's clock,
every step starting after a barrier). Both configurations must give the same output and grads.
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial

import thunder
import torch
import torch.distributed as dist

import thunder_tp
from benchmarks.lib.harness import exit_without_teardown, time_steps


class MLP(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="batch x sequence length")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="timed steps (at least 20)")
    parser.add_argument("--warmup", type=int, default=5)
    return parser.parse_args()


def build(hidden: int, device: torch.device, executors: list) -> torch.nn.Module:
    """The MLP, jitted with TP=world (fc1 column-, fc2 row-parallel) and the given executors."""
    torch.manual_seed(0)
    model = MLP(hidden).to(device)
    plan = {"fc1": thunder_tp.ColwiseParallel(), "fc2": thunder_tp.RowwiseParallel()}
    return thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan)], executors=executors)


def step(jm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    for t in (x, *jm.parameters()):
        t.grad = None
    y = jm(x)
    y.square().mean().backward()
    return y


def count_fusions(jm: torch.nn.Module) -> str:
    traces = (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
    return " / ".join(str(sum(b.sym.is_fusion for b in t.bound_symbols)) for t in traces)


def main() -> None:
    args = parse_args()
    if args.steps < 20:
        raise SystemExit("--steps must be at least 20")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, device=device, requires_grad=True)  # as inside a network

    tp = thunder_tp.executors()
    configs = {
        "thunder_tp.executors()": tp,
        "Thunder defaults + comm executor": [tp[0], *thunder.get_default_executors()],
    }
    rows, outputs = [], []
    for name, executors in configs.items():
        jm = build(args.hidden, device, executors)
        for _ in range(args.warmup):
            step(jm, x)
        times, _ = time_steps(partial(step, jm, x), args.steps, distributed=True, device=device)
        outputs.append((step(jm, x).detach(), x.grad.clone(), [p.grad.clone() for p in jm.parameters()]))
        rows.append((name, statistics.median(times), min(times), count_fusions(jm)))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)

    if dist.get_rank() == 0:
        world, backend = dist.get_world_size(), "NCCL" if cuda else "gloo"
        print(f"\nColwise->Rowwise MLP, TP={world} ({backend}), tokens={args.tokens}, hidden={args.hidden}")
        print(f"forward+backward step, median of {args.steps} after {args.warmup} warm-up\n")
        print("| executors | median (ms) | min (ms) | fusion regions fwd / bwd |")
        print("|---|---:|---:|---:|")
        for name, median, fastest, fusions in rows:
            print(f"| {name} | {median * 1e3:.2f} | {fastest * 1e3:.2f} | {fusions} |")
        print(f"\nspeed-up of thunder_tp.executors(): {rows[1][1] / rows[0][1]:.2f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
