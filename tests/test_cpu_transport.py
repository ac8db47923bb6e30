"""thunder_tp's CPU collectives (shared memory on one host, pairwise exchanges otherwise) give exactly the
collective's result, with many in flight at once, growing slots, and no files left behind."""

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


def _group(use_shm: bool):
    """A fresh group of every rank (each group decides its transport once, on first use)."""
    import os

    import torch.distributed as dist

    from thunder_tp import shm

    before = os.environ.get("THUNDER_TP_SHM")
    os.environ["THUNDER_TP_SHM"] = "1" if use_shm else "0"
    group = dist.new_group(list(range(dist.get_world_size())))
    try:
        assert (shm.channel(group) is not None) == use_shm
    finally:  # the worker runs later tests too
        os.environ.pop("THUNDER_TP_SHM") if before is None else os.environ.update(THUNDER_TP_SHM=before)
    return group


def _in_rank_order(summands, op):
    import torch

    out = summands[0].clone()
    for s in summands[1:]:
        out = out + s if op == "sum" else torch.maximum(out, s)
    return out


def _collectives(use_shm, cases):
    import torch
    import torch.distributed as dist

    from thunder_tp.collectives import _cpu_all_gather, _cpu_all_reduce, _cpu_reduce_scatter
    from thunder_tp.layouts import Shard, shard_tensor

    group = _group(use_shm)
    rank, size = dist.get_rank(), dist.get_world_size()
    pending, expected, exact = [], [], []  # everything in flight at once, waited in reverse order
    for i, (shape, dim, blocks) in enumerate(cases):
        layout = Shard(dim, blocks)
        torch.manual_seed(i)
        full = torch.randn(shape)
        summands = [torch.randn(shape) for _ in range(size)]  # rank r holds summands[r]
        pending.append(_cpu_all_gather(shard_tensor(full, layout, rank, size), dim, blocks, group))
        expected.append(full)
        pending.append(_cpu_reduce_scatter(summands[rank], dim, blocks, group))
        expected.append(shard_tensor(_in_rank_order(summands, "sum"), layout, rank, size))
        exact += [True, True]
        for op in ("sum", "max"):
            pending.append(_cpu_all_reduce(summands[rank], op, group))
            expected.append(_in_rank_order(summands, op))
            exact.append(use_shm or op == "max" or size == 2)  # gloo's own all_reduce sums in its own order
    for (work, result), want, bitwise in reversed(list(zip(pending, expected, exact))):
        work.wait()
        torch.testing.assert_close(result, want, **({"rtol": 0, "atol": 0} if bitwise else {}))


def _growing_slots():
    """Sizes from 4 KiB to 8 MiB, two in flight at a time; then which files are left and how far slots grew."""
    import glob

    import torch
    import torch.distributed as dist

    from thunder_tp import shm
    from thunder_tp.collectives import _cpu_all_reduce

    group = _group(True)
    size = dist.get_world_size()
    previous = None
    for step in range(12):
        current = _cpu_all_reduce(torch.full((1024 << step,), float(dist.get_rank())), "sum", group)
        for work, out in [previous] if previous else []:
            work.wait()
            assert out.eq(size * (size - 1) / 2).all()
        previous = current
    previous[0].wait()
    assert previous[1].eq(size * (size - 1) / 2).all()
    channel = shm.channel(group)
    dist.barrier()  # every peer has acknowledged the last message
    _cpu_all_reduce(torch.ones(4), "sum", group)[0].wait()  # finds its slot free: unlinks its file
    return max(s.gen for s in channel.slots), len(channel.slots), sorted(glob.glob(channel.prefix + "*"))


def _mismatched_sizes():
    """One rank sends a different size: a clear error, not a hang or a wrong result."""
    import torch
    import torch.distributed as dist

    from thunder_tp.collectives import _cpu_all_reduce

    group = _group(True)
    work, _ = _cpu_all_reduce(torch.ones(4 + dist.get_rank()), "sum", group)
    try:
        work.wait()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "exchange"])
def test_cpu_collectives_exact(world, use_shm):
    cases = [c for c in CASES if c[0][c[1]] % world == 0 and not (c[2] and any(b % world for b in c[2]))]
    run_ranks(_collectives, world, use_shm, cases)


def test_shm_slots_grow_and_files_go():
    for gen, slots, files in run_ranks(_growing_slots, 2):
        assert gen >= 3 and slots <= 3, (gen, slots)  # 64 KiB -> ... -> 8 MiB in a few slots
        assert len(files) <= 1, files  # only the slot of the very last message may still be linked


def test_shm_size_mismatch_is_an_error():
    for message in run_ranks(_mismatched_sizes, 2):
        assert message and "same collectives in the same order" in message, message
