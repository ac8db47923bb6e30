"""Single-process unit tests: layouts, blocked shards, view grouping, basic-indexing maps, redistribution costs."""

import pytest
import thunder.core.devices as devices
import thunder.core.dtypes as dtypes
import torch
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, tracectx

from thunder_tp.layouts import (
    Partial,
    Replicate,
    Shard,
    check_shardable,
    local_shape,
    shard_tensor,
    unshard_tensor,
)
from thunder_tp.propagation.views import _getitem_map, view_groups
from thunder_tp.reshard import redistribute_cost


def test_blocked_shard_takes_a_chunk_of_every_block():
    q, k, v = torch.arange(8), 100 + torch.arange(4), 200 + torch.arange(4)
    full = torch.cat([q, k, v])
    pieces = [shard_tensor(full, Shard(0, (8, 4, 4)), r, 2) for r in range(2)]
    assert pieces[0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    assert torch.equal(unshard_tensor(pieces, Shard(0, (8, 4, 4))), full)


def test_plain_shard_round_trip_and_local_shape():
    full = torch.randn(6, 8)
    pieces = [shard_tensor(full, Shard(1), r, 4) for r in range(4)]
    assert pieces[0].shape == local_shape(full.shape, Shard(1), 4) == (6, 2)
    assert torch.equal(unshard_tensor(pieces, Shard(1)), full)
    assert torch.equal(unshard_tensor([full, full], Partial()), 2 * full)


def test_check_shardable_names_the_problem():
    with pytest.raises(ValueError, match=r"w: dim 0 of size 510 is not divisible by the TP group size 4"):
        check_shardable((510, 8), Shard(0), 4, "w")
    with pytest.raises(ValueError, match="block of size 6"):
        check_shardable((14,), Shard(0, (8, 6)), 4, "qkv")
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
    from thunder_tp.styles import ColwiseParallel, match_plan

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
