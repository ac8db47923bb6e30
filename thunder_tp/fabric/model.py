"""What ThunderTPStrategy does to a model: the plan, the transforms, each rank's shards, and Fabric's view of them.

Fabric keeps the user's module (its `_FabricModule` reads the original's attributes, `.parameters()`, `state_dict()`
and `load_state_dict()`), while a TP-jitted module computes with its own tensors, each rank's shards (Thunder traces
the original module, whose parameters keep their full, logical shapes). So after setup the original's parameters are
placeholders of their full shapes, and its state_dict() / load_state_dict() read and write the shards. An optimizer
holds the original tensors (built before setup) or the placeholders (built after it) until Fabric sets it up; then
it steps the shards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import thunder
import torch
import torch.nn as nn
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from thunder.transforms import MaterializationTransform

from thunder_tp.data_parallel.mesh import Mesh
from thunder_tp.execution.executor import executors as default_executors
from thunder_tp.plans import auto as auto_plan
from thunder_tp.plans import hf as hf_plan
from thunder_tp.plans import litgpt as litgpt_plan
from thunder_tp.runtimes.divergence import checksum
from thunder_tp.styles import dtensor
from thunder_tp.thunder_internals.dynamo import in_torch_compile
from thunder_tp.thunder_internals.private import applied_transforms, original_module
from thunder_tp.transform import TensorParallel

FAMILIES = ("litgpt", "hf")


@dataclass(frozen=True)
class ModelOptions:
    """The strategy's options that shape the jitted model."""

    plan: Mapping[str, Any] | str | None = None
    #: a ModelParallelStrategy parallelize_fn(model, device_mesh), read for the plan and the data parallelism
    parallelize_fn: Callable | None = None
    data_parallel: str = "fsdp"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    executors: Sequence | None = None
    activation_checkpointing: frozenset[type] = field(default_factory=frozenset)
    #: the full parameters compared at setup, over the world (so TensorParallel's own check is off)
    check_weights: bool = True
    #: TensorParallel's other keyword options (check_inputs, overlap, float8_all_gather, ...), passed on as they are
    tensor_parallel: Mapping[str, Any] = field(default_factory=dict)
    example_inputs: tuple[tuple, dict] | None = None


def family_of(module: nn.Module) -> str | None:
    """"litgpt" for a litgpt GPT (or a module holding one), "hf" for a transformers model, else None."""
    try:
        from litgpt import GPT

        if any(isinstance(m, GPT) for m in module.modules()):
            return "litgpt"
    except ImportError:
        pass
    try:
        from transformers import PreTrainedModel

        if isinstance(module, PreTrainedModel):
            return "hf"
    except ImportError:
        pass
    return None


def read_parallelize_fn(module: nn.Module, options: ModelOptions, device_mesh) -> ModelOptions:
    """The options with a parallelize_fn read: its parallelize_module calls as the plan, its FSDP2 `fully_shard`
    (composable `replicate`) as data_parallel "fsdp" ("ddp"); other options as they were."""
    if options.parallelize_fn is None:
        return options
    read = dtensor.read_parallelize_fn(options.parallelize_fn, module, device_mesh)
    if not read.plan:
        raise ValueError(f"ThunderTPStrategy: the parallelize_fn {getattr(options.parallelize_fn, '__name__', '')} "
                         "made no parallelize_module call, so there is no plan to read; call parallelize_module(model, "
                         "device_mesh['tensor_parallel'], plan) in it, or pass ThunderTPStrategy(plan=...)")
    return replace(options, plan=read.plan, parallelize_fn=None,
                   data_parallel=read.data_parallel or options.data_parallel)


def resolve_plan(module: nn.Module, options: ModelOptions, tp_size: int) -> Mapping[str, Any]:
    """The plan `options.plan` names for `module` (default: its family's, else the automatic one)."""
    plan = options.plan if options.plan is not None else (family_of(module) or "auto")
    family_options = {"sequence_parallel": options.sequence_parallel, "loss_parallel": options.loss_parallel}
    if plan in FAMILIES:
        return (litgpt_plan if plan == "litgpt" else hf_plan)(module, **family_options)
    if any(family_options.values()):
        raise ValueError(
            "ThunderTPStrategy: sequence_parallel= and loss_parallel= are options of the family plans (plan=\"litgpt\" "
            f"or \"hf\"); with plan={plan if isinstance(plan, str) else 'a dict'!r} put the styles in the plan itself"
        )
    if plan == "auto":
        args, kwargs = _example_inputs(module, options)
        return auto_plan(module, *args, tp_size=tp_size, **kwargs)
    if isinstance(plan, str):
        raise ValueError(f'ThunderTPStrategy: plan must be a dict of styles, "auto", "litgpt" or "hf", got {plan!r}')
    return plan


def _example_inputs(module: nn.Module, options: ModelOptions) -> tuple[tuple, dict]:
    """The automatic plan's example call: `example_inputs=`, or for a litgpt GPT token ids on the meta device."""
    if options.example_inputs is not None:
        return options.example_inputs
    if family_of(module) == "litgpt":
        gpt = next(m for m in module.modules() if hasattr(m, "max_seq_length") and hasattr(m, "config"))
        return (torch.zeros(1, gpt.max_seq_length, dtype=torch.long, device="meta"),), {}
    raise ValueError(
        "ThunderTPStrategy(plan=\"auto\") searches the plan on a trace of the model, so it needs an example call for "
        f"a {type(module).__name__}: ThunderTPStrategy(plan=\"auto\", example_inputs=((idx,), {{}})) (meta tensors are "
        "fine)"
    )


def checkpoint_activations(module: nn.Module, policy: frozenset[type]) -> None:
    """Recompute the forward of every submodule of a type in `policy` in the backward (torch.utils.checkpoint, which
    Thunder traces; TP keeps its collectives in the recomputation)."""
    from torch.utils.checkpoint import checkpoint

    for m in module.modules():
        if isinstance(m, tuple(policy)):
            m.forward = functools.partial(checkpoint, m.forward, use_reentrant=False)


def jit(module: nn.Module, options: ModelOptions, mesh: Mesh, device: torch.device) -> tuple[Any, dict[str, int]]:
    """`module` jitted with TensorParallel over the mesh's TP group, Thunder's DDP or FSDP over its data-parallel group,
    and each rank's meta-device tensors materialized by their modules' own reset_parameters; and the checksum of every
    full parameter that this rank sharded (the module's, or the materialized one), for the ranks to compare."""
    checksums = {name: checksum(p) for name, p in module.named_parameters() if not p.is_meta}
    plan = resolve_plan(module, options, mesh.tp)
    checkpoint_activations(module, options.activation_checkpointing)
    tensor_parallel = TensorParallel(plan, process_group=mesh.tp_group, check_weights=False, **options.tensor_parallel)
    transforms: list = [tensor_parallel]
    if mesh.dp > 1:
        transforms.append(_data_parallel(options.data_parallel, mesh, device))
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        # after FSDP (each rank materializes its FSDP shards), before DDP (which records its parameters' devices)
        where = len(transforms) - (options.data_parallel == "ddp" and mesh.dp > 1)
        init = functools.partial(reset_each_module, checksums=checksums)
        transforms.insert(where, MaterializationTransform(device, init=init))
    executors = list(options.executors) if options.executors is not None else default_executors()
    jitted = thunder.jit(module, transforms=transforms, executors=executors)
    _run_eagerly_under_torch_compile(jitted)
    return jitted, checksums


def _data_parallel(kind: str, mesh: Mesh, device: torch.device):
    if kind == "ddp":
        from thunder.distributed.transforms.ddp_v2 import DDPTransform

        return DDPTransform(process_group=mesh.dp_group, bucket_size_in_mb=25.0, broadcast_from=None)
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    return FSDPTransform(device=device, process_group=mesh.dp_group)


def reset_each_module(transform: MaterializationTransform, jitted, checksums: dict[str, int]) -> None:
    """MaterializationTransform's init: each module whose tensors were on the meta device runs its own
    reset_parameters at full size, on the module itself (a reset_parameters replaced on the instance, as litgpt's
    initialize_weights does, acts on the module it was bound to), in module order (the order and so the random
    numbers of litgpt's reset_parameters(model) on one device); the transforms before shard the result. The
    checksum of each full parameter goes to `checksums`."""
    plain = original_module(jitted)
    for name, module in plain.named_modules():
        prefix = f"{name}." if name else ""
        own = [k for k, t in (*module._parameters.items(), *module._buffers.items())
               if t is not None and prefix + k in transform.have_materialized]
        if not own:
            continue
        if not callable(getattr(module, "reset_parameters", None)):
            raise TypeError(
                f"ThunderTPStrategy: {type(module).__name__} ({name or 'the model'}) was built on the meta device "
                "(fabric.init_module(empty_init=True)) but has no reset_parameters to initialize it; give it one, or "
                "build the model without empty_init"
            )
        with _full_size(module, own, transform.device) as full:
            module.reset_parameters()
        checksums.update({prefix + k: checksum(full[k]) for k in module._parameters if k in full})
        jitted.load_original_state_dict({prefix + k: v for k, v in full.items()})


@contextlib.contextmanager
def _full_size(module: nn.Module, names: list[str], device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Give `module` empty full-size tensors for `names` meanwhile; yields a dict that holds them afterwards."""
    saved = {k: (module._parameters if k in module._parameters else module._buffers)[k] for k in names}
    full: dict[str, torch.Tensor] = {}
    for k, t in saved.items():
        empty = torch.empty(t.shape, dtype=t.dtype, device=device)
        if k in module._parameters:
            module._parameters[k] = nn.Parameter(empty, requires_grad=t.requires_grad)
        else:
            module._buffers[k] = empty
    try:
        yield full
        for k in names:
            full[k] = (module._parameters if k in module._parameters else module._buffers)[k].detach()
    finally:
        for k, t in saved.items():
            (module._parameters if k in module._parameters else module._buffers)[k] = t


def _run_eagerly_under_torch_compile(jitted) -> None:
    """Fabric re-applies torch.compile to what the strategy returns when it was handed a compiled module (litgpt's
    pretrain compiles the model first); dynamo cannot trace a Thunder-compiled module, so its forward is excluded from
    dynamo (Thunder compiles it), and the first call under torch.compile says so once."""
    forward = jitted.forward

    @torch.compiler.disable
    def forward_outside_dynamo(*args, **kwargs):
        if not forward_outside_dynamo.told and in_torch_compile():
            rank_zero_warn("ThunderTPStrategy: the model was torch.compile'd; Thunder compiles it instead "
                           "(torch.compile is not applied on top of a Thunder-jitted module)")
        forward_outside_dynamo.told = True
        return forward(*args, **kwargs)

    forward_outside_dynamo.told = False
    jitted.forward = forward_outside_dynamo


def stand_ins(jitted, device: torch.device) -> list[tuple[torch.Tensor, str]]:
    """Every tensor an optimizer may hold for a parameter of the jitted module, with the parameter's name: the shard
    it computes with, the original module's tensor that the shard replaced (full-size, or on the meta device under
    init_module(empty_init=True)), and the placeholder that replaces that tensor in the original module from now on.

    A placeholder has the full logical shape, lives on `device` and is one NaN element broadcast (no memory; any use
    of it outside the jitted module shows as NaN): Fabric's module lists these (it reads the original module), and an
    optimizer built from them after setup is accepted by Fabric (no meta-device tensors)."""
    plain = original_module(jitted)
    found: list[tuple[torch.Tensor, str]] = []
    made: dict[int, nn.Parameter] = {}  # a tied parameter: one placeholder under each of its names
    for name, p in plain.named_parameters(remove_duplicate=False):
        shard = jitted.get_parameter(name)
        found.append((shard, name))
        if shard is p:
            continue
        if id(p) not in made:
            fill = float("nan") if p.dtype.is_floating_point or p.dtype.is_complex else 0
            value = torch.full((), fill, dtype=p.dtype, device=device).expand(p.shape)
            made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
        owner, _, attr = name.rpartition(".")
        plain.get_submodule(owner)._parameters[attr] = made[id(p)]
        found += [(p, name), (made[id(p)], name)]
    return found


def move_optimizer_to_shards(optimizer: torch.optim.Optimizer, owners: Mapping[torch.Tensor, tuple[Any, str]]) -> None:
    """Point an optimizer at the shards of the parameters it holds (stand-ins: `owners` maps each to its jitted module
    and name), keeping its param groups' options; state already there for a full tensor is sharded like it."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [p for p in held if p not in owners]
    if unknown:
        shapes = [tuple(p.shape) for p in unknown[:3]]
        raise ValueError(
            f"ThunderTPStrategy: the optimizer holds {len(unknown)} of its {len(held)} tensors (e.g. of shapes "
            f"{shapes}) that are no parameter of the model set up by this strategy: it would step tensors the model "
            "does not compute with. Build the optimizer from the parameters of the model you pass to fabric.setup, "
            "then set both up: `model, optimizer = fabric.setup(model, optimizer)`, or `model = fabric.setup(model)` "
            "then `optimizer = fabric.setup_optimizers(optimizer)` (the model first)"
        )
    for group in optimizer.param_groups:
        group["params"] = [_shard_of(owners[p]) for p in group["params"]]
    for p in [p for p in optimizer.state if p in owners and _shard_of(owners[p]) is not p]:
        jitted, name = owners[p]
        state = optimizer.state.pop(p)
        optimizer.state[_shard_of(owners[p])] = {k: _sharded_like(jitted, name, p, v) for k, v in state.items()}


def _shard_of(owner: tuple[Any, str]) -> nn.Parameter:
    jitted, name = owner
    return jitted.get_parameter(name)


def _sharded_like(jitted, name: str, full: torch.Tensor, value: Any) -> Any:
    """An optimizer state entry of parameter `name` on this rank: a tensor of the full parameter's shape goes through
    the jitted module's transforms as the parameter would (its TP shard, then its FSDP shard); anything else stays."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != full.shape:
        return value
    owner, _, attr = name.rpartition(".")
    piece = {attr: value}
    for transform in applied_transforms(jitted):
        piece = transform.transform_state_dict_for_submodule(jitted, owner, piece)
    return piece[attr]


def load_raw(jitted, path, strict: bool) -> None:
    """A plain state-dict file (litgpt's lit_model.pth) into the jitted module: memory-mapped, each rank copies its
    slices (load_full_state_dict)."""
    load_full_state_dict(jitted, torch.load(path, mmap=True, weights_only=True, map_location="cpu"), strict)


def load_full_state_dict(jitted, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
    """A full (logical) state dict into the jitted module's shards, through the original module's own load_state_dict
    (its key mapping, as LoRA's for a base checkpoint, and its strictness), module by module; returns its
    missing and unexpected keys."""
    state_dict = {k: v._load_tensor() if hasattr(v, "_load_tensor") else v for k, v in state_dict.items()}
    plain = original_module(jitted)
    with _assigned(plain, state_dict, strict) as (loaded, keys):
        dtypes = {n: t.dtype for n, t in (*jitted.named_parameters(), *jitted.named_buffers())}
        jitted.load_original_state_dict({n: t.to(dtypes.get(n, t.dtype)) for n, t in loaded.items()})
    return keys


@contextlib.contextmanager
def _assigned(plain: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool) -> Iterator[tuple[dict, Any]]:
    """`plain.load_state_dict(state_dict, strict, assign=True)` meanwhile (its full tensors, by reference); yields the
    entries it loaded, keyed as the module names them, and its incompatible keys; the module's own tensors are back
    afterwards."""
    before = dict(plain.state_dict(keep_vars=True))
    owners = {n: plain.get_submodule(n.rpartition(".")[0]) for n in before}
    try:
        keys = nn.Module.load_state_dict(plain, state_dict, strict=strict, assign=True)
        after = plain.state_dict(keep_vars=True)
        yield {n: t.detach() for n, t in after.items() if t is not before[n]}, keys
    finally:
        for n, t in before.items():
            attr = n.rpartition(".")[2]
            module = owners[n]
            (module._parameters if attr in module._parameters else module._buffers)[attr] = t


def route_state_dicts_to_shards(jitted) -> None:
    """The original module (what Fabric's module reads and writes) saves and loads the jitted module's tensors:
    `state_dict()` holds the full tensors, gathered from the ranks, and `load_state_dict(full)` loads each rank's
    slices (both collective: every rank calls them, as litgpt's loops do). `state_dict(keep_vars=True)` (thunder_tp's
    checkpoint code, which reads only names and shapes) is left as it is."""
    def full_entries(module, state_dict, prefix, local_metadata) -> None:
        if any(isinstance(v, nn.Parameter) for v in state_dict.values()):
            return
        full = {k.lstrip("."): v for k, v in jitted.original_state_dict().items()}
        for name in list(state_dict):
            if name[len(prefix):] in full:
                state_dict[name] = full[name[len(prefix):]]

    plain = original_module(jitted)
    plain.register_state_dict_post_hook(full_entries)
    plain.load_state_dict = functools.partial(load_full_state_dict, jitted)
