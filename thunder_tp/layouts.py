"""Layouts of a tensor on the TP group (Replicate, Shard, Partial) and the TP group itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import placement_types

from thunder_tp.one_rank import fake_group_device


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
    `replicas` (one per block, or one for an unblocked dim): a block with r replicas is cut into
    size/r chunks and rank i holds chunk i // r, so r consecutive ranks hold copies of the same chunk
    (K/V heads shared by the query heads of several ranks). None: every block has 1 replica.
    """

    dim: int
    blocks: tuple[int, ...] | None = None
    replicas: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        extra = "" if self.blocks is None else f", blocks={self.blocks}"
        extra += "" if self.replicas is None else f", replicas={self.replicas}"
        return f"Shard({self.dim}{extra})"

    def moved(self, dim: int) -> Shard:
        """The same split on another dim (views, permutations, reductions move the sharded dim)."""
        return Shard(dim, self.blocks, self.replicas)

    def block_replicas(self) -> tuple[int, ...]:
        """Replicas of each block (of the one block when unblocked)."""
        return self.replicas or (1,) * len(self.blocks or (0,))

    @property
    def is_replicated(self) -> bool:
        """Whether some chunk is held by more than one rank."""
        return any(r > 1 for r in self.block_replicas())


@dataclass(frozen=True)
class Partial:
    """Each rank holds a summand; the value is the sum over ranks."""

    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op != "sum":
            raise ValueError(f"Partial({self.reduce_op!r}) is not supported; only Partial('sum') is")

    def __repr__(self) -> str:
        return "Partial()"


@dataclass(frozen=True)
class StackShard:
    """Item `index` of a stack of `count` same-shaped tensors (the experts of a MoE layer) whose stacking dim is split
    over the ranks: rank `index // (count / size)` holds the tensor whole, every other rank nothing (a piece of
    length 0 in dim 0). So each rank holds `count / size` whole items, its shard of the stack."""

    index: int
    count: int

    def __repr__(self) -> str:
        return f"StackShard({self.index} of {self.count})"

    def owner(self, size: int) -> int:
        """The rank that holds the tensor."""
        return self.index // (self.count // size)


Layout = Replicate | Shard | Partial | StackShard
REPLICATE = Replicate()
PARTIAL = Partial()


def as_layout(layout: object) -> Layout | None:
    """A thunder_tp layout, given one or a torch.distributed.tensor placement (Shard(dim), Replicate(), Partial());
    None stays None."""
    if layout is None or isinstance(layout, (Replicate, Shard, Partial)):
        return layout
    kind = type(layout)  # exact types: a subclass (DTensor's _StridedShard, MaskPartial) splits differently
    if kind is placement_types.Shard:
        return Shard(layout.dim)
    if kind is placement_types.Replicate:
        return REPLICATE
    if kind is placement_types.Partial:
        return Partial(layout.reduce_op)
    raise TypeError(
        f"{layout!r} is not a layout thunder_tp supports: use Shard(dim), Replicate() or Partial() (thunder_tp's or "
        "torch.distributed.tensor's)"
    )


def normalize(layout: Layout, ndim: int) -> Layout:
    """Shard with a non-negative dim; other layouts unchanged."""
    if isinstance(layout, Shard) and layout.dim < 0:
        return layout.moved(layout.dim + ndim)
    return layout


def check_shardable(shape: Sequence[int], layout: Layout, size: int, what: str) -> None:
    """Raise a ValueError naming `what` if `layout` cannot split a tensor of `shape` over `size` ranks."""
    if isinstance(layout, StackShard) and layout.count % size:
        raise ValueError(
            f"{what}: one of {layout.count} stacked tensors (experts) held whole by one rank each, which {size} ranks "
            f"cannot share evenly: {size} does not divide {layout.count}; choose a TP size that divides {layout.count} "
            "or split the experts like dense MLPs (expert_parallel=False)"
        )
    if not isinstance(layout, Shard):
        return
    if not -len(shape) <= layout.dim < len(shape):
        raise ValueError(f"{what}: {layout} is out of range for a tensor of shape {tuple(shape)}")
    n = shape[layout.dim]
    blocks = layout.blocks or (n,)
    if sum(blocks) != n:
        raise ValueError(f"{what}: blocks {layout.blocks} do not add up to dim {layout.dim} of size {n}")
    replicas = layout.block_replicas()
    if len(replicas) != len(blocks) or any(size % r for r in replicas):
        raise ValueError(f"{what}: {layout} needs one replica count per block, each dividing the TP size {size}")
    for b, r in zip(blocks, replicas, strict=True):
        if b % (size // r):
            part = f"block of size {b} in dim {layout.dim}" if layout.blocks else f"dim {layout.dim} of size {n}"
            split = f"the TP group size {size}" if r == 1 else f"{size // r} ({r} replicas on {size} ranks)"
            raise ValueError(
                f"{what}: {part} is not divisible by {split}; "
                f"choose a TP size that divides {b} or leave this tensor replicated"
            )


def local_size(n: int, layout: Shard, size: int) -> int:
    """Length of one rank's piece of the sharded dim (of full length n)."""
    return sum(length for _, length in held_chunks(layout, n, 0, size))


def local_shape(shape: Sequence[int], layout: Layout, size: int, rank: int | None = None) -> tuple[int, ...]:
    """Shape of one rank's piece (the same on every rank, but for a StackShard: then `rank`'s)."""
    out = list(shape)
    if isinstance(layout, Shard):
        out[layout.dim] = local_size(out[layout.dim], layout, size)
    if isinstance(layout, StackShard):
        if rank is None:
            raise ValueError(f"the shape of a {layout} piece depends on the rank; pass rank=")
        out[0] = out[0] if rank == layout.owner(size) else 0
    return tuple(out)


def local_blocks(
    blocks: tuple[int, ...] | None, size: int, replicas: tuple[int, ...] | None = None
) -> tuple[int, ...] | None:
    """Sizes of one rank's chunk of each block."""
    if blocks is None:
        return None
    return tuple(length for _, length in held_chunks(Shard(0, blocks, replicas), sum(blocks), 0, size))


def held_chunks(layout: Shard, n: int, rank: int, size: int) -> list[tuple[int, int]]:
    """(start, length) in the full dim of each piece `rank` holds, in the order of its local piece."""
    chunks, start = [], 0
    for block, r in zip(layout.blocks or (n,), layout.block_replicas(), strict=True):
        length = block * r // size
        chunks.append((start + (rank // r) * length, length))
        start += block
    return chunks


def full_length(layout: Shard, local_n: int, size: int) -> int:
    """Length of the full sharded dim, from the length `local_n` of one rank's piece."""
    return sum(layout.blocks) if layout.blocks else local_n * size // layout.block_replicas()[0]


def _all_chunks(layout: Shard, n: int, size: int) -> list[tuple[int, int]]:
    """Every (start, length) some rank holds, in order: together they tile the full dim."""
    return sorted({chunk for rank in range(size) for chunk in held_chunks(layout, n, rank, size)})


def _cat(parts: Sequence, dim: int, ops):
    return parts[0] if len(parts) == 1 else ops.cat(list(parts), dim)


def shard_tensor(t: torch.Tensor, layout: Layout, rank: int, size: int, ops=torch) -> torch.Tensor:
    """This rank's piece of a full tensor (meta tensors too; proxies inside a trace with ops=thunder.torch)."""
    if isinstance(layout, StackShard):
        return t if rank == layout.owner(size) else t[:0]
    if not isinstance(layout, Shard):
        return t
    chunks = _all_chunks(layout, t.shape[layout.dim], size)
    parts = dict(zip(chunks, ops.split(t, [length for _, length in chunks], layout.dim), strict=True))
    return _cat([parts[c] for c in held_chunks(layout, t.shape[layout.dim], rank, size)], layout.dim, ops)


def piece_parts(piece: torch.Tensor, layout: Layout, rank: int, size: int, ops=torch) -> list[torch.Tensor]:
    """A rank's piece cut into the chunks it holds (views, in held_chunks' order); an unsharded tensor whole."""
    if isinstance(layout, StackShard):
        return [piece] if rank == layout.owner(size) else []
    if not isinstance(layout, Shard):
        return [piece]
    n = full_length(layout, piece.shape[layout.dim], size)
    return list(ops.split(piece, [length for _, length in held_chunks(layout, n, rank, size)], layout.dim))


def shard_chunks(shape: Sequence[int], layout: Layout, rank: int, size: int) -> list[tuple[tuple[int, ...],
                                                                                           tuple[int, ...]]]:
    """(global offsets, sizes) of the slices of the full tensor that make up this rank's piece (held_chunks in
    every dim); the piece is their concatenation along the layout's dim, in this order."""
    if isinstance(layout, StackShard):
        return [((0,) * len(shape), tuple(shape))] if rank == layout.owner(size) else []
    if not isinstance(layout, Shard):
        return [((0,) * len(shape), tuple(shape))]
    dim = layout.dim % len(shape)
    return [
        (tuple(start if d == dim else 0 for d in range(len(shape))),
         tuple(length if d == dim else n for d, n in enumerate(shape)))
        for start, length in held_chunks(layout, shape[dim], rank, size)
    ]


def unshard_tensor(pieces: Sequence[torch.Tensor], layout: Layout, ops=torch) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order (replicated chunks taken from their first holder;
    proxies inside a trace with ops=thunder.torch)."""
    if isinstance(layout, Replicate):
        return pieces[0]
    if isinstance(layout, StackShard):
        return pieces[layout.owner(len(pieces))]
    if isinstance(layout, Partial):
        return torch.stack(list(pieces)).sum(0)
    size = len(pieces)
    n = full_length(layout, pieces[0].shape[layout.dim], size)
    parts: dict[tuple[int, int], torch.Tensor] = {}
    for rank, piece in enumerate(pieces):
        for chunk, part in zip(held_chunks(layout, n, rank, size), piece_parts(piece, layout, rank, size, ops),
                               strict=True):
            parts.setdefault(chunk, part)
    return _cat([parts[c] for c in sorted(parts)], layout.dim, ops)


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a process group's tensors live: the current CUDA device for NCCL, ``thunder_tp.one_rank``'s device for
    a fake group, else the CPU."""
    backend = dist.get_backend(group) if dist.is_available() and dist.is_initialized() else None
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fake_group_device() if backend == "fake" else torch.device("cpu")


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
            raise ValueError(f"thunder_tp.TensorParallel: rank {me} is not a member of the given TP process group; "
                             f"{fix}")
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
            raise ValueError(f"thunder_tp.TensorParallel: rank {me} is not a member of the given TP process group; "
                             f"{fix}")
        return cls(group, dist.get_world_size(group), rank)
