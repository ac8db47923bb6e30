"""Training benchmark of a litgpt GPT under thunder_tp tensor parallelism (flag names as in Thunder's benchmark_litgpt).

    torchrun --nproc-per-node 2 benchmarks/benchmark_litgpt.py --model_name pythia-14m --n_layers 2 \\
        --distributed_mode tp --tp_size 2 --max_iters 10 --warmup_iters 2 --dump_thunder_traces true

The model is ``litgpt.GPT(Config.from_name(model_name))`` with random weights (the configs are builtin; nothing is
downloaded) wrapped with its next-token cross-entropy, so the loss is inside the jitted program (which is what
makes ``--loss_parallel true`` possible). Batches are random tokens (seeded; the same on every rank of a TP group).
One iteration is forward + backward + an SGD step. Runs on CPU (gloo) or, when CUDA is available, on one GPU per
rank (NCCL).

Reported (rank 0; averages over the iterations after ``--warmup_iters``): iteration time (the slowest rank's),
tokens/s, parameter bytes per rank, peak memory (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the process's
max RSS), bytes saved for backward, and the collectives of one iteration (forward/backward, from the final traces
via ``thunder_tp.collectives_table``). ``--json_path`` writes all of it, per-iteration losses and times included.

Distributed modes are entries of ``MODES`` (mode -> ``Mode(transforms=..., data_parallel=...)``): a mode is a
function that builds the ``transforms=`` list for ``thunder.jit`` from the model, the options and the process
groups: ``none``, ``tp``, ``tp_sp`` and the 2-D ``tp_ddp`` / ``tp_fsdp`` (TP over ``--tp_size`` consecutive ranks
inside Thunder's DDPTransform / FSDPTransform over the ``--dp_size`` data-parallel groups), e.g.::

    torchrun --nproc-per-node 4 benchmarks/benchmark_litgpt.py --distributed_mode tp_fsdp --tp_size 2 --dp_size 2

Thunder benchmark_litgpt's ``--global_batch_size`` (gradient accumulation), ``--checkpoint_activations`` and
``--low_precision_mode`` (``none``; a bf16 model with ``--dtype bfloat16``) work as there. A 2-D mode is a few
lines, e.g.::

    def _tp_ddp(model, args, groups):
        from thunder.distributed.transforms.ddp_v2 import DDPTransform
        return [*_tp(model, args, groups), DDPTransform(process_group=groups.dp_group, bucket_size_in_mb=25.0,
                                                        broadcast_from=None)]
    MODES["tp_ddp"] = Mode(_tp_ddp, data_parallel=True)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

# --------------------------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------------------------


def str2bool(value: str | bool) -> bool:
    """"true"/"false" (and yes/no, 1/0) as jsonargparse reads them in Thunder's benchmark_litgpt."""
    if isinstance(value, bool):
        return value
    v = value.strip().lower()
    if v in ("true", "t", "yes", "y", "1", "on"):
        return True
    if v in ("false", "f", "no", "n", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {value!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Training benchmark of a litgpt GPT under thunder_tp tensor parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model_name", default="pythia-14m", help="litgpt Config.from_name (builtin configs, random weights)")
    p.add_argument("--n_layers", type=int, default=None, help="override the config's n_layer")
    p.add_argument("--block_size", type=int, default=128, help="sequence length (overrides the config's block_size)")
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--global_batch_size", type=int, default=None,
                   help="sequences per optimizer step over all data-parallel ranks; a multiple of micro_batch_size * "
                        "dp size: gradients accumulate over the micro-batches (default: micro_batch_size * dp size)")
    p.add_argument("--checkpoint_activations", type=str2bool, default=False,
                   help="activation checkpointing of every transformer block (torch.utils.checkpoint, which Thunder "
                        "turns into recomputation in the backward, collectives included)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the model's parameters")
    p.add_argument("--low_precision_mode", default="none", choices=["none", *FP8_MODES],
                   help="Thunder's fp8 modes need TransformerEngine on CUDA, which thunder_tp does not support: none only")
    p.add_argument("--max_iters", type=int, default=10, help="iterations in all, warm-up included")
    p.add_argument("--warmup_iters", type=int, default=2, help="first iterations left out of the averages")
    p.add_argument("--compile", default="thunder", choices=sorted(EXECUTORS) + ["eager"],
                   help="thunder: thunder_tp.executors() (fusion executor); thunder_default: Thunder's default "
                        "executors + thunder_tp's comm executor; eager: plain PyTorch (distributed_mode none only)")
    p.add_argument("--distributed_mode", default="none", choices=list(MODES))
    p.add_argument("--tp_size", type=int, default=None, help="TP group size (default: the world size)")
    p.add_argument("--dp_size", type=int, default=None,
                   help="data-parallel size of the 2-D modes (tp_ddp, tp_fsdp); dp * tp = world (default: world // tp)")
    p.add_argument("--loss_parallel", type=str2bool, default=False, help="cross-entropy over vocab-sharded logits")
    p.add_argument("--dump_thunder_traces", type=str2bool, default=False,
                   help="rank 0 prints the final traces; every rank writes them to --trace_dir")
    p.add_argument("--trace_dir", default="traces", help="where --dump_thunder_traces writes rank{r}_* files")
    p.add_argument("--json_path", default="", help="write the results as JSON here (rank 0)")
    p.add_argument("--return_metrics_as_json", type=str2bool, default=False,
                   help="accepted for compatibility with Thunder's script; JSON is written whenever --json_path is set")
    p.add_argument("--learning_rate", type=float, default=0.5, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--timeout", type=float, default=None,
                   help="process-group timeout in seconds (a hung peer's collective fails after it; default torch's)")
    p.add_argument("--save_checkpoint", default="", help="at the end, ck.save the model and optimizer to this DCP directory")
    p.add_argument("--resume", default="", help="ck.load model and optimizer from a DCP directory (saved at any TP size)")
    p.add_argument("--checkpoint", default="", help="start from a full state-dict file such as litgpt's lit_model.pth")
    p.add_argument("--simulate", type=int, default=0, metavar="N",
                   help="dry run in one plain process: N simulated ranks (thunder_tp.simulate), one forward + backward; "
                        "prints each rank's parameter bytes and collectives (no torchrun)")
    args = p.parse_args(argv)
    if args.simulate and args.distributed_mode not in ("tp", "tp_sp"):
        p.error(f"--simulate simulates a TP plan: use --distributed_mode tp or tp_sp, not {args.distributed_mode!r}")
    if args.max_iters <= args.warmup_iters:
        p.error(f"--max_iters ({args.max_iters}) must be larger than --warmup_iters ({args.warmup_iters})")
    if args.low_precision_mode != "none":
        p.error(f"--low_precision_mode {args.low_precision_mode}: fp8 through TransformerEngine is not supported by "
                "thunder_tp; use --low_precision_mode none with --dtype bfloat16 for a bf16 model")
    if args.compile == "eager" and args.distributed_mode != "none":
        p.error("--compile eager runs plain PyTorch, which has no tensor parallelism: use --distributed_mode none, "
                "or --compile thunder / thunder_default")
    return args


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


def init_distributed(timeout_s: float | None = None) -> tuple[int, int, torch.device]:
    """Join the default process group (NCCL + cuda:LOCAL_RANK on CUDA, gloo on CPU); a single process works too."""
    if "RANK" not in os.environ:  # plain `python benchmark_litgpt.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # one GPU per rank, or none at all: every rank decides the same way (NCCL can't share a GPU between ranks)
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        if torch.cuda.is_available() and local_rank == 0:
            print(f"note: {torch.cuda.device_count()} GPU(s) for {local_world} ranks per node: running on CPU (gloo)")
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def make_groups(tp_size: int) -> Groups:
    """TP groups of ``tp_size`` consecutive ranks and the orthogonal DP groups (the default group where one spans it)."""
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
class Mode:
    """``transforms(model, args, groups)`` builds the ``transforms=`` list; ``data_parallel``: the mode syncs grads
    over the DP groups (without it, a TP size smaller than the world size is refused: the replicas would train
    independently)."""

    transforms: Callable[[nn.Module, argparse.Namespace, Groups], list]
    data_parallel: bool = False


def _none(model: nn.Module, args: argparse.Namespace, groups: Groups) -> list:
    return []


def _tp(model: nn.Module, args: argparse.Namespace, groups: Groups, *, sequence_parallel: bool = False) -> list:
    import thunder_tp

    plan = thunder_tp.plans.litgpt(model, sequence_parallel=sequence_parallel, loss_parallel=args.loss_parallel)
    return [thunder_tp.TensorParallel(plan, process_group=groups.tp_group)]


MODES: dict[str, Mode] = {
    "none": Mode(_none),
    "tp": Mode(_tp),
    "tp_sp": Mode(partial(_tp, sequence_parallel=True)),
}


# 2-D: TP over the tp groups, then Thunder's DDP / FSDP over the dp groups (TP first; see thunder_tp/mesh.py)


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


MODES["tp_ddp"] = Mode(_tp_ddp, data_parallel=True)
MODES["tp_fsdp"] = Mode(_tp_fsdp, data_parallel=True)


def _thunder_tp_executors() -> list:
    import thunder_tp

    return thunder_tp.executors()


def _thunder_default_executors() -> list:
    import thunder
    from thunder_tp.collectives import comm_executor

    return [comm_executor, *thunder.get_default_executors()]


#: --compile -> the executors list for thunder.jit
EXECUTORS: dict[str, Callable[[], list]] = {
    "thunder": _thunder_tp_executors,
    "thunder_default": _thunder_default_executors,
}


# --------------------------------------------------------------------------------------------------------------
# model and data
# --------------------------------------------------------------------------------------------------------------


def make_config(args: argparse.Namespace):
    from litgpt import Config

    overrides: dict[str, Any] = {"block_size": args.block_size}
    if args.n_layers is not None:
        overrides["n_layer"] = args.n_layers
    return Config.from_name(args.model_name, **overrides)


#: tokens are drawn from [0, DATA_VOCAB), as in Thunder's benchmark, so that the loss visibly goes down
DATA_VOCAB = 100


def make_batch(args: argparse.Namespace, vocab: int, dp_rank: int, iteration: int, device: torch.device,
               rows: int | None = None):
    """Random (idx, targets) of shape (rows (micro_batch_size), block_size); identical on the ranks of a TP group."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + dp_rank * 10_007 + iteration)
    data = torch.randint(0, min(DATA_VOCAB, vocab), (rows or args.micro_batch_size, args.block_size + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


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


# --------------------------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------------------------


def tensor_bytes(proxies) -> int:
    return sum(math.prod(int(s) for s in p.shape) * p.dtype.bytes for p in proxies)


def saved_for_backward(forward_trace) -> dict | None:
    """Tensors the forward trace returns for the backward (Thunder's ``return output, (saved_tensors, other)``).

    ``bytes``/``count``: all of them; ``activation_bytes``: without the forward's own inputs (parameters, batch),
    which are held anyway. ``None`` when the trace saves nothing (no backward).
    """
    from thunder.core import prims
    from thunder.core.proxies import TensorProxy
    from thunder.core.pytree import tree_flatten

    ret = next((b for b in reversed(forward_trace.bound_symbols) if b.sym.id == prims.PrimIDs.RETURN), None)
    if ret is None or len(ret.args) != 2 or not isinstance(ret.args[1], (tuple, list)) or not ret.args[1]:
        return None
    output, (saved, *_) = ret.args
    tensors = {p.name: p for p in tree_flatten(saved)[0] if isinstance(p, TensorProxy)}
    inputs = set()
    if isinstance(output, dict) and "flat_args" in output:
        inputs = {p.name for p in tree_flatten(output["flat_args"])[0] if isinstance(p, TensorProxy)}
    return {
        "count": len(tensors),
        "bytes": tensor_bytes(tensors.values()),
        "activation_bytes": tensor_bytes(p for n, p in tensors.items() if n not in inputs),
    }


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# --------------------------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------------------------


def log(rank: int, *msg: Any) -> None:
    if rank == 0:
        print(*msg, flush=True)


def make_model(args: argparse.Namespace, config, device: torch.device) -> nn.Module:
    """The litgpt GPT with its loss, seeded random weights in ``--dtype``, blocks checkpointed if asked."""
    from thunder_tp.plans.litgpt import GPTWithLoss

    torch.manual_seed(args.seed)
    with device:
        model = GPTWithLoss(config).to(DTYPES[args.dtype])
    if args.checkpoint_activations:
        checkpoint_blocks(model)
    return model


def build(args: argparse.Namespace, groups: Groups, device: torch.device):
    """The config, the model (same random weights on every rank) and the jitted (or eager) module to train."""

    config = make_config(args)
    model = make_model(args, config, device)
    if args.compile == "eager":
        return config, model, model
    import thunder

    transforms = MODES[args.distributed_mode].transforms(model, args, groups)
    return config, model, thunder.jit(model, transforms=transforms, executors=EXECUTORS[args.compile]())


def train(args: argparse.Namespace, groups: Groups, device: torch.device, jm: nn.Module, vocab: int):
    optimizer = torch.optim.SGD(jm.parameters(), lr=args.learning_rate)
    load_checkpoints(args, jm, optimizer)
    steps = accumulation_steps(args, groups.dp_size)
    losses, times = [], []
    for it in range(args.max_iters):
        idx, targets = make_batch(args, vocab, groups.dp_rank, it, device, rows=steps * args.micro_batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for micro_idx, micro_targets in zip(idx.split(args.micro_batch_size), targets.split(args.micro_batch_size)):
            micro_loss = jm(micro_idx, micro_targets) / steps  # gradients accumulate over the micro-batches
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        optimizer.step()
        loss_value = loss.item()  # waits for the step
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(loss_value)
        times.append(dt)
        tag = " (warm-up)" if it < args.warmup_iters else ""
        log(groups.rank, f"iter {it}: loss {loss_value:.4f}, iter time: {dt * 1000:.2f} ms{tag}")
    if args.save_checkpoint:
        import thunder_tp.checkpoint as ck

        ck.save(args.save_checkpoint, jm, optimizer)
        log(groups.rank, f"checkpoint saved to {args.save_checkpoint}")
    # the slowest rank's time per iteration
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return losses, t.tolist()


def load_checkpoints(args: argparse.Namespace, jm: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """--checkpoint (pretrained weights, a file) then --resume (model and optimizer, a DCP directory)."""
    import thunder_tp.checkpoint as ck

    if args.checkpoint:
        ck.load(args.checkpoint, jm)
    if args.resume:
        ck.load(args.resume, jm, optimizer)


def collectives_per_iteration(jm: nn.Module) -> dict:
    import thunder
    import thunder_tp
    from thunder_tp.debug import totals

    forward = thunder.last_traces(jm)[-1]
    backward = thunder.last_backward_traces(jm)
    tables = {"forward": thunder_tp.collectives_table(forward),
              "backward": thunder_tp.collectives_table(backward[-1] if backward else None)}
    per_pass = {}
    for name, table in tables.items():
        kinds = totals(table)
        per_pass[name] = {
            "count": sum(k["count"] for k in kinds.values()),
            "bytes": sum(k["bytes"] for k in kinds.values()),
            "by_kind": kinds,
        }
    return {"tables": tables, "per_iteration": per_pass}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.simulate:
        return simulate_dry_run(args)
    rank, world, device = init_distributed(args.timeout)
    try:
        return run(args, rank, world, device)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
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
    groups = make_groups(tp_size) if args.distributed_mode != "none" else Groups(rank, world, 1, 0, None, 1, 0, None)
    if args.distributed_mode == "none" and world > 1:
        log(rank, f"note: --distributed_mode none with {world} ranks: every rank trains its own full copy")

    config, model, jm = build(args, groups, device)
    param_bytes = sum(p.numel() * p.element_size() for p in jm.parameters())  # this rank's shards
    full_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the unsharded model
    log(rank, f"model {config.name}: {config.n_layer} layers, n_embd {config.n_embd}, vocab {config.padded_vocab_size}, "
              f"{sum(p.numel() for p in model.parameters())} parameters ({sum(p.numel() for p in jm.parameters())} "
              f"on rank 0); block_size {args.block_size}, "
              f"micro_batch_size {args.micro_batch_size}; world {world}, tp {groups.tp_size}, dp {groups.dp_size}; "
              f"mode {args.distributed_mode}, compile {args.compile}, loss_parallel {args.loss_parallel}, device {device}")

    losses, times = train(args, groups, device, jm, config.padded_vocab_size)
    if not all(math.isfinite(x) for x in losses):
        log(rank, f"ERROR: non-finite loss: {losses}")
        return 1
    timed = times[args.warmup_iters:]
    avg_s = sum(timed) / len(timed)
    steps = accumulation_steps(args, groups.dp_size)
    tokens_per_iter = steps * args.micro_batch_size * args.block_size * groups.dp_size
    results: dict[str, Any] = {
        "model_name": args.model_name,
        "n_layers": config.n_layer,
        "block_size": args.block_size,
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": steps * args.micro_batch_size * groups.dp_size,
        "gradient_accumulation_steps": steps,
        "checkpoint_activations": args.checkpoint_activations,
        "dtype": args.dtype,
        "world_size": world,
        "tp_size": groups.tp_size,
        "dp_size": groups.dp_size,
        "distributed_mode": args.distributed_mode,
        "compile": args.compile,
        "loss_parallel": args.loss_parallel,
        "device": str(device),
        "max_iters": args.max_iters,
        "warmup_iters": args.warmup_iters,
        "losses": losses,
        "loss_decreased": losses[-1] < losses[0],
        "iter_times_ms": [t * 1000 for t in times],
        "average_iter_time_ms": avg_s * 1000,
        "tokens_per_iter": tokens_per_iter,
        "tokens_per_sec": tokens_per_iter / avg_s,
        "param_bytes_per_rank": param_bytes,
        "param_bytes_full_model": full_param_bytes,
        "peak_memory_bytes": peak_memory_bytes(device),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "max RSS",
    }
    if args.compile != "eager":
        import thunder

        results["saved_for_backward"] = saved_for_backward(thunder.last_traces(jm)[-1])
        results["collectives"] = collectives_per_iteration(jm)
    # every rank's peak memory (they can differ, e.g. rank 0 prints)
    peaks = [None] * world
    dist.all_gather_object(peaks, results["peak_memory_bytes"])
    results["peak_memory_bytes_per_rank"] = peaks

    report(results, rank)
    if args.dump_thunder_traces and args.compile != "eager":
        dump(args, jm, rank)
    if args.json_path and rank == 0:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        log(rank, f"results written to {path}")
    return 0


def report(r: dict, rank: int) -> None:
    if rank != 0:
        return
    lines = [
        "",
        f"Model name: {r['model_name']}",
        f"Seq Length: {r['block_size']}",
        f"Micro BS: {r['micro_batch_size']}",
        f"Global BS: {r['global_batch_size']} ({r['gradient_accumulation_steps']} micro-batches per step and DP rank)",
        f"Model dtype: {r['dtype']}" + (", activation checkpointing" if r["checkpoint_activations"] else ""),
        f"Number of Layers: {r['n_layers']}",
        f"Distributed Mode: {r['distributed_mode']} (world {r['world_size']}, tp {r['tp_size']}, dp {r['dp_size']})"
        + (", loss parallel" if r["loss_parallel"] else ""),
        f"Compiler: {r['compile']}",
        f"Loss: {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} ({'decreased' if r['loss_decreased'] else 'did NOT decrease'})",
        f"Average iter time: {r['average_iter_time_ms']:.2f} ms (over {r['max_iters'] - r['warmup_iters']} iterations)",
        f"Tokens/s: {r['tokens_per_sec']:.2f}",
        f"Parameters per rank: {fmt_bytes(r['param_bytes_per_rank'])} (full model: {fmt_bytes(r['param_bytes_full_model'])})",
        f"Peak memory ({r['peak_memory_kind']}, rank 0): {fmt_bytes(r['peak_memory_bytes'])}",
    ]
    saved = r.get("saved_for_backward")
    if saved:
        lines.append(f"Saved for backward: {fmt_bytes(saved['bytes'])} in {saved['count']} tensors "
                     f"({fmt_bytes(saved['activation_bytes'])} without parameters and inputs)")
    coll = r.get("collectives")
    if coll:
        for name, c in coll["per_iteration"].items():
            kinds = ", ".join(f"{v['count']} {k} ({fmt_bytes(v['bytes'])})" for k, v in c["by_kind"].items()) or "none"
            lines.append(f"Collectives per iteration, {name}: {c['count']} calls, {fmt_bytes(c['bytes'])}: {kinds}")
    print("\n".join(lines), flush=True)


def dump(args: argparse.Namespace, jm: nn.Module, rank: int) -> None:
    import thunder
    import thunder_tp

    if rank == 0:
        backward = thunder.last_backward_traces(jm)
        print("##########\n# final forward trace (rank 0)\n##########", flush=True)
        print(thunder.last_traces(jm)[-1], flush=True)
        if backward:
            print("##########\n# final backward trace (rank 0)\n##########", flush=True)
            print(backward[-1], flush=True)
    paths = thunder_tp.dump_traces(jm, args.trace_dir)
    dist.barrier()
    log(rank, f"traces of every rank written to {Path(args.trace_dir).resolve()} "
              f"({', '.join(p.name for p in paths)} for rank 0)")


# --------------------------------------------------------------------------------------------------------------
# --simulate N: the TP plan on N ranks simulated in this process (LocalTensor), without N processes
# --------------------------------------------------------------------------------------------------------------


def simulate_dry_run(args: argparse.Namespace) -> int:
    """One forward + backward of the TP=N program on N simulated ranks; prints per-rank parameter bytes and collectives."""
    import thunder
    import thunder_tp

    n = args.simulate
    if args.tp_size not in (None, n):
        raise SystemExit(f"--simulate {n} simulates a TP group of {n} ranks; drop --tp_size or set it to {n}")
    # model and batch as plain tensors, before the simulation: inside it, factories make per-rank LocalTensors
    config = make_config(args)
    model = make_model(args, config, torch.device("cpu"))
    idx, targets = make_batch(args, config.padded_vocab_size, 0, 0, torch.device("cpu"))
    with thunder_tp.simulate(world_size=n):
        transforms = MODES[args.distributed_mode].transforms(model, args, Groups(0, n, n, 0, None, 1, 0, None))
        jm = thunder.jit(model, transforms=transforms, executors=thunder_tp.executors())  # torch executor here
        t0 = time.perf_counter()
        loss = jm(idx, targets)
        loss.backward()
        seconds = time.perf_counter() - t0
        collectives = collectives_per_iteration(jm)
        if args.dump_thunder_traces:
            thunder_tp.dump_traces(jm, args.trace_dir)
    losses = thunder_tp.per_rank(loss)
    param_bytes = {r: 0 for r in range(n)}
    for p in jm.parameters():
        for r, piece in thunder_tp.per_rank(p).items():
            param_bytes[r] += piece.numel() * piece.element_size()
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lines = [
        f"Simulated {n} ranks in one process (thunder_tp.simulate; Thunder's torch executor): model {config.name}, "
        f"{config.n_layer} layers, mode {args.distributed_mode}, loss_parallel {args.loss_parallel}, "
        f"block_size {args.block_size}, micro_batch_size {args.micro_batch_size}",
        f"forward + backward: {seconds:.2f} s (simulated, all ranks)",
        *(f"rank {r}: loss {losses[r].item():.6f}, parameters {fmt_bytes(param_bytes[r])}" for r in range(n)),
        f"full model: {fmt_bytes(full_bytes)}",
    ]
    for name, c in collectives["per_iteration"].items():
        kinds = ", ".join(f"{v['count']} {k} ({fmt_bytes(v['bytes'])})" for k, v in c["by_kind"].items()) or "none"
        lines.append(f"Collectives per rank and iteration, {name}: {c['count']} calls, {fmt_bytes(c['bytes'])}: {kinds}")
    if args.dump_thunder_traces:
        lines.append(f"traces of every simulated rank written to {Path(args.trace_dir).resolve()}")
    print("\n".join(lines), flush=True)
    if args.json_path:
        results = {"simulate": n, "model_name": args.model_name, "n_layers": config.n_layer,
                   "distributed_mode": args.distributed_mode, "loss_parallel": args.loss_parallel,
                   "losses": {r: v.item() for r, v in losses.items()}, "param_bytes_per_rank": param_bytes,
                   "param_bytes_full_model": full_bytes, "collectives": collectives}
        Path(args.json_path).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
