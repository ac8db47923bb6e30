"""The model's tensors (and optimizer state) as this rank holds them, described to DCP as plain or sharded tensors."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from thunder_tp.collectives import gather_full
from thunder_tp.layouts import REPLICATE, Layout, Shard
from thunder_tp.pieces import piece_parts, shard_chunks, shard_tensor
from thunder_tp.thunder_internals.private import applied_transforms, original_module
from thunder_tp.thunder_internals.sharded_tensor import is_sharded_tensor, local_slices, sharded_tensor

Chunks = list[tuple[tuple[int, ...], tuple[int, ...]]]


@dataclass
class HeldTensor:
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
        return [(offsets, sizes, part) for (offsets, sizes), part in zip(self.chunks(), parts, strict=True)]

    def for_dcp(self) -> torch.Tensor:
        """A plain tensor when every rank holds all of it, else a ShardedTensor of this rank's slices.

        A chunk that several ranks hold (replicated K/V heads) is described once, by its first holder: DCP then
        writes it once and reads it once; copy_from hands it on to the other holders.
        """
        whole = [((0,) * len(self.global_shape), self.global_shape)]
        if all(self.chunks(r) == whole for r in range(self.size)):  # (a StackShard tensor: whole on one rank only)
            return self.local
        holders: dict[tuple, int] = {}
        for r in range(self.size):
            for chunk in self.chunks(r):
                holders.setdefault(chunk, r)
        device = self.local.device
        placements = {chunk: f"rank:{dist.get_global_rank(self.group, r)}/{device}" for chunk, r in holders.items()}
        views = {(o, s): view for o, s, view in self.slices()}
        mine = {chunk: views[chunk].contiguous() for chunk, r in holders.items() if r == self.rank}
        return sharded_tensor(placements, mine, self.global_shape, self.local.dtype, self.group)

    def copy_from(self, value: torch.Tensor) -> None:
        """Write what DCP loaded into for_dcp()'s value into `local`, wherever DCP did not write in place
        (collective for a layout with replicated chunks: their first holders pass them on)."""
        if is_sharded_tensor(value):
            views = {(o, s): view for o, s, view in self.slices()}
            pairs = [(views[chunk], tensor) for chunk, tensor in local_slices(value)]
        else:
            pairs = [(self.local, value)]
        with torch.no_grad():
            for view, source in pairs:
                if view.data_ptr() != source.data_ptr():
                    view.copy_(source)
            if isinstance(self.layout, Shard) and self.layout.is_replicated:
                full = gather_full(self.local, self.layout, self.global_shape[self.layout.dim], self.group)
                self.local.copy_(shard_tensor(full, self.layout, self.rank, self.size))


@contextlib.contextmanager
def sharded_tensor_without_deprecation_warnings():
    """ShardedTensor warns that DTensor replaces it, but DTensor cannot hold several slices per rank (q|k|v blocks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


# --- the model's tensors ---------------------------------------------------------------------------------------


def _tensor_parallel(model: nn.Module):
    """The model's TensorParallel transform, if any (after refusing FSDP)."""
    from thunder_tp.transform import TensorParallel

    _check_data_parallel(model)
    return next((t for t in applied_transforms(model) if isinstance(t, TensorParallel)), None)


def replaced_from_checkpoint(model: nn.Module, names: Iterable[str]) -> None:
    """Tell the model's TensorParallel that these tensors now hold a checkpoint's values, alike on every rank."""
    tp = _tensor_parallel(model)
    if tp is not None:
        tp.loaded_from_checkpoint(list(names))


def _check_data_parallel(model: nn.Module) -> None:
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    if any(isinstance(t, FSDPTransform) for t in applied_transforms(model)):
        raise NotImplementedError(
            "thunder_tp.checkpoint: FSDPTransform keeps a padded dim-0 chunk of each TP shard per dp rank, and its "
            "(offsets, sizes) in the global tensor are not exposed by Thunder's FSDPTransform, so they cannot be "
            "described to torch.distributed.checkpoint; use DDPTransform for 2-D checkpoints, or gather with "
            "original_state_dict()"
        )


def model_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The tensor the model computes with (a ThunderModule's override, i.e. the local shard)."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def model_tensors(model: nn.Module) -> dict[str, HeldTensor]:
    """Every entry of the plain model's state dict, as this rank holds it."""
    tp = _tensor_parallel(model)
    rank, size, group = (tp.tp.rank, tp.tp.size, tp.tp.group) if tp is not None else (0, 1, None)
    out = {}
    for name, original in original_module(model).state_dict(keep_vars=True).items():
        layout = tp.parameter_layouts.get(name, REPLICATE) if tp is not None else REPLICATE
        out[name] = HeldTensor(model_tensor(model, name).detach(), tuple(original.shape), layout, rank, size, group)
    return out


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id of each tensor the model computes with -> its plain parameter name."""
    return {id(model_tensor(model, name)): name for name, _ in original_module(model).named_parameters()}


def state_like(param: HeldTensor, value: torch.Tensor) -> HeldTensor:
    """An optimizer state tensor: sharded like its parameter when it has the parameter's shape."""
    if value.dim() and tuple(value.shape) == tuple(param.local.shape):
        return HeldTensor(value.detach(), param.global_shape, param.layout, param.rank, param.size, param.group)
    return HeldTensor(value.detach(), tuple(value.shape), REPLICATE, 0, 1, None)
