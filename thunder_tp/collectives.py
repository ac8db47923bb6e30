"""Collective symbols of the TP group, their conjugate grads and torch.distributed implementations.

Each symbol is an opaque operator of `comm_executor`:
- `fn` is a synchronous torch.distributed implementation (used when the executor is not listed);
- its execution transform lowers it to Thunder's async torchex prims plus a wait, which Thunder's
  wait sorting moves as late as data allows (CPU tensors on gloo: to `tp_cpu_all_reduce` /
  `tp_cpu_all_gather` / `tp_cpu_reduce_scatter`, shared memory on one host, plus the same wait);
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

from thunder_tp import shm
from thunder_tp.layouts import Shard, local_blocks, local_shape, shard_tensor, unshard_tensor
from thunder_tp.simulate import local_piece

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
    return local_piece(a, Shard(dim, blocks), dist.get_rank(group), group.size(), group)  # per rank when simulated


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


# --- CPU tensors on gloo: shared memory on one host, pairwise exchanges otherwise ------------------
# Gloo sends CPU tensors over TCP even on one host, with several kernel round trips per collective. When every
# rank of the group is on this host, `shm` lets each rank publish its contribution once and its peers read it
# in place (2 ranks on a 2-core VM, each after a matmul: all_reduce of 2 MB ~4 ms -> ~0.7 ms). Otherwise
# all_gather and reduce_scatter exchange pieces pairwise, which beats gloo's allgather / reduce_scatter ~2.5x,
# and all_reduce stays gloo's. Shared memory and exchanges combine contributions in rank order, so every rank
# computes bitwise the same result.


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


def _place(full: torch.Tensor, piece: torch.Tensor, dim: int, blocks: Blocks, rank: int, size: int) -> None:
    """Write rank `rank`'s piece into its place in the full tensor."""
    split = list(local_blocks(blocks, size) or (piece.shape[dim],))
    for view, part in zip(_piece_views(full, dim, blocks, rank, size), piece.split(split, dim)):
        view.copy_(part)


def _combine(parts: list[torch.Tensor], out: torch.Tensor, op: str = "sum") -> None:
    """out = parts[0] (op) parts[1] (op) ..., in rank order."""
    fn = torch.add if op == "sum" else torch.maximum
    fn(parts[0], parts[1], out=out)
    for part in parts[2:]:
        fn(out, part, out=out)


class _Pending:
    """What one CPU collective has in flight, waited on as one (torchex's wait_prim_impl calls ``.wait()``);
    ``finish`` then writes the result."""

    def __init__(self, works: list, finish):
        self.works, self.finish = works, finish

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            work.wait()
        self.finish()
        return True


def _over_shm(channel: shm.Channel, a: torch.Tensor, combine) -> _Pending:
    """Publish `a`; on wait, ``combine(every rank's contribution)``."""
    seq = channel.publish(a)

    def finish() -> None:
        combine(channel.contributions(seq, a))
        channel.done(seq)

    return _Pending([], finish)


def _exchange(group: dist.ProcessGroup, send: dict[int, torch.Tensor], recv: dict[int, torch.Tensor]) -> list:
    works = []
    for peer in send:
        peer_rank = dist.get_global_rank(group, peer)
        works += [dist.isend(send[peer], peer_rank, group=group), dist.irecv(recv[peer], peer_rank, group=group)]
    return works


def _cpu_all_reduce(a: torch.Tensor, op: str, group: dist.ProcessGroup):
    """Partial -> Replicate (op "sum" or "max"): (work, result, valid after work.wait())."""
    a = a.contiguous()
    out = torch.empty_like(a)
    channel = shm.channel(group)
    if channel is None:
        out.copy_(a)
        return dist.all_reduce(out, dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group, True), out
    return _over_shm(channel, a, lambda parts: _combine(parts, out, op)), out


def _cpu_all_gather(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup):
    """Shard(dim, blocks) -> Replicate: (work, full tensor, valid after work.wait())."""
    size, rank = group.size(), dist.get_rank(group)
    a = a.contiguous()
    shape = list(a.shape)
    shape[dim] *= size
    full = torch.empty(shape, dtype=a.dtype, device=a.device)
    _place(full, a, dim, blocks, rank, size)
    peers = [p for p in range(size) if p != rank]
    channel = shm.channel(group)
    if channel is not None:
        return _over_shm(channel, a, lambda parts: [_place(full, parts[p], dim, blocks, p, size) for p in peers]), full
    direct = dim == 0 and blocks is None  # each peer's piece is a contiguous chunk of `full`: receive in place
    recv = {p: full.narrow(0, p * a.shape[0], a.shape[0]) if direct else torch.empty_like(a) for p in peers}
    works = _exchange(group, {p: a for p in peers}, recv)
    return _Pending(works, lambda: None if direct else [_place(full, recv[p], dim, blocks, p, size) for p in peers]), full


def _cpu_reduce_scatter(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup):
    """Partial -> Shard(dim, blocks): (work, this rank's summed piece, valid after work.wait())."""
    size, rank = group.size(), dist.get_rank(group)
    out = torch.empty(local_shape(a.shape, Shard(dim), size), dtype=a.dtype, device=a.device)
    channel = shm.channel(group)
    if channel is not None:
        a = a.contiguous()
        return _over_shm(channel, a, lambda parts: _combine([_piece(p, dim, blocks, rank, size) for p in parts], out)), out
    mine = _piece(a, dim, blocks, rank, size)
    peers = [p for p in range(size) if p != rank]
    recv = {p: torch.empty_like(out) for p in peers}
    works = _exchange(group, {p: _piece(a, dim, blocks, p, size).contiguous() for p in peers}, recv)
    return _Pending(works, lambda: _combine([mine if r == rank else recv[r] for r in range(size)], out)), out


def _future(meta):
    def future_meta(*args) -> FutureTensorProxy:
        t = meta(*args)
        return FutureTensorProxy(shape=t.shape, like=t)

    return future_meta


tp_cpu_all_reduce = comm_executor.register_operator("tp_cpu_all_reduce", meta=_future(_like), fn=_cpu_all_reduce)
tp_cpu_all_gather = comm_executor.register_operator(
    "tp_cpu_all_gather", meta=_future(_gathered_meta), fn=_cpu_all_gather
)
tp_cpu_reduce_scatter = comm_executor.register_operator(
    "tp_cpu_reduce_scatter", meta=_future(_scattered_meta), fn=_cpu_reduce_scatter
)


def _on_cpu_gloo(a: TensorProxy, group: dist.ProcessGroup) -> bool:
    """CPU tensors on a gloo group of more than one rank: thunder_tp's CPU transport."""
    return a.device.type == "cpu" and group.size() > 1 and "gloo" in str(dist.get_backend(group))


#: symbol name -> the kind of collective it issues
COLLECTIVE_KINDS: dict[str, str] = {
    "tp_reduce_from_tp": "all_reduce",
    "tp_all_reduce_max": "all_reduce",
    "tp_cpu_all_reduce": "all_reduce",
    "tp_gather": "all_gather",
    "tp_gather_to_tp": "all_gather",
    "tp_cpu_all_gather": "all_gather",
    "tp_reduce_scatter": "reduce_scatter",
    "tp_cpu_reduce_scatter": "reduce_scatter",
}


# --- async lowering: Thunder's torchex prims + wait (sorted late by thunder's sort_waits) ---------


def _async_all_reduce(op: str):
    def lower(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
        from thunder.executors.torchex import all_reduce_prim_impl, wait_prim_impl

        if _on_cpu_gloo(a, group):
            return wait_prim_impl(tp_cpu_all_reduce(a, op, group))
        reduce_op = DistributedReduceOps.SUM if op == "sum" else DistributedReduceOps.MAX
        return wait_prim_impl(all_reduce_prim_impl(a, reduce_op, group, True, False))

    return lower


def _async_all_gather(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import all_gather_prim_impl, wait_prim_impl

    if _on_cpu_gloo(a, group):
        return wait_prim_impl(tp_cpu_all_gather(a, dim, blocks, group))
    size = group.size()
    gathered = wait_prim_impl(all_gather_prim_impl(tp_pack(a, 0, None, 1), group, True, None))
    if dim == 0 and blocks is None:
        return gathered
    return tp_unpack(gathered, dim, blocks, size, tuple(a.shape))


def _async_reduce_scatter(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import reduce_scatter_prim_impl, wait_prim_impl

    if _on_cpu_gloo(a, group):
        return wait_prim_impl(tp_cpu_reduce_scatter(a, dim, blocks, group))
    packed = tp_pack(a, dim, blocks, group.size())
    out = wait_prim_impl(reduce_scatter_prim_impl(packed, DistributedReduceOps.SUM, group, True, None))
    if dim == 0:
        return out
    from thunder.torch import reshape

    return reshape(out, local_shape(a.shape, Shard(dim), group.size()))


comm_executor.register_implementation(tp_reduce_from_tp, execution_transform=_async_all_reduce("sum"))
comm_executor.register_implementation(tp_all_reduce_max, execution_transform=_async_all_reduce("max"))
comm_executor.register_implementation(tp_gather, execution_transform=_async_all_gather)
comm_executor.register_implementation(tp_gather_to_tp, execution_transform=_async_all_gather)
comm_executor.register_implementation(tp_reduce_scatter, execution_transform=_async_reduce_scatter)
for _sym in (tp_copy_to_tp, tp_scatter, tp_pack, tp_unpack, tp_cpu_all_reduce, tp_cpu_all_gather,
             tp_cpu_reduce_scatter):
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
