"""Data for a TP group: every rank of a TP group gets the same batches; the data is split by the data-parallel group.

Map-style datasets go through Fabric's DistributedSampler with the strategy's `distributed_sampler_kwargs` (the
data-parallel rank and size). litdata's StreamingDataset (litgpt's pretraining data modules) shards on its own, by
the world's rank and size, which it reads from torch.distributed when it is built; `shard_by_data_parallel` gives it
the data-parallel rank and size instead, before it is first iterated (Fabric's `setup_dataloaders` calls it through
the strategy's `process_dataloader`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from thunder_tp.data_parallel.mesh import Mesh


def shard_by_data_parallel(dataset: Any, mesh: Mesh) -> int:
    """Make every litdata StreamingDataset in `dataset` (itself, or those of a CombinedStreamingDataset) shard by the
    data-parallel group of `mesh`; returns how many it changed (0 for any other dataset)."""
    changed = 0
    for streaming in _streaming_datasets(dataset):
        env = streaming.distributed_env
        nodes = env.num_nodes if mesh.dp % env.num_nodes == 0 else 1
        streaming.distributed_env = type(env)(world_size=mesh.dp, global_rank=mesh.dp_rank, num_nodes=nodes)
        changed += 1
    return changed


def _streaming_datasets(dataset: Any) -> Iterator[Any]:
    """litdata's StreamingDatasets in `dataset`: those with a `distributed_env` (world_size, global_rank, num_nodes)."""
    env = getattr(dataset, "distributed_env", None)
    if env is not None and all(hasattr(env, a) for a in ("world_size", "global_rank", "num_nodes")):
        yield dataset
    for inner in getattr(dataset, "_datasets", None) or ():  # litdata's CombinedStreamingDataset
        yield from _streaming_datasets(inner)
