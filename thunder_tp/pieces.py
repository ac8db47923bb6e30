"""A rank's piece of a tensor, on tensors and inside traces (proxies, with ops=thunder.torch): cut from the full
tensor, padded to the longest piece and trimmed back, cut into the chunks it holds, and the full tensor assembled from
every rank's piece. `layouts.held_chunks` says which chunks each rank holds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from thunder_tp.layouts import (
    Layout,
    Partial,
    Pieces,
    Replicate,
    Shard,
    held_chunks,
    padded_lengths,
    rank_pieces,
)


def _full_length(layout: Shard, lengths: Sequence[int], size: int) -> int:
    """Length of the full sharded dim, from the length of every rank's piece."""
    if layout.blocks is not None:
        return sum(layout.blocks)
    (split,) = layout.block_splits()
    if split is None:
        return sum(lengths)
    return split.units * lengths[0] // split.unit_ranges(size)[0][1]


def _narrow(t, dim: int, start: int, length: int):
    return t[(slice(None),) * dim + (slice(start, start + length),)]


def _padded(t, dim: int, to: int, ops):
    """`t` with zeros after it along `dim`, `to` long (inside a trace a pad even of nothing: every rank's program
    must have the same ops, or the scheduler could order their collectives differently)."""
    missing = to - t.shape[dim]
    if missing == 0 and ops is torch:
        return t
    pad = [0] * (2 * (t.ndim - dim))
    pad[-1] = missing
    return torch.nn.functional.pad(t, tuple(pad)) if ops is torch else ops.pad(t, tuple(pad), value=0)


def _cat(parts: Sequence, dim: int, ops):
    return parts[0] if len(parts) == 1 else ops.cat(list(parts), dim)


def take_piece(t, dim: int, chunks: Sequence[tuple[int, int]], ops=torch, padded_to: Sequence[int] | None = None):
    """The piece of full `t` made of `chunks` (one per block), each padded with zeros to `padded_to` if given."""
    parts = [_narrow(t, dim, start, length) for start, length in chunks]
    if padded_to is not None:
        parts = [_padded(p, dim, to, ops) for p, to in zip(parts, padded_to, strict=True)]
    return _cat(parts, dim, ops)


def trimmed_piece(padded, dim: int, chunks: Sequence[tuple[int, int]], padded_to: Sequence[int], ops=torch):
    """The piece of `chunks` from its padded form (each block's part padded to `padded_to`; inside a trace cut even
    where nothing is padded, as `_padded`)."""
    if tuple(length for _, length in chunks) == tuple(padded_to) and ops is torch:
        return padded
    at, parts = 0, []
    for (_, length), to in zip(chunks, padded_to, strict=True):
        parts.append(_narrow(padded, dim, at, length))
        at += to
    return _cat(parts, dim, ops)


def padded_piece(piece, dim: int, chunks: Sequence[tuple[int, int]], padded_to: Sequence[int], ops=torch):
    """A piece of `chunks` with each block's part padded with zeros to `padded_to` (inside a trace padded even by
    nothing, as `_padded`)."""
    if tuple(length for _, length in chunks) == tuple(padded_to) and ops is torch:
        return piece
    parts = ops.split(piece, [length for _, length in chunks], dim) if len(chunks) > 1 else [piece]
    return _cat([_padded(p, dim, to, ops) for p, to in zip(parts, padded_to, strict=True)], dim, ops)


def assembled(pieces: Sequence, dim: int, every: Pieces, ops=torch):
    """The full tensor from every rank's piece (of `every`'s chunks), chunks held by several ranks from their first
    holder."""
    parts: dict[tuple[int, int], object] = {}
    for piece, chunks in zip(pieces, every, strict=True):
        split = ops.split(piece, [length for _, length in chunks], dim) if len(chunks) > 1 else [piece]
        for chunk, part in zip(chunks, split, strict=True):
            parts.setdefault(chunk, part)
    return _cat([parts[c] for c in sorted(parts) if c[1]], dim, ops)


def shard_tensor(t: torch.Tensor, layout: Layout, rank: int, size: int, ops=torch, *,
                 padded: bool = False) -> torch.Tensor:
    """This rank's piece of a full tensor (meta tensors too; proxies inside a trace with ops=thunder.torch);
    `padded`: each block's part padded with zeros to the longest piece's (rank 0's), as a simulation holds it."""
    if (owner := layout.owner(size)) is not None:
        return t if rank == owner else t[:0]
    if not isinstance(layout, Shard):
        return t
    every = rank_pieces(layout, t.shape[layout.dim], size)
    return take_piece(t, layout.dim, every[rank], ops, padded_lengths(every) if padded else None)


def piece_parts(piece: torch.Tensor, layout: Layout, rank: int, size: int, ops=torch) -> list[torch.Tensor]:
    """A rank's piece cut into the chunks it holds (views, in held_chunks' order); an unsharded tensor whole."""
    if (owner := layout.owner(size)) is not None:
        return [piece] if rank == owner else []
    if not isinstance(layout, Shard) or layout.blocks is None:
        return [piece]
    lengths = [length for _, length in held_chunks(layout, sum(layout.blocks), rank, size)]
    return list(ops.split(piece, lengths, layout.dim))


def shard_chunks(shape: Sequence[int], layout: Layout, rank: int, size: int) -> list[tuple[tuple[int, ...],
                                                                                           tuple[int, ...]]]:
    """(global offsets, sizes) of the slices of the full tensor that make up this rank's piece (held_chunks in
    every dim); the piece is their concatenation along the layout's dim, in this order."""
    if (owner := layout.owner(size)) is not None:
        return [((0,) * len(shape), tuple(shape))] if rank == owner else []
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
    if (owner := layout.owner(len(pieces))) is not None:
        return pieces[owner]
    if isinstance(layout, Partial):
        return torch.stack(list(pieces)).sum(0)
    size = len(pieces)
    n = _full_length(layout, [p.shape[layout.dim] for p in pieces], size)
    return assembled(pieces, layout.dim, rank_pieces(layout, n, size), ops)
