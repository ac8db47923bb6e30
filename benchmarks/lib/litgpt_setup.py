"""The litgpt benchmark's setup: process groups, distributed modes (``MODES``), the model and the batches.

A distributed mode is an entry of ``MODES`` (mode -> ``DistributedMode(transforms=..., data_parallel=...)``): a
function that builds the ``transforms=`` list for ``thunder.jit`` from the model, the options and the process groups
(one mode per run, picked by ``--distributed_mode``; the modes a benchmark compares side by side are
``harness.Mode``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.lib.float8 import convert_to_float8
from benchmarks.lib.harness import EXECUTORS, log, random_batch, seeded_model

#: --dtype -> the parameters' dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Thunder's benchmark_litgpt fp8 modes (TransformerEngine), refused with an explanation
FP8_MODES = ("fp8-delayed-te", "fp8-default-te", "fp8-delayed-te-wo_layernorm", "fp8-default-te-wo_layernorm")

# --------------------------------------------------------------------------------------------------------------
# distributed setup
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Groups:
    """This rank's place in a (dp x tp) layout of the world, tp-fastest (TP groups are consecutive ranks)."""

    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    tp_group: Any  # torch ProcessGroup; None: the default group
    dp_size: int
    dp_rank: int
    dp_group: Any


def make_groups(tp_size: int) -> Groups:
    """TP groups of ``tp_size`` consecutive ranks and the orthogonal DP groups (the default group if one spans it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp_size < 1 or world % tp_size:
        raise SystemExit(f"--tp_size {tp_size} must divide the world size {world}")
    dp_size = world // tp_size
    tp_group = dp_group = None  # None: the default group, for a group that spans the world
    # every rank creates every group, in the same order (torch.distributed's rule), and keeps its own
    if tp_size != world:
        for d in range(dp_size):
            g = dist.new_group(list(range(d * tp_size, (d + 1) * tp_size)))
            if rank // tp_size == d:
                tp_group = g
    if dp_size != world:
        for t in range(tp_size):
            g = dist.new_group(list(range(t, world, tp_size)))
            if rank % tp_size == t:
                dp_group = g
    return Groups(rank, world, tp_size, rank % tp_size, tp_group, dp_size, rank // tp_size, dp_group)


# --------------------------------------------------------------------------------------------------------------
# distributed modes: mode -> the transforms for thunder.jit
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistributedMode:
    """``transforms(model, args, groups)`` builds the ``transforms=`` list; ``data_parallel``: the mode syncs grads
    over the DP groups (without it, a TP size smaller than the world size is refused: the replicas would train
    independently)."""

    transforms: Callable[[nn.Module, argparse.Namespace, Groups], list]
    data_parallel: bool = False


def _none(model: nn.Module, args: argparse.Namespace, groups: Groups) -> list:
    return []


def _tp(model: nn.Module, args: argparse.Namespace, groups: Groups, *, sequence_parallel: bool = False) -> list:
    import thunder_tp

    if args.plan == "auto":
        plan = _auto_plan(model, args, groups, sequence_parallel)
    else:
        plans = thunder_tp.plans.hf if args.hf_model_type else thunder_tp.plans.litgpt
        plan = plans(model, sequence_parallel=sequence_parallel, loss_parallel=args.loss_parallel)
    return [thunder_tp.TensorParallel(plan, process_group=groups.tp_group, overlap=args.tp_overlap,
                                      float8_all_gather=args.use_torchao_fp8_allgather)]


def _auto_plan(model: nn.Module, args: argparse.Namespace, groups: Groups, sequence_parallel: bool):
    """--plan auto: plans.auto searched on a batch of meta tensors; rank 0 prints it."""
    import thunder_tp

    if sequence_parallel or args.loss_parallel:
        raise SystemExit("--plan auto chooses every layout itself: leave out --loss_parallel and use "
                         "--distributed_mode tp")
    batch = torch.zeros(args.micro_batch_size, args.block_size, dtype=torch.int64, device="meta")
    plan = thunder_tp.plans.auto(model, batch, batch, tp_size=groups.tp_size)
    if groups.rank == 0:
        print(plan, flush=True)
    return plan


MODES: dict[str, DistributedMode] = {
    "none": DistributedMode(_none),
    "tp": DistributedMode(_tp),
    "tp_sp": DistributedMode(partial(_tp, sequence_parallel=True)),
}


# 2-D: TP over the tp groups, then Thunder's DDP / FSDP over the dp groups (TP first; thunder_tp/data_parallel/mesh.py)


def _dp_group(groups: Groups):
    return groups.dp_group if groups.dp_group is not None else dist.group.WORLD


def _tp_ddp(model: nn.Module, args: argparse.Namespace, groups: Groups) -> list:
    from thunder.distributed.transforms.ddp_v2 import DDPTransform

    ddp = DDPTransform(process_group=_dp_group(groups), bucket_size_in_mb=25.0, broadcast_from=None)
    return [*_tp(model, args, groups), ddp]


def _tp_fsdp(model: nn.Module, args: argparse.Namespace, groups: Groups) -> list:
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    device = next(model.parameters()).device
    return [*_tp(model, args, groups), FSDPTransform(device=device, process_group=_dp_group(groups))]


MODES["tp_ddp"] = DistributedMode(_tp_ddp, data_parallel=True)
MODES["tp_fsdp"] = DistributedMode(_tp_fsdp, data_parallel=True)


# --------------------------------------------------------------------------------------------------------------
# model and data
# --------------------------------------------------------------------------------------------------------------


#: --hf_model_type's sizes unless --hf_config overrides them: the Llama of the comparison with HF's own TP
HF_SIZES = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1536, vocab_size=8192)


@dataclass(frozen=True)
class ModelInfo:
    """What the report says about the model, litgpt's or HF's."""

    name: str
    n_layer: int
    n_embd: int
    vocab_size: int


def model_info(args: argparse.Namespace, config) -> ModelInfo:
    """Name, layers, width and vocabulary of a litgpt Config or an HF config."""
    if args.hf_model_type:
        return ModelInfo(f"hf:{args.hf_model_type}", config.num_hidden_layers, config.hidden_size, config.vocab_size)
    return ModelInfo(config.name, config.n_layer, config.n_embd, config.padded_vocab_size)


def make_config(args: argparse.Namespace):
    """The litgpt Config of --model_name, or the HF config of --hf_model_type (sizes HF_SIZES | --hf_config)."""
    if args.hf_model_type:
        return _hf_config(args)
    from litgpt import Config

    overrides: dict[str, Any] = {"block_size": args.block_size}
    if args.n_layers is not None:
        overrides["n_layer"] = args.n_layers
    return Config.from_name(args.model_name, **overrides)


def _hf_config(args: argparse.Namespace):
    import json

    from transformers import AutoConfig

    sizes = HF_SIZES | json.loads(args.hf_config or "{}") | {"max_position_embeddings": args.block_size}
    if args.n_layers is not None:
        sizes["num_hidden_layers"] = args.n_layers
    return AutoConfig.for_model(args.hf_model_type, **sizes)


#: tokens are drawn from [0, DATA_VOCAB), as in Thunder's benchmark, so that the loss visibly goes down
DATA_VOCAB = 100


def make_batch(args: argparse.Namespace, vocab: int, dp_rank: int, iteration: int, device: torch.device,
               rows: int | None = None):
    """Random (idx, targets) of shape (rows (micro_batch_size), block_size); identical on the ranks of a TP group."""
    seed = args.seed * 1_000_003 + dp_rank * 10_007 + iteration
    return random_batch(rows or args.micro_batch_size, args.block_size, min(DATA_VOCAB, vocab), seed, device)


def accumulation_steps(args: argparse.Namespace, dp_size: int) -> int:
    """Micro-batches per optimizer step on each data-parallel rank (``--global_batch_size``)."""
    per_step = args.micro_batch_size * dp_size
    if args.global_batch_size is None:
        return 1
    if args.global_batch_size < per_step or args.global_batch_size % per_step:
        raise SystemExit(f"--global_batch_size {args.global_batch_size} must be a multiple of --micro_batch_size "
                         f"{args.micro_batch_size} * dp size {dp_size} = {per_step}")
    return args.global_batch_size // per_step


def checkpoint_blocks(model: nn.Module) -> None:
    """Run every litgpt Block under torch.utils.checkpoint; Thunder recomputes its activations in the backward."""
    from litgpt.model import Block
    from torch.utils.checkpoint import checkpoint

    for module in model.modules():
        if isinstance(module, Block):
            module.forward = partial(checkpoint, module.forward, use_reentrant=False)


def make_model(args: argparse.Namespace, config, device: torch.device) -> nn.Module:
    """The litgpt GPT (or HF CausalLM) with its loss, seeded random weights in ``--dtype``, its linears torchao's
    float8 ones and its blocks checkpointed if asked."""
    if args.hf_model_type:
        model = seeded_model(lambda: _hf_with_loss(config), args.seed, device, DTYPES[args.dtype])
    else:
        from thunder_tp.plans.litgpt import GPTWithLoss

        model = seeded_model(lambda: GPTWithLoss(config), args.seed, device, DTYPES[args.dtype])
    if args.use_torchao_fp8_linear:
        model = convert_to_float8(model, args.torchao_fp8_recipe, device)
    if args.checkpoint_activations:
        checkpoint_blocks(model)
    return model


def _hf_with_loss(config) -> nn.Module:
    """An HF CausalLM returning only its loss (the logits are never returned, so never gathered)."""
    from transformers import AutoModelForCausalLM

    from thunder_tp.plans.hf import CausalLMLoss

    return CausalLMLoss(AutoModelForCausalLM.from_config(config))


def build(args: argparse.Namespace, groups: Groups, device: torch.device):
    """The config, the model (same random weights on every rank) and the jitted (or eager) module to train."""
    config = make_config(args)
    model = make_model(args, config, device)
    if args.compile == "eager":
        return config, model, model
    import thunder

    transforms = MODES[args.distributed_mode].transforms(model, args, groups)
    return config, model, thunder.jit(model, transforms=transforms, executors=EXECUTORS[args.compile]())


def resolve_groups(args: argparse.Namespace, rank: int, world: int) -> Groups:
    """This rank's TP and DP groups from --distributed_mode, --tp_size and --dp_size (an error if they don't fit)."""
    mode = MODES[args.distributed_mode]
    if args.distributed_mode == "none":
        tp_size = 1
        if args.tp_size not in (None, 1):
            raise SystemExit("--tp_size needs a tensor-parallel --distributed_mode (tp, tp_sp)")
    else:
        tp_size = args.tp_size or (world // args.dp_size if args.dp_size else world)
    if args.dp_size is not None and not mode.data_parallel:
        raise SystemExit(f"--dp_size needs a 2-D --distributed_mode (tp_ddp, tp_fsdp), not {args.distributed_mode}")
    if args.dp_size is not None and args.dp_size * tp_size != world:
        raise SystemExit(f"--dp_size {args.dp_size} * --tp_size {tp_size} must equal the world size {world}")
    if tp_size < world and not mode.data_parallel and args.distributed_mode != "none":
        raise SystemExit(
            f"--distributed_mode {args.distributed_mode} with --tp_size {tp_size} < world size {world}: the TP "
            f"replicas would train independently; use --tp_size {world} (or a 2-D mode that syncs grads over DP)"
        )
    if args.distributed_mode == "none" and world > 1:
        log(rank, f"note: --distributed_mode none with {world} ranks: every rank trains its own full copy")
    return make_groups(tp_size) if args.distributed_mode != "none" else Groups(rank, world, 1, 0, None, 1, 0, None)
