"""thunder_tp's collectives on torch.distributed (gloo here, the path NCCL takes too): lowered to Thunder's async
torchex prims with named work handles, all issued before the first wait, each giving exactly the collective's
result; pieces of unequal lengths (a size that does not divide the dim or a block) padded to the longest and
trimmed."""

import pytest

from tests.dist import run_ranks

CASES = [  # (full shape, dim, blocks)
    ((4, 6, 8), 0, None),
    ((4, 6, 8), 1, None),
    ((4, 6, 8), 2, None),
    ((2, 3, 24), 2, (8, 8, 8)),
    ((2, 3, 24), 2, (16, 4, 4)),
    ((24, 5), 0, (8, 16)),
    ((7, 5, 3), 0, None),
    ((3, 10, 4), 1, None),
    ((2, 3, 25), 2, (11, 7, 7)),
]


def _collectives(cases):
    import thunder
    import torch
    import torch.distributed as dist

    from tests.tp_checks import FAST_EXECUTORS
    from thunder_tp.collectives import tp_gather, tp_reduce_from_tp, tp_reduce_scatter
    from thunder_tp.layouts import Shard, rank_pieces
    from thunder_tp.pieces import shard_tensor

    group = dist.new_group(list(range(dist.get_world_size())))
    rank, size = dist.get_rank(), dist.get_world_size()

    every = [(dim, rank_pieces(Shard(dim, blocks), shape[dim], size)) for shape, dim, blocks in cases]

    def program(*tensors):
        outs = []
        for (shard, summand), (dim, pieces) in zip(zip(tensors[::2], tensors[1::2], strict=True), every, strict=True):
            outs += [tp_gather(shard, dim, pieces, group), tp_reduce_scatter(summand, dim, pieces, group),
                     tp_reduce_from_tp(summand, group)]
        return outs

    inputs, expected = [], []
    for i, (shape, dim, blocks) in enumerate(cases):
        layout = Shard(dim, blocks)
        torch.manual_seed(i)
        full = torch.randn(shape, dtype=torch.float64)
        summands = [torch.randn(shape, dtype=torch.float64) for _ in range(size)]  # rank r holds summands[r]
        total = sum(summands[1:], summands[0].clone())
        inputs += [shard_tensor(full, layout, rank, size), summands[rank]]
        expected += [full, shard_tensor(total, layout, rank, size), total]
    jitted = thunder.jit(program, executors=FAST_EXECUTORS)
    for got, want in zip(jitted(*inputs), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    names = [b.sym.name for b in thunder.last_traces(jitted)[-1].bound_symbols]
    issues = [i for i, n in enumerate(names) if n.startswith("torch_") and n.endswith("_prim_impl") and "wait" not in n]
    waits = [i for i, n in enumerate(names) if n == "torch_wait_prim_impl"]
    return len(issues), len(waits), names.count("tp_name_work"), max(issues) < min(waits)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_async_collectives_exact_and_all_in_flight(world):
    cases = [c for c in CASES if all(n >= world for n in c[2] or (c[0][c[1]],))]
    for issues, waits, named, all_issued_first in run_ranks(_collectives, world, cases):
        assert issues == waits == named == 3 * len(cases), (issues, waits, named)
        assert all_issued_first  # every collective is in flight before the first wait
