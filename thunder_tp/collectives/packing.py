"""Packing of blocked shards around torch.distributed's dim-0 collectives, on tensors and inside traces.

all_gather_into_tensor and reduce_scatter_tensor concatenate the ranks' pieces along dim 0; a Shard of another dim,
or of a fused dim made of blocks, is packed into that order before and unpacked from it after.
"""

from __future__ import annotations

import torch
from thunder.core.proxies import TensorProxy

from thunder_tp.layouts import Shard, local_blocks, shard_tensor, unshard_tensor

Blocks = tuple[int, ...] | None


# --- on tensors (the symbols' synchronous implementations) -------------------------------------------------


def pack(a: torch.Tensor, dim: int, blocks: Blocks, size: int) -> torch.Tensor:
    """Every rank's piece of `a`, concatenated along dim 0 (the layout reduce_scatter_tensor expects)."""
    if size == 1 or (dim == 0 and blocks is None):  # already in that order: no copy (the collectives only read it)
        return a.contiguous()
    return torch.cat([shard_tensor(a, Shard(dim, blocks), r, size).contiguous() for r in range(size)], 0)


def unpack(a: torch.Tensor, dim: int, blocks: Blocks, size: int, piece: tuple[int, ...]) -> torch.Tensor:
    """Inverse of the dim-0 concatenation made by all_gather_into_tensor."""
    return unshard_tensor(a.view(size, *piece).unbind(0), Shard(dim, blocks))


# --- inside traces: torch ops the fusion executor can claim, so they do not split fusion regions -------------


def rank_pieces_ops(a: TensorProxy, dim: int, blocks: Blocks, size: int) -> list[TensorProxy]:
    """Every rank's Shard(dim, blocks) piece of the full `a`, in rank order (as layouts.shard_tensor, on proxies)."""
    from thunder.torch import cat, chunk, split

    chunks = [chunk(block, size, dim) for block in (split(a, list(blocks), dim) if blocks else [a])]
    if len(chunks) == 1:
        return list(chunks[0])
    return [cat([c[r] for c in chunks], dim) for r in range(size)]


def pack_ops(a: TensorProxy, dim: int, blocks: Blocks, size: int) -> TensorProxy:
    """`pack` inside a trace."""
    from thunder.torch import cat, contiguous

    if size == 1 or (dim == 0 and blocks is None):
        return contiguous(a)
    return cat([contiguous(piece) for piece in rank_pieces_ops(a, dim, blocks, size)], 0)


def unpack_ops(a: TensorProxy, dim: int, blocks: Blocks, size: int, piece: tuple[int, ...]) -> TensorProxy:
    """`unpack` inside a trace."""
    from thunder.torch import cat, reshape, split, unbind

    pieces = unbind(reshape(a, size, *piece), 0)
    if blocks is None:
        return cat(list(pieces), dim)
    per_rank = [split(p, list(local_blocks(blocks, size)), dim) for p in pieces]
    return cat([cat([r[i] for r in per_rank], dim) for i in range(len(blocks))], dim)
