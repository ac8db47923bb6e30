"""bench_generate.py's model and command line, shared with the benchmarks that run its decode step: the seeded
litgpt llama of its flags and its KV cache, and the gpt-fast-style TP written by hand (``shard_by_hand``)."""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.lib.harness import EXECUTORS, seeded_model, tensor_bytes
from benchmarks.lib.litgpt_setup import DTYPES

MODEL_SEED = 1337


def make_config(args: argparse.Namespace):
    """The llama of the flags, its context the prompt plus the new tokens."""
    from litgpt import Config

    return Config(
        name="bench-llama", block_size=args.prompt_len + args.new_tokens, vocab_size=args.vocab,
        padded_vocab_size=args.vocab, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
        n_query_groups=args.n_query_groups, intermediate_size=args.intermediate_size, bias=False,
        mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", parallel_residual=False, rotary_percentage=1.0,
    )


def new_gpt(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The litgpt GPT with seeded random weights (the same on every rank) in ``--dtype``, without a KV cache."""
    from litgpt import GPT

    return seeded_model(lambda: GPT(make_config(args)), MODEL_SEED, device, DTYPES[args.dtype]).eval()


def set_cache(model: nn.Module, args: argparse.Namespace, device: torch.device) -> nn.Module:
    """``model`` with a KV cache for ``--batch`` sequences, in ``--dtype`` (litgpt's default is torch's, float32)."""
    model.set_kv_cache(batch_size=args.batch, device=device, dtype=DTYPES[args.dtype])
    return model


# --- tensor parallelism by hand ----------------------------------------------------------------------------


def _set_weight(linear: nn.Linear, weight: torch.Tensor) -> None:
    """Give ``linear`` its own copy of ``weight`` (a slice of the full weight, which is then freed)."""
    linear.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def shard_by_hand(model: nn.Module, rank: int, world: int) -> list[tuple[str, int]]:
    """gpt-fast-style TP of a litgpt llama, in place (before ``set_kv_cache``, which then builds the cache of the
    local K/V heads): this rank's heads of each of the q, k and v blocks of ``qkv`` and its columns of ``fc_1`` /
    ``fc_2`` and of ``lm_head`` (by vocab), its rows of both ``proj``; an all_reduce of the attention's and the MLP's
    outputs and an all_gather of the logits. The list the collectives of the last forward go to as (kind, bytes)."""
    c = model.config
    for name in ("n_head", "n_query_groups", "intermediate_size", "padded_vocab_size"):
        if getattr(c, name) % world:
            raise ValueError(f"manual_tp: {name} {getattr(c, name)} is not divisible by the {world} ranks")
    calls: list[tuple[str, int]] = []

    def all_reduce(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out)
        calls.append(("all_reduce", tensor_bytes(out)))
        return out

    def all_gather(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.contiguous())
        calls.append(("all_gather", world * tensor_bytes(out)))
        return torch.cat(parts, dim=-1)

    local = copy.copy(c)  # what each attention reads: its local heads
    local.n_head, local.n_query_groups = c.n_head // world, c.n_query_groups // world
    kv = c.n_query_groups * c.head_size
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        blocks = attn.qkv.weight.split((c.n_head * c.head_size, kv, kv))  # litgpt's fused layout: q | k | v
        _set_weight(attn.qkv, torch.cat([w.chunk(world)[rank] for w in blocks]))
        _set_weight(attn.proj, attn.proj.weight.chunk(world, dim=1)[rank])
        attn.config = local
        for fc in (mlp.fc_1, mlp.fc_2):
            _set_weight(fc, fc.weight.chunk(world)[rank])
        _set_weight(mlp.proj, mlp.proj.weight.chunk(world, dim=1)[rank])
        attn.register_forward_hook(all_reduce)
        mlp.register_forward_hook(all_reduce)
    _set_weight(model.lm_head, model.lm_head.weight.chunk(world)[rank])
    model.lm_head.register_forward_hook(all_gather)
    model.register_forward_pre_hook(lambda module, inputs: calls.clear())
    return calls


def generate_args(argv: list[str] | None = None, description: str = "bench_generate.py") -> argparse.Namespace:
    """bench_generate.py's command line (the model, the prompts, the modes, the timing), parsed from ``argv``."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--n_embd", type=int, default=1024)
    p.add_argument("--n_head", type=int, default=8)
    p.add_argument("--n_query_groups", type=int, default=4, help="K/V heads")
    p.add_argument("--intermediate_size", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--batch", type=int, default=1, help="1: litgpt's generate loop; more: its batched loop")
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="timed generations per mode, one per round, modes alternating")
    p.add_argument("--warmup", type=int, default=1, help="untimed generations per mode (the first compiles)")
    p.add_argument("--modes", default="all",
                   help="comma-separated: single_thunder, single_eager, thunder_tp, thunder_tp_gather, manual_tp, "
                        "eager_2threads")
    p.add_argument("--compile", default="thunder", choices=sorted(EXECUTORS),
                   help="the thunder modes' executors: thunder_tp.executors() (Inductor fusions on CPU), or "
                        "Thunder's defaults + thunder_tp's comm executor (no fusion compile: quick)")
    p.add_argument("--pin_cores", type=int, default=1, help="CPU runs: pin local rank r to core r")
    p.add_argument("--timeout", type=float, default=600, help="process-group timeout in seconds")
    p.add_argument("--json_path", default="")
    args = p.parse_args(argv)
    if args.new_tokens < 2 or args.warmup < 1 or args.rounds < 1:
        p.error("--new_tokens must be at least 2 (a first token and a decode step), --warmup and --rounds at least 1")
    return args
