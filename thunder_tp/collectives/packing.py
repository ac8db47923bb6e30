"""Packing of blocked shards around torch.distributed's dim-0 collectives, on tensors and inside traces.

all_gather_into_tensor and reduce_scatter_tensor concatenate the ranks' pieces along dim 0; a Shard of another dim,
or of a fused dim made of blocks, is packed into that order before and unpacked from it after. `ops` is torch for
tensors (the symbols' synchronous implementations) and thunder.torch inside a trace (ops the fusion executor can
claim, so they do not split fusion regions).
"""

from __future__ import annotations

import torch

from thunder_tp.layouts import Shard, shard_tensor, unshard_tensor

Blocks = tuple[int, ...] | None


def pack(a: torch.Tensor, dim: int, blocks: Blocks, size: int, ops=torch) -> torch.Tensor:
    """Every rank's piece of `a`, concatenated along dim 0 (the layout reduce_scatter_tensor expects)."""
    if size == 1 or (dim == 0 and blocks is None):  # already in that order: no copy (the collectives only read it)
        return a.contiguous() if ops is torch else ops.contiguous(a)
    return ops.cat([shard_tensor(a, Shard(dim, blocks), r, size, ops) for r in range(size)], 0)


def unpack(a: torch.Tensor, dim: int, blocks: Blocks, size: int, piece: tuple[int, ...], ops=torch) -> torch.Tensor:
    """Inverse of the dim-0 concatenation made by all_gather_into_tensor."""
    pieces = ops.reshape(a, (size, *piece))
    if blocks is None:  # rank order is the order of the chunks: a permuted view, which fusions read in place
        full = list(piece)
        full[dim] *= size
        return ops.reshape(ops.movedim(pieces, 0, dim), full)
    return unshard_tensor(ops.unbind(pieces, 0), Shard(dim, blocks), ops)
