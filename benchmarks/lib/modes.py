"""The one mode registry: how a benchmark wraps its model (eager, thunder.jit, thunder_tp TP, DDP/FSDP over it,
DTensor TP, TP by hand); the trainer, its ``--compare``, bench_rank and bench_generate select from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.lib.harness import thunder_default_executors, thunder_tp_executors
from benchmarks.lib.llama import Llama, LlamaConfig, WithLoss, shard_by_hand, thunder_tp_plan


@dataclass(frozen=True)
class How:
    """What a mode's wrapping takes besides the model."""

    executors: Callable[[], list] = thunder_tp_executors
    tp_group: Any = None  # None: the default group
    dp_group: Any = None
    overlap: str = "auto"
    loss_parallel: bool = False
    float8_all_gather: bool = False
    plan: str = "hand"  # or "auto": plans.auto searches on a meta batch of ``batch``'s shape
    batch: tuple[int, int] = (1, 1)
    tp_size: int = 0  # plans.auto's; 0: the TP group's size
    materialize: torch.device | None = None  # a meta-device model: this rank's shards materialized here
    compile_backend: str = "inductor"  # DTensor modes under torch.compile
    verbose: bool = False  # plans.auto's plan printed
    first: tuple = ()  # transforms before the mode's (ContextParallel)


@dataclass(frozen=True)
class Mode:
    """A way to run a model: ``wrap(model, how)`` gives the module; ``distributed`` False: one device."""

    name: str
    description: str
    wrap: Callable[[nn.Module, How], nn.Module]
    runtime: str = "thunder"  # eager, thunder or compile
    distributed: bool = True
    data_parallel: bool = False  # syncs grads over the DP groups


@dataclass(frozen=True)
class Selected:
    """A mode as a benchmark runs it: ``build`` makes its module, on ``ranks`` ranks (1: rank 0 alone, ``on_ranks``)."""

    name: str
    description: str
    runtime: str
    ranks: int
    build: Callable[..., nn.Module]


def tp_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """thunder_tp's hand plan for the benchmark Llama or a litgpt GPT (the model's own)."""
    import thunder_tp
    if isinstance(model, WithLoss):
        return thunder_tp_plan(sequence_parallel, loss_parallel)
    return thunder_tp.plans.litgpt(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def dtensor_plan(kind: str, loss_parallel: bool = False) -> dict:
    """DTensor plan for ``Llama``: 'default' (per-linear), 'best' (shared inputs) or 'sp' (torchtitan's)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
    act = Shard(1) if kind == "sp" else Replicate()
    blk = "layers.*."
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel else ColwiseParallel(input_layouts=act, output_layouts=Replicate()),
        **{blk + w: ColwiseParallel() for w in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                                                 "feed_forward.w3")},
        blk + "attention.wo": RowwiseParallel(output_layouts=act),
        blk + "feed_forward.w2": RowwiseParallel(output_layouts=act),
    }
    if kind != "default":  # one Replicate input shared by q/k/v (w1/w3): their Partial grads all-reduced once
        plan[blk + "attention"] = PrepareModuleInput(
            input_layouts=(act, None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=False)
        plan[blk + "feed_forward"] = PrepareModuleInput(
            input_layouts=(act,), desired_input_layouts=(Replicate(),), use_local_output=False)
    if kind == "sp":
        plan.update({"norm": SequenceParallel(), blk + "attention_norm": SequenceParallel(),
                     blk + "ffn_norm": SequenceParallel()})
    return plan


def without_layer_keys(plan: dict, model: nn.Module) -> dict:
    """The plan without its per-layer (glob) keys where the model has no layers (bench_rank's depth 0)."""
    has_layers = any(name.endswith(".0") for name, _ in model.named_modules())
    return plan if has_layers else {k: v for k, v in plan.items() if "*" not in k}


def init_local(module: nn.Module, device: torch.device) -> None:
    """A meta-device module on ``device`` with random local weights, buffers recomputed by ``reset_parameters``."""
    from torch.distributed.tensor import DTensor
    module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.normal_(0.0, 0.02) if local.ndim > 1 else local.fill_(1.0)
        for m in module.modules():
            if m._non_persistent_buffers_set and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def jit(model: nn.Module, how: How, transforms: list | None = None) -> nn.Module:
    """thunder.jit with ``how``'s executors; a meta-device model's shards materialized by each module's own init."""
    import thunder
    from thunder.transforms import MaterializationTransform
    transforms = [*how.first, *(transforms or [])]
    if how.materialize is not None:
        init = MaterializationTransform.init_from_original_module_init()
        transforms.append(MaterializationTransform(how.materialize, init=init))
    return thunder.jit(model, transforms=transforms, executors=how.executors())


def _plan(model: nn.Module, how: How, sequence_parallel: bool) -> dict:
    """The hand plan, or the one plans.auto searches on a meta batch (``how.plan``)."""
    import thunder_tp
    if how.plan == "hand":
        return without_layer_keys(tp_plan(model, sequence_parallel, how.loss_parallel), model)
    if sequence_parallel or how.loss_parallel:
        raise SystemExit("--plan auto chooses every layout itself: leave out --loss_parallel and use tp")
    batch = torch.zeros(how.batch, dtype=torch.int64, device="meta")
    plan = thunder_tp.plans.auto(model, batch, batch, tp_size=how.tp_size or dist.get_world_size(how.tp_group))
    if how.verbose:
        print(plan, flush=True)
    return plan


def tp_transform(model: nn.Module, how: How, sequence_parallel: bool = False):
    """TensorParallel of the model's plan with ``how``'s group, overlap and float8 gathering."""
    import thunder_tp
    return thunder_tp.TensorParallel(_plan(model, how, sequence_parallel), process_group=how.tp_group,
                                     overlap=how.overlap, float8_all_gather=how.float8_all_gather)


def _tp(model: nn.Module, how: How, sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    how = replace(how, loss_parallel=how.loss_parallel or loss_parallel)
    return jit(model, how, [tp_transform(model, how, sequence_parallel)])


def _tp_dp(model: nn.Module, how: How, fsdp: bool) -> nn.Module:
    """TP, then Thunder's DDP or FSDP over ``how``'s DP group (default: every rank)."""
    from thunder.distributed.transforms.ddp_v2 import DDPTransform
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform
    group = how.dp_group if how.dp_group is not None else dist.group.WORLD
    dp = (FSDPTransform(device=next(model.parameters()).device, process_group=group) if fsdp
          else DDPTransform(process_group=group, bucket_size_in_mb=25.0, broadcast_from=None))
    return jit(model, how, [tp_transform(model, how), dp])


def dtensor(model: nn.Module, how: How, kind: str, compile: bool = False, loss_parallel: bool = False) -> nn.Module:
    """The Llama under a DTensor plan (``loss_parallel``: the targets replicated, the loss in its context)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context
    from torch.distributed.tensor.parallel import parallelize_module
    device = how.materialize or next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    parallelize_module(model.model, mesh, without_layer_keys(dtensor_plan(kind, loss_parallel), model))
    if how.materialize is not None:
        init_local(model, how.materialize)
    if loss_parallel:
        model.register_forward_pre_hook(lambda _m, args: (args[0], DTensor.from_local(args[1], mesh, [Replicate()])))
        model.step_context = loss_parallel_context  # harness.step_context: forward and backward inside it
    return torch.compile(model, backend=how.compile_backend) if compile else model


def _manual_tp(model: nn.Module, how: How) -> nn.Module:
    """A litgpt GPT under gpt-fast-style TP by hand (``shard_by_hand``), its KV cache (if set) set again."""
    cache = model.transformer.h[0].attn.kv_cache if len(model.transformer.h) else None
    model.collectives = shard_by_hand(model, dist.get_rank(), dist.get_world_size())
    if how.materialize is not None:
        init_local(model, how.materialize)
    if cache is not None:
        model.set_kv_cache(batch_size=cache.k.shape[0], device=cache.k.device, dtype=cache.k.dtype)
    return model


def _executors(executors: Callable[[], list]) -> Callable[[nn.Module, How], nn.Module]:
    return lambda model, how: jit(model, replace(how, executors=executors))


def _inductor() -> list:
    import thunder_tp
    return thunder_tp.executors("inductor")


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("eager", "eager PyTorch", lambda model, how: model, runtime="eager", distributed=False),
    Mode("thunder", "thunder.jit", jit, distributed=False),
    Mode("thunder_defaults", "thunder.jit, Thunder's default executors + thunder_tp's comm executor",
         _executors(thunder_default_executors), distributed=False),
    Mode("thunder_inductor", "thunder.jit, thunder_tp.executors('inductor') (on CUDA: Triton, not nvFuser)",
         _executors(_inductor), distributed=False),
    Mode("tp", "thunder_tp TP", _tp),
    Mode("tp_sp", "thunder_tp TP+SP", partial(_tp, sequence_parallel=True)),
    Mode("tp_lp", "thunder_tp TP, loss parallel", partial(_tp, loss_parallel=True)),
    Mode("tp_sp_lp", "thunder_tp TP+SP, loss parallel", partial(_tp, sequence_parallel=True, loss_parallel=True)),
    Mode("tp_auto", "thunder_tp TP, the plan plans.auto searched",
         lambda model, how: _tp(model, replace(how, plan="auto"))),
    Mode("tp_ddp", "thunder_tp TP, Thunder's DDP over the DP groups", partial(_tp_dp, fsdp=False), data_parallel=True),
    Mode("tp_fsdp", "thunder_tp TP, Thunder's FSDP over the DP groups", partial(_tp_dp, fsdp=True), data_parallel=True),
    Mode("dtensor_tp_default", "DTensor TP, default plan (Colwise/Rowwise per linear)",
         partial(dtensor, kind="default"), runtime="eager"),
    Mode("dtensor_tp", "DTensor TP, best eager plan (+PrepareModuleInput)", partial(dtensor, kind="best"),
         runtime="eager"),
    Mode("dtensor_tp_lp", "DTensor TP, best eager plan, loss_parallel()",
         partial(dtensor, kind="best", loss_parallel=True), runtime="eager"),
    Mode("dtensor_sp", "DTensor TP+SP (torchtitan's plan)", partial(dtensor, kind="sp"), runtime="eager"),
    Mode("dtensor_tp_compile", "DTensor TP, best plan, torch.compile", partial(dtensor, kind="best", compile=True),
         runtime="compile"),
    Mode("manual_tp", "hand-written TP (gpt-fast style), eager", _manual_tp, runtime="eager"),
)}


def select(known: dict[str, Any], names: str, flag: str) -> list[str]:
    """The names of ``known`` in ``names`` (comma-separated, or 'all'), in ``known``'s order; an unknown one exits."""
    wanted = list(known) if names == "all" else [n for n in names.split(",") if n]
    if unknown := [n for n in wanted if n not in known]:
        raise SystemExit(f"{flag}: unknown {unknown}; choose from {list(known)}")
    return [n for n in known if n in wanted]


def llama_on_meta(cfg: LlamaConfig, dtype: torch.dtype) -> nn.Module:
    """The benchmark Llama with its loss, on the meta device."""
    with torch.device("meta"):
        return WithLoss(Llama(cfg)).to(dtype)


def gpt_on_meta(config, context: int, dtype: torch.dtype) -> nn.Module:
    """litgpt's GPT on the meta device, for ``context`` cached positions plus the decoded one."""
    from litgpt import GPT
    with torch.device("meta"):
        model = GPT(config).to(dtype)
    model.max_seq_length = context + 1
    return model.eval()


def unstepped(model: Any) -> nn.Module:
    """The jitted module of a ``thunder_tp.DecodeStep``, else ``model``."""
    import thunder_tp
    return model.module if isinstance(model, thunder_tp.DecodeStep) else model
