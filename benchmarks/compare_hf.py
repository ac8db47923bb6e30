"""thunder_tp vs HuggingFace's own TP on the same HF Llama (CPU/gloo or CUDA/NCCL), side by side in one run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/compare_hf.py [--steps 10 --json_path out.json]

Rank 0 writes a seeded HF Llama (default: dim 512, 4 layers, 8 / 4 heads, FFN 1536, vocab 8192, fp32) with
``save_pretrained``; every mode loads that directory and trains it with the same step (forward with ``labels``,
backward, SGD) on the same batch (4 x 256 by default):

- ``hf_tp``: ``AutoModelForCausalLM.from_pretrained(dir, tp_plan="auto")``, HF's DTensor TP, eager (needs accelerate);
- ``thunder_tp`` / ``thunder_tp_lp``: ``thunder.jit`` of ``plans.CausalLMLoss(model)`` (only the loss returned)
  with ``TensorParallel(plans.hf(model))`` (loss parallel for the second), ``thunder_tp.executors()`` (or
  ``--executors thunder_default``).

Before timing, each mode's first-step loss and gradients (gathered to full tensors) are gated against one device's
eager step (``gate.py``). Reported per mode: median step time over ``--steps`` (after ``--warmup``), collectives per
step (thunder: from the traces; HF: counted with CommDebugMode), saved-for-backward bytes and peak step memory.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from compare import comm_mode, hooked_saved_bytes, summarize_records
from gate import check_gradients, full_grads
from harness import (
    EXECUTORS, collectives_per_iteration, exit_without_teardown, init_distributed, log, peak_step_bytes, random_batch,
    saved_for_backward, timed, write_json,
)
from litgpt_setup import HF_SIZES

MODES = ("hf_tp", "thunder_tp", "thunder_tp_lp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--n_layers", type=int, default=HF_SIZES["num_hidden_layers"])
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--grad_rtol", type=float, default=1e-4, help="gate: grads within this of their largest entry")
    p.add_argument("--executors", default="thunder", choices=sorted(EXECUTORS),
                   help="thunder: thunder_tp.executors(); thunder_default: Thunder's defaults + thunder_tp's comm executor")
    p.add_argument("--json_path", default="")
    return p.parse_args(argv)


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


def build(mode: str, directory: str, executors: str) -> nn.Module:
    """The module a mode trains: called as module(idx, targets) -> loss."""
    from transformers import AutoModelForCausalLM

    import thunder
    import thunder_tp
    from thunder_tp.plans.hf import CausalLMLoss

    if mode == "hf_tp":
        return CausalLMLoss(AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", torch_dtype=torch.float32))
    model = CausalLMLoss(AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32))
    plan = thunder_tp.plans.hf(model, loss_parallel=mode == "thunder_tp_lp")
    return thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan)], executors=EXECUTORS[executors]())


def step(module: nn.Module, optimizer, idx, targets) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = module(idx, targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def run_mode(mode: str, directory: str, idx, targets, reference: dict, args) -> dict:
    """Gate the first step against one device, then time; memory and collectives of one more step."""
    module = build(mode, directory, args.executors)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    loss = module(idx, targets)
    loss.backward()
    torch.testing.assert_close(loss.detach(), reference["loss"], rtol=1e-4, atol=1e-5)
    check_gradients(mode, full_grads(module), reference["grads"], args.grad_rtol)
    times = [timed(lambda: step(module, optimizer, idx, targets).item())[1] for _ in range(args.warmup + args.steps)]
    result = {"step_ms": 1000 * statistics.median(times[args.warmup:]), "loss": loss.item(),
              "peak_step_bytes": peak_step_bytes(lambda: step(module, optimizer, idx, targets))}
    if mode == "hf_tp":
        with comm_mode() as comm:
            saved, loss = hooked_saved_bytes(lambda: module(idx, targets), list(module.parameters()))
            loss.backward()
        result |= {"saved_bytes": saved, "collectives": summarize_records(comm.records)}
    else:
        import thunder

        result |= {"saved_bytes": saved_for_backward(thunder.last_traces(module)[-1])["bytes"],
                   "collectives": collectives_per_iteration(module)["per_iteration"]}
    return result


def reference_step(directory: str, idx, targets) -> dict:
    """One device's eager loss and grads."""
    from transformers import AutoModelForCausalLM

    from thunder_tp.plans.hf import CausalLMLoss

    model = CausalLMLoss(AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32))
    loss = model(idx, targets)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.double() for n, p in model.named_parameters()}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = init_distributed()
    torch.set_num_threads(1)
    directory = save_model(args, rank)
    idx, targets = random_batch(args.batch, args.seq, HF_SIZES["vocab_size"], 0, device)
    reference = reference_step(directory, idx, targets)
    results = {"world": world, "batch": args.batch, "seq": args.seq, "modes": {}}
    for mode in args.modes.split(","):
        results["modes"][mode] = run_mode(mode, directory, idx, targets, reference, args)
        log(rank, f"{mode}: {results['modes'][mode]['step_ms']:.1f} ms per step")
    base = results["modes"].get("hf_tp", {}).get("step_ms")
    for mode, r in results["modes"].items():
        r["vs_hf_tp"] = r["step_ms"] / base if base else None
        log(rank, f"{mode}: {r['step_ms']:.1f} ms ({r['vs_hf_tp'] or 0:.3f} x hf_tp), saved {r['saved_bytes']} B, "
                  f"peak step {r['peak_step_bytes']} B, collectives {r['collectives']}")
    if args.json_path and rank == 0:
        write_json(args.json_path, results)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
