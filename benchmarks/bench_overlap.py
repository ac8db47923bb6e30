"""Collectives decomposed for overlap on this machine: the training step with ``TensorParallel(overlap="never")``
and ``overlap="always"`` side by side, and what chunked matmuls cost against one.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.bench_overlap --json_path overlap.json

The benchmark Llama (``lib/llama.py``, compare.py's dims by default), ``--batch`` x ``--seq`` tokens, fp32,
``thunder_tp.executors()`` (Inductor regions), forward + cross-entropy + backward + SGD, per plan (``--plans``: tp,
tp_sp): both programs are built from the same weights, their first losses and grads compared (within
``--grad_rtol`` of each grad's largest entry), then timed in alternating rounds (medians of the slowest rank's
steps). Each rank is pinned to its own core. Printed per row: the step, the collectives of a step (the decomposed
ones in pieces: ``send_recv`` for the shifts of an all_gather or reduce_scatter), and what ``overlap="auto"``
would decompose on this machine. Then, on rank 0 alone: every matmul of a layer at its TP shape, whole and in k
chunks of tokens (each chunk's matmul on a contiguous view, as the decomposed program runs them).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse
import statistics
from dataclasses import asdict

import thunder
import torch
import torch.distributed as dist

import thunder_tp
from benchmarks.lib import chunked_matmuls
from benchmarks.lib.harness import (
    alternating_rounds,
    init_distributed,
    pin_to_core,
    random_batch,
    seeded_model,
    time_steps,
    write_json,
)
from benchmarks.lib.llama import Llama, LlamaConfig, WithLoss, thunder_tp_plan
from thunder_tp.tools.debug import collective_calls

OVERLAPS = ("never", "always")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cfg = LlamaConfig()
    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "ffn_hidden"):
        p.add_argument(f"--{f}", type=int, default=getattr(cfg, f))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--plans", default="tp,tp_sp", help="comma-separated: tp, tp_sp")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode, over the rounds")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--grad_rtol", type=float, default=1e-4)
    p.add_argument("--chunks", default="tp,4", help="chunk counts of the matmul timing (tp: the TP size)")
    p.add_argument("--matmul_repeats", type=int, default=30)
    p.add_argument("--json_path", default=None)
    return p.parse_args(argv)


def _config(args) -> LlamaConfig:
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "ffn_hidden")
    return LlamaConfig(**{f: getattr(args, f) for f in fields}, max_seq=args.seq)


def _collectives(jm) -> str:
    """A step's collectives: kind x count per pass."""
    parts = []
    for name, traces in (("fwd", thunder.last_traces(jm)), ("bwd", thunder.last_backward_traces(jm))):
        counts: dict[str, int] = {}
        for call in collective_calls(traces[-1]):
            counts[call["kind"]] = counts.get(call["kind"], 0) + 1
        parts.append(f"{name} " + " + ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return "; ".join(parts)


def _build(cfg: LlamaConfig, plan: str, overlap: str):
    model = seeded_model(lambda: WithLoss(Llama(cfg)), 0)
    transform = thunder_tp.TensorParallel(thunder_tp_plan(plan == "tp_sp"), overlap=overlap)
    jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors())
    return jm, torch.optim.SGD(jm.parameters(), lr=1e-3)


def _step(jm, optimizer, idx, targets) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = jm(idx, targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _first_grads(jm, idx, targets) -> tuple[float, dict[str, torch.Tensor]]:
    loss = jm(idx, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in jm.named_parameters()}
    jm.zero_grad(set_to_none=True)
    return loss.item(), grads


def _check_same(first: dict, rtol: float) -> None:
    (loss0, grads0), (loss1, grads1) = first.values()
    if abs(loss0 - loss1) > rtol * abs(loss0):
        raise AssertionError(f"losses differ: {loss0} / {loss1}")
    for n, g in grads0.items():
        scale = g.abs().max().item() or 1.0
        if (grads1[n] - g).abs().max().item() > rtol * scale:
            raise AssertionError(f"grad of {n} differs beyond {rtol} of its largest entry")


def train_rows(args, cfg: LlamaConfig) -> dict:
    """Per plan: the step with and without the decomposition, alternating."""
    idx, targets = random_batch(args.batch, args.seq, cfg.vocab, 0, torch.device("cpu"))
    rows = {}
    for plan in args.plans.split(","):
        built = {overlap: _build(cfg, plan, overlap) for overlap in OVERLAPS}
        _check_same({o: _first_grads(jm, idx, targets) for o, (jm, _) in built.items()}, args.grad_rtol)
        for jm, opt in built.values():
            for _ in range(args.warmup):
                _step(jm, opt, idx, targets)
        times: dict[str, list[float]] = {o: [] for o in OVERLAPS}
        per_round = max(1, args.steps // args.rounds)
        for _, overlap in alternating_rounds(list(OVERLAPS), args.rounds):
            jm, opt = built[overlap]
            times[overlap] += time_steps(lambda jm=jm, opt=opt: _step(jm, opt, idx, targets), per_round,
                                         distributed=True)[0]
        rows[plan] = {o: {"median_s": statistics.median(t), "times_s": t, "collectives": _collectives(built[o][0])}
                      for o, t in times.items()}
        rows[plan]["auto"] = _auto_collectives(cfg, plan, idx, targets)
    return rows


def _auto_collectives(cfg: LlamaConfig, plan: str, idx, targets) -> str:
    """What overlap="auto" issues here (Thunder's default executors: the decision, not a timing)."""
    model = seeded_model(lambda: WithLoss(Llama(cfg)), 0)
    transform = thunder_tp.TensorParallel(thunder_tp_plan(plan == "tp_sp"), overlap="auto")
    jm = thunder.jit(model, transforms=[transform], executors=[thunder_tp.collectives.comm_executor])
    jm(idx, targets).backward()
    return _collectives(jm)


def matmul_rows(args, size: int) -> list[dict]:
    """Each matmul of a layer at its TP shape, whole and in chunks of tokens (lib/chunked_matmuls.py)."""
    model = {"dim": args.dim, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "ffn_hidden": args.ffn_hidden}
    return chunked_matmuls.measure(model, args.batch * args.seq, [size], args.chunks, torch.device("cpu"),
                                   torch.float32, args.matmul_repeats)


def report(args, train: dict, matmuls: list[dict]) -> str:
    lines = [f"benchmark Llama dim {args.dim}, {args.n_layers} layers, {args.batch} x {args.seq} tokens, fp32, "
             f"{dist.get_world_size()} gloo ranks, thunder_tp.executors(); medians of {args.steps} steps", "",
             "| plan | overlap=\"never\" (ms) | overlap=\"always\" (ms) | always / never | collectives (never) | "
             "collectives (always) | overlap=\"auto\" issues |", "|---|---:|---:|---:|---|---|---|"]
    for plan, row in train.items():
        never, always = row["never"]["median_s"], row["always"]["median_s"]
        lines.append(f"| {plan} | {never * 1e3:.1f} | {always * 1e3:.1f} | {always / never:.3f} | "
                     f"{row['never']['collectives']} | {row['always']['collectives']} | {row['auto']} |")
    lines += ["", chunked_matmuls.report(matmuls)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, size, _ = init_distributed()
    pin_to_core()
    torch.set_num_threads(1)
    cfg = _config(args)
    train = train_rows(args, cfg)
    matmuls = matmul_rows(args, size) if rank == 0 else []
    dist.barrier()
    if rank == 0:
        print(report(args, train, matmuls), flush=True)
        if args.json_path:
            write_json(args.json_path, {"config": asdict(cfg), "args": vars(args), "train": train,
                                        "matmuls": matmuls})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
