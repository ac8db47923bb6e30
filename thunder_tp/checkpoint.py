"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save at any TP size, load at any other.

    import thunder_tp.checkpoint as ck
    ck.save(path, jm, optimizer)   # collective; a DCP directory, each rank writes only its shards
    ck.load(path, jm, optimizer)   # collective; a DCP directory or a full state-dict file (lit_model.pth)
    python -m thunder_tp.checkpoint export DIR OUT   # DCP directory -> one torch.save'd plain state dict

Representation: keys are the plain model's names ("model.<name>", "optim.state.<name>.<key>",
"optim.param_groups.<i>.<hyperparameter>", as torch.distributed.checkpoint.state_dict writes them). A TP-sharded
tensor is a ShardedTensor whose local shards are the slices of the global tensor this rank holds
(layouts.shard_chunks: one per block for a fused q|k|v), so DCP's own planner reshards on load by overlapping
saved and wanted chunks. Unsharded tensors are plain tensors, which DCP writes once however many ranks hold
them (so the dp replicas of 2-D TP x DDP write nothing twice).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from thunder_tp.collectives import gather_full
from thunder_tp.layouts import REPLICATE, Layout, Shard, group_device, piece_parts, shard_chunks, shard_tensor
from thunder_tp.thunder_private import applied_transforms, original_module, set_parameter, set_trace_device

__all__ = ["save", "load", "get_state_dict", "set_state_dict", "export"]

Chunks = list[tuple[tuple[int, ...], tuple[int, ...]]]


@dataclass
class _Tensor:
    """One tensor of the plain model (or its optimizer state) as this rank holds it."""

    local: torch.Tensor  # this rank's piece (detached; a view of the model's tensor, or a new buffer on load)
    global_shape: tuple[int, ...]
    layout: Layout
    rank: int
    size: int
    group: dist.ProcessGroup | None
    materialized: bool = False  # `local` is a new buffer that replaces a meta-device tensor once loaded

    def chunks(self, rank: int | None = None) -> Chunks:
        return shard_chunks(self.global_shape, self.layout, self.rank if rank is None else rank, self.size)

    def slices(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        """(global offsets, sizes, view of `local`) for each chunk this rank holds."""
        parts = piece_parts(self.local, self.layout, self.rank, self.size)
        return [(offsets, sizes, part) for (offsets, sizes), part in zip(self.chunks(), parts)]

    def for_dcp(self) -> torch.Tensor:
        """A plain tensor when this rank holds all of it, else a ShardedTensor of its slices.

        A chunk that several ranks hold (replicated K/V heads) is described once, by its first holder: DCP then
        writes it once and reads it once; copy_from hands it on to the other holders.
        """
        if self.chunks() == [((0,) * len(self.global_shape), self.global_shape)]:
            return self.local
        device = self.local.device
        holders: dict[tuple, int] = {}
        for r in range(self.size):
            for chunk in self.chunks(r):
                holders.setdefault(chunk, r)
        placement = lambda r: f"rank:{dist.get_global_rank(self.group, r)}/{device}"  # noqa: E731
        every = [ShardMetadata(list(o), list(s), placement(r)) for (o, s), r in holders.items()]
        views = {(o, s): view for o, s, view in self.slices()}
        shards = [LocalShard(views[(o, s)].contiguous(), md)
                  for ((o, s), r), md in zip(holders.items(), every) if r == self.rank]
        props = TensorProperties(dtype=self.local.dtype, requires_grad=False)
        metadata = ShardedTensorMetadata(every, torch.Size(self.global_shape), props)
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata, process_group=self.group)

    def copy_from(self, value: torch.Tensor) -> None:
        """Write what DCP loaded into for_dcp()'s value into `local`, wherever DCP did not write in place
        (collective for a layout with replicated chunks: their first holders pass them on)."""
        if isinstance(value, ShardedTensor):
            views = {(o, s): view for o, s, view in self.slices()}
            pairs = [(views[(tuple(x.metadata.shard_offsets), tuple(x.metadata.shard_sizes))], x.tensor)
                     for x in value.local_shards()]
        else:
            pairs = [(self.local, value)]
        with torch.no_grad():
            for view, source in pairs:
                if view.data_ptr() != source.data_ptr():
                    view.copy_(source)
            if isinstance(self.layout, Shard) and self.layout.is_replicated:
                full = gather_full(self.local, self.layout, self.group)
                self.local.copy_(shard_tensor(full, self.layout, self.rank, self.size))


@contextlib.contextmanager
def _sharded_tensor_without_deprecation_warnings():
    """ShardedTensor warns that DTensor replaces it, but DTensor cannot hold several slices per rank (q|k|v blocks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


# --- the model's tensors ---------------------------------------------------------------------------------------


def _tensor_parallel(model: nn.Module):
    from thunder_tp.transform import TensorParallel

    _check_data_parallel(model)
    return next((t for t in applied_transforms(model) if isinstance(t, TensorParallel)), None)


def _check_data_parallel(model: nn.Module) -> None:
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    if any(isinstance(t, FSDPTransform) for t in applied_transforms(model)):
        raise NotImplementedError(
            "thunder_tp.checkpoint: FSDPTransform keeps a padded dim-0 chunk of each TP shard per dp rank, and its "
            "(offsets, sizes) in the global tensor are not exposed by Thunder's FSDPTransform, so they cannot be "
            "described to torch.distributed.checkpoint; use DDPTransform for 2-D checkpoints, or gather with "
            "original_state_dict()"
        )


def _plain_module(model: nn.Module) -> nn.Module:
    return original_module(model)


def _get(model: nn.Module, name: str) -> torch.Tensor:
    """The tensor the model computes with (a ThunderModule's override, i.e. the local shard)."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def _model_tensors(model: nn.Module) -> dict[str, _Tensor]:
    """Every entry of the plain model's state dict, as this rank holds it."""
    tp = _tensor_parallel(model)
    rank, size, group = (tp.tp.rank, tp.tp.size, tp.tp.group) if tp is not None else (0, 1, None)
    out = {}
    for name, original in _plain_module(model).state_dict(keep_vars=True).items():
        layout = tp.parameter_layouts.get(name, REPLICATE) if tp is not None else REPLICATE
        out[name] = _Tensor(_get(model, name).detach(), tuple(original.shape), layout, rank, size, group)
    return out


def _parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(_get(model, name)): name for name, _ in _plain_module(model).named_parameters()}


def _like(param: _Tensor, value: torch.Tensor) -> _Tensor:
    """An optimizer state tensor: sharded like its parameter when it has the parameter's shape."""
    if value.dim() and tuple(value.shape) == tuple(param.local.shape):
        return _Tensor(value.detach(), param.global_shape, param.layout, param.rank, param.size, param.group)
    return _Tensor(value.detach(), tuple(value.shape), REPLICATE, 0, 1, None)


# --- the torch.distributed.checkpoint.state_dict mirror ---------------------------------------------------------


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    """(model, optimizer) state dicts keyed by plain names, sharded tensors as ShardedTensor (for dcp.save/load)."""
    tensors = _model_tensors(model)
    model_sd = {name: t.for_dcp() for name, t in tensors.items()}
    if optimizer is None:
        return model_sd, {}
    names = _parameter_names(model)
    state = {
        names[id(p)]: {
            k: _like(tensors[names[id(p)]], v).for_dcp() if isinstance(v, torch.Tensor) else v for k, v in s.items()
        }
        for p, s in optimizer.state.items()
    }
    return model_sd, {"state": state, "param_groups": _param_groups(model, optimizer)}


def _param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's hyperparameters, its parameters by plain name."""
    names = _parameter_names(model)
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]


def set_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, model_state_dict: dict, optim_state_dict: dict
) -> None:
    """Copy state dicts shaped like get_state_dict's (after dcp.load) into the model and optimizer."""
    tensors = _model_tensors(model)
    for name, value in model_state_dict.items():
        tensors[name].copy_from(value)
    if optimizer is None or not optim_state_dict:
        return
    params = {name: _get(model, name) for name in optim_state_dict["state"]}
    for name, entries in optim_state_dict["state"].items():
        optimizer.state[params[name]] = {k: _restore(tensors[name], v) for k, v in entries.items()}
    for group, saved in zip(optimizer.param_groups, optim_state_dict["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _restore(param: _Tensor, value):
    """An optimizer state value as this rank's tensor (a ShardedTensor's slices placed like its parameter's)."""
    if not isinstance(value, ShardedTensor):
        return value
    state = _like(param, torch.empty_like(param.local, dtype=value.dtype))
    state.copy_from(value)
    return state.local


# --- save -----------------------------------------------------------------------------------------------------


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write a DCP checkpoint directory (collective): each rank writes only its shards, replicas once."""
    with _sharded_tensor_without_deprecation_warnings():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd} | ({"optim": optim_sd} if optimizer is not None else {})
        dcp.save(state, checkpoint_id=os.fspath(path))


# --- load -----------------------------------------------------------------------------------------------------


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a DCP directory (any TP size) or a full state-dict file into the model's current layout (collective)."""
    path = os.fspath(path)
    tensors = _model_tensors(model)
    _materialize(tensors)  # meta-device tensors get empty local buffers (installed only after loading)
    error = None
    try:
        if os.path.isdir(path):
            metadata = _read_metadata(path)
            optim_targets = _check_directory(path, metadata, model, tensors, optimizer)
        else:
            full = _read_file(path, tensors)
    except (ValueError, FileNotFoundError, TypeError, RuntimeError) as e:
        error = e
    _agree(error, path)
    if os.path.isdir(path):
        with _sharded_tensor_without_deprecation_warnings():
            _load_directory(path, model, tensors, optimizer, optim_targets)
    else:
        for name, t in tensors.items():
            for offsets, sizes, view in t.slices():
                view.copy_(full[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])
    _install(model, tensors, optimizer)


def _agree(error: Exception | None, path: str) -> None:
    """Raise on every rank if any rank rejected the checkpoint (so no rank waits in a collective)."""
    failed = error is not None
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([int(failed)], device=group_device(None))
        dist.all_reduce(flag)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"thunder_tp.checkpoint.load({path!r}): another rank rejected the checkpoint (see its error); nothing was loaded"
        )


def _read_metadata(path: str) -> Metadata:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"thunder_tp.checkpoint.load: {os.path.join(path, '.metadata')} does not exist, so {path!r} is not a complete "
            "DCP checkpoint (ck.save writes .metadata last: the save was interrupted, or this is another kind of directory)"
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


def _check_directory(path: str, metadata: Metadata, model: nn.Module, tensors: dict[str, _Tensor], optimizer) -> dict:
    """Validate keys and shapes against the model (and optimizer); return the optimizer state to load into."""
    entries = metadata.state_dict_metadata
    saved = {k[len("model."):]: md for k, md in entries.items() if k.startswith("model.")}
    _check_keys(path, set(tensors), set(saved))
    for name, t in tensors.items():
        _check_shape(path, name, t.global_shape, tuple(saved[name].size))
    return _optimizer_targets(path, entries, model, tensors, optimizer) if optimizer is not None else {}


def _optimizer_targets(path: str, entries: dict, model: nn.Module, tensors: dict[str, _Tensor], optimizer) -> dict:
    """Empty local tensors for every optimizer state entry the checkpoint holds, checked against the optimizer."""
    kind = type(optimizer).__name__
    groups = {}
    for key in entries:
        if key.startswith("optim.param_groups."):
            index, _, hyper = key[len("optim.param_groups."):].partition(".")
            groups.setdefault(int(index), set()).add(hyper)
    if not groups:
        raise ValueError(
            f"thunder_tp.checkpoint.load: {path!r} holds no optimizer state; pass optimizer=None or a checkpoint saved with one"
        )
    wanted = [set(g) | {"params"} for g in optimizer.param_groups]
    if [groups[i] for i in sorted(groups)] != wanted:
        raise TypeError(
            f"thunder_tp.checkpoint.load: the optimizer state in {path!r} has param_groups with keys "
            f"{[sorted(groups[i]) for i in sorted(groups)]}, but this {kind} has {[sorted(w) for w in wanted]}: "
            "the checkpoint was saved with another optimizer type or another number of param groups"
        )
    names = _parameter_names(model)
    in_optimizer = {names[id(p)] for p in _params(optimizer)}
    targets: dict[str, dict[str, _Tensor]] = {}
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
                    f"thunder_tp.checkpoint.load: {key!r} in {path!r} is not a tensor; thunder_tp loads tensor optimizer "
                    "state only"
                )
            param = tensors[name]
            size = tuple(md.size)
            shape = param.local.shape if size == param.global_shape else size
            local = torch.empty(shape, dtype=md.properties.dtype, device=_tensor_device(param))
            replicated = _Tensor(local, size, REPLICATE, 0, 1, None)
            targets.setdefault(name, {})[field] = _like(param, local) if size == param.global_shape else replicated
    _check_keys(f"the optimizer state in {path!r}", in_optimizer if targets else set(), set(targets))
    return targets


def _load_directory(path: str, model, tensors: dict[str, _Tensor], optimizer, optim_targets: dict) -> None:
    state = {"model": {name: t.for_dcp() for name, t in tensors.items()}}
    if optimizer is not None:
        state["optim"] = {
            "state": {n: {k: t.for_dcp() for k, t in fields.items()} for n, fields in optim_targets.items()},
            "param_groups": _param_groups(model, optimizer),
        }
    dcp.load(state, checkpoint_id=path)
    for name, t in tensors.items():
        t.copy_from(state["model"][name])
    if optimizer is not None:
        for name, fields in optim_targets.items():
            for key, t in fields.items():
                t.copy_from(state["optim"]["state"][name][key])
        for group, saved in zip(optimizer.param_groups, state["optim"]["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        optimizer._thunder_tp_loaded_state = optim_targets  # installed by _install once params are final


def _read_file(path: str, tensors: dict[str, _Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict, memory-mapped: nothing is read until a rank copies its slices."""
    try:
        full = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"thunder_tp.checkpoint.load: {path!r} is neither a DCP directory nor a file") from e
    except Exception as e:  # noqa: BLE001  (torch.load raises several kinds for a file it cannot read)
        raise ValueError(f"thunder_tp.checkpoint.load: {path!r} is not a torch.save'd state dict ({e})") from e
    if not isinstance(full, dict):
        raise ValueError(f"thunder_tp.checkpoint.load: {path!r} holds a {type(full).__name__}, expected a state dict")
    prefix = _submodule_prefix(set(tensors), set(full))
    full = {prefix + k: v for k, v in full.items()}
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


# --- meta-device models ---------------------------------------------------------------------------------------


def _tensor_device(t: _Tensor) -> torch.device:
    return group_device(t.group) if t.local.is_meta else t.local.device


def _materialize(tensors: dict[str, _Tensor]) -> None:
    """Give meta-device entries an empty local buffer on the group's device (never a full tensor)."""
    for t in tensors.values():
        if t.local.is_meta:
            t.local = torch.empty(t.local.shape, dtype=t.local.dtype, device=_tensor_device(t))
            t.materialized = True


def _install(model: nn.Module, tensors: dict[str, _Tensor], optimizer) -> None:
    """Put newly materialized tensors into the model (and the optimizer's param groups), then optimizer state."""
    plain = _plain_module(model)
    swapped = {}
    for name, t in tensors.items():
        if not getattr(t, "materialized", False):
            continue
        old = _get(model, name)
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
    by_name = {name: _get(model, name) for name in loaded}
    optimizer.state.clear()
    for name, fields in loaded.items():
        optimizer.state[by_name[name]] = {k: t.local for k, t in fields.items()}


def _materialize_non_persistent(model: nn.Module) -> None:
    """Buffers outside the state dict (litgpt's rope cache) are rebuilt by their module's reset_parameters."""
    plain = _plain_module(model)
    for module_name, module in plain.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        prefix = f"{module_name}." if module_name else ""
        if not any(_get(model, prefix + n).is_meta for n in names):
            continue
        copy = _shallow_copy(module)
        copy.to_empty(device=group_device(None), recurse=False)
        copy.reset_parameters()
        for n in names:
            value = copy._buffers[n].to(module._buffers[n].dtype)  # reset_parameters may use default dtypes
            if plain is model:
                module._buffers[n] = value
            else:
                model.set_buffer(prefix + n, value)
                set_trace_device(module._buffers[n], value.device)


def _shallow_copy(module: nn.Module) -> nn.Module:
    import copy

    clone = copy.copy(module)
    clone._parameters, clone._buffers, clone._modules = dict(module._parameters), dict(module._buffers), {}
    return clone


# --- export ---------------------------------------------------------------------------------------------------


def export(directory: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write the model part of a DCP checkpoint as one plain state dict (what litgpt loads as lit_model.pth)."""
    directory = os.fspath(directory)
    entries = _read_metadata(directory).state_dict_metadata
    model = {
        k[len("model."):]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in entries.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    dcp.load({"model": model}, checkpoint_id=directory, no_dist=True)
    torch.save(model, os.fspath(out))


def main(argv: list[str]) -> int:
    """python -m thunder_tp.checkpoint export DIR OUT"""
    if len(argv) != 3 or argv[0] != "export":
        print("usage: python -m thunder_tp.checkpoint export DIR OUT", file=sys.stderr)
        return 2
    export(argv[1], argv[2])
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
