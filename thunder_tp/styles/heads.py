"""Styles of what is split by attention heads besides the projections: a norm over sharded features
(`FeatureShardedNorm`) and a KV cache (`KVCacheParallel`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from thunder_tp.layouts import Layout, Shard, Split, canonical
from thunder_tp.styles.base import Style


@dataclass(frozen=True)
class FeatureShardedNorm(Style):
    """A norm over a feature dim that arrives sharded (OLMo-2's q/k norm over all heads of a column-parallel
    projection): weight and bias split like the features, so each rank normalizes its own features and only
    the statistics (b*s numbers) are all_reduced; the activations are never gathered. `unit`, `groups`: the
    features' heads, split as the projection splits them (ColwiseParallel's).
    """

    unit: int = 1
    groups: int | None = None

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every parameter split on its (only) dim like the heads (whole heads are checked on the projection)."""
        layouts: dict[str, Layout] = {}
        for name, p in module.named_parameters(recurse=False):
            split = Split(p.shape[0] // self.unit, self.groups).normal(size)
            layouts[name] = canonical(Shard(0, splits=(split,)), p.shape[0], size)
        return layouts


@dataclass(frozen=True)
class KVCacheParallel(Style):
    """A KV cache (litgpt's `KVCache`: buffers `k`, `v` of shape (batch, heads, max_seq_length, head_size)) split
    by heads like the K/V heads of the attention that fills it, so writing new keys and values is local.

    With fewer heads than ranks each head is held by the ranks whose query heads use it (K/V-head replication). A cache
    starts empty: each rank's piece is allocated zeroed at its local size on the group's device (also for a
    meta-device model), the module keeps meta-device placeholders of the full size, and its `reset_parameters()`
    zeroes the pieces.
    """

    head_dim: int = 1

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every buffer split on `head_dim` as K/V heads are (ColwiseParallel's replicable blocks)."""
        layouts: dict[str, Layout] = {}
        for name, buffer in module.named_buffers(recurse=False):
            heads = buffer.shape[self.head_dim]
            split = Split(heads, replicated=heads < size).normal(size)
            layouts[name] = canonical(Shard(self.head_dim, splits=(split,)), heads, size)
        if not layouts:
            raise TypeError(f"KVCacheParallel applies to a module with cache buffers, {type(module).__name__} has none")
        return layouts
