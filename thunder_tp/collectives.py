"""Collective symbols of the TP group, their conjugate grads and torch.distributed implementations.

Each symbol is an opaque operator of `comm_executor`:
- `fn` is a synchronous torch.distributed implementation (used when the executor is not listed);
- its execution transform lowers it to Thunder's async torchex prims plus a wait, which Thunder's
  wait sorting moves as late as data allows (all_gather / reduce_scatter of CPU tensors on gloo: to
  `tp_all_gather_exchange` / `tp_reduce_scatter_exchange`, pairwise isend/irecv, plus the same wait);
- its grad is the conjugate collective (Megatron's f/g operator pairs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.transforms import register_grad
from thunder.distributed.prims import DistributedReduceOps
from thunder.extend import OperatorExecutor, register_executor

from thunder_tp.layouts import Shard, local_blocks, local_shape, shard_tensor, unshard_tensor

comm_executor = OperatorExecutor("thunder_tp_comm", version="0.1")
register_executor(comm_executor)

Blocks = tuple[int, ...] | None


# --- shapes of the results --------------------------------------------------------------------


def _like(a: TensorProxy, *_args) -> TensorProxy:
    return TensorProxy(like=a)


def _gathered_meta(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
    shape = list(a.shape)
    shape[dim] *= group.size()
    return TensorProxy(like=a, shape=tuple(shape))


def _scattered_meta(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
    return TensorProxy(like=a, shape=local_shape(a.shape, Shard(dim), group.size()))


def _packed_meta(a: TensorProxy, dim: int, blocks: Blocks, size: int) -> TensorProxy:
    piece = local_shape(a.shape, Shard(dim), size)
    return TensorProxy(like=a, shape=(size * piece[0], *piece[1:]))


def _unpacked_meta(a: TensorProxy, dim: int, blocks: Blocks, size: int, piece: tuple[int, ...]) -> TensorProxy:
    shape = list(piece)
    shape[dim] *= size
    return TensorProxy(like=a, shape=tuple(shape))


# --- local data movement around the dim-0 collectives of torch.distributed ----------------------


def _pack(a: torch.Tensor, dim: int, blocks: Blocks, size: int) -> torch.Tensor:
    """Every rank's piece of `a`, concatenated along dim 0 (the layout reduce_scatter_tensor expects)."""
    if size == 1 or (dim == 0 and blocks is None):  # already in that order: no copy (the collectives only read it)
        return a.contiguous()
    return torch.cat([shard_tensor(a, Shard(dim, blocks), r, size).contiguous() for r in range(size)], 0)


def _unpack(a: torch.Tensor, dim: int, blocks: Blocks, size: int, piece: tuple[int, ...]) -> torch.Tensor:
    """Inverse of the dim-0 concatenation made by all_gather_into_tensor."""
    return unshard_tensor(a.view(size, *piece).unbind(0), Shard(dim, blocks))


def _local(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> torch.Tensor:
    return shard_tensor(a, Shard(dim, blocks), dist.get_rank(group), group.size())


def _all_reduce(a: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = a.contiguous().clone()
    dist.all_reduce(out, op, group)
    return out


def gather_shards(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's Shard(dim, blocks) piece (synchronous)."""
    size = group.size()
    out = torch.empty((size * a.shape[0], *a.shape[1:]), dtype=a.dtype, device=a.device)
    dist.all_gather_into_tensor(out, a.contiguous(), group)
    return _unpack(out, dim, blocks, size, tuple(a.shape))


def _reduce_scatter(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> torch.Tensor:
    size = group.size()
    packed = _pack(a, dim, blocks, size)
    out = torch.empty((packed.shape[0] // size, *packed.shape[1:]), dtype=a.dtype, device=a.device)
    dist.reduce_scatter_tensor(out, packed, dist.ReduceOp.SUM, group)
    return out.view(local_shape(a.shape, Shard(dim), size))


tp_pack = comm_executor.register_operator("tp_pack", meta=_packed_meta, fn=_pack)
tp_unpack = comm_executor.register_operator("tp_unpack", meta=_unpacked_meta, fn=_unpack)

# --- the TP collectives ---------------------------------------------------------------------------

tp_copy_to_tp = comm_executor.register_operator("tp_copy_to_tp", meta=_like, fn=lambda a, group: a)
tp_reduce_from_tp = comm_executor.register_operator("tp_reduce_from_tp", meta=_like, fn=_all_reduce)
tp_gather = comm_executor.register_operator("tp_gather", meta=_gathered_meta, fn=gather_shards)
tp_gather_to_tp = comm_executor.register_operator("tp_gather_to_tp", meta=_gathered_meta, fn=gather_shards)
tp_scatter = comm_executor.register_operator("tp_scatter", meta=_scattered_meta, fn=_local)
tp_reduce_scatter = comm_executor.register_operator("tp_reduce_scatter", meta=_scattered_meta, fn=_reduce_scatter)
tp_all_reduce_max = comm_executor.register_operator(
    "tp_all_reduce_max", meta=_like, fn=lambda a, group: _all_reduce(a, group, dist.ReduceOp.MAX)
)


# --- gloo: all_gather and reduce_scatter as pairwise exchanges ------------------------------------
# Gloo's allgather and reduce_scatter are far slower than exchanging the same bytes pairwise (2 ranks on
# loopback: all_gather of 16 MB pieces ~34 ms vs ~13 ms; reduce_scatter of 16 MB ~17-22 ms vs ~8-10 ms). So on
# gloo each rank sends every peer its piece and receives theirs (all in flight at once); the wait places what
# arrived straight into the result's layout, so no separate pack/unpack copy is needed.


def _piece_views(t: torch.Tensor, dim: int, blocks: Blocks, rank: int, size: int) -> list[torch.Tensor]:
    """Views of rank `rank`'s piece of the full tensor `t`: one per block (one in all for an unblocked dim)."""
    views, start = [], 0
    for block in blocks or (t.shape[dim],):
        views.append(t.narrow(dim, start + rank * (block // size), block // size))
        start += block
    return views


def _piece(t: torch.Tensor, dim: int, blocks: Blocks, rank: int, size: int) -> torch.Tensor:
    views = _piece_views(t, dim, blocks, rank, size)
    return views[0] if len(views) == 1 else torch.cat(views, dim)


class _Exchange:
    """The sends and receives of one exchange, waited on as one (torchex's wait_prim_impl calls ``.wait()``);
    ``finish`` then combines what was received into the result."""

    def __init__(self, works: list, finish):
        self.works, self.finish = works, finish

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            work.wait()
        self.finish()
        return True


def _exchange(group: dist.ProcessGroup, send: dict[int, torch.Tensor], recv: dict[int, torch.Tensor]) -> list:
    works = []
    for peer in send:
        peer_rank = dist.get_global_rank(group, peer)
        works += [dist.isend(send[peer], peer_rank, group=group), dist.irecv(recv[peer], peer_rank, group=group)]
    return works


def _exchange_all_gather(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup):
    """Shard(dim, blocks) -> Replicate: (work, full tensor, valid after work.wait())."""
    size, rank = group.size(), dist.get_rank(group)
    a = a.contiguous()
    shape = list(a.shape)
    shape[dim] *= size
    full = torch.empty(shape, dtype=a.dtype, device=a.device)
    split = list(local_blocks(blocks, size) or (a.shape[dim],))

    def place(piece: torch.Tensor, r: int) -> None:
        for view, part in zip(_piece_views(full, dim, blocks, r, size), piece.split(split, dim)):
            view.copy_(part)

    place(a, rank)
    direct = dim == 0 and blocks is None  # each peer's piece is a contiguous chunk of `full`: receive in place
    peers = [p for p in range(size) if p != rank]
    recv = {p: full.narrow(0, p * a.shape[0], a.shape[0]) if direct else torch.empty_like(a) for p in peers}
    works = _exchange(group, {p: a for p in peers}, recv)
    return _Exchange(works, lambda: None if direct else [place(recv[p], p) for p in peers]), full


def _exchange_reduce_scatter(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup):
    """Partial -> Shard(dim, blocks): (work, this rank's summed piece, valid after work.wait()).
    Summands are added in rank order, the same on every rank."""
    size, rank = group.size(), dist.get_rank(group)
    peers = [p for p in range(size) if p != rank]
    mine = _piece(a, dim, blocks, rank, size)
    recv = {p: torch.empty(mine.shape, dtype=a.dtype, device=a.device) for p in peers}
    works = _exchange(group, {p: _piece(a, dim, blocks, p, size).contiguous() for p in peers}, recv)
    out = torch.empty(mine.shape, dtype=a.dtype, device=a.device)

    def finish() -> None:
        parts = [mine if r == rank else recv[r] for r in range(size)]
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)

    return _Exchange(works, finish), out


def _future(meta):
    def future_meta(*args) -> FutureTensorProxy:
        t = meta(*args)
        return FutureTensorProxy(shape=t.shape, like=t)

    return future_meta


tp_all_gather_exchange = comm_executor.register_operator(
    "tp_all_gather_exchange", meta=_future(_gathered_meta), fn=_exchange_all_gather
)
tp_reduce_scatter_exchange = comm_executor.register_operator(
    "tp_reduce_scatter_exchange", meta=_future(_scattered_meta), fn=_exchange_reduce_scatter
)


def _by_exchange(a: TensorProxy, group: dist.ProcessGroup) -> bool:
    """CPU tensors on a gloo group with more than one rank: all_gather / reduce_scatter by pairwise exchange."""
    return a.device.type == "cpu" and group.size() > 1 and "gloo" in str(dist.get_backend(group))


#: symbol name -> the kind of collective it issues
COLLECTIVE_KINDS: dict[str, str] = {
    "tp_reduce_from_tp": "all_reduce",
    "tp_all_reduce_max": "all_reduce",
    "tp_gather": "all_gather",
    "tp_gather_to_tp": "all_gather",
    "tp_all_gather_exchange": "all_gather",
    "tp_reduce_scatter": "reduce_scatter",
    "tp_reduce_scatter_exchange": "reduce_scatter",
}


# --- async lowering: Thunder's torchex prims + wait (sorted late by thunder's sort_waits) ---------


def _async_all_reduce(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import all_reduce_prim_impl, wait_prim_impl

    return wait_prim_impl(all_reduce_prim_impl(a, DistributedReduceOps.SUM, group, True, False))


def _async_all_gather(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import all_gather_prim_impl, wait_prim_impl

    if _by_exchange(a, group):
        return wait_prim_impl(tp_all_gather_exchange(a, dim, blocks, group))
    size = group.size()
    gathered = wait_prim_impl(all_gather_prim_impl(tp_pack(a, 0, None, 1), group, True, None))
    if dim == 0 and blocks is None:
        return gathered
    return tp_unpack(gathered, dim, blocks, size, tuple(a.shape))


def _async_reduce_scatter(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import reduce_scatter_prim_impl, wait_prim_impl

    if _by_exchange(a, group):
        return wait_prim_impl(tp_reduce_scatter_exchange(a, dim, blocks, group))
    packed = tp_pack(a, dim, blocks, group.size())
    out = wait_prim_impl(reduce_scatter_prim_impl(packed, DistributedReduceOps.SUM, group, True, None))
    if dim == 0:
        return out
    from thunder.torch import reshape

    return reshape(out, local_shape(a.shape, Shard(dim), group.size()))


comm_executor.register_implementation(tp_reduce_from_tp, execution_transform=_async_all_reduce)
comm_executor.register_implementation(tp_gather, execution_transform=_async_all_gather)
comm_executor.register_implementation(tp_gather_to_tp, execution_transform=_async_all_gather)
comm_executor.register_implementation(tp_reduce_scatter, execution_transform=_async_reduce_scatter)
for _sym in (tp_copy_to_tp, tp_scatter, tp_all_reduce_max, tp_pack, tp_unpack, tp_all_gather_exchange,
             tp_reduce_scatter_exchange):
    comm_executor.register_implementation(_sym, _sym)


# --- conjugate grads ----------------------------------------------------------------------------


def _copy_to_tp_grad(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    out = tp_copy_to_tp(a, group)
    put_grad(a, tp_reduce_from_tp(get_grad(out), group))
    return out


def _reduce_from_tp_grad(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    out = tp_reduce_from_tp(a, group)
    put_grad(a, get_grad(out))
    return out


def _all_reduce_max_grad(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    return tp_all_reduce_max(a, group)  # used only as a shift constant: no gradient flows through it


def _conjugate(forward, backward):
    def grad(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
        out = forward(a, dim, blocks, group)
        put_grad(a, backward(get_grad(out), dim, blocks, group))
        return out

    return grad


register_grad(tp_copy_to_tp, _copy_to_tp_grad)
register_grad(tp_reduce_from_tp, _reduce_from_tp_grad)
register_grad(tp_all_reduce_max, _all_reduce_max_grad)
register_grad(tp_gather, _conjugate(tp_gather, tp_scatter))
register_grad(tp_gather_to_tp, _conjugate(tp_gather_to_tp, tp_reduce_scatter))
register_grad(tp_scatter, _conjugate(tp_scatter, tp_gather))
register_grad(tp_reduce_scatter, _conjugate(tp_reduce_scatter, tp_gather))
