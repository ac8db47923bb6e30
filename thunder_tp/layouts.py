"""Layouts of a tensor on the TP group (Replicate, Shard, Partial) and the TP group itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """Each rank holds one contiguous chunk of `dim`.

    `blocks` describes a fused dim made of several blocks (e.g. q|k|v): each block is chunked
    separately and a rank holds the concatenation of its chunk of every block.
    """

    dim: int
    blocks: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Shard({self.dim})" if self.blocks is None else f"Shard({self.dim}, blocks={self.blocks})"


@dataclass(frozen=True)
class Partial:
    """Each rank holds a summand; the value is the sum over ranks."""

    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op != "sum":
            raise ValueError(f"Partial({self.reduce_op!r}) is not supported; only Partial('sum') is")

    def __repr__(self) -> str:
        return "Partial()"


Layout = Replicate | Shard | Partial
REPLICATE = Replicate()
PARTIAL = Partial()

def normalize(layout: Layout, ndim: int) -> Layout:
    """Shard with a non-negative dim; other layouts unchanged."""
    if isinstance(layout, Shard) and layout.dim < 0:
        return Shard(layout.dim + ndim, layout.blocks)
    return layout


def check_shardable(shape: Sequence[int], layout: Layout, size: int, what: str) -> None:
    """Raise a ValueError naming `what` if `layout` cannot split a tensor of `shape` over `size` ranks."""
    if not isinstance(layout, Shard):
        return
    if not -len(shape) <= layout.dim < len(shape):
        raise ValueError(f"{what}: {layout} is out of range for a tensor of shape {tuple(shape)}")
    n = shape[layout.dim]
    blocks = layout.blocks or (n,)
    if sum(blocks) != n:
        raise ValueError(f"{what}: blocks {layout.blocks} do not add up to dim {layout.dim} of size {n}")
    for b in blocks:
        if b % size:
            part = f"block of size {b} in dim {layout.dim}" if layout.blocks else f"dim {layout.dim} of size {n}"
            raise ValueError(
                f"{what}: {part} is not divisible by the TP group size {size}; "
                f"choose a TP size that divides {b} or leave this tensor replicated"
            )


def local_shape(shape: Sequence[int], layout: Layout, size: int) -> tuple[int, ...]:
    """Shape of one rank's piece."""
    out = list(shape)
    if isinstance(layout, Shard):
        out[layout.dim] //= size
    return tuple(out)


def local_blocks(blocks: tuple[int, ...] | None, size: int) -> tuple[int, ...] | None:
    """Sizes of one rank's chunk of each block."""
    return None if blocks is None else tuple(b // size for b in blocks)


def shard_tensor(t: torch.Tensor, layout: Layout, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full tensor (works on meta tensors too)."""
    if not isinstance(layout, Shard):
        return t
    dim = layout.dim
    pieces = t.split(list(layout.blocks), dim) if layout.blocks else (t,)
    return torch.cat([p.chunk(size, dim)[rank] for p in pieces], dim)


def shard_chunks(shape: Sequence[int], layout: Layout, rank: int, size: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(global offsets, sizes) of the slices of the full tensor that make up this rank's piece (see shard_tensor).

    The piece is their concatenation along the layout's dim, in this order; checkpoints use only this.
    """
    full = ((0,) * len(shape), tuple(shape))
    if not isinstance(layout, Shard):
        return [full]
    dim, chunks, start = layout.dim % len(shape), [], 0
    for block in layout.blocks or (shape[layout.dim],):
        step = block // size
        offsets = tuple(start + rank * step if d == dim else 0 for d in range(len(shape)))
        chunks.append((offsets, tuple(step if d == dim else n for d, n in enumerate(shape))))
        start += block
    return chunks


def unshard_tensor(pieces: Sequence[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order."""
    if isinstance(layout, Replicate):
        return pieces[0]
    if isinstance(layout, Partial):
        return torch.stack(list(pieces)).sum(0)
    dim = layout.dim
    if layout.blocks is None:
        return torch.cat(list(pieces), dim)
    size = len(pieces)
    per_rank = [p.split(list(local_blocks(layout.blocks, size)), dim) for p in pieces]
    return torch.cat([torch.cat([r[i] for r in per_rank], dim) for i in range(len(layout.blocks))], dim)


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a process group's tensors live: the current CUDA device for NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class TPGroup:
    """The process group that TP shards over, with this process's rank in it."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, process_group: dist.ProcessGroup | None) -> TPGroup:
        """Resolve `None` to the default group; fail clearly when torch.distributed is not initialized."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "thunder_tp.TensorParallel needs an initialized torch.distributed process group: call "
                "torch.distributed.init_process_group(...) (e.g. run under torchrun) before thunder.jit"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        me = dist.get_rank()
        fix = "pass the group that contains this rank, e.g. thunder_tp.init_mesh(dp=..., tp=...).tp_group"
        if group == dist.GroupMember.NON_GROUP_MEMBER:  # what new_group(ranks) returns on ranks outside `ranks`
            raise ValueError(f"thunder_tp.TensorParallel: rank {me} is not a member of the given TP process group; {fix}")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"thunder_tp.TensorParallel: process_group must be a torch.distributed.ProcessGroup or None (the "
                f"default group), got {type(group).__name__}; with a thunder_tp mesh pass mesh.tp_group"
            )
        try:
            rank = dist.get_rank(group)
        except (ValueError, RuntimeError) as e:  # not created by new_group over the default (world) group
            raise ValueError(
                f"thunder_tp.TensorParallel: the TP process group is not a subgroup of the default (world) group "
                f"({e}); create it with torch.distributed.new_group or thunder_tp.init_mesh"
            ) from e
        if rank < 0:
            raise ValueError(f"thunder_tp.TensorParallel: rank {me} is not a member of the given TP process group; {fix}")
        return cls(group, dist.get_world_size(group), rank)
