"""Gradient clipping by the whole model's norm: computed once across the TP group and the data-parallel group.

`torch.nn.utils.clip_grad_norm_` on a rank of a TP-jitted module sees that rank's shards only: each rank computes
another norm, scales by another factor, and the replicated parameters drift apart. Here every element of the
logical (single-device) gradient is counted exactly once: a sharded gradient's chunks on the rank that holds them
(a chunk held by several ranks, as a K/V head replicated over the query heads of several ranks, on its first
holder), a replicated gradient on TP rank 0; the sums are all-reduced over the TP group, and over the data-parallel
group where Thunder's FSDPTransform shards each TP piece on dim 0 (under DDPTransform the gradients are the same on
every data-parallel rank, so they count once). The norm and the scale are then the same on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import REPLICATE, Layout, Shard, rank_pieces
from thunder_tp.thunder_internals.private import applied_transforms, original_module

__all__ = ["clip_grad_norm_", "clip_grad_value_", "grad_norm"]


@dataclass(frozen=True)
class _Groups:
    """Where a module's gradients are split: the TP group (with its parameters' layouts) and FSDP's group."""

    layouts: dict[str, Layout]
    full_shapes: dict[str, torch.Size]  # of each parameter, by its plain name
    tp_group: dist.ProcessGroup | None
    tp_rank: int
    tp_size: int
    fsdp: object | None  # Thunder's FSDPTransform, if the module is sharded over a data-parallel group too


def clip_grad_norm_(
    module: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of `module` (TP-jitted, possibly under Thunder's DDP/FSDP) as one device would: scale them
    all by max_norm / (norm + 1e-6) where the whole model's norm exceeds max_norm; returns that norm, the same
    tensor value on every rank (collective: every rank of the TP and data-parallel groups must call it)."""
    total = grad_norm(module, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"thunder_tp.clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite "
            f"({total.item()}), so they cannot be clipped; pass error_if_nonfinite=False to scale them anyway"
        )
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in _grads(module):
        grad.mul_(scale.to(grad.dtype))
    return total


def clip_grad_value_(module: nn.Module, clip_value: float) -> None:
    """Clamp every gradient element of `module` to [-clip_value, clip_value] (elementwise: no communication)."""
    for grad in _grads(module):
        grad.clamp_(-clip_value, clip_value)


def grad_norm(module: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient, each logical element counted once (collective, as clip_grad_norm_)."""
    groups = _groups_of(module)
    named = _named_grads(module)
    dtype = torch.float64 if any(g.dtype == torch.float64 for _, g in named) else torch.float32
    device = named[0][1].device if named else ranks_of(groups.tp_group).device
    parts = [part for name, grad in named for part in _counted_parts(name, grad, groups) if part.numel()]
    norms = [torch.linalg.vector_norm(p, norm_type, dtype=dtype) for p in parts]
    infinite = math.isinf(norm_type)
    if not norms:
        total = torch.zeros((), dtype=dtype, device=device)
    else:
        total = torch.stack(norms).max() if infinite else (torch.stack(norms) ** norm_type).sum()
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    for group in (groups.tp_group, groups.fsdp.process_group if groups.fsdp is not None else None):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=op, group=group)
    return total if infinite else total ** (1.0 / norm_type)


def _groups_of(module: nn.Module) -> _Groups:
    """The module's TensorParallel layouts and group, and FSDP's transform (none of either for a plain module)."""
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_tp.transform import TensorParallel

    transforms = applied_transforms(module)
    tp = next((t for t in transforms if isinstance(t, TensorParallel)), None)
    fsdp = next((t for t in transforms if isinstance(t, FSDPTransform)), None)
    if tp is None:
        return _Groups({}, {}, None, 0, 1, fsdp)
    shapes = {name: p.shape for name, p in original_module(module).named_parameters()}
    return _Groups(tp.parameter_layouts, shapes, tp.tp.group, tp.tp.rank, tp.tp.size, fsdp)


def _named_grads(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(plain name, this rank's gradient) of every parameter with one (a tied parameter once)."""
    named = []
    for name, _ in original_module(module).named_parameters():
        grad = module.get_parameter(name).grad
        if grad is not None:
            named.append((name, grad))
    return named


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [g for _, g in _named_grads(module)]


def _counted_parts(name: str, grad: torch.Tensor, groups: _Groups) -> list[torch.Tensor]:
    """The views of this rank's gradient of `name` that this rank counts in the norm."""
    if grad.ndim == 0:
        return [grad] if groups.tp_rank == 0 else []
    layout = groups.layouts.get(name, REPLICATE)
    rows = _fsdp_rows(name, groups)
    held = grad.shape[0] if rows is None else rows[2]  # length of dim 0 of the TP piece
    dim, segments = _segments(layout, grad, held, groups, groups.full_shapes.get(name))
    if rows is None:
        return [grad.narrow(dim, start, length) for start, length in segments]
    first, end, _ = rows
    if dim != 0:
        kept = grad.narrow(0, 0, end - first)
        return [kept.narrow(dim, start, length) for start, length in segments]
    parts = []
    for start, length in segments:
        lo, hi = max(start, first), min(start + length, end)
        if hi > lo:
            parts.append(grad.narrow(0, lo - first, hi - lo))
    return parts


def _fsdp_rows(name: str, groups: _Groups) -> tuple[int, int, int] | None:
    """(first, end, length): the rows of dim 0 of the TP piece that FSDP gives this rank (it pads dim 0 up to a
    multiple of its group's size; the padding rows are left out) and the piece's length; None without FSDP."""
    fsdp = groups.fsdp
    if fsdp is None or name not in fsdp.sharded_params:
        return None
    piece_shape, shard_shape, _ = fsdp.sharded_params[name]
    first = dist.get_rank(fsdp.process_group) * shard_shape[0]
    return first, max(first, min(first + shard_shape[0], piece_shape[0])), piece_shape[0]


def _segments(layout: Layout, grad: torch.Tensor, held: int, groups: _Groups,
              full_shape: torch.Size | None) -> tuple[int, list[tuple[int, int]]]:
    """(dim, [(start, length)]) of the TP piece that this rank counts, in the piece's coordinates along its split
    dim: each chunk on its first holder; a replicated tensor on TP rank 0; a tensor one rank holds alone (an expert)
    where it is (the other ranks hold nothing of it, or in a simulation zeros). `held`: the piece's length of dim 0."""
    if layout.owner(groups.tp_size) is not None:
        return 0, [(0, held)]
    if not isinstance(layout, Shard):
        return 0, [] if groups.tp_rank else [(0, held)]
    dim = layout.dim % grad.ndim
    every = rank_pieces(layout, full_shape[dim], groups.tp_size)
    segments, offset = [], 0
    for i, chunk in enumerate(every[groups.tp_rank]):
        if next(r for r, chunks in enumerate(every) if chunks[i] == chunk) == groups.tp_rank:  # its first holder
            segments.append((offset, chunk[1]))
        offset += chunk[1]
    return dim, segments
