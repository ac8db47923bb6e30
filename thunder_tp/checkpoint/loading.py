"""load: a DCP directory saved at any TP size, a full state-dict file or an HF safetensors directory, into the
model's current layout."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from thunder_tp.checkpoint.materialize import install, materialize, tensor_device
from thunder_tp.checkpoint.safetensors_dir import is_hf_directory, read_hf_directory
from thunder_tp.checkpoint.state_dict import optimized_parameters, param_groups_by_name
from thunder_tp.checkpoint.tensors import (
    HeldTensor,
    model_tensors,
    parameter_names,
    replaced_from_checkpoint,
    sharded_tensor_without_deprecation_warnings,
    state_like,
)
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import REPLICATE
from thunder_tp.styles.matching import tied_parameters
from thunder_tp.thunder_internals.private import original_module


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a DCP directory (any TP size) or a full state-dict file into the model's current layout (collective)."""
    path = os.fspath(path)
    tensors = model_tensors(model)
    materialize(tensors)  # meta-device tensors get empty local buffers (installed only after loading)
    error, full = None, None
    try:
        if is_hf_directory(path):
            full = _complete(path, model, tensors, read_hf_directory(path))
        elif os.path.isdir(path):
            metadata = read_metadata(path)
            optim_targets = _check_directory(path, metadata, model, tensors, optimizer)
        else:
            full = _complete(path, model, tensors, _read_file(path))
    except (ValueError, FileNotFoundError, TypeError, RuntimeError) as e:
        error = e
    _agree(error, path)
    if full is None:
        with sharded_tensor_without_deprecation_warnings():
            _load_directory(path, model, tensors, optimizer, optim_targets)
    else:
        for name, t in tensors.items():
            for offsets, sizes, view in t.slices():
                view.copy_(full[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))])
    install(model, tensors, optimizer)
    replaced_from_checkpoint(model, tensors)


def _agree(error: Exception | None, path: str) -> None:
    """Raise on every rank if any rank rejected the checkpoint (so no rank waits in a collective)."""
    failed = error is not None
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([int(failed)], device=ranks_of().device)
        dist.all_reduce(flag)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"thunder_tp.checkpoint.load({path!r}): another rank rejected the checkpoint (see its error); nothing was "
            "loaded"
        )


def read_metadata(path: str) -> Metadata:
    """A DCP directory's metadata, or a clear error when it is not a complete checkpoint."""
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"thunder_tp.checkpoint.load: {os.path.join(path, '.metadata')} does not exist, so {path!r} is not a "
            "complete DCP checkpoint (ck.save writes .metadata last: the save was interrupted, or this is another "
            "kind of directory)"
        ) from e


def _check_keys(where: str, expected: set[str], found: set[str]) -> None:
    missing, extra = sorted(expected - found), sorted(found - expected)
    if missing or extra:
        raise ValueError(
            f"thunder_tp.checkpoint.load: {where} does not match the model: missing keys {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected keys {extra[:8]}{'...' if len(extra) > 8 else ''} "
            "(keys are the plain model's state_dict names; was it saved from another model or config?)"
        )


def _check_shape(where: str, name: str, expected: tuple[int, ...], found: tuple[int, ...]) -> None:
    if tuple(expected) != tuple(found):
        raise ValueError(
            f"thunder_tp.checkpoint.load: {name!r} in {where} has shape {tuple(found)}, the model expects "
            f"{tuple(expected)} (global, unsharded): the checkpoint was saved from another config"
        )


def _check_directory(path: str, metadata: Metadata, model: nn.Module, tensors: dict[str, HeldTensor],
                     optimizer) -> dict:
    """Validate keys and shapes against the model (and optimizer); return the optimizer state to load into."""
    entries = metadata.state_dict_metadata
    saved = {k[len("model."):]: md for k, md in entries.items() if k.startswith("model.")}
    _check_keys(path, set(tensors), set(saved))
    for name, t in tensors.items():
        _check_shape(path, name, t.global_shape, tuple(saved[name].size))
    return _optimizer_targets(path, entries, model, tensors, optimizer) if optimizer is not None else {}


def _optimizer_targets(path: str, entries: dict, model: nn.Module, tensors: dict[str, HeldTensor], optimizer) -> dict:
    """Empty local tensors for every optimizer state entry the checkpoint holds, checked against the optimizer."""
    kind = type(optimizer).__name__
    groups = {}
    for key in entries:
        if key.startswith("optim.param_groups."):
            index, _, hyper = key[len("optim.param_groups."):].partition(".")
            groups.setdefault(int(index), set()).add(hyper)
    if not groups:
        raise ValueError(
            f"thunder_tp.checkpoint.load: {path!r} holds no optimizer state; pass optimizer=None or a checkpoint saved "
            "with one"
        )
    wanted = [set(g) | {"params"} for g in optimizer.param_groups]
    if [groups[i] for i in sorted(groups)] != wanted:
        raise TypeError(
            f"thunder_tp.checkpoint.load: the optimizer state in {path!r} has param_groups with keys "
            f"{[sorted(groups[i]) for i in sorted(groups)]}, but this {kind} has {[sorted(w) for w in wanted]}: "
            "the checkpoint was saved with another optimizer type or another number of param groups"
        )
    names = parameter_names(model)
    in_optimizer = {names[id(p)] for p in optimized_parameters(optimizer)}
    targets: dict[str, dict[str, HeldTensor]] = {}
    for key, md in entries.items():
        if key.startswith("optim.state."):
            name, _, field = key[len("optim.state."):].rpartition(".")
            if name not in in_optimizer:
                raise ValueError(
                    f"thunder_tp.checkpoint.load: {path!r} has optimizer state {key!r} for a parameter this {kind} "
                    "does not optimize"
                )
            if not isinstance(md, TensorStorageMetadata):
                raise TypeError(
                    f"thunder_tp.checkpoint.load: {key!r} in {path!r} is not a tensor; thunder_tp loads tensor "
                    "optimizer state only"
                )
            param = tensors[name]
            size = tuple(md.size)
            shape = param.local.shape if size == param.global_shape else size
            local = torch.empty(shape, dtype=md.properties.dtype, device=tensor_device(param))
            replicated = HeldTensor(local, size, REPLICATE, 0, 1, None)
            targets.setdefault(name, {})[field] = state_like(param, local) if size == param.global_shape else replicated
    _check_keys(f"the optimizer state in {path!r}", in_optimizer if targets else set(), set(targets))
    return targets


def _load_directory(path: str, model, tensors: dict[str, HeldTensor], optimizer, optim_targets: dict) -> None:
    state = {"model": {name: t.for_dcp() for name, t in tensors.items()}}
    if optimizer is not None:
        state["optim"] = {
            "state": {n: {k: t.for_dcp() for k, t in fields.items()} for n, fields in optim_targets.items()},
            "param_groups": param_groups_by_name(model, optimizer),
        }
    dcp.load(state, checkpoint_id=path)
    for name, t in tensors.items():
        t.copy_from(state["model"][name])
    if optimizer is not None:
        for name, fields in optim_targets.items():
            for key, t in fields.items():
                t.copy_from(state["optim"]["state"][name][key])
        for group, saved in zip(optimizer.param_groups, state["optim"]["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        optimizer._thunder_tp_loaded_state = optim_targets  # installed by install once params are final


def _read_file(path: str) -> dict:
    """A full state dict, memory-mapped: nothing is read until a rank copies its slices."""
    try:
        full = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"thunder_tp.checkpoint.load: {path!r} is neither a DCP directory nor a file") from e
    except Exception as e:  # torch.load raises several kinds for a file it cannot read
        raise ValueError(f"thunder_tp.checkpoint.load: {path!r} is not a torch.save'd state dict ({e})") from e
    if not isinstance(full, dict):
        raise ValueError(f"thunder_tp.checkpoint.load: {path!r} holds a {type(full).__name__}, expected a state dict")
    return full


def _complete(path: str, model: nn.Module, tensors: dict[str, HeldTensor], full: dict) -> dict:
    """A full state dict (tensors, or slices read on indexing) keyed like the model: a submodule's keys prefixed,
    a tied weight that the file leaves out (save_pretrained's lm_head.weight) read as the one it is tied to; keys
    and shapes checked."""
    prefix = _submodule_prefix(set(tensors), set(full))
    full = {prefix + k: v for k, v in full.items()}
    for name, tied_to in tied_parameters(original_module(model)).items():
        if name not in full and tied_to in full:
            full[name] = full[tied_to]
    _check_keys(path, set(tensors), set(full))
    for name, t in tensors.items():
        _check_shape(path, name, t.global_shape, tuple(full[name].shape))
    return full


def _submodule_prefix(names: set[str], found: set[str]) -> str:
    """The prefix (e.g. "gpt.") that turns the keys of a submodule's state dict into the model's, else ""."""
    key = next(iter(found), "")
    for name in names:
        prefix = name[: len(name) - len(key)]
        if name.endswith(key) and prefix.endswith(".") and {prefix + k for k in found} == names:
            return prefix
    return ""
