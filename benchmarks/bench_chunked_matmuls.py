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

import torch

from benchmarks.lib.chunked_matmuls import MODELS, measure, report
from benchmarks.lib.harness import DTYPES, options, write_json


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
