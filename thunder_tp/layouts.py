"""Layouts of a tensor on the TP group (Replicate, Shard, Partial) and the TP group itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from thunder.core.proxies import pyval
from torch.distributed.tensor import placement_types


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"

    def owner(self, size: int) -> int | None:
        """The rank that alone holds the tensor; None: every rank holds it."""
        return None


@dataclass(frozen=True)
class Split:
    """How one block of a sharded dim is cut over the ranks: into `units` whole units (e.g. attention heads, each
    block length / units long) in `groups` equal runs of consecutive units (the query heads of one K/V head; None:
    every unit is its own group).

    With at least as many groups as ranks, each rank holds a run of whole groups, balanced (the first ranks one group
    more). With fewer groups than ranks, the ranks are spread over the groups (the last groups one rank more) and the
    ranks of a group split its units, balanced; `replicated`: they each hold all of them (K/V heads that the query
    heads of several ranks share). Either way rank 0 holds a longest piece (a simulation pads every piece to it).
    `reversed`: the pieces in reverse rank order, the last rank holding the first (context parallelism's head-tail
    order; for a split into equal pieces).
    """

    units: int
    groups: int | None = None
    replicated: bool = False
    reversed: bool = False

    def __repr__(self) -> str:
        extra = "" if self.groups is None else f" in {self.groups} groups"
        flags = "".join(f", {flag}" for flag in ("replicated", "reversed") if getattr(self, flag))
        return f"Split({self.units} units{extra}{flags})"

    def unit_ranges(self, size: int) -> list[tuple[int, int]]:
        """(first unit, number of units) that each rank holds, in rank order."""
        ranges = self._in_order(size)
        return ranges[::-1] if self.reversed else ranges

    def _in_order(self, size: int) -> list[tuple[int, int]]:
        groups = self.groups or self.units
        per_group = self.units // groups
        if groups >= size or (self.groups is None and not self.replicated):
            return [(first * per_group, count * per_group) for first, count in balanced(groups, size)]
        base, extra = divmod(size, groups)
        ranges = []
        for group in range(groups):
            ranks = base + (group >= groups - extra)
            first = group * per_group
            if self.replicated:
                ranges += [(first, per_group)] * ranks
            else:
                ranges += [(first + start, count) for start, count in balanced(per_group, ranks)]
        return ranges

    def normal(self, size: int) -> Split:
        """The same cut in one form per cut: whole groups per rank as groups of one unit; replicated groups as
        replicated units; groups whose units fall as a balanced split of all units would as ungrouped units."""
        if self.reversed:
            return self
        groups = self.groups or self.units
        if groups >= size or (groups == self.units and not self.replicated):
            return Split(groups)
        if self.replicated:
            return Split(groups, replicated=True)
        return Split(self.units) if self.unit_ranges(size) == Split(self.units).unit_ranges(size) else self


def balanced(n: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of `parts` consecutive pieces of `n` whose lengths differ by at most one, the longer first
    (numpy's array_split; torch.chunk would give ceil-sized pieces and leave the last ranks short or empty)."""
    base, extra = divmod(n, parts)
    return [(i * base + min(i, extra), base + (i < extra)) for i in range(parts)]


@dataclass(frozen=True)
class Shard:
    """Each rank holds a piece of `dim`: by default a balanced run of it (lengths differ by at most one, the longer on
    the first ranks), which is torch.chunk's piece wherever the size divides the dim.

    `blocks` describes a fused dim made of several blocks (e.g. q|k|v): each block is split separately and a rank
    holds the concatenation of its piece of every block. `splits` (one per block, or one for an unblocked dim; None
    for a block split by default): a block split by whole units (`Split`: attention heads, K/V heads held by several
    ranks). A Shard with splits describes one TP size: the one its style made it for.
    """

    dim: int
    blocks: tuple[int, ...] | None = None
    splits: tuple[Split | None, ...] | None = None

    def __repr__(self) -> str:
        extra = "" if self.blocks is None else f", blocks={self.blocks}"
        extra += "" if self.splits is None else f", splits={self.splits}"
        return f"Shard({self.dim}{extra})"

    def moved(self, dim: int) -> Shard:
        """The same split on another dim (views, permutations, reductions move the sharded dim)."""
        return Shard(dim, self.blocks, self.splits)

    def block_splits(self) -> tuple[Split | None, ...]:
        """The split of each block (of the one block when unblocked); None: the default."""
        return self.splits or (None,) * len(self.blocks or (0,))

    @property
    def is_replicated(self) -> bool:
        """Whether some piece is held by more than one rank."""
        return any(s is not None and s.replicated for s in self.block_splits())

    def owner(self, size: int) -> int | None:
        """The rank that alone holds the tensor; None: every rank holds a piece of it."""
        return None


@dataclass(frozen=True)
class Partial:
    """Each rank holds a summand; the value is the sum over ranks."""

    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op != "sum":
            raise ValueError(f"Partial({self.reduce_op!r}) is not supported; only Partial('sum') is")

    def __repr__(self) -> str:
        return "Partial()"

    def owner(self, size: int) -> int | None:
        """The rank that alone holds the tensor; None: every rank holds a summand of it."""
        return None


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
        """The rank that alone holds the tensor, whole (the others hold nothing of it)."""
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
    """Raise a ValueError naming `what` if `layout` cannot split a tensor of `shape` over `size` ranks: a dim or block
    too short to give every rank a piece, or units (heads) that do not cut it."""
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
    splits = layout.block_splits()
    if len(splits) != len(blocks):
        raise ValueError(f"{what}: {layout} needs one split per block")
    for block, split in zip(blocks, splits, strict=True):
        part = f"block of size {block} in dim {layout.dim}" if layout.blocks else f"dim {layout.dim} of size {n}"
        if split is None:
            if block < size:
                raise ValueError(f"{what}: {part} cannot be split over {size} ranks (each needs at least one entry); "
                                 f"use at most {block} ranks or leave this tensor replicated")
            continue
        if block % split.units or split.units % (split.groups or split.units):
            raise ValueError(f"{what}: {split} does not cut the {part} into whole units")
        if any(count == 0 for _, count in split.unit_ranges(size)):
            raise ValueError(f"{what}: the {part} is {split.units} units (e.g. heads), fewer than {size} ranks need "
                             "(each at least one); use fewer ranks or leave this tensor replicated")


def held_chunks(layout: Shard, n: int, rank: int, size: int) -> list[tuple[int, int]]:
    """(start, length) in the full dim (of length n) of each block's piece that `rank` holds, in block order (the
    order of its local piece). Under cache="symbolic values" `n` may be a size proxy: its traced value is used, which
    the prologue pins (thunder_internals.prologue)."""
    chunks, start = [], 0
    for block, split in zip(layout.blocks or (pyval(n),), layout.block_splits(), strict=True):
        if split is None:
            first, length = balanced(block, size)[rank]
        else:
            unit = block // split.units
            first, length = (x * unit for x in split.unit_ranges(size)[rank])
        chunks.append((start + first, length))
        start += block
    return chunks


#: every rank's chunks of a sharded dim: per rank, per block (start, length) in the full dim (held_chunks of each)
Pieces = tuple[tuple[tuple[int, int], ...], ...]


def rank_pieces(layout: Shard, n: int, size: int) -> Pieces:
    """held_chunks of every rank: what a collective on pieces of `layout` needs to know (plain ints, for traces)."""
    return tuple(tuple(held_chunks(layout, n, rank, size)) for rank in range(size))


def padded_lengths(pieces: Pieces) -> tuple[int, ...]:
    """The length of each block's piece padded to the longest one: rank 0's (balanced splits put it there)."""
    return tuple(length for _, length in pieces[0])


def is_even(pieces: Pieces) -> bool:
    """Whether every rank's piece of every block is as long as every other's (no padding anywhere)."""
    return all(tuple(length for _, length in chunks) == padded_lengths(pieces) for chunks in pieces)


def uneven(layout: Layout, shape: Sequence[int], size: int) -> bool:
    """Whether the ranks' pieces of a tensor of `shape` in `layout` differ in shape."""
    if isinstance(layout, StackShard):
        return True
    return isinstance(layout, Shard) and not is_even(rank_pieces(layout, shape[layout.dim], size))


def canonical(layout: Layout, n: int, size: int) -> Layout:
    """`layout` with each block's split in its normal form, and dropped where it cuts as the default does (so that
    layouts that split alike compare equal)."""
    if not isinstance(layout, Shard) or layout.splits is None:
        return layout
    splits = []
    for block, split in zip(layout.blocks or (n,), layout.splits, strict=True):
        if split is not None and block % split.units == 0:
            split = split.normal(size)
            unit = block // split.units
            if [(s * unit, c * unit) for s, c in split.unit_ranges(size)] == balanced(block, size):
                split = None
        splits.append(split)
    return Shard(layout.dim, layout.blocks, None if all(s is None for s in splits) else tuple(splits))


def local_size(n: int, layout: Shard, size: int, rank: int) -> int:
    """Length of `rank`'s piece of the sharded dim (of full length n)."""
    return sum(length for _, length in held_chunks(layout, n, rank, size))


def local_shape(shape: Sequence[int], layout: Layout, size: int, rank: int) -> tuple[int, ...]:
    """Shape of `rank`'s piece (in a simulation, rank 0's: the longest, to which every piece is padded)."""
    out = list(shape)
    if isinstance(layout, Shard):
        out[layout.dim] = local_size(out[layout.dim], layout, size, rank)
    if isinstance(layout, StackShard):
        out[0] = out[0] if rank == layout.owner(size) else 0
    return tuple(out)


def largest_piece(shape: Sequence[int], layout: Layout, size: int) -> tuple[int, ...]:
    """Each dim's longest over the `size` ranks' pieces of a tensor of `shape`: a fact every rank knows alike."""
    return tuple(map(max, zip(*(local_shape(shape, layout, size, rank) for rank in range(size)), strict=True)))


def local_blocks(blocks: tuple[int, ...] | None, splits: tuple[Split | None, ...] | None, size: int,
                 rank: int) -> tuple[int, ...] | None:
    """Sizes of `rank`'s piece of each block."""
    if blocks is None:
        return None
    return tuple(length for _, length in held_chunks(Shard(0, blocks, splits), sum(blocks), rank, size))


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
