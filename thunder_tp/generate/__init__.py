"""Text generation from a litgpt model split over N ranks: ``torchrun --nproc-per-node N -m thunder_tp.generate``.

The counterpart of litgpt's ``generate``: the model is built on the meta device, its KV cache made, jitted with
TensorParallel (each rank holds its share of the weights and of the cache) and loaded from ``lit_model.pth`` slice
by slice; or, with ``--model_name``, built with random weights (token ids are printed). Compilation happens in a
warm-up run before any timing. Sampling is on by default (``--temperature 0`` is greedy), seeded once per run and
alike on every rank. This module parses the command line and imports nothing heavy before it has (``--help`` answers
at once); ``thunder_tp.generate.generation`` runs it. Errors in the arguments are printed as one line on rank 0
(exit code 2), without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

#: --precision: Lightning's names (thunder_tp.generate.generation maps them to dtypes)
PRECISIONS = ("32-true", "bf16-true", "16-true", "64-true")
#: --sampling: thunder_tp.models.litgpt_sampling's samplers
SAMPLERS = ("shards", "gather")
#: --decode_step: thunder_tp.DecodeStep's strategies
DECODE_STEPS = ("bound", "compiled", "graph")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, litgpt's generate flags where they apply; ``--help`` shows every default."""
    p = argparse.ArgumentParser(prog="python -m thunder_tp.generate", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint_dir", type=Path,
                        help="litgpt checkpoint: lit_model.pth, model_config.yaml, tokenizer")
    source.add_argument("--model_name", help="litgpt config name: random weights, token ids printed")
    p.add_argument("--n_layers", type=int, default=None, help="override the config's n_layer (with --model_name)")
    p.add_argument("--prompt", default="What food do llamas eat?", help="the text to continue")
    p.add_argument("--max_new_tokens", type=int, default=50, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy")
    p.add_argument("--top_k", type=_top_k, default=50, help="sample among the k most likely tokens ('none': all)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling's probability mass")
    p.add_argument("--num_samples", type=int, default=1, help="sequences to generate")
    p.add_argument("--sampling", choices=SAMPLERS, default="shards",
                   help="shards: thunder_tp's sampler (litgpt's semantics, a Gumbel-max draw) inside the jitted "
                        "program, under TP on each rank's vocabulary shard, no logits gathered; gather: litgpt's "
                        "sample on the gathered logits")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16-true", help="the model's dtype")
    p.add_argument("--tp_size", type=int, default=None, help="TP group size (default: the world size)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed, the same on every rank")
    p.add_argument("--compile", choices=["thunder", "thunder_default", "eager"], default="thunder",
                   help="thunder: thunder_tp's executors; thunder_default: Thunder's; eager: no jit (one device)")
    p.add_argument("--decode_step", choices=["auto", *DECODE_STEPS, "off"], default="auto",
                   help="how decode steps run (thunder_tp.DecodeStep): auto is 'graph' on CUDA, 'compiled' on the "
                        "CPU (the fastest measured there); off calls the jitted model each step")
    p.add_argument("--json_path", type=Path, default=None, help="write the report (samples, timings) here")
    return p.parse_args(argv)


def _top_k(text: str) -> int | None:
    """--top_k: a number, or 'none' (litgpt's None: every token)."""
    return None if text.lower() == "none" else int(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Generate and report; returns what ``--json_path`` gets."""
    args = parse_args(argv)
    from thunder_tp.generate.generation import generate

    return generate(args)


def cli(argv: list[str] | None = None) -> int:
    """``main`` for the command line: a refused request (``GenerateError``) is one line on rank 0's stderr and exit
    code 2 on every rank (after a barrier, so that torchrun does not stop rank 0 before it printed)."""
    args = parse_args(argv)
    from thunder_tp.generate.generation import GenerateError, finish, generate

    try:
        generate(args)
    except GenerateError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"thunder_tp.generate: error: {error}", file=sys.stderr, flush=True)
        finish()
        return 2
    return 0

