"""thunder_tp.checkpoint: save / load time and peak memory per rank, for a litgpt model of a few hundred MB.

    python -m benchmarks.bench_checkpoint [--n_layer 4 --n_embd 1024 --vocab 16384 --tp 1 2 4]

For each TP size: every rank builds the model, shards it (TensorParallel; TP=1 is a plain nn.Module in one
process), and `ck.save`s it; then a meta-device model at that TP size `ck.load`s the same directory, and
another one the TP=2 directory (resharding). Peak memory is the rise of the process's peak RSS (VmHWM, reset
through /proc/self/clear_refs) above its RSS before the call, next to the rank's own shard bytes and the
largest parameter: the target is "own shards plus one parameter's worth".
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any

from benchmarks.lib.harness import rss_rise, timed
from benchmarks.lib.ranks import spawn_ranks

MB = 2**20


def _measure(fn: Callable[[], Any]) -> tuple[float, int | None]:
    """(seconds, rise of peak RSS above the RSS before) of fn()."""
    (_, seconds), rise = rss_rise(partial(timed, fn))
    return seconds, rise


def _config(n_layer: int, n_embd: int, vocab: int):
    from litgpt import Config

    return Config(
        block_size=256, vocab_size=vocab, padded_vocab_size=vocab, n_layer=n_layer, n_head=16, n_query_groups=16,
        n_embd=n_embd, intermediate_size=4 * n_embd, bias=True, mlp_class_name="GptNeoxMLP",
        norm_class_name="LayerNorm", parallel_residual=True, rotary_percentage=0.25,
    )


def _build(config, tp: int, device: str):
    import thunder
    import torch
    from litgpt import GPT

    import thunder_tp

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    if tp == 1:
        return model
    return thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))])


def _local_bytes(model) -> tuple[int, int]:
    """(bytes of this rank's tensors, bytes of its largest one)."""
    from thunder_tp.checkpoint.tensors import model_tensors

    sizes = [t.local.numel() * t.local.element_size() for t in model_tensors(model).values()]
    return sum(sizes), max(sizes)


def _rank(config_args: tuple, tp: int, root: str) -> dict:
    """One rank's figures at this TP size."""
    import thunder_tp.checkpoint as ck

    config = _config(*config_args)
    path = os.path.join(root, f"tp{tp}")
    model = _build(config, tp, "cpu")
    shards, largest = _local_bytes(model)
    save_s, save_peak = _measure(partial(ck.save, path, model))
    del model
    out = {"shards": shards, "largest": largest, "save_s": save_s, "save_peak": save_peak}
    for name, source in (("load", path), ("reshard", os.path.join(root, "tp2"))):
        meta = _build(config, tp, "meta")
        out[f"{name}_s"], out[f"{name}_peak"] = _measure(partial(ck.load, source, meta))
        del meta
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 1, 4],
                   help="TP sizes (2 first: the others reshard from it)")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench_ckpt_")
    config_args = (args.n_layer, args.n_embd, args.vocab)
    try:
        rows = []
        for tp in args.tp:
            results = spawn_ranks(_rank, tp, config_args, tp, root, timeout_s=1800)
            files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, f"tp{tp}")) for f in fs]
            total = sum(map(os.path.getsize, files))
            rows.append((tp, total, max(results, key=lambda r: r["save_peak"] + r["load_peak"])))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"model: n_layer={args.n_layer} n_embd={args.n_embd} vocab={args.vocab}, float32 (per rank: the worst rank)")
    print("| TP | checkpoint | rank's shards | largest param | save s | save peak | load s | load peak | load from "
          "TP=2 s | peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tp, total, r in sorted(rows):
        print(f"| {tp} | {total / MB:.0f} MB | {r['shards'] / MB:.0f} MB | {r['largest'] / MB:.0f} MB | "
              f"{r['save_s']:.2f} | {r['save_peak'] / MB:.0f} MB | {r['load_s']:.2f} | {r['load_peak'] / MB:.0f} MB | "
              f"{r['reshard_s']:.2f} | {r['reshard_peak'] / MB:.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
