"""The trainer's setup: process groups, the model, its mode (``modes.MODES``) and the batches."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.lib.harness import DTYPES, EXECUTORS, log, random_batch, seeded_model
from benchmarks.lib.modes import MODES, How

#: Thunder's benchmark_litgpt fp8 modes (TransformerEngine), refused with an explanation
FP8_MODES = ("fp8-delayed-te", "fp8-default-te", "fp8-delayed-te-wo_layernorm", "fp8-default-te-wo_layernorm")
#: --distributed_mode's choices, entries of ``modes.MODES`` ("none": one device per rank)
TRAINER_MODES = ("none", "tp", "tp_sp", "tp_ddp", "tp_fsdp")

# distributed setup


@dataclass(frozen=True)
class Groups:
    """This rank's place in a (dp x cp x tp) layout of the world, tp fastest, then cp (TP groups are consecutive ranks,
    CP groups ranks ``tp_size`` apart)."""

    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    tp_group: Any  # torch ProcessGroup; None: the default group
    dp_size: int
    dp_rank: int
    dp_group: Any
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None


def make_groups(tp_size: int, cp_size: int = 1) -> Groups:
    """TP groups of ``tp_size`` consecutive ranks, CP groups of ``cp_size`` ranks ``tp_size`` apart (a (cp x tp) mesh as
    ``thunder_tp.init_mesh(dp=cp, tp=tp)`` lays it out) and the DP groups orthogonal to both."""
    rank, world = dist.get_rank(), dist.get_world_size()
    block = tp_size * cp_size
    if tp_size < 1 or cp_size < 1 or world % block:
        raise SystemExit(f"--tp_size {tp_size} * --context_parallel_size {cp_size} must divide the world size {world}")
    dp_size = world // block
    tp_groups = [list(range(start, start + tp_size)) for start in range(0, world, tp_size)]
    cp_groups = [list(range(start + t, start + block, tp_size)) for start in range(0, world, block)
                 for t in range(tp_size)]
    dp_groups = [list(range(offset, world, block)) for offset in range(block)]
    tp_group = _own_group(rank, world, tp_groups)
    cp_group = _own_group(rank, world, cp_groups) if cp_size > 1 else None
    dp_group = _own_group(rank, world, dp_groups)
    return Groups(rank, world, tp_size, rank % tp_size, tp_group, dp_size, rank // block, dp_group,
                  cp_size, rank // tp_size % cp_size, cp_group)


def _own_group(rank: int, world: int, groups: list[list[int]]):
    """Every group of ``groups`` created, this rank's returned."""
    if len(groups[0]) == world:
        return None
    own = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            own = group
    return own


# model and data


def make_config(args: argparse.Namespace):
    """The litgpt Config of --model_name (fields of --litgpt_config over it)."""
    from litgpt import Config
    overrides: dict[str, Any] = json.loads(args.litgpt_config or "{}") | {"block_size": args.block_size}
    if args.n_layers is not None:
        overrides["n_layer"] = args.n_layers
    return Config.from_name(args.model_name, **overrides)


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
    """The litgpt GPT with its loss and seeded weights in ``--dtype``, float8 and checkpointed if asked."""
    from thunder_tp.plans.litgpt import GPTWithLoss
    model = seeded_model(lambda: GPTWithLoss(config), args.seed, device, DTYPES[args.dtype])
    if args.use_torchao_fp8_linear:
        model = convert_to_float8(model, args.torchao_fp8_recipe, device)
    if args.checkpoint_activations:
        checkpoint_blocks(model)
    return model


def build(args: argparse.Namespace, groups: Groups, device: torch.device):
    """The config, the model (same random weights on every rank) and the jitted (or eager) module to train."""
    config = make_config(args)
    model = make_model(args, config, device)
    if args.compile == "eager":
        return config, model, model
    return config, model, wrap(model, args, groups)


def wrap(model: nn.Module, args: argparse.Namespace, groups: Groups) -> nn.Module:
    """The model under --distributed_mode's mode, ContextParallel over the CP group first."""
    return MODES[mode_name(args)].wrap(model, how_of(args, groups))


def how_of(args: argparse.Namespace, groups: Groups) -> How:
    """What the mode's wrapping takes, from the flags and this rank's groups."""
    import thunder_tp
    first = () if groups.cp_size == 1 else (
        thunder_tp.ContextParallel(groups.cp_group, load_balance=args.cp_load_balance, rotate=args.cp_rotate),)
    return How(EXECUTORS[args.compile], groups.tp_group, groups.dp_group, args.tp_overlap, args.loss_parallel,
               args.use_torchao_fp8_allgather, args.plan, (args.micro_batch_size, args.block_size), groups.tp_size,
               verbose=groups.rank == 0, first=first)


def mode_name(args: argparse.Namespace) -> str:
    """The registry's name of --distributed_mode (none: thunder.jit alone)."""
    return "thunder" if args.distributed_mode == "none" else args.distributed_mode


def resolve_groups(args: argparse.Namespace, rank: int, world: int) -> Groups:
    """This rank's TP, CP and DP groups from the flags (an error naming the fix if they don't fit)."""
    mode, cp_size = MODES[mode_name(args)], args.context_parallel_size
    if world % cp_size:
        raise SystemExit(f"--context_parallel_size {cp_size} must divide the world size {world}")
    if args.distributed_mode == "none":
        tp_size = 1
        if args.tp_size not in (None, 1):
            raise SystemExit("--tp_size needs a tensor-parallel --distributed_mode (tp, tp_sp)")
    else:
        tp_size = args.tp_size or (world // (args.dp_size * cp_size) if args.dp_size else world // cp_size)
    if args.dp_size is not None and not mode.data_parallel:
        raise SystemExit(f"--dp_size needs a 2-D --distributed_mode (tp_ddp, tp_fsdp), not {args.distributed_mode}")
    if args.dp_size is not None and args.dp_size * cp_size * tp_size != world:
        raise SystemExit(f"--dp_size {args.dp_size} * --context_parallel_size {cp_size} * --tp_size {tp_size} must "
                         f"equal the world size {world}")
    if world % (cp_size * tp_size):
        raise SystemExit(f"--context_parallel_size {cp_size} * --tp_size {tp_size} must divide the world size "
                         f"{world}: use --tp_size {world // cp_size} or a divisor of it")
    parallel = args.distributed_mode != "none" or cp_size > 1
    if cp_size * tp_size < world and parallel and not mode.data_parallel:
        fix = f"--tp_size {world // cp_size}" if args.distributed_mode != "none" else \
            f"--context_parallel_size {world}"
        raise SystemExit(f"--distributed_mode {args.distributed_mode} with --context_parallel_size {cp_size} * "
                         f"--tp_size {tp_size} < world size {world}: the replicas would train independently; use {fix} "
                         "(or a 2-D mode that syncs grads over DP)")
    if not parallel and world > 1:
        log(rank, f"note: --distributed_mode none with {world} ranks: every rank trains its own full copy")
    return make_groups(tp_size, cp_size) if parallel else Groups(rank, world, 1, 0, None, 1, 0, None)


#: what a float8 gemm (torch._scaled_mm) needs of a CUDA device: Ada or Hopper on
FLOAT8_CAPABILITY = (8, 9)


def keeps_in_high_precision(module: nn.Module, name: str) -> bool:
    """The linears torchtitan leaves unconverted: the head, and dims not multiples of 16."""
    return name.rsplit(".", 1)[-1] == "lm_head" or module.in_features % 16 != 0 or module.out_features % 16 != 0


def convert_to_float8(model: nn.Module, recipe: str, device: torch.device) -> nn.Module:
    """``model`` with its linears (but those ``keeps_in_high_precision`` names) torchao's Float8Linear of ``recipe``:
    torch._scaled_mm on a CUDA device that has it, emulated in high precision on the CPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability < FLOAT8_CAPABILITY:
        raise SystemExit(f"--use_torchao_fp8_linear on CUDA needs compute capability {FLOAT8_CAPABILITY} or higher "
                         f"for float8 gemms (torch._scaled_mm); this GPU has {capability}")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=capability is None)
    return convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda m, name: not keeps_in_high_precision(m, name))


def count_float8_linears(model: nn.Module) -> int:
    """How many of the model's linears are torchao's Float8Linear."""
    from torchao.float8.float8_linear import Float8Linear
    return sum(isinstance(m, Float8Linear) for m in model.modules())
