"""plans.auto's search time beside the first compile of the same model, and its plan against the hand plan.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.bench_auto_plan --models Llama-3.2-1B,pythia-160m \\
        --n_layers 2 --block_size 128

For each litgpt config (builtin, random weights, float32, wrapped with its loss):
`thunder.jit(model, transforms=[TensorParallel("auto", example_inputs=...)], executors=thunder_tp.executors())`
searches at jit (Thunder's trace of the model plus the pricing of candidate plans); the first call then compiles
from the search's trace (TP rewrite, autograd, fusion and Inductor compile, plus one step), the second call is one
step: first compile = first - second. Without the search, the compile would interpret the model itself, as the
search's trace did: what the search adds to the first compile is its time less its trace. Rank 0 prints a markdown
table: search and trace seconds, first compile, that ratio, and the auto and hand plans' collectives per step and
cost-model communication (MiB-equivalent).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist


def measure(name: str, args: argparse.Namespace, size: int) -> dict:
    """Search, first compile and the two plans' prices of one config on this rank."""
    import thunder
    from litgpt import Config

    import thunder_tp
    from thunder_tp.plans.litgpt import GPTWithLoss

    config = Config.from_name(name, n_layer=args.n_layers, block_size=args.block_size)
    idx = torch.randint(0, config.padded_vocab_size, (args.batch, args.block_size),
                        generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = GPTWithLoss(config)
    transform = thunder_tp.TensorParallel("auto", example_inputs=((idx, idx), {}))
    start = time.perf_counter()
    jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors())
    search = time.perf_counter() - start
    plan = transform.plan
    hand, _ = plan.price(thunder_tp.plans.litgpt(model))  # on the search's trace, before the compile rewrites it
    calls = []
    for _ in range(2):
        start = time.perf_counter()
        jm(idx, idx).backward()
        calls.append(time.perf_counter() - start)
    assert plan.trace_reused, "the first call did not start from the search's trace"
    compile_without_search = calls[0] - calls[1] + plan.trace_seconds
    return {"model": name, "search": search, "trace": plan.trace_seconds, "compile": calls[0] - calls[1],
            "added": (search - plan.trace_seconds) / compile_without_search, "auto": plan.communication, "hand": hand}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="Llama-3.2-1B,pythia-160m", help="litgpt config names, comma-separated")
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = [measure(name, args, dist.get_world_size()) for name in args.models.split(",")]
    if dist.get_rank() == 0:
        print(f"\nTP={dist.get_world_size()}, {args.n_layers} layers, batch {args.batch} x {args.block_size}\n")
        print("| model | search (s) | of it: trace (s) | first compile, from the search's trace (s) | search less its "
              "trace / compile that interprets itself | auto plan | hand plan |")
        print("|---|---:|---:|---:|---:|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['search']:.1f} | {r['trace']:.1f} | {r['compile']:.1f} | "
                  f"{r['added']:.2f} | {r['auto']} | {r['hand']} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
