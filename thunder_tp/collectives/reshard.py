"""Resharding: the alpha-beta cost of a redistribution and the collective that performs it."""

from __future__ import annotations

import math

import torch.distributed as dist
from thunder.core.proxies import TensorProxy

from thunder_tp import collectives as C
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.costs import ALPHA_BYTES
from thunder_tp.layouts import REPLICATE, Layout, Partial, Replicate, Shard, padded_lengths, rank_pieces

#: resharding a parameter is a last resort: its layout is the user's
PARAMETER_PENALTY = 1000.0
#: a local slice moves no data but is not free
SLICE_COST = 1.0


def nbytes(t: TensorProxy) -> int:
    """Bytes of the tensor a proxy describes (symbolic dims at their traced values)."""
    return math.prod(int(s) for s in t.shape) * t.dtype.bytes


def wire_bytes(t: TensorProxy, layout: Layout, size: int) -> int:
    """Bytes a collective over the pieces of `t` (logical) in `layout` moves in all: its pieces padded to the longest
    (torch.distributed's all_gather / reduce_scatter take equal pieces), so the padding is priced too."""
    if not isinstance(layout, Shard):
        return nbytes(t)
    n = int(t.shape[layout.dim])
    padded = size * sum(padded_lengths(rank_pieces(layout, n, size)))
    return nbytes(t) * padded // n


def collective_cost(kind: str, full_bytes: int, size: int) -> float:
    """Alpha-beta cost of one collective of `kind` on a tensor of `full_bytes` over `size` ranks, in bytes
    (`costs.ALPHA_BYTES` a call)."""
    moved = full_bytes * (size - 1) / size
    return ALPHA_BYTES + moved * {"all_reduce": 2.0, "all_to_all": 1.0 / size}.get(kind, 1.0)


def collective_kind(src: Layout, dst: Layout, shape: tuple[int, ...], size: int) -> str | None:
    """The collective that turns a tensor of `shape` from `src` into `dst` (None: nothing, or a local slice)."""
    match src, dst:
        case _ if src == dst:
            return None
        case Partial(), Replicate():
            return "all_reduce"
        case Partial(), Shard():
            return "reduce_scatter"
        case Shard(), Shard() if _all_to_all_applies(src, dst, shape, size):
            return "all_to_all"
        case Shard(), Replicate() | Shard():  # Shard -> Shard otherwise: gather, then slice
            return "all_gather"
    return None


def collective_bytes(src: Layout, dst: Layout, t: TensorProxy, size: int) -> int:
    """Bytes of the collective that turns `t` from `src` into `dst`, padding included (`wire_bytes`)."""
    return wire_bytes(t, src if isinstance(src, Shard) else dst, size)


def redistribute_cost(src: Layout, dst: Layout, t: TensorProxy, size: int, *, is_parameter: bool = False) -> float:
    """Alpha-beta cost of turning `t` from `src` into `dst` over `size` ranks."""
    if src == dst:
        return 0.0
    # -> Partial is never chosen; a tensor one rank holds alone (an expert) is only read there, by its MoE layer
    if _replicated_shard(src, dst) or isinstance(dst, Partial) or any(x.owner(size) is not None for x in (src, dst)):
        return math.inf
    kind = collective_kind(src, dst, t.shape, size)
    cost = collective_cost(kind, collective_bytes(src, dst, t, size), size) if kind else 0.0
    if isinstance(dst, Shard) and kind in (None, "all_gather"):  # a local slice (of the gathered tensor)
        cost += SLICE_COST
    return cost * (PARAMETER_PENALTY if is_parameter else 1.0)


def _all_to_all_applies(src: Shard, dst: Shard, shape: tuple[int, ...], size: int) -> bool:
    """Shard(i) -> Shard(j), i != j, of plain shards that the ranks split evenly, on real ranks: one all_to_all, as
    DTensor's shard_dim_alltoall (a simulation gathers and slices: one trace runs for every simulated rank)."""
    plain = all(x.blocks is None and x.splits is None and int(shape[x.dim]) % size == 0 for x in (src, dst))
    return src.dim != dst.dim and plain and not ranks_of().one_trace_for_all


def _replicated_shard(*layouts: Layout) -> bool:
    return any(isinstance(x, Shard) and x.is_replicated for x in layouts)


def _check_redistributable(src: Layout, dst: Layout) -> None:
    if src != dst and _replicated_shard(src, dst):
        raise NotImplementedError(
            f"thunder_tp cannot redistribute {src} to {dst}: chunks held by several ranks (replicated K/V heads) "
            "are only used where they are (attention heads); please report the model that needs this"
        )


def gather_into_tp_region(x: TensorProxy, src: Shard, shape: tuple[int, ...], group: dist.ProcessGroup) -> TensorProxy:
    """Emit the gather of a Shard piece `x` (of a tensor of `shape`) whose whole value is used by sharded compute: its
    grad, a Partial sum, is reduce-scattered back into the shard (sequence parallel's all_gather / reduce_scatter
    pair)."""
    _check_redistributable(src, REPLICATE)
    return C.tp_gather_to_tp(x, src.dim, rank_pieces(src, int(shape[src.dim]), group.size()), group)


def redistribute(x: TensorProxy, src: Layout, dst: Layout, shape: tuple[int, ...],
                 group: dist.ProcessGroup) -> TensorProxy:
    """Emit the collective that turns local piece `x` of a tensor of `shape` from `src` into `dst` (inside a trace
    context)."""
    _check_redistributable(src, dst)
    size = group.size()

    def pieces(layout: Shard):
        return rank_pieces(layout, int(shape[layout.dim]), size)

    match src, dst:
        case _ if src == dst:
            return x
        case Partial(), Replicate():
            return C.tp_reduce_from_tp(x, group)
        case Partial(), Shard():
            return C.tp_reduce_scatter(x, dst.dim, pieces(dst), group)
        case Shard(), Replicate():
            return C.tp_gather(x, src.dim, pieces(src), group)
        case Replicate(), Shard():
            return C.tp_scatter(x, dst.dim, pieces(dst), group)
        case Shard(), Shard() if _all_to_all_applies(src, dst, shape, size):
            return C.tp_all_to_all(x, src.dim, dst.dim, group)
        case Shard(), Shard():
            return C.tp_scatter(C.tp_gather(x, src.dim, pieces(src), group), dst.dim, pieces(dst), group)
    raise NotImplementedError(f"thunder_tp cannot redistribute {src} to {dst}")
