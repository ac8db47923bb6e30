"""Decode benchmark: litgpt's greedy generation under the modes of ``RUNS``, side by side (docs/generation.md).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.bench_generate --dtype float32 --batch 1
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # ranks compile side by side on few cores

import argparse
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

from benchmarks.lib import harness
from benchmarks.lib.llama import LlamaConfig, litgpt_config
from benchmarks.lib.modes import MODES, How, Selected, select

PROMPT_SEED, MODEL_SEED = 1234, 1337
#: a mode's token may leave the reference's where their reference logits are this many eps of the dtype (times the
#: largest logit) apart or closer: a near-tie, which rounding decides. Random weights give flat logits (in bf16 the
#: top two are often 0-2 ulps apart); at the default size eager litgpt's logits are within 6 (fp32) and 1.1 (bf16)
#: eps x the largest logit of float64's, so two implementations' within ~12, and two tokens' gaps within ~24
NEAR_TIE_EPS = 32


def decode_config(args: argparse.Namespace):
    """The litgpt Llama of bench_generate's flags, its context the prompt plus the new tokens."""
    config = litgpt_config(LlamaConfig(dim=args.n_embd, n_layers=args.n_layer, n_heads=args.n_head,
                                       n_kv_heads=args.n_query_groups, vocab=args.vocab,
                                       ffn_hidden=args.intermediate_size, max_seq=args.prompt_len + args.new_tokens))
    config.name = "bench-llama"
    return config


def new_gpt(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The litgpt GPT with seeded random weights (the same on every rank) in ``--dtype``, without a KV cache."""
    from litgpt import GPT
    return harness.seeded_model(lambda: GPT(decode_config(args)), MODEL_SEED, device, harness.DTYPES[args.dtype]).eval()


def set_cache(model: nn.Module, args: argparse.Namespace, device: torch.device) -> nn.Module:
    """``model`` with a KV cache for ``--batch`` sequences, in ``--dtype`` (litgpt's default is torch's, float32)."""
    model.set_kv_cache(batch_size=args.batch, device=device, dtype=harness.DTYPES[args.dtype])
    return model


class TokenMismatch(Exception):
    """A mode generated other tokens than single-device eager litgpt."""


#: the modes: name -> (the registry's mode, the label, litgpt's sampler (thunder_tp.set_sampling))
RUNS = {"thunder": ("thunder", "(a)", "shards"), "eager": ("eager", "(b)", "shards"), "tp": ("tp", "(c)", "shards"),
        "tp_gather": ("tp", "(c') logits gathered,", "gather"), "manual_tp": ("manual_tp", "(d)", "shards")}


def selected_modes(args: argparse.Namespace, device: torch.device) -> list[Selected]:
    """The modes of ``--modes``: ``mode.build(shared)`` makes its module (``shared``: rank 0's single-device GPT)."""
    how, world = How(harness.EXECUTORS[args.compile]), dist.get_world_size()
    def build(registered: str, shared: nn.Module | None) -> nn.Module:
        mode = MODES[registered]
        return mode.wrap(set_cache(new_gpt(args, device), args, device) if mode.distributed else shared, how)
    def run(name: str, registered: str, label: str) -> Selected:
        mode = MODES[registered]
        where = f", TP={world}" if mode.distributed else ", one device"
        return Selected(name, f"{label} {mode.description}{where}", mode.runtime, world if mode.distributed else 1,
                        partial(build, registered))
    return [run(name, *RUNS[name][:2]) for name in select(RUNS, args.modes, "--modes")]


def generation(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float, float]:
    """One greedy generation by litgpt's loop: the new tokens, the seconds to the first token and from it on."""
    from litgpt.generate.base import batched_generate_fn, generate_fn
    length = prompts.size(1) + new_tokens
    stream = (generate_fn(model, prompts[0], length, temperature=0.0, include_prompt=False, include_eos=True)
              if prompts.size(0) == 1 else
              map(torch.cat, batched_generate_fn(model, prompts, length, sample_args={"temperature": 0.0},
                                                 include_prompt=False, include_eos=True)))
    tokens, stamps = [], []
    start = time.perf_counter()
    for token in stream:  # litgpt has called .item() on it: the device has finished it
        stamps.append(time.perf_counter())
        tokens.append(token)
    return torch.stack(tokens, dim=1), stamps[0] - start, stamps[-1] - stamps[0]


@dataclass(frozen=True)
class Reference:
    """Eager litgpt's greedy tokens (batch, new_tokens) and, computed once asked, its logits at each."""

    tokens: torch.Tensor
    logits: Callable[[], torch.Tensor]
    eps: float


def reference(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> Reference:
    """The reference of ``model`` (eager): batch 1's tokens from ``litgpt.generate.base.generate``."""
    from litgpt.generate.base import generate
    if prompts.size(0) > 1:
        tokens = generation(model, prompts, new_tokens)[0]
    else:
        tokens = generate(model, prompts[0], prompts.size(1) + new_tokens, temperature=0.0, include_prompt=False)
        tokens = tokens.view(1, -1)
    @functools.cache
    def logits() -> torch.Tensor:
        with torch.inference_mode():  # one forward over prompt and tokens, without the KV cache
            out = model(torch.cat([prompts, tokens[:, :-1]], dim=1))
        return out[:, prompts.size(1) - 1:].float()
    return Reference(tokens, logits, torch.finfo(next(model.parameters()).dtype).eps)


def check_tokens(name: str, tokens: torch.Tensor, ref: Reference) -> list[dict]:
    """The near-ties where each row first leaves the reference's; ``TokenMismatch`` at any other difference."""
    if tokens.shape != ref.tokens.shape:
        raise TokenMismatch(f"{name}: {tuple(tokens.shape)} tokens, expected {tuple(ref.tokens.shape)}")
    ties = []
    for row in range(tokens.size(0)):
        differ = (tokens[row] != ref.tokens[row]).nonzero()
        if not len(differ):
            continue
        pos = differ[0].item()
        logits = ref.logits()[row, pos]
        gap = (logits[ref.tokens[row, pos]] - logits[tokens[row, pos]]).abs().item()
        tolerance = NEAR_TIE_EPS * ref.eps * logits.abs().max().item()
        if gap > tolerance:
            raise TokenMismatch(
                f"{name}: tokens differ from single-device eager litgpt's, first at row {row}, new token {pos}: "
                f"{tokens[row, pos:pos + 8].tolist()} vs {ref.tokens[row, pos:pos + 8].tolist()}; their reference "
                f"logits differ by {gap:.3g} > {tolerance:.3g}, not a near-tie")
        ties.append({"row": row, "token": pos, "gap": gap, "tolerance": tolerance})
    return ties


def timed_generation(mode: Selected, module: nn.Module, prompts: torch.Tensor, args: argparse.Namespace,
                     ref: Reference | None) -> tuple[float, float, list[dict]]:
    """One generation: time to first token, tokens/s (the slowest rank's), near-ties (checked given ``ref``)."""
    from thunder_tp.models.litgpt_sampling import sampling
    if mode.ranks != 1:
        dist.barrier()
    with sampling(RUNS[mode.name][2]):
        tokens, ttft, decode_s = generation(module, prompts, args.new_tokens)
    ties = check_tokens(mode.name, tokens, ref) if ref is not None else []
    if mode.ranks != 1:
        ttft, decode_s = harness.slowest_rank([ttft, decode_s])
    return ttft, prompts.size(0) * (args.new_tokens - 1) / decode_s, ties


def decode_collectives(module: nn.Module) -> dict | None:
    """The collectives of the module's last forward (a decode step) as ``{kind: {count, bytes}}``; None without."""
    import thunder

    from thunder_tp import collectives_table
    from thunder_tp.tools.debug import totals
    if hasattr(module, "collectives"):  # manual_tp: counted by its hooks
        return totals({"kind": kind, "count": 1, "total_bytes": nbytes} for kind, nbytes in module.collectives)
    if isinstance(module, thunder.ThunderModule):
        return totals(collectives_table(thunder.last_traces(module)[-1])) or None
    return None


def prepare(mode: Selected, shared: nn.Module | None, prompts: torch.Tensor, args: argparse.Namespace,
            ref: Reference | None, result: dict) -> nn.Module | None:
    """Build ``mode`` and run its first generation (compiles, checked) into ``result``."""
    try:
        start = time.perf_counter()
        module = mode.build(shared)
        result["near_ties"] = timed_generation(mode, module, prompts, args, ref)[2]
        result["first_generation_s"] = time.perf_counter() - start
    except Exception as e:
        traceback.print_exc()
        result["error"] = harness.error_line(e, 400)
        return None
    result["param_bytes"], result["kv_cache_bytes"] = harness.param_bytes(module), harness.kv_cache_bytes(module)
    result["decode_collectives"] = decode_collectives(module)
    return module


def run_modes(modes: list[Selected], args: argparse.Namespace, device: torch.device) -> dict:
    """Build and check every mode, then run the rest of the warm-up and the timed generations in alternating rounds."""
    import thunder
    rank = dist.get_rank()
    prompts = harness.random_batch(args.batch, args.prompt_len, args.vocab, PROMPT_SEED, device)[0]
    shared = harness.on_ranks(1, lambda: set_cache(new_gpt(args, device), args, device))
    ref = harness.on_ranks(1, lambda: reference(shared, prompts, args.new_tokens))
    results: dict[str, dict] = {}
    modules: dict[str, nn.Module] = {}
    for mode in modes:
        harness.log(rank, f"[bench_generate] {mode.name}: {mode.description}")
        result = results[mode.name] = {"description": mode.description, "ranks": mode.ranks, "ttft_s": [],
                                       "decode_tokens_per_s": []}
        module = harness.on_ranks(mode.ranks, partial(prepare, mode, shared, prompts, args, ref, result))
        if harness.agreed(module is not None or rank != 0 and mode.ranks == 1):
            modules[mode.name] = module
    ready = [m for m in modes if m.name in modules]
    for r, mode in harness.alternating_rounds(ready, args.warmup - 1 + args.rounds):  # a generation per mode and round
        def run(mode: Selected = mode, timed: bool = r >= args.warmup - 1) -> None:
            ttft, tokens_per_s, _ = timed_generation(mode, modules[mode.name], prompts, args, ref)
            if timed:
                results[mode.name]["ttft_s"].append(ttft)
                results[mode.name]["decode_tokens_per_s"].append(tokens_per_s)
        harness.on_ranks(mode.ranks, run)
    for name, module in modules.items():  # over every generation of the run
        if isinstance(module, thunder.ThunderModule):
            results[name]["compiles"] = thunder.cache_misses(module)
    for result in results.values():
        if result["ttft_s"]:
            result["ttft_median_s"] = statistics.median(result["ttft_s"])
            result["decode_tokens_per_s_median"] = statistics.median(result["decode_tokens_per_s"])
    return results


def _ratio(value: float | None, base: float | None) -> str:
    """``value / base`` to two decimals, '–' where either is missing."""
    return f"{value / base:.2f}" if value and base else "–"


def _tokens_cell(result: dict) -> str:
    """'yes', 'up to a near-tie ...' or 'no: the error'."""
    if "error" in result:
        return f"no: {result['error']}"
    ties = "; ".join(f"row {t['row']} to new token {t['token']}, then a near-tie (logits {t['gap']:.2g} apart)"
                     for t in result.get("near_ties", []))
    return f"yes, {ties}" if ties else "yes"


def _kinds(by_kind: dict | None) -> str:
    """'12 all_reduce + 1 all_gather', '–' for none."""
    return " + ".join(f"{v['count']} {k}" for k, v in by_kind.items()) if by_kind else "–"


def report(args: argparse.Namespace, results: dict, world: int, device: torch.device) -> None:
    """Print the markdown table and the collectives of a decode step (rank 0)."""
    c = decode_config(args)
    params = sum(p.numel() for p in new_gpt(args, torch.device("meta")).parameters())
    print(f"\nllama: {c.n_layer} layers, n_embd {c.n_embd}, {c.n_head} heads / {c.n_query_groups} K/V groups, "
          f"intermediate {c.intermediate_size}, vocab {c.padded_vocab_size}: {params / 1e6:.1f} M parameters, "
          f"{args.dtype}; batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens (greedy); "
          f"{args.rounds} rounds, medians; {world} ranks, {device}, --compile {args.compile}\n")
    base = results.get("thunder", {})
    cells = []
    for r in results.values():
        ttft, tps = r.get("ttft_median_s"), r.get("decode_tokens_per_s_median")
        cells.append([r["description"], r["ranks"], f"{ttft:.3f}" if ttft else "–",
                      _ratio(base.get("ttft_median_s"), ttft), f"{tps:.1f}" if tps else "–",
                      _ratio(tps, base.get("decode_tokens_per_s_median")), _kinds(r.get("decode_collectives")),
                      harness.fmt_bytes(r.get("kv_cache_bytes")), harness.fmt_bytes(r.get("param_bytes")),
                      r.get("compiles", "–"), _tokens_cell(r)])
    print(*harness.table("mode | ranks> | time to first token (s)> | × (a)> | decode tok/s> | × (a)> | "
                         "collectives / decode step | KV cache / rank> | params / rank> | compiles> | tokens = (b)",
                         cells), sep="\n")
    print("(× (a): (a)'s time to first token over the mode's, the mode's decode tokens/s over (a)'s: "
          "higher is faster)")
    for name, r in results.items():
        if r.get("decode_collectives"):
            per_step = {"decode step": harness.pass_totals(r["decode_collectives"])}
            print(*harness.collectives_lines(per_step, f"{name}, collectives per rank"), sep="\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (the model, the prompts, the modes, the timing; see the module docstring)."""
    p = harness.options(__doc__, dtype="float32")
    for name, default in (("n_layer", 6), ("n_embd", 1024), ("n_head", 8), ("n_query_groups", 4),
                          ("intermediate_size", 2816), ("vocab", 16384), ("prompt_len", 128), ("new_tokens", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--batch", type=int, default=1, help="1: litgpt's generate loop; more: its batched loop")
    p.add_argument("--rounds", type=int, default=5, help="timed generations per mode, one per round, modes alternating")
    p.add_argument("--warmup", type=int, default=1, help="untimed generations per mode (the first compiles)")
    p.add_argument("--modes", default="all", help="comma-separated: thunder, eager, tp, tp_gather, manual_tp")
    p.add_argument("--compile", default="thunder", choices=sorted(harness.EXECUTORS),
                   help="the thunder modes' executors: thunder_tp.executors() (Inductor fusions on CPU), or "
                        "Thunder's defaults + thunder_tp's comm executor (no fusion compile: quick)")
    p.add_argument("--pin_cores", type=int, default=1, help="CPU runs: pin local rank r to core r")
    p.add_argument("--timeout", type=float, default=600, help="process-group timeout in seconds")
    args = p.parse_args(argv)
    if args.new_tokens < 2 or args.warmup < 1 or args.rounds < 1:
        p.error("--new_tokens must be at least 2 (a first token and a decode step), --warmup and --rounds at least 1")
    return args


@record  # a failing rank's error and traceback go into torchrun's summary
def main(argv: list[str] | None = None) -> int:
    """Run the selected modes (see the module docstring); 0 when every mode ran and generated the reference tokens."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.pin_cores and not torch.cuda.is_available():
        harness.pin_to_core()
    rank, world, device = harness.init_distributed(args.timeout)
    try:
        return run(args, rank, world, device)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    """Measure and report on this rank."""
    results = run_modes(selected_modes(args, device), args, device)
    failed = [name for name, r in results.items() if "error" in r]
    if rank == 0:
        report(args, results, world, device)
        if args.json_path:
            out = {"args": vars(args), "world_size": world, "device": str(device), "results": results}
            print(f"results written to {harness.write_json(args.json_path, out)}")
        if failed:
            print(f"\nERROR: {', '.join(failed)} failed or generated other tokens than single-device eager litgpt "
                  f"(see the table)", file=sys.stderr, flush=True)
    dist.barrier()
    return 1 if failed else 0


if __name__ == "__main__":
    harness.exit_without_teardown(main())
