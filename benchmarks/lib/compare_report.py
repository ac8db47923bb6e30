"""The side-by-side report of ``benchmark_litgpt --compare``: the markdown table, the targets and the JSON."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict

import torch

from benchmarks.lib.harness import write_json


def _mb(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _comm_cell(r: dict) -> str:
    f, b = r.get("comm_forward_trace") or r.get("comm_forward"), r.get("comm_backward_trace") or r.get("comm_backward")
    if f is None or b is None:
        return "-"

    def short(c):
        abbrev = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}
        return " ".join(f"{n}{abbrev.get(k, k)}" for k, n in sorted(c["counts"].items())) or "0"

    return f"{short(f)} / {short(b)}"


def comm_bytes(r: dict) -> int | None:
    """Bytes a mode's collectives move per step (forward + backward), from its traces or else counted at runtime."""
    f, b = r.get("comm_forward_trace") or r.get("comm_forward"), r.get("comm_backward_trace") or r.get("comm_backward")
    return None if f is None or b is None else f["bytes"] + b["bytes"]


def baseline_for(name: str) -> str:
    """The 1-rank run a mode's speed-up is measured against: same model family and runtime."""
    family = name.rpartition(":")[0] or ("hf" if name == "hf_tp" else "")
    if family:
        return f"{family}:thunder"
    return "thunder" if name.startswith(("tp", "thunder")) else "eager"


def speedup(results: dict, name: str, step_s: float) -> float | None:
    """A step of ``step_s`` seconds of mode ``name`` against its 1-rank baseline's median; None without one."""
    base = results.get(baseline_for(name), {}).get("median_s")
    return base / step_s if base else None


def parallel_efficiency(results: dict, name: str, step_s: float) -> float | None:
    """``speedup`` per rank of mode ``name``."""
    faster = speedup(results, name, step_s)
    return faster / results[name]["ranks"] if faster else None


def _saved_cell(r: dict) -> str:
    if r.get("runtime") == "thunder" and r.get("saved_bytes_hooks") is not None:
        return f"{_mb(r.get('saved_bytes'))} ({_mb(r['saved_bytes_hooks'])})"
    return _mb(r.get("saved_bytes"))


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown_table(results: dict) -> str:
    """One row per mode: step times, speed-ups, memory, fusion regions and collectives, or why it was not timed."""
    ref = (results.get("dtensor_tp") or results.get("hf_tp") or {}).get("median_s")
    lines = [
        "| mode | ranks | step median (ms) | min–max (ms) | tokens/s | × DTensor TP (or HF's) | speed-up vs 1 rank "
        "| parallel eff. | first iter (s) | params/rank (MB) | saved for bwd (MB) | peak step mem (MB) "
        "| page faults/step | fusion regions fwd / bwd | collectives fwd / bwd | comm/step (MB) | loss ok |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for name, r in results.items():
        first = _fmt(r.get("first_iter_s"), ".1f")
        if "median_s" not in r:
            reason = r.get("error") or r.get("skipped") or "not run"
            lines.append(f"| {name} | {r.get('ranks', '–')} | – | – | – | – | – | – | {first} | – | – | – | – | – | – "
                         f"| – | {reason} |")
            continue
        faster = speedup(results, name, r["median_s"])
        cells = [
            name, str(r["ranks"]), f"{r['median_s'] * 1e3:.0f}", f"{r['min_s'] * 1e3:.0f}–{r['max_s'] * 1e3:.0f}",
            f"{r['tokens_per_s']:.0f}", _fmt(r["median_s"] / ref if ref else None, ".2f"), _fmt(faster, ".2f"),
            _fmt(parallel_efficiency(results, name, r["median_s"]), ".2f"), first, _mb(r.get("param_bytes")),
            _saved_cell(r),
            _mb(r.get("peak_step_bytes")), _fmt(r.get("minor_faults_per_step"), ".0f"),
            " / ".join(map(str, r["fusion_regions"])) if "fusion_regions" in r else "–",
            _comm_cell(r), _mb(comm_bytes(r)), "yes" if r.get("loss_ok") else "NO",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_line(r: dict) -> str:
    """One mode's result in a line (the progress log)."""
    if "median_s" not in r:
        return r.get("error") or r.get("skipped") or "not run"
    return (f"median {r['median_s'] * 1e3:.0f} ms (min {r['min_s'] * 1e3:.0f}, max {r['max_s'] * 1e3:.0f}), "
            f"first iter {r['first_iter_s']:.1f} s, loss {r['loss_step1']:.6f}, comm {_comm_cell(r)}, "
            f"{r.get('minor_faults_per_step', 0):.0f} page faults/step")


def paired_ratio(a: dict, b: dict) -> float | None:
    """Median over the rounds of a's step time over b's in the same round (both medians of their round's steps):
    the modes of a round run minutes apart at most, so the host's drift between rounds cancels."""
    pairs = [x / y for x, y in zip(a.get("round_medians_s", []), b.get("round_medians_s", []), strict=True)]
    return statistics.median(pairs) if pairs else None


def _ratio(a: dict, b: dict, target: float) -> dict:
    """``a``'s step time over ``b``'s: of the medians over all steps, and paired by round."""
    return {"ratio": a["median_s"] / b["median_s"], "ratio_paired_by_round": paired_ratio(a, b), "target": target}


def _efficiency(tp: dict, single: dict, world: int, target: float) -> dict:
    """The single device's step time over ``world`` times the TP mode's: of the medians, and paired by round."""
    paired = paired_ratio(single, tp)
    return {"value": single["median_s"] / (world * tp["median_s"]),
            "value_paired_by_round": None if paired is None else paired / world, "target": target}


def targets_summary(results: dict, world: int) -> dict:
    """The run against its targets (step time against DTensor's and the single device's, first iteration against
    plain thunder.jit), measured."""
    out: dict = {}
    tp, dt, single = (results.get(n, {}) for n in ("tp", "dtensor_tp", "thunder"))
    if "median_s" in tp and "median_s" in dt:
        out["tp_vs_dtensor"] = _ratio(tp, dt, 0.85)
    if "median_s" in tp and "median_s" in single:
        out["parallel_efficiency"] = _efficiency(tp, single, world, 0.9)
    lp, dt_lp = (results.get(n, {}) for n in ("tp_lp", "dtensor_tp_lp"))
    if "median_s" in lp and "median_s" in dt_lp:
        out["tp_vs_dtensor_loss_parallel"] = _ratio(lp, dt_lp, 0.85)
    if "median_s" in lp and "median_s" in single:
        out["parallel_efficiency_loss_parallel"] = _efficiency(lp, single, world, 0.9)
    for name in ("hf:tp", "hf:tp_lp"):
        if "median_s" in results.get(name, {}) and "median_s" in results.get("hf_tp", {}):
            out[f"{name}_vs_hf_tp"] = _ratio(results[name], results["hf_tp"], 0.7)
    if "first_iter_s" in tp and "first_iter_s" in single:
        out["first_iter_vs_thunder_jit"] = {"ratio": tp["first_iter_s"] / single["first_iter_s"], "target": 1.3}
    if "comm_forward_trace" in tp:
        out["tp_collectives"] = {"forward": tp["comm_forward_trace"]["counts"],
                                            "backward": tp["comm_backward_trace"]["counts"]}
    return out


def report(args, cfg, world: int, results: dict) -> None:
    """Print the run's header, the table and the targets; write the JSON."""
    table = markdown_table(results)
    print()
    print(f"Llama dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} ffn={cfg.ffn_hidden} "
          f"vocab={cfg.vocab}, batch={args.micro_batch_size} seq={args.block_size}; {world} ranks x "
          f"{torch.get_num_threads()} thread, "
          f"{'NCCL' if torch.cuda.is_available() else 'gloo'}; "
          f"median of {args.max_iters - args.warmup_iters} steps after {args.warmup_iters} warm-up")
    print()
    print(table)
    summary = targets_summary(results, world)
    print()
    print(json.dumps(summary, indent=1))
    if args.json_path:
        write_json(args.json_path, {"command": " ".join(sys.argv), "config": asdict(cfg), "world_size": world,
                                    "batch": args.micro_batch_size, "seq": args.block_size, "steps": args.max_iters,
                                    "warmup": args.warmup_iters, "modes": results, "targets": summary, "table": table})
