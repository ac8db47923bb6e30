"""One rank of a TP group at true shapes, alone on this device: per-rank step time and memory, and a projection to N
(docs/gpu.md: the modes (a)-(i), the figures, the projection).

    python -m benchmarks.bench_rank --model Llama-3-8B --tp 1,2,4,8 --project          # a GPU
    python -m benchmarks.bench_rank --model tiny --tp 4 --quick                          # CI, on the CPU
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse
import gc
import itertools
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

from benchmarks.lib import harness, llama, modes
from benchmarks.lib.alpha_beta import LINKS, TORCHTITAN_8B, RecordedPass, extrapolate, project_step
from benchmarks.lib.llama import LlamaConfig
from benchmarks.lib.modes import MODES, How, dtensor, gpt_on_meta, init_local, llama_on_meta, unstepped

#: --model presets: the dims of litgpt's configs of those names (tiny: for the CPU)
PRESETS = {
    "Llama-3-8B": dict(n_layer=32, n_embd=4096, n_head=32, n_query_groups=8, intermediate_size=14336, vocab=128256),
    "Llama-3-70B": dict(n_layer=80, n_embd=8192, n_head=64, n_query_groups=8, intermediate_size=28672, vocab=128256),
    "tiny": dict(n_layer=2, n_embd=64, n_head=8, n_query_groups=4, intermediate_size=128, vocab=256),
}


#: --plan: thunder_tp's training modes of the registry
PLANS = ("tp", "tp_sp", "tp_lp", "tp_sp_lp")


@dataclass(frozen=True)
class RankMode:
    """A mode of the tables (docs/gpu.md): ``build`` makes one rank's module with random weights on ``device``."""

    key: str
    description: str
    runtime: str  # "thunder" or "compile"
    build: Callable[..., nn.Module]
    cuda_only: str = ""  # why it runs on CUDA only


def how(device: torch.device, quick: bool, backend: str | None = None, overlap: str = "auto") -> How:
    """Materialized on ``device``; ``quick``: no code generation (Thunder's default executors, Dynamo's eager)."""
    import thunder_tp
    executors = harness.thunder_default_executors if quick else partial(thunder_tp.executors, backend)
    return How(executors, overlap=overlap, materialize=device, compile_backend="eager" if quick else "inductor")


def _thunder_training(backend: str, cfg, device, dtype, quick: bool, plan: str, overlap: str) -> nn.Module:
    return MODES[plan].wrap(llama_on_meta(cfg, dtype), how(device, quick, backend, overlap))


def _dtensor_training(cfg, device, dtype, quick: bool, plan: str, overlap: str) -> nn.Module:
    """torchtitan's plan ("sp") or the best eager one, loss parallel as ``plan`` says, under torch.compile."""
    kind = "sp" if "sp" in plan else "best"
    return dtensor(llama_on_meta(cfg, dtype), how(device, quick), kind, compile=True, loss_parallel="lp" in plan)


def _thunder_decode(strategy: str | None, config, context: int, batch: int, device, dtype, quick: bool):
    """One rank's GPT and KV cache (built on the meta device) under the tp mode, through a ``thunder_tp.DecodeStep`` of
    ``strategy`` (quick: bound), or (None) the jitted module's call."""
    from litgpt.model import build_mask_cache

    import thunder_tp
    model = gpt_on_meta(config, context, dtype)
    model.set_kv_cache(batch_size=batch, device=torch.device("meta"), dtype=dtype)
    model.mask_cache = build_mask_cache(context + 1, device)  # a plain attribute, not a buffer
    jm = MODES["tp"].wrap(model, how(device, quick))
    strategy = "bound" if quick and strategy == "compiled" else strategy
    return jm if strategy is None else thunder_tp.DecodeStep(jm, strategy)


def _compiled_decode(registered: str, config, context: int, batch: int, device, dtype, quick: bool) -> nn.Module:
    """The GPT under ``registered`` (hand TP, or eager) with its KV cache, under torch.compile."""
    model = gpt_on_meta(config, context, dtype)
    model.collectives = []
    model = MODES[registered].wrap(model, how(device, quick))
    if registered == "eager":
        init_local(model, device)
    model.set_kv_cache(batch_size=batch, device=device, dtype=dtype)
    if quick:
        return torch.compile(model, backend="eager")
    return torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else "default")


TRAINING = (
    RankMode("a", "thunder_tp, nvFuser regions", "thunder", partial(_thunder_training, "nvfuser"),
             cuda_only="nvFuser runs on CUDA only"),
    RankMode("b", "thunder_tp, Inductor regions", "thunder", partial(_thunder_training, "inductor")),
    RankMode("c", "DTensor (torchtitan plan), torch.compile", "compile", _dtensor_training),
)
DECODE = (
    RankMode("d", "thunder_tp decode step, compiled whole", "thunder", partial(_thunder_decode, "compiled")),
    RankMode("e", "thunder_tp decode step, CUDA graph", "thunder", partial(_thunder_decode, "graph"),
             cuda_only="CUDA graphs need CUDA"),
    RankMode("f", "hand-written TP (gpt-fast style), torch.compile reduce-overhead", "compile",
             partial(_compiled_decode, "manual_tp")),
    RankMode("g", "thunder_tp, the jitted module's call", "thunder", partial(_thunder_decode, None)),
    RankMode("h", "thunder_tp decode step, bound (Thunder's regions, no prologue)", "thunder",
             partial(_thunder_decode, "bound")),
    RankMode("i", "one device, the whole GPT, torch.compile", "compile", partial(_compiled_decode, "eager")),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = harness.options(__doc__, dtype="bfloat16")
    p.add_argument("--model", choices=list(PRESETS), default="tiny")
    for dim in ("n_embd", "n_head", "n_query_groups", "intermediate_size", "vocab"):
        p.add_argument(f"--{dim}", type=int, default=None, help="override the preset's")
    p.add_argument("--full_layers", type=int, default=None, help="the depth reported (default: the preset's)")
    p.add_argument("--layers", default="0,2", help="depths measured: two (extrapolated to --full_layers) or one")
    p.add_argument("--tp", default="1,2,4,8", help="TP sizes")
    p.add_argument("--train_modes", default="a,b,c", help="training modes ('' for none)")
    p.add_argument("--decode_modes", default="d,e,f", help="decode modes ('' for none)")
    p.add_argument("--plan", choices=PLANS, default="tp_sp_lp",
                   help="training: TP, with sequence parallel (sp) and/or loss parallel (lp)")
    p.add_argument("--overlap", choices=["auto", "always", "never"], default="auto",
                   help="training: thunder_tp's collectives decomposed for overlap (TensorParallel(overlap=...))")
    for name, default, what in (("seq", 8192, "training sequence"), ("batch", 1, "training rows per step"),
                                ("context", 1024, "decode: cached positions"), ("steps", 5, "timed steps (medians)"),
                                ("warmup", 2, "untimed steps (the first compiles)")):
        p.add_argument(f"--{name}", type=int, default=default, help=what)
    p.add_argument("--decode_batches", default="1,8")
    p.add_argument("--quick", action="store_true",
                   help="no code generation (Thunder's default executors, Dynamo's eager): plumbing, not speed")
    p.add_argument("--project", action="store_true", help="print the projection to an 8-GPU node")
    p.add_argument("--link", choices=list(LINKS), default="h100_nvlink")
    p.add_argument("--decode_link", choices=list(LINKS), default="h100_nvlink_graph",
                   help="the link for the CUDA-graph decode rows (e)/(f)")
    p.add_argument("--link_override", default="", help="e.g. 'all_reduce.latency_us=18,all.bus_gbps=350'")
    args = p.parse_args(argv)
    args.depths = [int(d) for d in args.layers.split(",") if d]
    if not 1 <= len(args.depths) <= 2 or len(set(args.depths)) != len(args.depths):
        p.error("--layers: one depth, or two different ones")
    return args


def model_dims(args: argparse.Namespace) -> dict:
    """The preset's dims with the command line's overrides."""
    dims = dict(PRESETS[args.model])
    dims.update({k: getattr(args, k) for k in dims if getattr(args, k, None) is not None})
    dims["n_layer"] = args.full_layers or dims["n_layer"]
    return dims


def llama_config(dims: dict, layers: int, seq: int) -> LlamaConfig:
    return LlamaConfig(dim=dims["n_embd"], n_layers=layers, n_heads=dims["n_head"], n_kv_heads=dims["n_query_groups"],
                       vocab=dims["vocab"], ffn_hidden=dims["intermediate_size"], max_seq=seq, rope_theta=500000.0)


def run_row(tp: int, device: torch.device, measure: Callable[[], dict]) -> dict:
    """``measure()`` as the last rank of a fake group of ``tp`` ranks, after releasing what earlier rows left."""
    import thunder_tp
    left = release_memory(device)
    try:
        with thunder_tp.one_rank(tp, tp - 1, device), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            result = measure()
    except Exception as e:
        traceback.print_exc()
        return {"error": harness.error_line(e)}
    finally:
        release_memory(device)
    result["fallbacks"] = _fallbacks(caught)
    if device.type == "cuda" and result.get("peak_bytes") is not None:
        result.update(peak_bytes=result["peak_bytes"] - left, left_bytes=left)
    return result


def _fallbacks(caught: list[warnings.WarningMessage]) -> list[str]:
    """The warnings of regions that their backend rejected (thunder_tp.execution.fallback); the others shown."""
    from thunder_tp.execution.fallback import RegionFallbackWarning
    for w in caught:
        if not issubclass(w.category, RegionFallbackWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return [str(w.message) for w in caught if issubclass(w.category, RegionFallbackWarning)]


def release_memory(device: torch.device) -> int:
    """Frees what earlier rows left: unreachable objects, torch.compile's caches (Dynamo's cache entries keep the
    compiled modules' tensors alive), the CUDA allocator's cached blocks."""
    gc.collect()
    torch._dynamo.reset()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def training_row(mode: RankMode, args, dims: dict, depth: int, tp: int, device) -> dict:
    """One training measurement with the collectives of a step (a compiled mode runs one more, counted by
    CommDebugMode after timing: a dispatch mode makes Dynamo run the rest eagerly)."""
    from benchmarks.lib.side_by_side import counted_step
    cfg = llama_config(dims, depth, args.seq)
    torch.manual_seed(0)  # the same weights in every mode: (a) and (b) compute the same loss
    model = mode.build(cfg, device, harness.DTYPES[args.dtype], args.quick, plan=args.plan, overlap=args.overlap)
    batch = harness.random_batch(args.batch, args.seq, cfg.vocab, 1234, device)
    result = harness.timed_training(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-4), args.steps,
                                    args.warmup, device)
    result["param_bytes"] = harness.param_bytes(model)
    if mode.runtime == "thunder":
        return result | harness.thunder_structure(model)
    forward, backward = counted_step(model, *batch)
    return result | {"traces": {}, "collectives": {"forward": [[k, tp, b] for k, b in forward],
                                                   "backward": [[k, tp, b] for k, b in backward]}}


def decode_row(mode: RankMode, args, dims: dict, depth: int, tp: int, batch: int, device) -> dict:
    """One decode measurement with the collectives of a step."""
    config = llama.litgpt_config(llama_config(dims, depth, 8192))
    model = mode.build(config, args.context, batch, device, harness.DTYPES[args.dtype], args.quick)
    result = harness.timed_decode(model, batch, args.context, args.steps, args.warmup, device)
    module = unstepped(model)
    result.update(param_bytes=harness.param_bytes(module), kv_cache_bytes=harness.kv_cache_bytes(module))
    if mode.runtime == "thunder":
        return result | harness.thunder_structure(module)
    return result | {"traces": {}, "collectives": {"forward": [[k, tp, b] for k, b in model.collectives],
                                                   "backward": []}}


def _selected(table: tuple[RankMode, ...], keys: str, device: torch.device) -> tuple[list[RankMode], dict[str, str]]:
    """The modes of ``table`` named in ``keys`` that can run on ``device``, and the skipped ones with their reasons."""
    known = {m.key: m for m in table}
    chosen = [known[k] for k in modes.select(known, keys, "--train_modes / --decode_modes")]
    run = [m for m in chosen if device.type == "cuda" or not m.cuda_only]
    return run, {m.key: m.cuda_only for m in chosen if m not in run}


def sweep(args: argparse.Namespace, device: torch.device) -> dict:
    """Every (workload, TP size, mode, depth) row, then the figures at the reported depth and the projections."""
    dims = model_dims(args)
    train, train_skipped = _selected(TRAINING, args.train_modes, device)
    decode, decode_skipped = _selected(DECODE, args.decode_modes, device)
    rows = []
    for tp in [int(t) for t in args.tp.split(",") if t]:
        for mode in train:
            by_depth = {d: run_row(tp, device, partial(training_row, mode, args, dims, d, tp, device))
                        for d in args.depths}
            rows.append(_row("training", mode, tp, None, by_depth, args, dims))
        for batch in [int(b) for b in args.decode_batches.split(",") if b]:
            for mode in decode:
                by_depth = {d: run_row(tp, device, partial(decode_row, mode, args, dims, d, tp, batch, device))
                            for d in args.depths}
                rows.append(_row("decode", mode, tp, batch, by_depth, args, dims))
    return {"dims": dims, "rows": rows, "skipped": {**train_skipped, **decode_skipped}}


def _row(workload: str, mode: RankMode, tp: int, batch: int | None, by_depth: dict, args, dims) -> dict:
    """A row at the reported depth: every figure and the projection extrapolated from the measured depths."""
    row = {"workload": workload, "mode": mode.key, "description": mode.description, "tp": tp, "rank": tp - 1,
           "batch": batch if batch is not None else args.batch, "depths": by_depth}
    if errors := [r["error"] for r in by_depth.values() if "error" in r]:
        row["error"] = errors[0]
        return row
    for key in ("forward_s", "backward_s", "optimizer_s", "step_s", "host_s", "back_to_back_s", "peak_bytes",
                "param_bytes", "kv_cache_bytes"):
        if all(r.get(key) is not None for r in by_depth.values()):
            row[key] = _at_depth({d: r[key] for d, r in by_depth.items()}, dims["n_layer"])
    row["loss_finite"] = all(r["loss_finite"] for r in by_depth.values())
    row["collectives"] = by_depth[max(by_depth)]["collectives"]
    row["projection"] = _projection(workload, mode, by_depth, args, dims)
    return row


def _at_depth(values: dict[int, float], layers: int) -> float:
    return extrapolate(values, layers) if len(values) == 2 else next(iter(values.values()))


def _projection(workload: str, mode: RankMode, by_depth: dict, args, dims) -> dict:
    """The step on the link at each measured depth, extrapolated: seconds without and with overlap, and comm."""
    graphs = workload == "decode" and mode.key in ("e", "f")
    link = LINKS[args.decode_link if graphs else args.link].overridden(args.link_override)
    per_depth = {}
    for depth, r in by_depth.items():
        compute = ({"forward": r["forward_s"], "backward": r["backward_s"]} if workload == "training"
                   else {"forward": r["back_to_back_s"]})
        traces = r["traces"] or {name: RecordedPass(calls) for name, calls in r["collectives"].items()}  # unscheduled
        step = project_step(traces, compute, link, other_s=r.get("optimizer_s", 0.0))
        per_depth[depth] = {"no_overlap_s": step.no_overlap_s, "overlap_s": step.overlap_s, "comm_s": step.comm_s}
    out = {k: _at_depth({d: p[k] for d, p in per_depth.items()}, dims["n_layer"]) for k in per_depth[max(per_depth)]}
    out["overlap_s"] = min(out["overlap_s"], out["no_overlap_s"])  # two depths' lines may cross past the deeper one
    return {**out, "link": link.name, "overlap_from_trace": bool(by_depth[max(by_depth)]["traces"])}


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and print the tables; 1 where a row failed or a loss was not finite."""
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = sweep(args, device)
    failed = report(results, args, device)
    if args.json_path:
        for row in results["rows"]:
            for r in row["depths"].values():
                r.pop("traces", None)
        print("results written to "
              f"{harness.write_json(args.json_path, {'args': vars(args), 'device': str(device), **results})}")
    return 1 if failed else 0


#: the projection's references (docs/gpu.md): gpt-fast's Llama-3.1-8B decode at batch 1 on A100-80GB, tokens/s by TP
#: size, and the HBM bandwidth of an H100 SXM over an A100's (3.35 / 2.039 TB/s), which bounds decode
GPT_FAST_A100, H100_OVER_A100_BANDWIDTH = {1: 93.8, 2: 149.0, 4: 217.0, 8: 276.0}, 3.35 / 2.039
#: the decode modes that run thunder_tp's program (their collectives, bytes and parameters must agree)
THUNDER_DECODE = {"d", "e", "g", "h"}


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f}"


def _kinds(calls: list) -> str:
    """'9 all_reduce + 1 all_gather' of ``[kind, group size, bytes]`` calls."""
    counts = Counter(kind for kind, _, _ in calls)
    return " + ".join(f"{n} {k}" for k, n in counts.items()) or "none"


def _structure(row: dict) -> tuple:
    """What must agree between modes: collectives (kind, bytes, in order) of each pass and parameter bytes."""
    return tuple(tuple(map(tuple, row["collectives"][p])) for p in ("forward", "backward")), row.get("param_bytes")


def _describe_difference(a: dict, b: dict) -> str:
    """Each pass's collectives and the parameter bytes of two rows, where they differ."""
    def calls(row: dict, p: str) -> str:
        return f"{_kinds(row['collectives'][p])}, {harness.fmt_bytes(sum(c[2] for c in row['collectives'][p]))}"
    parts = [f"{p}: {calls(a, p)} vs {calls(b, p)}" for p in ("forward", "backward") if calls(a, p) != calls(b, p)]
    if a.get("param_bytes") != b.get("param_bytes"):
        parts.append(f"parameters {harness.fmt_bytes(a.get('param_bytes'))} vs "
                     f"{harness.fmt_bytes(b.get('param_bytes'))}")
    return "; ".join(parts) or "the same"


def _failed(r: dict, *cells) -> str:
    """A failed row: its leading cells, the mode and the error."""
    return "| " + " | ".join(map(str, cells)) + f" | ({r['mode']}) {r['description']} | failed: {r['error']} |||||||||"


def _training_table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    cells = [_failed(r, r["tp"]) if "error" in r else
             [r["tp"], f"({r['mode']}) {r['description']}",
              *(_ms(r[k]) for k in ("step_s", "forward_s", "backward_s", "optimizer_s")), _peak(r),
              harness.fmt_bytes(r["param_bytes"]),
              f"{_kinds(r['collectives']['forward'])} / {_kinds(r['collectives']['backward'])}",
              "yes" if r["loss_finite"] else "NO", f"{r['batch'] * args.seq / r['step_s'] / r['tp']:.0f}"]
             for r in rows]
    return harness.table("TP> | mode | step (ms)> | forward> | backward> | AdamW> | peak memory> | params / rank> | "
                         f"collectives fwd / bwd ({max(args.depths)} layers) | loss finite | "
                         "tokens/s/GPU, compute only>", cells)


def _peak(row: dict) -> str:
    """The peak memory and how it was had: extrapolated, or measured at the one depth run."""
    if row.get("peak_bytes") is None:
        return harness.fmt_bytes(None)
    depths = list(row["depths"])
    return f"{harness.fmt_bytes(row['peak_bytes'])} ({'extrapolated' if len(depths) == 2 else f'{depths[0]} layers'})"


def _memory_notes(rows: list[dict]) -> list[str]:
    """What earlier rows left allocated."""
    left = {id(r): max((d.get("left_bytes", 0) for d in r["depths"].values()), default=0) for r in rows}
    return [f"- {r['workload']} TP={r['tp']} ({r['mode']}): {harness.fmt_bytes(left[id(r)])} still allocated before "
            "its run, subtracted from its peak" for r in rows if left[id(r)]]


def _per_layer_us(row: dict) -> str:
    """The back-to-back step's growth per layer between the two measured depths (µs)."""
    depths = sorted(row["depths"])
    if len(depths) != 2:
        return "–"
    steps = [row["depths"][d]["back_to_back_s"] for d in depths]
    return f"{(steps[1] - steps[0]) / (depths[1] - depths[0]) * 1e6:.0f}"


def _decode_table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    cells = [_failed(r, r["tp"], r["batch"]) if "error" in r else
             [r["tp"], r["batch"], f"({r['mode']}) {r['description']}", _ms(r["step_s"]), _ms(r["host_s"]),
              _ms(r["back_to_back_s"]), _per_layer_us(r), f"{r['host_s'] / r['step_s']:.2f}",
              f"{r['batch'] / r['back_to_back_s']:.1f}", _kinds(r["collectives"]["forward"]),
              harness.fmt_bytes(r["param_bytes"]), harness.fmt_bytes(r.get("kv_cache_bytes"))] for r in rows]
    return harness.table("TP> | batch> | mode | step (ms)> | host (ms)> | back-to-back step (ms)> | per layer (µs)> | "
                         f"host / step> | tokens/s, compute only> | collectives / step ({max(args.depths)} layers) | "
                         "params / rank> | KV cache / rank>", cells)


def _losses_agree(a: dict, b: dict, dtype: str) -> tuple[bool, str]:
    """Whether two training rows' first measured losses at their deepest depth (the same weights and batch) agree:
    within a few roundings of a bf16 loss (2e-2 relative), else 1e-4."""
    la, lb = (r["depths"][max(r["depths"])]["samples"][0]["loss"] for r in (a, b))
    rtol = 2e-2 if dtype == "bfloat16" else 1e-4
    agree = abs(la - lb) <= rtol * max(abs(la), abs(lb))
    return agree, f"loss {la:.4f} vs {lb:.4f}{'' if agree else f' (must agree within {rtol:g}: FAILED)'}"


def _structure_lines(rows: list[dict], dtype: str) -> tuple[list[str], bool]:
    """Per TP size: thunder_tp's two backends must agree exactly (else a failure), and in training their losses too."""
    lines, failed = [], False
    by_tp: dict[tuple, dict[str, dict]] = {}
    for r in (r for r in rows if "error" not in r):
        by_tp.setdefault((r["workload"], r["tp"], r["batch"]), {})[r["mode"]] = r
    for (workload, tp, batch), by_mode in by_tp.items():
        for a, b in itertools.combinations(sorted(by_mode), 2):
            ra, rb = by_mode[a], by_mode[b]
            same, must = _structure(ra) == _structure(rb), {a, b} <= {"a", "b"} or {a, b} <= THUNDER_DECODE
            verdict = "same collectives, bytes and parameters" if same else _describe_difference(ra, rb)
            if must and not same:
                failed, verdict = True, f"{verdict} (must agree: FAILED)"
            if workload == "training" and {a, b} == {"a", "b"}:
                agree, losses = _losses_agree(ra, rb, dtype)
                failed, verdict = failed or not agree, f"{verdict}; {losses}"
            where = f"{workload} TP={tp}{f', batch {batch}' if workload == 'decode' else ''}"
            lines.append(f"- {where}: ({a}) vs ({b}): {verdict}")
    return lines, failed


def _reference(workload: str, tp: int, model: str) -> str:
    if workload == "training":
        return f"torchtitan 8B: {TORCHTITAN_8B['without async TP']} (FSDP8 x TP8)" if model == "Llama-3-8B" else "–"
    a100 = GPT_FAST_A100.get(tp)
    if a100 is None or model != "Llama-3-8B":
        return "–"
    return f"gpt-fast A100: {a100:g}; x H100/A100 bandwidth: {a100 * H100_OVER_A100_BANDWIDTH:.0f}"


def _projection_table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    cells = []
    for r in (r for r in rows if "error" not in r):
        p = r["projection"]
        if r["workload"] == "training":  # rates in tokens/s per GPU
            tokens, compute = r["batch"] * args.seq / r["tp"], r["step_s"]
        else:  # tokens/s
            tokens, compute = r["batch"], r["back_to_back_s"]
        overlap = f"{tokens / p['overlap_s']:.1f}" if p["overlap_from_trace"] else "– (no trace)"
        cells.append([r["workload"], r["tp"], r["batch"], f"({r['mode']})", _ms(compute), _ms(p["comm_s"]),
                      _ms(p["no_overlap_s"]), _ms(p["overlap_s"]), f"{tokens / p['no_overlap_s']:.1f}", overlap,
                      _reference(r["workload"], r["tp"], args.model)])
    return harness.table("workload | TP> | batch> | mode | compute (ms)> | communication (ms)> | "
                         "step, no overlap (ms)> | step, overlap (ms)> | no overlap> | overlap> | reference", cells)


def report(results: dict, args: argparse.Namespace, device: torch.device) -> bool:
    """Print every table; True where a row failed, a loss was not finite or thunder_tp's modes disagreed."""
    dims = results["dims"]
    depths = " and ".join(map(str, args.depths))
    scaled = f"measured at {depths} layers, extrapolated per layer to {dims['n_layer']}" if len(args.depths) == 2 \
        else f"{depths} layers as measured"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{args.model} shapes (n_embd {dims['n_embd']}, {dims['n_head']} heads / {dims['n_query_groups']} K/V, "
          f"FFN {dims['intermediate_size']}, vocab {dims['vocab']}), {scaled}; {args.dtype}; one rank of a fake group "
          f"on {name}{'; --quick (no code generation)' if args.quick else ''}; medians of {args.steps} steps")
    for key, reason in results["skipped"].items():
        print(f"mode ({key}) skipped: {reason}")
    rows = results["rows"]
    training = [r for r in rows if r["workload"] == "training"]
    decode = [r for r in rows if r["workload"] == "decode"]
    if training:
        print(f"\nTraining (forward + backward + AdamW, batch {args.batch} x seq {args.seq}, plan {args.plan}):\n")
        print(*_training_table(training, args), sep="\n")
    if notes := _memory_notes([r for r in rows if "error" not in r]):
        print("\nPeak memory:", *notes, sep="\n")
    fallbacks = [f"- {r['workload']} TP={r['tp']} ({r['mode']}), {depth} layers: {message}" for r in rows
                 for depth, d in r["depths"].items() for message in d.get("fallbacks", ())]
    if fallbacks:
        print("\nFALLBACK: regions that their backend rejected ran on the next one:", *fallbacks, sep="\n")
    if decode:
        print(f"\nDecode (one token, {args.context} cached positions):\n")
        print(*_decode_table(decode, args), sep="\n")
    structure, failed = _structure_lines(rows, args.dtype)
    print("\nStructure per TP size (collectives: kind, bytes, order; parameter bytes per rank):", *structure, sep="\n")
    if args.project:
        link = LINKS[args.link].overridden(args.link_override)
        print("\nProjection to one 8-GPU node (compute measured here + alpha-beta communication; training in "
              "tokens/s/GPU, decode in tokens/s):\n")
        print(link.table(), "", *_projection_table(rows, args), sep="\n")
        print(f"(decode rows (e), (f) on {args.decode_link}; details and what the model leaves out: docs/gpu.md)")
    bad = [r for r in rows if "error" in r or not r.get("loss_finite", False)]
    for r in bad:
        print(f"ERROR: {r['workload']} TP={r['tp']} ({r['mode']}): {r.get('error', 'loss or logits not finite')}")
    return bool(bad) or failed


if __name__ == "__main__":
    sys.exit(main())
