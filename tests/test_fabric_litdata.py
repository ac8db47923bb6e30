"""litdata's StreamingDataset (litgpt's pretraining data) shards by the world; the strategy's process_dataloader makes
it shard by the data-parallel group, so the ranks of a TP group stream the same items. Runs where litdata is
installed (it is not a dependency: its own requirements would replace this project's torch; `pip install --no-deps
litdata boto3 botocore s3transfer jmespath obstore tifffile` brings it without)."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks


def _item(i: int) -> torch.Tensor:
    return torch.full((9,), i, dtype=torch.long)


def _streamed(directory: str, tp: int) -> dict:
    from litdata import StreamingDataset

    import thunder_tp
    from thunder_tp.fabric.data import shard_by_data_parallel

    mesh = thunder_tp.init_mesh(tp=tp)
    by_world = [int(x[0]) for x in StreamingDataset(directory)]
    dataset = StreamingDataset(directory)
    changed = shard_by_data_parallel(torch.utils.data.DataLoader(dataset).dataset, mesh)
    return {"by_world": by_world, "by_dp": [int(x[0]) for x in dataset], "changed": changed, "dp_rank": mesh.dp_rank}


@pytest.mark.parametrize("world,tp", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_streaming_dataset_shards_by_the_data_parallel_group(tmp_path, world, tp):
    litdata = pytest.importorskip("litdata")
    directory = str(tmp_path / "optimized")
    litdata.optimize(fn=_item, inputs=list(range(16)), output_dir=directory, chunk_size=2, num_workers=1)
    ranks = run_ranks(_streamed, world, directory, tp, timeout=300)
    assert all(r["changed"] == 1 for r in ranks)
    assert ranks[0]["by_world"] != ranks[1]["by_world"]  # litdata alone: every rank its own items
    for start in range(0, world, tp):  # the ranks of a TP group stream the same items
        assert all(r["by_dp"] == ranks[start]["by_dp"] for r in ranks[start : start + tp])
    streamed = [sorted(ranks[d * tp]["by_dp"]) for d in range(world // tp)]
    assert sorted(i for items in streamed for i in items) == list(range(16))  # the data-parallel ranks split the data
