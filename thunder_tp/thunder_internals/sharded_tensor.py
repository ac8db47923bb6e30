"""torch's ShardedTensor (``torch.distributed._shard``): how thunder_tp describes to DCP a tensor of which a rank
holds several slices (blocked q|k|v, K/V heads), which DTensor cannot hold. torch 2.10 exports it under private
module paths only, and builds one from the global metadata without a collective only privately.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

__all__ = ["Slice", "is_sharded_tensor", "local_slices", "sharded_tensor"]

Slice = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, sizes)


def sharded_tensor(placements: dict[Slice, str], local: dict[Slice, torch.Tensor], global_shape: tuple[int, ...],
                   dtype: torch.dtype, group: dist.ProcessGroup) -> ShardedTensor:
    """A ShardedTensor of `global_shape` made of the slices `placements` puts (``"rank:R/device"``), this rank's
    `local` ones given, without a collective (``_init_from_local_shards_and_global_metadata``)."""
    every = [ShardMetadata(list(o), list(s), placement) for (o, s), placement in placements.items()]
    shards = [Shard(local[key], md) for key, md in zip(placements, every, strict=True) if key in local]
    metadata = ShardedTensorMetadata(every, torch.Size(global_shape), TensorProperties(dtype=dtype,
                                                                                       requires_grad=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata, process_group=group)


def is_sharded_tensor(value: object) -> bool:
    """Whether `value` is a ShardedTensor."""
    return isinstance(value, ShardedTensor)


def local_slices(value: ShardedTensor) -> list[tuple[Slice, torch.Tensor]]:
    """This rank's slices of a ShardedTensor, each with its place in the global tensor."""
    return [((tuple(x.metadata.shard_offsets), tuple(x.metadata.shard_sizes)), x.tensor) for x in value.local_shards()]
