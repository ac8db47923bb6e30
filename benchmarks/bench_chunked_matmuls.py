"""What chunked matmuls cost against whole ones: each matmul of a Llama layer at its TP shape, whole and cut into
chunks of tokens, as the collectives decomposed for overlap run them (``TensorParallel(overlap=...)``).

    python -m benchmarks.bench_chunked_matmuls --model Llama-3-8B --tp 2,4,8 --device cuda --json_path chunked.json
    python -m benchmarks.bench_chunked_matmuls --model benchmark --tp 2 --tokens 512 --dtype float32   # the CPU

Per site (wq|wk|wv, wo, w1|w3, w2) and chunk count (``--chunks``; "tp": as many as the TP size, the per-rank pieces
of sequence parallel): the forward (each chunk's output), the backward's input grads (one matmul per chunk) and
weight grads (a matmul per chunk, summed), whole against chunked, medians of ``--repeats`` (CUDA: synchronized).
``benchmarks/projection/overlap.py --chunk_timings`` reads the JSON to price the chunks instead of its model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.lib.harness import DTYPES, options, write_json

MODELS = {
    "Llama-3-8B": dict(dim=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, tokens=8192),
    "benchmark": dict(dim=512, n_heads=8, n_kv_heads=4, ffn_hidden=1536, tokens=512),  # the benchmark Llama
}


def sites(model: dict, tp: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of each site's matmul on one rank of ``tp`` (w1|w3 and wq|wk|wv as one)."""
    head_dim = model["dim"] // model["n_heads"]
    return {"wq|wk|wv": (model["dim"], (model["n_heads"] + 2 * model["n_kv_heads"]) * head_dim // tp),
            "wo": (model["dim"] // tp, model["dim"]), "w1|w3": (model["dim"], 2 * model["ffn_hidden"] // tp),
            "w2": (model["ffn_hidden"] // tp, model["dim"])}


def median_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` (the device's work included)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _weight_grad(dys: list[torch.Tensor], xs: list[torch.Tensor]) -> torch.Tensor:
    total = dys[0].t() @ xs[0]
    for dy, x in zip(dys[1:], xs[1:], strict=True):
        total = total + dy.t() @ x
    return total


def time_site(tokens: int, k: int, n: int, chunks: int, device: torch.device, dtype: torch.dtype,
              repeats: int) -> dict[str, float]:
    """Forward, input grad and weight grad of (tokens x k) @ (k x n): whole and in ``chunks`` chunks of tokens."""
    x, w = torch.randn(tokens, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype)
    dy = torch.randn(tokens, n, device=device, dtype=dtype)
    xs, dys = x.split(tokens // chunks), dy.split(tokens // chunks)
    work = {
        "forward": (lambda: F.linear(x, w), lambda: [F.linear(p, w) for p in xs]),
        "input_grad": (lambda: dy @ w, lambda: [p @ w for p in dys]),
        "weight_grad": (lambda: dy.t() @ x, lambda: _weight_grad(dys, xs)),
    }
    out = {}
    for name, (whole, chunked) in work.items():
        out[f"{name}_whole_s"] = median_s(whole, repeats, device)
        out[f"{name}_chunked_s"] = median_s(chunked, repeats, device)
    return out


def measure(model: dict, tokens: int, tps: list[int], chunk_counts: str, device: torch.device, dtype: torch.dtype,
            repeats: int) -> list[dict]:
    """One row per (TP size, chunk count, site): its shape and the medians of ``time_site``."""
    rows = []
    for tp in tps:
        counts = [tp if c == "tp" else int(c) for c in chunk_counts.split(",")]
        for chunks in dict.fromkeys(counts):
            for site, (k, n) in sites(model, tp).items():
                row = {"tp": tp, "chunks": chunks, "site": site, "tokens": tokens, "k": k, "n": n,
                       "shape": f"({tokens} x {k}) @ ({k} x {n})"}
                rows.append(row | time_site(tokens, k, n, chunks, device, dtype, repeats))
    return rows


def report(rows: list[dict]) -> str:
    """The rows as a markdown table: whole times and chunked / whole ratios."""
    lines = ["| TP | chunks | site | shape | forward: whole (ms) / chunked | input grads | weight grads | "
             "all three: chunked / whole |", "|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[f'{p}_whole_s'] * 1e3:.3f} / {r[f'{p}_chunked_s'] / r[f'{p}_whole_s']:.2f}x"
                 for p in ("forward", "input_grad", "weight_grad")]
        whole = sum(r[f"{p}_whole_s"] for p in ("forward", "input_grad", "weight_grad"))
        chunked = sum(r[f"{p}_chunked_s"] for p in ("forward", "input_grad", "weight_grad"))
        lines.append(f"| {r['tp']} | {r['chunks']} | {r['site']} | {r['shape']} | {' | '.join(cells)} | "
                     f"{chunked / whole:.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options(__doc__, dtype="bfloat16")
    p.add_argument("--model", choices=list(MODELS), default="Llama-3-8B")
    p.add_argument("--tokens", type=int, default=None, help="batch x seq (default: the model's)")
    p.add_argument("--tp", default="2,4,8")
    p.add_argument("--chunks", default="tp", help="comma-separated chunk counts; tp: the TP size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=20)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = MODELS[args.model]
    device = torch.device(args.device)
    tokens = args.tokens or model["tokens"]
    rows = measure(model, tokens, [int(t) for t in args.tp.split(",")], args.chunks, device, DTYPES[args.dtype],
                   args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{args.model} sites, {tokens} tokens, {args.dtype}, {name}; medians of {args.repeats}\n")
    print(report(rows), flush=True)
    if args.json_path:
        write_json(args.json_path, {"args": vars(args), "device": name, "rows": rows})


if __name__ == "__main__":
    main()
