"""bench_rank.py's tables: per-rank figures, the structure check of each TP size, and the projection beside the
public references (their sources in docs/gpu.md)."""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from benchmarks.lib.harness import fmt_bytes

#: torchtitan, Llama-3-8B on H100s (FSDP 8 x TP 8, bf16): tokens/s/GPU (docs/gpu.md)
TORCHTITAN_8B_TOKENS_PER_GPU = 4378
#: gpt-fast decode, batch 1, Llama-3.1-8B on A100-80GB: tokens/s by TP size (docs/gpu.md)
GPT_FAST_A100 = {1: 93.8, 2: 149.0, 4: 217.0, 8: 276.0}
#: HBM bandwidth of an H100 SXM over an A100-80GB SXM (3.35 / 2.039 TB/s): decode is bound by it
H100_OVER_A100_BANDWIDTH = 3.35 / 2.039


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
    parts = []
    for p in ("forward", "backward"):
        ka, kb = Counter((k, n) for k, _, n in a["collectives"][p]), Counter((k, n) for k, _, n in b["collectives"][p])
        if ka != kb:
            parts.append(f"{p}: {_kinds(a['collectives'][p])} vs {_kinds(b['collectives'][p])}"
                         f" ({fmt_bytes(sum(x[2] for x in a['collectives'][p]))} vs "
                         f"{fmt_bytes(sum(x[2] for x in b['collectives'][p]))})")
    if a.get("param_bytes") != b.get("param_bytes"):
        parts.append(f"parameters {fmt_bytes(a.get('param_bytes'))} vs {fmt_bytes(b.get('param_bytes'))}")
    return "; ".join(parts) or "the same"


def _training_table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = ["| TP | mode | step (ms) | forward | backward | AdamW | peak memory | params / rank "
             f"| collectives fwd / bwd ({max(args.depths)} layers) "
             "| loss finite | tokens/s/GPU, compute only |", "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tp']} | ({r['mode']}) {r['description']} | failed: {r['error']} |||||||||")
            continue
        tokens = r["batch"] * args.seq / r["step_s"] / r["tp"]
        lines.append(
            f"| {r['tp']} | ({r['mode']}) {r['description']} | {_ms(r['step_s'])} | {_ms(r['forward_s'])} | "
            f"{_ms(r['backward_s'])} | {_ms(r['optimizer_s'])} | {_peak(r)} | "
            f"{fmt_bytes(r['param_bytes'])} | {_kinds(r['collectives']['forward'])} / "
            f"{_kinds(r['collectives']['backward'])} | {'yes' if r['loss_finite'] else 'NO'} | {tokens:.0f} |")
    return lines


def _peak(row: dict) -> str:
    """The peak memory and how it was had: measured at the reported depth or at the one run, or extrapolated."""
    source = row.get("peak_source", "")
    if row.get("peak_bytes") is None or not source:
        return fmt_bytes(row.get("peak_bytes"))
    tag = "extrapolated" if source.startswith("extrapolated") else source.removeprefix("measured at ")
    return f"{fmt_bytes(row['peak_bytes'])} ({tag})"


def _memory_notes(rows: list[dict]) -> list[str]:
    """Why a peak is extrapolated where the run at full depth failed; what earlier rows left allocated."""
    notes = [f"- {r['workload']} TP={r['tp']} ({r['mode']}): peak {r['peak_source']}" for r in rows
             if "error" in r.get("peak_run", {})]
    for r in rows:
        left = max((d.get("left_bytes", 0) for d in (*r["depths"].values(), r.get("peak_run", {}))), default=0)
        if left:
            notes.append(f"- {r['workload']} TP={r['tp']} ({r['mode']}): {fmt_bytes(left)} still allocated before "
                         "its run, subtracted from its peak")
    return notes


def _per_layer_us(row: dict) -> str:
    """The back-to-back step's growth per layer between the two measured depths (µs)."""
    depths = sorted(row["depths"])
    if len(depths) != 2:
        return "–"
    steps = [row["depths"][d]["back_to_back_s"] for d in depths]
    return f"{(steps[1] - steps[0]) / (depths[1] - depths[0]) * 1e6:.0f}"


def _decode_table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = ["| TP | batch | mode | step (ms) | host (ms) | back-to-back step (ms) | per layer (µs) | host / step | "
             f"tokens/s, compute only | collectives / step ({max(args.depths)} layers) | params / rank | KV cache / "
             "rank |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tp']} | {r['batch']} | ({r['mode']}) {r['description']} | failed: {r['error']} "
                         "|||||||||")
            continue
        lines.append(
            f"| {r['tp']} | {r['batch']} | ({r['mode']}) {r['description']} | {_ms(r['step_s'])} | {_ms(r['host_s'])} "
            f"| {_ms(r['back_to_back_s'])} | {_per_layer_us(r)} | {r['host_s'] / r['step_s']:.2f} | "
            f"{r['batch'] / r['back_to_back_s']:.1f} | {_kinds(r['collectives']['forward'])} | "
            f"{fmt_bytes(r['param_bytes'])} | {fmt_bytes(r.get('kv_cache_bytes'))} |")
    return lines


def _first_loss(row: dict) -> float:
    """The row's first measured loss at its deepest depth."""
    return row["depths"][max(row["depths"])]["samples"][0]["loss"]


def _losses_agree(a: dict, b: dict, dtype: str) -> tuple[bool, str]:
    """Whether two training rows' first measured losses (the same weights and batch) agree: within a few roundings
    of a bf16 loss (2e-2 relative), else 1e-4; and the words for it."""
    la, lb = _first_loss(a), _first_loss(b)
    rtol = 2e-2 if dtype == "bfloat16" else 1e-4
    agree = abs(la - lb) <= rtol * max(abs(la), abs(lb))
    return agree, f"loss {la:.4f} vs {lb:.4f}{'' if agree else f' (must agree within {rtol:g}: FAILED)'}"


def _structure_lines(rows: list[dict], dtype: str) -> tuple[list[str], bool]:
    """Per TP size: thunder_tp's two backends must agree exactly (else a failure), and in training their losses too;
    the others are compared."""
    lines, failed = [], False
    by_tp: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if "error" not in r:
            by_tp.setdefault((r["workload"], r["tp"], r["batch"]), {})[r["mode"]] = r
    for (workload, tp, batch), modes in by_tp.items():
        keys = sorted(modes)
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                same = _structure(modes[a]) == _structure(modes[b])
                must = {a, b} <= {"a", "b"} or {a, b} <= THUNDER_DECODE
                failed |= must and not same
                verdict = "same collectives, bytes and parameters" if same else _describe_difference(modes[a], modes[b])
                if workload == "training" and {a, b} == {"a", "b"}:
                    agree, losses = _losses_agree(modes[a], modes[b], dtype)
                    failed |= not agree
                    verdict += f"; {losses}"
                lines.append(f"- {workload} TP={tp}{f', batch {batch}' if workload == 'decode' else ''}: ({a}) vs "
                             f"({b}): {verdict}{' (must agree: FAILED)' if must and not same else ''}")
    return lines, failed


def _reference(workload: str, tp: int, model: str) -> str:
    if workload == "training":
        return f"torchtitan 8B: {TORCHTITAN_8B_TOKENS_PER_GPU} (FSDP8 x TP8)" if model == "Llama-3-8B" else "–"
    a100 = GPT_FAST_A100.get(tp)
    if a100 is None or model != "Llama-3-8B":
        return "–"
    return f"gpt-fast A100: {a100:g}; x H100/A100 bandwidth: {a100 * H100_OVER_A100_BANDWIDTH:.0f}"


def _projection_table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = ["| workload | TP | batch | mode | compute (ms) | communication (ms) | step, no overlap (ms) | step, "
             "overlap (ms) | no overlap | overlap | reference "
             "|", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            continue
        p = r["projection"]
        if r["workload"] == "training":  # rates in tokens/s per GPU
            tokens, compute = r["batch"] * args.seq / r["tp"], r["step_s"]
        else:  # tokens/s
            tokens, compute = r["batch"], r["back_to_back_s"]
        overlap = f"{tokens / p['overlap_s']:.1f}" if p["overlap_from_trace"] else "– (no trace)"
        lines.append(
            f"| {r['workload']} | {r['tp']} | {r['batch']} | ({r['mode']}) | {_ms(compute)} | {_ms(p['comm_s'])} | "
            f"{_ms(p['no_overlap_s'])} | {_ms(p['overlap_s'])} | {tokens / p['no_overlap_s']:.1f} | {overlap} | "
            f"{_reference(r['workload'], r['tp'], args.model)} |")
    return lines


def report(results: dict, args: argparse.Namespace, device: torch.device) -> bool:
    """Print every table; True where a row failed, a loss was not finite or thunder_tp's modes disagreed."""
    from benchmarks.lib.alpha_beta import LINKS

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
    notes = _memory_notes([r for r in rows if "error" not in r])
    if notes:
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
