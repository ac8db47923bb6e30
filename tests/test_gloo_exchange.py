"""The gloo lowering of all_gather / reduce_scatter as pairwise exchanges equals the collectives it replaces."""

import pytest

from tests.dist import run_ranks

CASES = [  # (full shape, dim, blocks)
    ((4, 6, 8), 0, None),
    ((4, 6, 8), 1, None),
    ((4, 6, 8), 2, None),
    ((2, 3, 24), 2, (8, 8, 8)),
    ((2, 3, 24), 2, (16, 4, 4)),
    ((24, 5), 0, (8, 16)),
]


def _exchanges(shape, dim, blocks):
    import torch
    import torch.distributed as dist

    from thunder_tp.collectives import _exchange_all_gather, _exchange_reduce_scatter
    from thunder_tp.layouts import Shard, shard_tensor

    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    layout = Shard(dim, blocks)
    torch.manual_seed(0)
    full = torch.randn(shape)
    work, gathered = _exchange_all_gather(shard_tensor(full, layout, rank, size), dim, blocks, group)
    work.wait()
    torch.testing.assert_close(gathered, full, rtol=0, atol=0)

    torch.manual_seed(1)
    summands = [torch.randn(shape) for _ in range(size)]  # rank r holds summands[r]
    work, piece = _exchange_reduce_scatter(summands[rank], dim, blocks, group)
    work.wait()
    expected = summands[0].clone()
    for s in summands[1:]:
        expected += s  # rank order, as the exchange adds them
    torch.testing.assert_close(piece, shard_tensor(expected, layout, rank, size), rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_collectives(world):
    for shape, dim, blocks in CASES:
        if blocks and any(b % world for b in blocks) or shape[dim] % world:
            continue
        run_ranks(_exchanges, world, shape, dim, blocks)
