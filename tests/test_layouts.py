"""Single-process unit tests: layouts, blocked shards, view grouping, basic-indexing maps, redistribution costs."""

import pytest
import thunder.core.devices as devices
import thunder.core.dtypes as dtypes
import torch
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, tracectx

from thunder_tp.collectives.reshard import redistribute_cost
from thunder_tp.layouts import (
    Partial,
    Replicate,
    Shard,
    Split,
    balanced,
    canonical,
    check_shardable,
    held_chunks,
    local_shape,
    rank_pieces,
)
from thunder_tp.pieces import shard_chunks, shard_tensor, unshard_tensor
from thunder_tp.propagation.views import _getitem_map, view_groups


def test_blocked_shard_takes_a_chunk_of_every_block():
    q, k, v = torch.arange(8), 100 + torch.arange(4), 200 + torch.arange(4)
    full = torch.cat([q, k, v])
    pieces = [shard_tensor(full, Shard(0, (8, 4, 4)), r, 2) for r in range(2)]
    assert pieces[0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    assert torch.equal(unshard_tensor(pieces, Shard(0, (8, 4, 4))), full)


def test_plain_shard_round_trip_and_local_shape():
    full = torch.randn(6, 8)
    pieces = [shard_tensor(full, Shard(1), r, 4) for r in range(4)]
    assert pieces[0].shape == local_shape(full.shape, Shard(1), 4, 0) == (6, 2)
    assert torch.equal(unshard_tensor(pieces, Shard(1)), full)
    assert torch.equal(unshard_tensor([full, full], Partial()), 2 * full)


def test_uneven_shard_is_balanced_and_round_trips():
    """A size that does not divide the dim: pieces differ by at most one entry, the longer first (not torch.chunk's
    ceil-sized pieces, which leave the last ranks short or empty: 9 over 4 would be 3, 3, 3, 0)."""
    full = torch.arange(10.0).reshape(10, 1)
    pieces = [shard_tensor(full, Shard(0), r, 4) for r in range(4)]
    assert [p.shape[0] for p in pieces] == [3, 3, 2, 2] == [local_shape((10, 1), Shard(0), 4, r)[0] for r in range(4)]
    assert torch.equal(unshard_tensor(pieces, Shard(0)), full)
    assert balanced(9, 4) == [(0, 3), (3, 2), (5, 2), (7, 2)]
    padded = shard_tensor(full, Shard(0), 3, 4, padded=True)
    assert padded.flatten().tolist() == [8, 9, 0]  # a simulation's piece: padded to the longest (rank 0's)
    check_shardable((510, 8), Shard(0), 4, "w")  # 128, 128, 127, 127


def test_head_splits_keep_whole_heads_and_their_kv_groups():
    """28 query heads in 4 K/V groups: at TP 8 each group's 7 heads over its 2 ranks (4 + 3) with the K/V head held by
    both; at TP 3 whole groups (2, 1, 1), their query heads with them; rank 0 always holds a longest piece."""
    q = Split(28, 4)
    assert [c for _, c in q.unit_ranges(8)] == [4, 3, 4, 3, 4, 3, 4, 3]
    assert Split(4, replicated=True).unit_ranges(8) == [(g, 1) for g in range(4) for _ in range(2)]
    assert q.unit_ranges(3) == [(0, 14), (14, 7), (21, 7)] and Split(4).unit_ranges(3) == [(0, 2), (2, 1), (3, 1)]
    assert [c for _, c in Split(9, 3).unit_ranges(8)] == [2, 1, 1, 1, 1, 1, 1, 1]  # extra ranks on the last groups
    for units, groups, size in [(28, 4, 8), (28, 4, 3), (28, 4, 6), (9, 3, 8), (15, 5, 8), (40, 10, 4), (71, 1, 8)]:
        counts = [c for _, c in Split(units, groups).unit_ranges(size)]
        assert counts[0] == max(counts) and sum(counts) == units, (units, groups, size, counts)
    kv = Split(4, replicated=True)
    layout = Shard(0, blocks=(28, 4, 4), splits=(q, kv, kv))
    assert held_chunks(layout, 36, 1, 8) == [(4, 3), (28, 1), (32, 1)]
    full = torch.arange(36.0).reshape(36, 1)
    assert torch.equal(unshard_tensor([shard_tensor(full, layout, r, 8) for r in range(8)], layout), full)
    assert shard_chunks((36, 1), layout, 1, 8) == [((4, 0), (3, 1)), ((28, 0), (1, 1)), ((32, 0), (1, 1))]
    assert rank_pieces(layout, 36, 8)[0] == ((0, 4), (28, 1), (32, 1))


def test_canonical_layouts_compare_equal_where_they_split_alike():
    assert canonical(Shard(1, splits=(Split(12, 12),)), 12, 8) == Shard(1)  # 2,2,2,2,1,1,1,1 heads: the default
    assert canonical(Shard(1, splits=(Split(12),)), 48, 8) == Shard(1, splits=(Split(12),))  # whole 4-wide heads
    assert canonical(Shard(1, splits=(Split(28, 4),)), 28, 3) == canonical(Shard(1, splits=(Split(4),)), 28, 3)
    assert canonical(Shard(0, splits=(Split(8, 2),)), 64, 4) == Shard(0)  # even: the default


def test_check_shardable_names_the_problem():
    with pytest.raises(ValueError, match=r"w: dim 0 of size 3 cannot be split over 4 ranks"):
        check_shardable((3, 8), Shard(0), 4, "w")
    with pytest.raises(ValueError, match="block of size 2"):
        check_shardable((14,), Shard(0, (12, 2)), 4, "qkv")
    with pytest.raises(ValueError, match=r"4 units \(e.g. heads\), fewer than 8 ranks need"):
        check_shardable((16,), Shard(0, splits=(Split(4),)), 8, "q")
    with pytest.raises(ValueError, match="Partial"):
        Partial("max")


def test_view_groups_pair_dims_with_equal_products():
    assert view_groups((2, 16, 64), (2, 16, 8, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert view_groups((2, 16, 4, 8), (2, 16, 32)) == [([0], [0]), ([1], [1]), ([2, 3], [2])]
    assert view_groups((32, 128), (4, 8, 128)) == [([0], [0, 1]), ([1], [2])]


def test_getitem_maps_whole_dims_only():
    assert _getitem_map((2, 3, 4, 16), (Ellipsis, slice(None, 8))) == [0, 1, 2, None]
    assert _getitem_map((2, 3), (slice(None), None, 0)) == [0, None]
    assert _getitem_map((2, 3, 4), (0,)) == [1, 2]
    assert _getitem_map((2, 3), (torch.tensor([1]),)) is None
    assert _getitem_map((5, 7), (slice(0, None), slice(None, 7))) == [0, 1]  # `0:` and `:7` of 7 take whole dims


def _proxy(shape):
    with tracectx(TraceCtx()):
        return TensorProxy(shape=shape, dtype=dtypes.float32, device=devices.cpu, requires_grad=False)


def test_costs_prefer_no_communication_and_never_choose_partial():
    t = _proxy((1024, 1024))
    slice_cost = redistribute_cost(Replicate(), Shard(0), t, 2)
    gather_cost = redistribute_cost(Shard(0), Replicate(), t, 2)
    reduce_cost = redistribute_cost(Partial(), Replicate(), t, 2)
    scatter_cost = redistribute_cost(Partial(), Shard(0), t, 2)
    assert redistribute_cost(Shard(0), Shard(0), t, 2) == 0 < slice_cost < gather_cost < reduce_cost
    assert redistribute_cost(Shard(0), Shard(1), t, 2) < gather_cost  # one all_to_all, not gather + slice
    assert redistribute_cost(Shard(1, blocks=(512, 512)), Shard(0), t, 2) > gather_cost  # blocked: gather, then slice
    assert scatter_cost < reduce_cost
    assert redistribute_cost(Replicate(), Partial(), t, 2) == float("inf")
    assert redistribute_cost(Shard(0), Replicate(), t, 2, is_parameter=True) > 100 * gather_cost


def test_thunder_parallel_type_only_where_thunder_means_it():
    from thunder.core.proxies import DistParallelType

    from thunder_tp.transform import _thunder_parallel_type

    assert _thunder_parallel_type(Shard(0), 2) is DistParallelType.COLUMN_WISE  # Linear weight dim 0
    assert _thunder_parallel_type(Shard(0), 1) is DistParallelType.COLUMN_WISE  # its bias
    assert _thunder_parallel_type(Shard(1), 2) is DistParallelType.ROW_WISE
    assert _thunder_parallel_type(Shard(1), 3) is None  # not a weight's input dim
    assert _thunder_parallel_type(Shard(2), 3) is None
    assert _thunder_parallel_type(Replicate(), 2) is None


def test_plan_key_suggestions_name_only_modules_with_tensors():
    """A mistyped key is pointed at modules a style can split (own parameters or buffers), not at a ReLU."""
    from thunder_tp.styles import ColwiseParallel
    from thunder_tp.styles.matching import match_plan

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"'fc1' matches no module of Sequential; modules with parameters: 0, 2$"):
        match_plan(model, {"fc1": ColwiseParallel()})
    model = torch.nn.ModuleDict({"fc1": torch.nn.Linear(4, 4), "fc1_act": torch.nn.ReLU(),
                                 "cache": torch.nn.Module()})
    model["cache"].register_buffer("k", torch.zeros(2))
    with pytest.raises(ValueError, match=r"'fc1_ac' matches no module of ModuleDict; close names: fc1") as error:
        match_plan(model, {"fc1_ac": ColwiseParallel()})
    assert "fc1_act" not in str(error.value), error.value
    with pytest.raises(ValueError, match=r"'cahce' matches no module of ModuleDict; close names: cache$"):
        match_plan(model, {"cahce": ColwiseParallel()})
