"""Meta-device models: local buffers for what a checkpoint fills, installed into the model once loaded."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from thunder_tp.checkpoint.tensors import HeldTensor, model_tensor
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.thunder_internals.private import original_module, set_parameter, set_trace_device


def tensor_device(t: HeldTensor) -> torch.device:
    """Where a tensor is, or will be once materialized (the group's device for a meta-device one)."""
    return ranks_of(t.group).device if t.local.is_meta else t.local.device


def materialize(tensors: dict[str, HeldTensor]) -> None:
    """Give meta-device entries an empty local buffer on the group's device (never a full tensor)."""
    for t in tensors.values():
        if t.local.is_meta:
            t.local = torch.empty(t.local.shape, dtype=t.local.dtype, device=tensor_device(t))
            t.materialized = True


def install(model: nn.Module, tensors: dict[str, HeldTensor], optimizer) -> None:
    """Put newly materialized tensors into the model (and the optimizer's param groups), then optimizer state."""
    plain = original_module(model)
    swapped = {}
    for name, t in tensors.items():
        if not getattr(t, "materialized", False):
            continue
        old = model_tensor(model, name)
        new = nn.Parameter(t.local, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else t.local
        swapped[id(old)] = new
        original = plain.state_dict(keep_vars=True)[name]
        if plain is not model:  # a ThunderModule: the computation uses overrides; tracing reads originals' devices
            if isinstance(new, nn.Parameter):
                set_parameter(model, name, new)
            else:
                model.set_buffer(name, new)
            set_trace_device(original, new.device)
        else:
            owner, _, attr = name.rpartition(".")
            module = plain.get_submodule(owner)
            (module._parameters if isinstance(new, nn.Parameter) else module._buffers)[attr] = new
    _materialize_non_persistent(model)
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        group["params"] = [swapped.get(id(p), p) for p in group["params"]]
    loaded = optimizer.__dict__.pop("_thunder_tp_loaded_state", {})
    by_name = {name: model_tensor(model, name) for name in loaded}
    optimizer.state.clear()
    for name, fields in loaded.items():
        optimizer.state[by_name[name]] = {k: t.local for k, t in fields.items()}


def _materialize_non_persistent(model: nn.Module) -> None:
    """Buffers outside the state dict (litgpt's rope cache, HF's rotary inv_freq) are rebuilt by their module."""
    plain = original_module(model)
    for module_name, module in plain.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        prefix = f"{module_name}." if module_name else ""
        if not any(model_tensor(model, prefix + n).is_meta for n in names):
            continue
        fresh = _shallow_copy(module)
        fresh.to_empty(device=ranks_of().device, recurse=False)
        _rebuild_buffers(fresh)
        for n in names:
            value = fresh._buffers[n].to(module._buffers[n].dtype)  # reset_parameters may use default dtypes
            _replace_aliases(module, module._buffers[n], value)
            if plain is model:
                module._buffers[n] = value
            else:
                model.set_buffer(prefix + n, value)
                set_trace_device(module._buffers[n], value.device)


def _replace_aliases(module: nn.Module, old: torch.Tensor, new: torch.Tensor) -> None:
    """Plain attributes that are the old buffer (HF rotary's original_inv_freq) become the new one."""
    for attr, value in list(vars(module).items()):
        if value is old:
            setattr(module, attr, new)


def _rebuild_buffers(module: nn.Module) -> None:
    """Recompute a module's buffers: its reset_parameters, or for HF's rotary embeddings (which have none) the
    inverse frequencies from its config, as its __init__ computes them."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif hasattr(module, "rope_init_fn") and hasattr(module, "config"):
        module.inv_freq, _ = module.rope_init_fn(module.config, module.inv_freq.device)
    else:
        raise NotImplementedError(
            f"thunder_tp.checkpoint: {type(module).__name__} has buffers outside the state dict but no "
            "reset_parameters to rebuild them on a meta-device model; build this model on a real device"
        )


def _shallow_copy(module: nn.Module) -> nn.Module:
    clone = copy.copy(module)
    clone._parameters, clone._buffers, clone._modules = dict(module._parameters), dict(module._buffers), {}
    return clone
