"""Collective symbols of the TP group, their conjugate grads and torch.distributed implementations.

Each symbol is an opaque operator of `comm_executor`:
- `fn` is a synchronous torch.distributed implementation (used when the executor is not listed);
- its execution transform lowers it, on every torch.distributed backend, to Thunder's async torchex prims
  plus a wait, which Thunder's wait sorting moves as late as data allows; a failed wait names the
  collective and its group;
- its grad is the conjugate collective (Megatron's f/g operator pairs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import FutureTensorProxy, NumberProxy, TensorProxy
from thunder.core.transforms import register_grad
from thunder.distributed.prims import DistributedReduceOps
from thunder.extend import OperatorExecutor, register_executor

from thunder_tp.layouts import Shard, local_blocks, local_shape, shard_tensor, unshard_tensor
from thunder_tp.simulate import for_each_rank, is_simulating, local_piece

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


def gather_full(a: torch.Tensor, layout: Shard, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's piece of `layout` (synchronous; replicated chunks from their first holder)."""
    size = group.size()
    out = torch.empty((size * a.shape[0], *a.shape[1:]), dtype=a.dtype, device=a.device)
    dist.all_gather_into_tensor(out, a.contiguous(), group)
    return unshard_tensor(out.view(size, *a.shape).unbind(0), layout)


def gather_shards(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's Shard(dim, blocks) piece (synchronous)."""
    return gather_full(a, Shard(dim, blocks), group)


def _reduce_scatter(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> torch.Tensor:
    size = group.size()
    packed = _pack(a, dim, blocks, size)
    out = torch.empty((packed.shape[0] // size, *packed.shape[1:]), dtype=a.dtype, device=a.device)
    dist.reduce_scatter_tensor(out, packed, dist.ReduceOp.SUM, group)
    return out.view(local_shape(a.shape, Shard(dim), size))


tp_pack = comm_executor.register_operator("tp_pack", meta=_packed_meta, fn=_pack)
tp_unpack = comm_executor.register_operator("tp_unpack", meta=_unpacked_meta, fn=_unpack)

# --- the rank inside traced programs ------------------------------------------------------------------------


def _rank_offset_meta(like: TensorProxy, step: int, group: dist.ProcessGroup) -> TensorProxy:
    return TensorProxy(like=like, shape=(), dtype=like.dtype)


def _rank_offset_impl(like: torch.Tensor, step: int, group: dist.ProcessGroup) -> torch.Tensor:
    return for_each_rank(lambda r: torch.tensor(r * step, dtype=like.dtype, device=like.device), group)


tp_rank_offset = comm_executor.register_operator("tp_rank_offset", meta=_rank_offset_meta, fn=_rank_offset_impl)
tp_rank_piece = comm_executor.register_operator("tp_rank_piece", meta=_scattered_meta, fn=_local)  # simulated tp_scatter
comm_executor.register_implementation(tp_rank_offset, tp_rank_offset)
comm_executor.register_implementation(tp_rank_piece, tp_rank_piece)


def rank_offset(tp, step: int, like: TensorProxy) -> int | TensorProxy:
    """``rank * step`` for a traced program: a constant on a real rank; in a simulation a per-rank tensor
    (``tp_rank_offset``, a 0-d tensor of ``like``'s dtype), since one trace runs for every simulated rank."""
    if not is_simulating():
        return tp.rank * step
    return tp_rank_offset(like, step, tp.group)


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


#: symbol name -> the kind of collective it issues
COLLECTIVE_KINDS: dict[str, str] = {
    "tp_reduce_from_tp": "all_reduce",
    "tp_all_reduce_max": "all_reduce",
    "tp_gather": "all_gather",
    "tp_gather_to_tp": "all_gather",
    "tp_reduce_scatter": "reduce_scatter",
}


# --- async lowering: Thunder's torchex prims + wait (sorted late by thunder's sort_waits) ---------
# One lowering for every torch.distributed backend. Each issued collective's work handle is wrapped so that a
# failed wait (a dead, hung or raising peer: torch.distributed's error or its process-group timeout) names the
# collective and the group.


class _NamedWork:
    """A torch.distributed work handle whose failed ``wait`` says which collective of which group failed."""

    def __init__(self, work, kind: str, a: torch.Tensor, group: dist.ProcessGroup):
        self.work, self.kind, self.shape, self.dtype, self.group = work, kind, tuple(a.shape), a.dtype, group

    def wait(self, timeout=None) -> bool:
        try:
            return self.work.wait() if timeout is None else self.work.wait(timeout)
        except Exception as e:
            raise RuntimeError(
                f"thunder_tp: {self.kind} of a {self.shape} {self.dtype} tensor over the "
                f"{dist.get_backend(self.group)} group of global ranks {dist.get_process_group_ranks(self.group)} "
                f"failed: {type(e).__name__}: {e}\nA peer rank of this group probably died, raised before this "
                "collective, or did not reach it within the process group's timeout (init_process_group(timeout=...)); "
                "see that rank's output."
            ) from e


def _name_work(future: tuple, kind: str, a: torch.Tensor, group: dist.ProcessGroup) -> tuple:
    work, result = future
    return _NamedWork(work, kind, a, group), result


tp_name_work = comm_executor.register_operator(
    "tp_name_work", meta=lambda future, kind, a, group: FutureTensorProxy(like=future), fn=_name_work
)


def _symbolic(a: TensorProxy) -> bool:
    """Shapes of symbolic values (cache="symbolic values"): Thunder 0.2.6's wait sorting cannot order async
    collectives on them (it reads their numel outside a trace), so those stay synchronous (the symbol's own fn)."""
    return any(isinstance(d, NumberProxy) for d in a.shape)


def _async_all_reduce(op: str):
    def lower(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
        from thunder.executors.torchex import all_reduce_prim_impl, wait_prim_impl

        if _symbolic(a):
            return (tp_reduce_from_tp if op == "sum" else tp_all_reduce_max)(a, group)

        reduce_op = DistributedReduceOps.SUM if op == "sum" else DistributedReduceOps.MAX
        future = all_reduce_prim_impl(a, reduce_op, group, True, False)
        return wait_prim_impl(tp_name_work(future, "all_reduce", a, group))

    return lower


def _async_all_gather(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import all_gather_prim_impl, wait_prim_impl

    if _symbolic(a):
        return tp_gather(a, dim, blocks, group)

    a = tp_pack(a, 0, None, 1)
    gathered = wait_prim_impl(tp_name_work(all_gather_prim_impl(a, group, True, None), "all_gather", a, group))
    if dim == 0 and blocks is None:
        return gathered
    return tp_unpack(gathered, dim, blocks, group.size(), tuple(a.shape))


def _async_reduce_scatter(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import reduce_scatter_prim_impl, wait_prim_impl

    if _symbolic(a):
        return tp_reduce_scatter(a, dim, blocks, group)

    packed = tp_pack(a, dim, blocks, group.size())
    future = reduce_scatter_prim_impl(packed, DistributedReduceOps.SUM, group, True, None)
    out = wait_prim_impl(tp_name_work(future, "reduce_scatter", packed, group))
    if dim == 0:
        return out
    from thunder.torch import reshape

    return reshape(out, local_shape(a.shape, Shard(dim), group.size()))


comm_executor.register_implementation(tp_reduce_from_tp, execution_transform=_async_all_reduce("sum"))
comm_executor.register_implementation(tp_all_reduce_max, execution_transform=_async_all_reduce("max"))
comm_executor.register_implementation(tp_gather, execution_transform=_async_all_gather)
comm_executor.register_implementation(tp_gather_to_tp, execution_transform=_async_all_gather)
comm_executor.register_implementation(tp_reduce_scatter, execution_transform=_async_reduce_scatter)
comm_executor.register_implementation(tp_name_work, tp_name_work)


# --- purely local symbols: torch ops the fusion executor can claim, so they do not split fusion regions -------


def _rank_pieces(a: TensorProxy, dim: int, blocks: Blocks, size: int) -> list[TensorProxy]:
    """Every rank's Shard(dim, blocks) piece of the full `a`, in rank order (as layouts.shard_tensor, on proxies)."""
    from thunder.torch import cat, chunk, split

    chunks = [chunk(block, size, dim) for block in (split(a, list(blocks), dim) if blocks else [a])]
    if len(chunks) == 1:
        return list(chunks[0])
    return [cat([c[r] for c in chunks], dim) for r in range(size)]


def _scatter_ops(a: TensorProxy, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> TensorProxy:
    if is_simulating():  # one trace runs for every simulated rank: the slice is cut per rank, at run time
        return tp_rank_piece(a, dim, blocks, group)
    return _rank_pieces(a, dim, blocks, group.size())[dist.get_rank(group)]


def _pack_ops(a: TensorProxy, dim: int, blocks: Blocks, size: int) -> TensorProxy:
    from thunder.torch import cat, contiguous

    if size == 1 or (dim == 0 and blocks is None):
        return contiguous(a)
    return cat([contiguous(piece) for piece in _rank_pieces(a, dim, blocks, size)], 0)


def _unpack_ops(a: TensorProxy, dim: int, blocks: Blocks, size: int, piece: tuple[int, ...]) -> TensorProxy:
    from thunder.torch import cat, reshape, split, unbind

    pieces = unbind(reshape(a, size, *piece), 0)
    if blocks is None:
        return cat(list(pieces), dim)
    per_rank = [split(p, list(local_blocks(blocks, size)), dim) for p in pieces]
    return cat([cat([r[i] for r in per_rank], dim) for i in range(len(blocks))], dim)


def _copy_to_tp_ops(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.core.prims import shallow_copy

    return shallow_copy(a)  # an alias under a new name (returning `a` itself leaves the output undefined)


comm_executor.register_implementation(tp_copy_to_tp, execution_transform=_copy_to_tp_ops)
comm_executor.register_implementation(tp_scatter, execution_transform=_scatter_ops)
comm_executor.register_implementation(tp_pack, execution_transform=_pack_ops)
comm_executor.register_implementation(tp_unpack, execution_transform=_unpack_ops)


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
