"""Fabric's save / load for a TP-jitted model: a sharded DCP directory through thunder_tp.checkpoint (any TP size in,
any other out), with the loop's plain state beside it; a plain state-dict file (lit_model.pth) read slice by slice.

    path/                 a DCP directory (thunder_tp.checkpoint.save: the model and the optimizer)
    path/meta.pt          everything else of the state (iter_num, step_count, a dataloader's state_dict()), rank 0
    path/rank{r}.pt       under FSDP instead of the DCP files: each rank's shards and optimizer state (same mesh only)

A `filter` (litgpt's LoRA-only files) writes one plain file instead, from rank 0: the filtered full tensors.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _Stateful
from thunder.core.module import ThunderModule

import thunder_tp.checkpoint as ck
from thunder_tp.fabric.model import load_raw
from thunder_tp.thunder_internals.private import applied_transforms

Filter = Mapping[str, Callable[[str, Any], bool]]


def save(path: Path, state: Mapping[str, Any], filter: Filter | None, rank: int) -> None:
    """Save `state` (collective): model and optimizer sharded, the rest in meta.pt; with `filter` a filtered full
    file."""
    model_key, model, optimizer_key, optimizer = _model_and_optimizer(state, "save")
    if filter is not None:
        _save_filtered(path, state, model_key, model, filter, rank)
        return
    if rank == 0 and path.is_file():
        path.unlink()
    _barrier()
    if _fsdp(model):
        _save_local(path, model, optimizer, rank)
    else:
        # checks that the TP group's replicas agree first (thunder_tp.runtimes.divergence)
        ck.save(path, model, optimizer)
    metadata = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in state.items()
                if k not in (model_key, optimizer_key)}
    if rank == 0:
        torch.save(metadata, path / _METADATA_FILENAME)


def load(path: Path, state: Any, strict: bool) -> dict[str, Any]:
    """Restore `state` from what `save` wrote (collective), or a module from a plain state-dict file; returns what
    the checkpoint holds beyond `state`."""
    if isinstance(state, nn.Module):
        if path.is_dir():
            ck.load(path, state)
        else:
            load_raw(state, path, strict)
        return {}
    if isinstance(state, torch.optim.Optimizer) or not path.is_dir():
        raise NotImplementedError(
            "ThunderTPStrategy.load_checkpoint: pass the whole state ({'model': model, 'optimizer': optimizer, ...}) "
            f"and a checkpoint directory that fabric.save wrote; got {type(state).__name__} and {path}"
        )
    model_key, model, optimizer_key, optimizer = _model_and_optimizer(state, "load")
    if (path / _LOCAL.format(rank=0)).exists():
        _load_local(path, model, optimizer)
    else:
        ck.load(path, model, optimizer)
    metadata = torch.load(path / _METADATA_FILENAME, weights_only=False) if (path / _METADATA_FILENAME).exists() else {}
    rest = [k for k in state if k not in (model_key, optimizer_key)]
    _validate_keys_for_strict_loading(rest, metadata.keys(), strict=strict)
    for key in rest:
        if key not in metadata:
            continue
        if isinstance(state[key], _Stateful):
            state[key].load_state_dict(metadata.pop(key))
        else:
            state[key] = metadata.pop(key)
    return metadata


#: under FSDP, each rank's own file (thunder_tp.checkpoint cannot describe FSDP's padded chunks to DCP yet)
_LOCAL = "rank{rank}.pt"


def _fsdp(model: ThunderModule) -> bool:
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    return any(isinstance(t, FSDPTransform) for t in applied_transforms(model))


def _save_local(path: Path, model: ThunderModule, optimizer, rank: int) -> None:
    """Each rank's tensors as it holds them (TP and FSDP shards) and its optimizer state, in its own file: loadable
    on the same mesh only."""
    path.mkdir(parents=True, exist_ok=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    state = {"model": model.state_dict(), "world_size": world}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    torch.save(state, path / _LOCAL.format(rank=rank))
    _barrier()


def _load_local(path: Path, model: ThunderModule, optimizer) -> None:
    """What _save_local wrote, on the same mesh (a clear error on another one)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    state = torch.load(path / _LOCAL.format(rank=rank), weights_only=False)
    if state["world_size"] != world:
        raise ValueError(
            f"ThunderTPStrategy: {path} holds each rank's FSDP shards of a run on {state['world_size']} ranks; it "
            f"loads on the same mesh only (this run has {world}). Save with data_parallel=\"ddp\" for checkpoints that "
            "load at any TP size"
        )
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def _model_and_optimizer(state: Mapping[str, Any], what: str) -> tuple[str, ThunderModule, str | None, Any]:
    """The one model set up by the strategy in `state`, and its optimizer (if any)."""
    models = [(k, v) for k, v in state.items() if isinstance(v, ThunderModule)]
    optimizers = [(k, v) for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    if len(models) != 1 or len(optimizers) > 1:
        raise ValueError(
            f"ThunderTPStrategy can {what} a state with one model set up by fabric.setup and at most one optimizer "
            f"(found {len(models)} models and {len(optimizers)} optimizers): "
            "fabric.save(path, {'model': model, 'optimizer': optimizer, ...})"
        )
    (model_key, model), (optimizer_key, optimizer) = models[0], (optimizers[0] if optimizers else (None, None))
    return model_key, model, optimizer_key, optimizer


def _save_filtered(path: Path, state: Mapping[str, Any], model_key: str, model: ThunderModule, filter: Filter,
                   rank: int) -> None:
    """One plain file from rank 0: the model's full tensors (gathered: collective) and the state's other entries,
    each kept where its filter says."""
    if any(isinstance(v, torch.optim.Optimizer) for v in state.values()):
        raise NotImplementedError("ThunderTPStrategy: fabric.save(..., filter=...) of an optimizer state is not "
                                  "supported")
    converted: dict[str, Any] = {}
    for key, value in state.items():
        if key == model_key:
            value = model.original_state_dict()
        elif isinstance(value, _Stateful):
            value = value.state_dict()
        _apply_filter(key, filter, value, converted)
    if rank == 0:
        if path.is_dir():
            shutil.rmtree(path)
        torch.save(converted, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
