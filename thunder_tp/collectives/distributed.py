"""Synchronous torch.distributed implementations of the TP collectives, and work handles whose failure names them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from thunder_tp.collectives.packing import pack, unpack
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import Layout, Pieces, Shard, padded_lengths, rank_pieces
from thunder_tp.pieces import padded_piece, shard_tensor, take_piece, trimmed_piece


def all_reduce(a: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A summed copy of `a` over `group`."""
    out = a.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def all_reduce_max(a: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The elementwise max of `a` over `group`, as a copy."""
    out = a.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def gather_full(a: torch.Tensor, layout: Shard, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor (its sharded dim `n` long) from every rank's piece of `layout` (synchronous; replicated chunks
    from their first holder)."""
    return gather_shards(a, layout.dim, rank_pieces(layout, n, group.size()), group)


def gather_shards(a: torch.Tensor, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's piece (`pieces`: its chunks; synchronous)."""
    size = group.size()
    a = padded_piece(a, dim, pieces[dist.get_rank(group)], padded_lengths(pieces)).contiguous()
    out = torch.empty((size * a.shape[0], *a.shape[1:]), dtype=a.dtype, device=a.device)
    dist.all_gather_into_tensor(out, a, group)
    return unpack(out, dim, pieces, tuple(a.shape))


def reduce_scatter(a: torch.Tensor, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's piece of the sum over ranks of `a`."""
    size = group.size()
    packed = pack(a, dim, pieces)
    out = torch.empty((packed.shape[0] // size, *packed.shape[1:]), dtype=a.dtype, device=a.device)
    dist.reduce_scatter_tensor(out, packed, dist.ReduceOp.SUM, group)
    shape = list(a.shape)
    shape[dim] = sum(padded_lengths(pieces))
    return trimmed_piece(out.view(shape), dim, pieces[dist.get_rank(group)], padded_lengths(pieces))


def all_to_all(a: torch.Tensor, src_dim: int, dst_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's Shard(dst_dim) piece of the tensor whose Shard(src_dim) pieces the ranks hold (synchronous; every
    piece of both dims equally long)."""
    size = group.size()
    dst_pieces = rank_pieces(Shard(dst_dim), a.shape[dst_dim], size)
    work, received = all_to_all_start(pack(a, dst_dim, dst_pieces), group)  # chunk r for rank r at dim-0 position r
    work.wait()
    piece = list(a.shape)
    piece[dst_dim] //= size
    return unpack(received, src_dim, rank_pieces(Shard(src_dim), a.shape[src_dim] * size, size), tuple(piece))


def all_to_all_start(packed: torch.Tensor, group: dist.ProcessGroup) -> tuple:
    """Issue the all_to_all of a packed tensor (chunk r for rank r along dim 0): Thunder's (work, result) future."""
    received = torch.empty_like(packed)
    work = dist.all_to_all_single(received, packed.contiguous(), group=group, async_op=True)
    return name_work((work, received), "all_to_all", packed, group)


def local(a: torch.Tensor, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's piece of the full `a` (every simulated rank's, padded to the longest, in a simulation)."""
    ranks = ranks_of(group)
    padded = padded_lengths(pieces) if ranks.one_trace_for_all else None
    return ranks.for_each(lambda r, full: take_piece(full, dim, pieces[r], torch, padded).clone(), a)


def local_piece(t: torch.Tensor, layout: Layout, rank: int, size: int, group: dist.ProcessGroup | None = None, *,
                padded: bool = False) -> torch.Tensor:
    """This rank's piece of the full tensor ``t``; in a simulation, every simulated rank's piece (a LocalTensor), at
    its own size, or `padded` to the longest piece as the simulated program computes with it (a KV cache it writes).

    A StackShard tensor is held whole by one rank and by no other, but one simulated trace cannot give the ranks
    different shapes: in a simulation the others hold zeros of its full shape instead."""
    ranks = ranks_of(group)
    if not ranks.one_trace_for_all:
        return shard_tensor(t, layout, rank, size)
    if (owner := layout.owner(size)) is not None:
        return ranks.for_each(lambda r, full: full.clone() if r == owner else torch.zeros_like(full), t.detach())
    return ranks.for_each(lambda r, full: shard_tensor(full, layout, r, size, padded=padded).clone(), t.detach())


def first_rank_only(a: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`a` on the group's first rank, zeros on the others: a Replicate value as a Partial sum, exactly."""
    return ranks_of(group).for_each(lambda r, x: x.clone() if r == 0 else torch.zeros_like(x), a)


def rank_value_tensor(like: torch.Tensor, values: tuple[int, ...], group: dist.ProcessGroup) -> torch.Tensor:
    """``values[rank]`` as a 0-d tensor of each simulated rank."""
    return ranks_of(group).for_each(lambda r: torch.tensor(values[r], dtype=like.dtype, device=like.device))


def padded_pieces(a: torch.Tensor, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> torch.Tensor:
    """Each simulated rank's piece padded to the longest (each block's part followed by zeros)."""
    padded = padded_lengths(pieces)
    return ranks_of(group).for_each(lambda r, x: padded_piece(x, dim, pieces[r], padded).contiguous(), a)


def trimmed_pieces(a: torch.Tensor, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> torch.Tensor:
    """Each simulated rank's padded piece trimmed back to its own length."""
    padded = padded_lengths(pieces)
    return ranks_of(group).for_each(lambda r, x: trimmed_piece(x, dim, pieces[r], padded).clone(), a)


def padding_filled(a: torch.Tensor, dim: int, pieces: Pieces, value: float, group: dist.ProcessGroup) -> torch.Tensor:
    """Each simulated rank's padded piece with its padding set to `value` (its real entries kept)."""
    padded = padded_lengths(pieces)

    def filled(rank: int, x: torch.Tensor) -> torch.Tensor:
        out, at = x.clone(), 0
        for (_, length), to in zip(pieces[rank], padded, strict=True):
            out.narrow(dim, at + length, to - length).fill_(value)
            at += to
        return out

    return ranks_of(group).for_each(filled, a)


def placed(a: torch.Tensor, dim: int, starts: tuple[int, ...], full: int, group: dist.ProcessGroup) -> torch.Tensor:
    """`a` in zeros `full` long along `dim`, at this rank's start (each simulated rank's)."""
    def place(rank: int, x: torch.Tensor) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] = full
        out = x.new_zeros(shape)
        out.narrow(dim, starts[rank], x.shape[dim]).copy_(x)
        return out

    return ranks_of(group).for_each(place, a)


def taken(a: torch.Tensor, dim: int, starts: tuple[int, ...], length: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The `length` entries of `a` along `dim` at this rank's start (each simulated rank's)."""
    return ranks_of(group).for_each(lambda r, x: x.narrow(dim, starts[r], length).clone(), a)


class NamedWork:
    """A torch.distributed work handle whose failed ``wait`` says which collective of which group failed."""

    def __init__(self, work, kind: str, a: torch.Tensor, group: dist.ProcessGroup):
        self.work, self.kind, self.shape, self.dtype, self.group = work, kind, tuple(a.shape), a.dtype, group

    def wait(self, timeout=None) -> bool:
        """The wrapped handle's wait; a failure is re-raised naming the collective, its tensor and its group."""
        try:
            return self.work.wait() if timeout is None else self.work.wait(timeout)
        except Exception as e:
            raise RuntimeError(
                f"thunder_tp: {self.kind} of a {self.shape} {self.dtype} tensor over the "
                f"{dist.get_backend(self.group)} group of global ranks {dist.get_process_group_ranks(self.group)} "
                f"failed: {type(e).__name__}: {e}\nA peer rank of this group probably died, raised before this "
                "collective, or did not reach it within the process group's timeout (init_process_group(timeout=...)); "
                "see that rank's output."
            ) from e


def name_work(future: tuple, kind: str, a: torch.Tensor, group: dist.ProcessGroup, padding: int = 0) -> tuple:
    """Thunder's (work, result) future with its work handle named (`padding`: the bytes of it that pad unequal
    pieces to the longest, for the trace tables)."""
    work, result = future
    return NamedWork(work, kind, a, group), result
