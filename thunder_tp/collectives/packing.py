"""Packing of shards around torch.distributed's dim-0 collectives, on tensors and inside traces.

all_gather_into_tensor and reduce_scatter_tensor concatenate equal pieces, one per rank, along dim 0; a Shard of
another dim, of a fused dim made of blocks, or with pieces of unequal lengths is packed into that order before and
unpacked from it after: each rank's piece padded to the longest (rank 0's), each block's part followed by zeros, and
trimmed again after. `ops` is torch for tensors (the symbols' synchronous implementations) and thunder.torch inside
a trace (ops the fusion executor can claim, so they do not split fusion regions).
"""

from __future__ import annotations

import torch

from thunder_tp.layouts import Pieces, is_even, padded_lengths
from thunder_tp.pieces import assembled, take_piece, trimmed_piece


def is_plain(pieces: Pieces) -> bool:
    """Whether the ranks' pieces are equal runs in rank order (one block): the dim-0 order needs no packing."""
    length = pieces[0][0][1]
    return all(chunks == ((rank * length, length),) for rank, chunks in enumerate(pieces))


def pack(a: torch.Tensor, dim: int, pieces: Pieces | None, ops=torch) -> torch.Tensor:
    """Every rank's piece of `a` (padded to the longest), concatenated along dim 0 (the layout reduce_scatter_tensor
    expects); pieces None: `a` itself, contiguous."""
    if pieces is None or len(pieces) == 1 or (dim == 0 and is_plain(pieces)):  # already in that order: no copy
        return a.contiguous() if ops is torch else ops.contiguous(a)
    padded = None if is_even(pieces) else padded_lengths(pieces)
    return ops.cat([take_piece(a, dim, chunks, ops, padded) for chunks in pieces], 0)


def unpack(a: torch.Tensor, dim: int, pieces: Pieces, piece: tuple[int, ...], ops=torch) -> torch.Tensor:
    """Inverse of the dim-0 concatenation made by all_gather_into_tensor of every rank's padded `piece`-shaped piece:
    the full tensor."""
    size = len(pieces)
    every = ops.reshape(a, (size, *piece))
    if is_plain(pieces):  # rank order is the order of the chunks: a permuted view, which fusions read in place
        full = list(piece)
        full[dim] *= size
        return ops.reshape(ops.movedim(every, 0, dim), full)
    parts = ops.unbind(every, 0)
    if not is_even(pieces):
        padded = padded_lengths(pieces)
        parts = [trimmed_piece(p, dim, chunks, padded, ops) for p, chunks in zip(parts, pieces, strict=True)]
    return assembled(parts, dim, pieces, ops)

