"""Llama-3-8B on an 8-GPU H100 node with the TP collectives decomposed for overlap (``TensorParallel(overlap=...)``):
exposed communication per layer and tokens/s/GPU against the undecomposed schedule (method: docs/gpu.md).

    python -m benchmarks.projection.overlap --tp 2,4,8 --sensitivity send_recv.latency_us=8 --json_path out.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import replace

import thunder
import torch

import thunder_tp
from benchmarks.lib.alpha_beta import LINKS, TORCHTITAN_8B, Link, PassProjection, flops, project_pass
from benchmarks.lib.harness import options, table, write_json
from benchmarks.lib.llama import LlamaConfig, thunder_tp_plan
from benchmarks.lib.modes import llama_on_meta
from thunder_tp.execution.overlap_cost import Costs, device_costs
from thunder_tp.thunder_internals.private import set_parameter

MODES = ("never", "auto", "always")
LLAMA_3_8B = dict(dim=4096, n_heads=32, n_kv_heads=8, vocab=128256, ffn_hidden=14336, rope_theta=500000.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options(__doc__)
    p.add_argument("--tp", default="2,4,8")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--layer_ms", type=float, default=6.31, help="a training step's compute per layer, measured")
    p.add_argument("--base_ms", type=float, default=8.58,
                   help="the rest of a step (embedding, head, loss, AdamW), measured: the whole step less the layers")
    p.add_argument("--measured_tp", type=int, default=8, help="the TP size of --layer_ms and --base_ms")
    p.add_argument("--link", choices=list(LINKS), default="h100_nvlink")
    p.add_argument("--sensitivity", action="append", default=[],
                   help="the same programs replayed again with the link changed, e.g. send_recv.latency_us=8 "
                        "(alpha_beta.Link.overridden; repeatable)")
    p.add_argument("--chunk_timings", default=None,
                   help="bench_chunked_matmuls.py's JSON, at commit c8c73c8 (chunks = TP size)")
    p.add_argument("--chunk_scales", default="1",
                   help="comma-separated factors on what the chunks add to compute (1: as priced; 0: free)")
    return p.parse_args(argv)


def traces(tp: int, layers: int, overlap, seq: int) -> tuple:
    """Rank tp-1's final forward and backward traces of the 8B Llama at ``layers`` layers, traced, not run."""
    cfg = LlamaConfig(n_layers=layers, max_seq=seq, **LLAMA_3_8B)
    with thunder_tp.one_rank(world_size=tp, rank=tp - 1, device="cpu"):
        tensor_parallel = thunder_tp.TensorParallel(thunder_tp_plan(True, True), overlap=overlap)
        jm = thunder.jit(llama_on_meta(cfg, torch.bfloat16), transforms=[tensor_parallel],
                         executors=thunder_tp.executors("inductor"))
        for name, p in list(jm.named_parameters()):  # uninitialized local pieces: the prologue checks their shapes
            set_parameter(jm, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad))
        for name, b in list(jm.named_buffers()):
            jm.set_buffer(name, torch.empty(b.shape, dtype=b.dtype))
        idx = torch.zeros(1, seq, dtype=torch.long)
        thunder.compile_data(jm)._get_computation_and_inputs(idx, idx)  # the traces of a call, without the call
        return thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]


def _matmul_seconds(costs: Costs):
    """A matmul symbol's time under the cost model, in FLOP-equivalents (``flops``' unit)."""
    def weigh(bsym) -> float:
        a = next(t for t in bsym.flat_args if hasattr(t, "shape"))
        out = next(t for t in bsym.flat_outs if hasattr(t, "shape"))
        rows = math.prod(int(d) for d in a.shape[:-1])
        return costs.matmul_s(rows, int(a.shape[-1]), int(out.shape[-1])) * costs.flops_per_s
    return weigh


def _total(trace, weigh) -> float:
    return sum(flops(b, weigh) for b in trace.bound_symbols)


def programs(args) -> tuple[dict, Callable]:
    """Per TP size, depth and mode: the (forward, backward) traces and each pass's compute."""
    measured = {depth: _step_flops(traces(args.measured_tp, depth, "never", args.seq)) for depth in (1, 2)}
    rate = measured[1] / ((args.base_ms + args.layer_ms) * 1e-3)  # FLOPs per measured second
    costs = replace(device_costs("nccl", "cuda", torch.bfloat16), flops_per_s=rate)
    model_time = _matmul_seconds(costs)
    timings = json.load(open(args.chunk_timings))["rows"] if args.chunk_timings else None
    out: dict = {}
    for tp in map(int, args.tp.split(",")):
        calibrated = 1.0 if timings is None else chunk_calibration(timings, tp, costs)
        print(f"TP {tp}: the chunks cost {calibrated:.2f} x what the model says", flush=True)
        for depth in (1, 2):
            pairs = {mode: traces(tp, depth, costs if mode == "auto" else mode, args.seq) for mode in MODES}
            whole = pairs["never"]
            step_flops = _step_flops(whole)
            compute = (args.base_ms + depth * args.layer_ms) * 1e-3 * step_flops / measured[depth]
            for mode, pair in pairs.items():
                for name, trace, reference in zip(("forward", "backward"), pair, whole, strict=True):
                    share = compute * _total(reference, flops) / step_flops
                    added = _total(trace, model_time) / _total(reference, model_time) - 1
                    out.setdefault(tp, {}).setdefault(depth, {}).setdefault(mode, {})[name] = (
                        trace, share, calibrated * added)
            print(f"TP {tp}, depth {depth}: traced", flush=True)
    return out, model_time


def project(programs: dict, model_time: Callable, link: Link, chunk_scale: float) -> dict:
    """Every pass of ``programs`` replayed on ``link``, what chunks add to compute times ``chunk_scale``."""
    return {tp: {depth: {mode: {name: project_pass(trace, share * (1 + chunk_scale * added), link,
                                                   lambda b: flops(b, model_time))
                                for name, (trace, share, added) in passes.items()}
                         for mode, passes in modes.items()}
                 for depth, modes in depths.items()}
            for tp, depths in programs.items()}


def _step_flops(pair) -> float:
    return sum(_total(t, flops) for t in pair)


def chunk_calibration(rows: list[dict], tp: int, costs: Costs) -> float:
    """What chunking the TP-``tp`` sites into ``tp`` pieces added on the GPU, over what the cost model adds."""
    measured = modelled = 0.0
    for r in (r for r in rows if r["tp"] == tp and r["chunks"] == tp):
        tokens, k, n = r["tokens"], r["k"], r["n"]
        whole = sum(r[f"{p}_whole_s"] for p in ("forward", "input_grad", "weight_grad"))
        measured += sum(r[f"{p}_chunked_s"] for p in ("forward", "input_grad", "weight_grad")) - whole
        inputs = [(k, n), (n, k)]  # the forward, the input grad: chunked; the weight grad: a call more per chunk
        modelled += sum(tp * costs.matmul_s(tokens // tp, a, b) - costs.matmul_s(tokens, a, b) for a, b in inputs)
        modelled += (tp - 1) * costs.matmul_call_s
    if modelled <= 0:
        raise ValueError(f"--chunk_timings has no rows of TP {tp} in {tp} chunks")
    return measured / modelled


def _sum(passes: dict[str, PassProjection], field: str) -> float:
    return sum(getattr(p, field) for p in passes.values())


def summary(args, projected: dict) -> dict:
    """Per TP and mode: per layer (depth 2 - depth 1) compute, serial communication, exposed communication."""
    rows = {}
    for tp, depths in projected.items():
        rows[tp] = {}
        for mode in MODES:
            one = {f: _sum(depths[1][mode], f) for f in ("compute_s", "comm_s", "no_overlap_s", "overlap_s")}
            layer = {f: _sum(depths[2][mode], f) - v for f, v in one.items()}
            whole = {f: v + (args.layers - 1) * layer[f] for f, v in one.items()}
            rows[tp][mode] = {
                "layer_compute_ms": layer["compute_s"] * 1e3, "layer_comm_ms": layer["comm_s"] * 1e3,
                "layer_exposed_ms": (layer["overlap_s"] - layer["compute_s"]) * 1e3,
                "tokens_per_s_no_overlap": args.seq / whole["no_overlap_s"] / tp,
                "tokens_per_s": args.seq / whole["overlap_s"] / tp,
            }
        base = rows[tp]["never"]
        for mode in MODES:
            rows[tp][mode]["exposed_vs_never"] = rows[tp][mode]["layer_exposed_ms"] / base["layer_exposed_ms"]
            rows[tp][mode]["chunk_cost_ms"] = rows[tp][mode]["layer_compute_ms"] - base["layer_compute_ms"]
    return rows


def report(args, link: Link, rows: dict) -> str:
    lines = [f"Llama-3-8B, bf16, 1 x {args.seq} tokens, SP + loss parallel, rank tp-1; compute: {args.layer_ms} ms "
             f"per layer + {args.base_ms} ms at TP {args.measured_tp} (scaled by FLOPs); {link.name}", ""]
    cells = [[tp, mode, *(f"{r[k]:.3f}" for k in ("layer_compute_ms", "chunk_cost_ms", "layer_comm_ms",
                                                   "layer_exposed_ms")), f"{r['exposed_vs_never']:.0%}",
              f"{r['tokens_per_s_no_overlap']:,.0f}", f"{r['tokens_per_s']:,.0f}"]
             for tp, modes in sorted(rows.items()) for mode, r in modes.items()]
    lines += table("TP> | mode | compute / layer (ms)> | chunks add (ms)> | comm / layer, serial (ms)> | "
                   "exposed / layer (ms)> | exposed vs undecomposed> | tokens/s/GPU, no overlap> | "
                   "tokens/s/GPU, schedule>", cells)
    titan = ", ".join(f"{k} {v:,} tokens/s/GPU" for k, v in TORCHTITAN_8B.items())
    return "\n".join([*lines, "", f"torchtitan, FSDP 8 x TP 8 on 64 H100s: {titan}"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    traced, model_time = programs(args)
    results = {}
    for override in ("", *args.sensitivity):
        link = LINKS[args.link].overridden(override) if override else LINKS[args.link]
        print(link.table(), "", sep="\n")
        for scale in map(float, args.chunk_scales.split(",")):
            rows = summary(args, project(traced, model_time, link, scale))
            print(f"what the chunks add, x {scale:g}:", report(args, link, rows), "", sep="\n")
            results[f"{override or 'as given'}, chunks x {scale:g}"] = rows
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json_path:
        write_json(args.json_path, {"args": vars(args), "links": results})


if __name__ == "__main__":
    main()
