"""The torch.distributed.checkpoint.state_dict mirror (get_state_dict / set_state_dict) and save."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from thunder_tp.checkpoint.safetensors_dir import save_config
from thunder_tp.checkpoint.tensors import (
    HeldTensor,
    model_tensor,
    model_tensors,
    parameter_names,
    replaced_from_checkpoint,
    sharded_tensor_without_deprecation_warnings,
    state_like,
)
from thunder_tp.runtimes.divergence import check_replicas
from thunder_tp.thunder_internals.private import original_module
from thunder_tp.thunder_internals.quiet import quiet_checkpoint_save
from thunder_tp.thunder_internals.sharded_tensor import is_sharded_tensor


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    """(model, optimizer) state dicts keyed by plain names, sharded tensors as ShardedTensor (for dcp.save/load)."""
    tensors = model_tensors(model)
    model_sd = {name: t.for_dcp() for name, t in tensors.items()}
    if optimizer is None:
        return model_sd, {}
    names = parameter_names(model)
    state = {
        names[id(p)]: {
            k: state_like(tensors[names[id(p)]], v).for_dcp() if isinstance(v, torch.Tensor) else v
            for k, v in s.items()
        }
        for p, s in optimizer.state.items()
    }
    return model_sd, {"state": state, "param_groups": param_groups_by_name(model, optimizer)}


def param_groups_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's hyperparameters, its parameters by plain name."""
    names = parameter_names(model)
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]


def set_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, model_state_dict: dict, optim_state_dict: dict
) -> None:
    """Copy state dicts shaped like get_state_dict's (after dcp.load) into the model and optimizer."""
    tensors = model_tensors(model)
    for name, value in model_state_dict.items():
        tensors[name].copy_from(value)
    replaced_from_checkpoint(model, model_state_dict)
    if optimizer is None or not optim_state_dict:
        return
    params = {name: model_tensor(model, name) for name in optim_state_dict["state"]}
    for name, entries in optim_state_dict["state"].items():
        optimizer.state[params[name]] = {k: _restore(tensors[name], v) for k, v in entries.items()}
    for group, saved in zip(optimizer.param_groups, optim_state_dict["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def optimized_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of every param group."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def _restore(param: HeldTensor, value):
    """An optimizer state value as this rank's tensor (a ShardedTensor's slices placed like its parameter's)."""
    if not is_sharded_tensor(value):
        return value
    state = state_like(param, torch.empty_like(param.local, dtype=value.dtype))
    state.copy_from(value)
    return state.local


# --- save -----------------------------------------------------------------------------------------------------


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write a DCP checkpoint directory (collective): each rank writes only its shards, replicas once (after checking
    that the replicas agree: thunder_tp.runtimes.divergence)."""
    _check_replicas(model)
    with sharded_tensor_without_deprecation_warnings(), quiet_checkpoint_save():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd} | ({"optim": optim_sd} if optimizer is not None else {})
        dcp.save(state, checkpoint_id=os.fspath(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_config(original_module(model), os.fspath(path))  # an HF model's config, for export --hf


def _check_replicas(model: nn.Module) -> None:
    """Raise on every rank if the TP group's copies of a replicated tensor differ (collective over the TP group)."""
    tensors = model_tensors(model)
    group = next((t.group for t in tensors.values()), None)
    if group is not None:
        check_replicas({n: (t.local, t.layout, t.global_shape) for n, t in tensors.items()}, group,
                       "thunder_tp.checkpoint.save")
