"""How `comm_executor` executes the TP symbols: collectives as async torch.distributed calls, the rest locally.

One lowering for every torch.distributed backend: Thunder's async torchex prims plus a wait, which Thunder's wait
sorting moves as late as data allows. Each issued collective's work handle is named (tp_name_work) so that a
failed wait (a dead, hung or raising peer: torch.distributed's error or its process-group timeout) names the
collective and the group. Purely local symbols lower to torch ops the fusion executor can claim. After fusion, an
all_reduce whose input nothing else reads runs in place (``reduce_in_place``).
"""

from __future__ import annotations

from functools import partial

import thunder.distributed.prims as dist_prims
import thunder.torch as ltorch
import torch.distributed as dist
from thunder.core import prims, utils
from thunder.core.compile_data import using_symbolic_values
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.distributed.prims import DistributedReduceOps
from thunder.executors.torchex import ex as pytorch_ex

from thunder_tp.collectives.packing import is_plain, pack, unpack
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.collectives.symbols import (
    comm_executor,
    tp_all_to_all,
    tp_all_to_all_start,
    tp_copy_all_to_tp,
    tp_copy_to_tp,
    tp_gather,
    tp_gather_to_tp,
    tp_max_all_reduce,
    tp_name_work,
    tp_pack,
    tp_padded_piece,
    tp_padding_filled,
    tp_placed,
    tp_rank_piece,
    tp_rank_value,
    tp_reduce_from_tp,
    tp_reduce_scatter,
    tp_scatter,
    tp_taken,
    tp_to_partial,
    tp_trimmed_piece,
    tp_unpack,
)
from thunder_tp.layouts import Pieces, Shard, is_even, padded_lengths, rank_pieces
from thunder_tp.pieces import padded_piece, take_piece, trimmed_piece


def _synchronous() -> bool:
    """True under cache="symbolic values", where collectives stay synchronous (the symbol's own fn): Thunder 0.2.6's
    wait sorting reads each async collective's input numel outside a trace, and there every proxy's numel is
    deferred (a function of its shape), symbolic dims or not (a 0-dim sum of a Partial product has none)."""
    return using_symbolic_values()


# --- collectives: Thunder's torchex prims + wait (sorted late by thunder's sort_waits) ---------------------


def _async_all_reduce(a: TensorProxy, group: dist.ProcessGroup, op: DistributedReduceOps = DistributedReduceOps.SUM
                      ) -> TensorProxy:
    from thunder.executors.torchex import all_reduce_prim_impl, wait_prim_impl

    if _synchronous():
        return (tp_reduce_from_tp if op is DistributedReduceOps.SUM else tp_max_all_reduce)(a, group)

    future = all_reduce_prim_impl(a, op, group, True, False)
    return wait_prim_impl(tp_name_work(future, "all_reduce", a, group))


def _async_all_gather(a: TensorProxy, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import all_gather_prim_impl, wait_prim_impl

    if _synchronous():
        return tp_gather(a, dim, pieces, group)

    if not is_even(pieces):  # every rank's piece as long as the longest (on every rank, even where it is that long)
        a = padded_piece(a, dim, pieces[dist.get_rank(group)], padded_lengths(pieces), ltorch)
    padded = tp_pack(a, 0, None)
    future = all_gather_prim_impl(padded, group, True, None)
    gathered = wait_prim_impl(tp_name_work(future, "all_gather", padded, group, padding_bytes(padded, dim, pieces)))
    if dim == 0 and is_plain(pieces):
        return gathered
    return tp_unpack(gathered, dim, pieces, tuple(padded.shape))


def _async_reduce_scatter(a: TensorProxy, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import reduce_scatter_prim_impl, wait_prim_impl

    if _synchronous():
        return tp_reduce_scatter(a, dim, pieces, group)

    packed = tp_pack(a, dim, pieces)
    future = reduce_scatter_prim_impl(packed, DistributedReduceOps.SUM, group, True, None)
    out = wait_prim_impl(tp_name_work(future, "reduce_scatter", packed, group, padding_bytes(a, dim, pieces)))
    if dim == 0 and is_plain(pieces):
        return out
    shape = list(a.shape)
    shape[dim] = sum(padded_lengths(pieces))
    padded = ltorch.reshape(out, shape)
    if is_even(pieces):
        return padded
    return trimmed_piece(padded, dim, pieces[dist.get_rank(group)], padded_lengths(pieces), ltorch)


def padding_bytes(t: TensorProxy, dim: int, pieces: Pieces) -> int:
    """Bytes of the padding in a collective of every rank's piece of `pieces` (each block padded to rank 0's), `t` a
    piece or the whole (for the size of one entry of `dim`)."""
    padded = sum(padded_lengths(pieces))
    missing = sum(padded - sum(length for _, length in chunks) for chunks in pieces)
    return t.numel // t.shape[dim] * missing * t.dtype.bytes


def _async_all_to_all(a: TensorProxy, src_dim: int, dst_dim: int, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import wait_prim_impl

    if _synchronous():
        return tp_all_to_all(a, src_dim, dst_dim, group)

    size = group.size()
    received = wait_prim_impl(tp_all_to_all_start(tp_pack(a, dst_dim, rank_pieces(Shard(dst_dim), a.shape[dst_dim],
                                                                                   size)), group))
    piece = list(a.shape)
    piece[dst_dim] //= size
    return tp_unpack(received, src_dim, rank_pieces(Shard(src_dim), a.shape[src_dim] * size, size), tuple(piece))


comm_executor.register_implementation(tp_reduce_from_tp, execution_transform=_async_all_reduce)
comm_executor.register_implementation(
    tp_max_all_reduce, execution_transform=partial(_async_all_reduce, op=DistributedReduceOps.MAX))
comm_executor.register_implementation(tp_gather, execution_transform=_async_all_gather)
comm_executor.register_implementation(tp_gather_to_tp, execution_transform=_async_all_gather)
comm_executor.register_implementation(tp_reduce_scatter, execution_transform=_async_reduce_scatter)
comm_executor.register_implementation(tp_all_to_all, execution_transform=_async_all_to_all)
comm_executor.register_implementation(tp_all_to_all_start, tp_all_to_all_start)
comm_executor.register_implementation(tp_name_work, tp_name_work)


# --- purely local symbols: torch ops the fusion executor can claim, so they do not split fusion regions -------


def _scatter_ops(a: TensorProxy, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> TensorProxy:
    rank = ranks_of(group).traced_rank
    if rank is None:  # one trace runs for every simulated rank: the slice is cut per rank, at run time
        return tp_rank_piece(a, dim, pieces, group)
    # dense, not a strided view: a fusion computes just this piece, and a matmul on it (the grad of gathered
    # logits is the lm_head's weight grad) runs at full speed instead of on a view that keeps the whole alive
    return ltorch.contiguous(take_piece(a, dim, pieces[rank], ltorch))


def _placed_ops(a: TensorProxy, dim: int, starts: tuple[int, ...], full: int, group) -> TensorProxy:
    rank = ranks_of(group).traced_rank
    if rank is None:  # the start depends on the simulated rank
        return tp_placed(a, dim, starts, full, group)
    start = starts[rank]
    pad = [0] * (2 * (a.ndim - dim))
    pad[-2:] = [start, full - start - a.shape[dim]]
    return ltorch.pad(a, tuple(pad), value=0)


def _taken_ops(a: TensorProxy, dim: int, starts: tuple[int, ...], length: int, group) -> TensorProxy:
    rank = ranks_of(group).traced_rank
    if rank is None:
        return tp_taken(a, dim, starts, length, group)
    start = starts[rank]
    return a[(slice(None),) * dim + (slice(start, start + length),)]


def _copy_to_tp_ops(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.core.prims import shallow_copy

    return shallow_copy(a)  # an alias under a new name (returning `a` itself leaves the output undefined)


def _to_partial_ops(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    rank = ranks_of(group).traced_rank
    if rank is None:  # one trace runs for every simulated rank
        return ltorch.where(ltorch.eq(tp_rank_value(a, tuple(range(group.size())), group), 0), a, 0)
    return _copy_to_tp_ops(a, group) if rank == 0 else ltorch.zeros_like(a)


def _copy_all_to_tp_ops(tensors: list[TensorProxy], group: dist.ProcessGroup) -> tuple[TensorProxy, ...]:
    return tuple(_copy_to_tp_ops(t, group) for t in tensors)


comm_executor.register_implementation(tp_copy_to_tp, execution_transform=_copy_to_tp_ops)
comm_executor.register_implementation(tp_copy_all_to_tp, execution_transform=_copy_all_to_tp_ops)
comm_executor.register_implementation(tp_scatter, execution_transform=_scatter_ops)
comm_executor.register_implementation(tp_to_partial, execution_transform=_to_partial_ops)
comm_executor.register_implementation(tp_placed, execution_transform=_placed_ops)
comm_executor.register_implementation(tp_taken, execution_transform=_taken_ops)
comm_executor.register_implementation(tp_pack, execution_transform=partial(pack, ops=ltorch))
comm_executor.register_implementation(tp_unpack, execution_transform=partial(unpack, ops=ltorch))
comm_executor.register_implementation(tp_rank_value, tp_rank_value)
comm_executor.register_implementation(tp_rank_piece, tp_rank_piece)
comm_executor.register_implementation(tp_padded_piece, tp_padded_piece)
comm_executor.register_implementation(tp_trimmed_piece, tp_trimmed_piece)
comm_executor.register_implementation(tp_padding_filled, tp_padding_filled)


# --- after fusion: all_reduces that need no copy of their input ---------------------------------------------

_ALL_REDUCE_IMPL_ID = pytorch_ex.implmap[dist_prims.PrimIDs.ALL_REDUCE].symbol.id


def reduce_in_place(trace: TraceCtx) -> TraceCtx:
    """``trace`` (fused) with each all_reduce of a value that a fusion region computed and nothing else reads
    issued in place: torchex's all_reduce otherwise copies its input first, one activation-sized copy per call."""
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    reduced = from_trace(trace)
    reduced.bound_symbols = [
        bsym.from_bsym(args=(*bsym.args[:4], True)) if _reducible_in_place(bsym, producers, consumers) else bsym
        for bsym in trace.bound_symbols
    ]
    reduced.set_provenance(TraceProvenance("thunder_tp: all_reduces in place"))
    return reduced


def _reducible_in_place(bsym: BoundSymbol, producers, consumers) -> bool:
    if bsym.sym.id != _ALL_REDUCE_IMPL_ID or len(bsym.args) < 5 or bsym.args[4]:
        return False
    a = bsym.args[0]
    readers = [c for c in consumers.get(a, ()) if c is not bsym]
    # tp_name_work reads only the shape and dtype, for its error message; a del reads nothing
    if any(c.sym.id not in (tp_name_work.id, prims.python_del.id) for c in readers):
        return False
    producer = producers.get(a, None)
    return producer is not None and producer.sym.is_fusion and _computed_fresh(producer, a)


def _computed_fresh(region: BoundSymbol, a: TensorProxy) -> bool:
    """True if the fusion ``region`` computes ``a`` into memory of its own that no other output of it shares."""
    root = _root(region.subsymbols, a.name)
    others = [out.name for out in region.flat_proxy_outs if out.name != a.name]
    return root[0] and all(_root(region.subsymbols, name) != root for name in others)


def _root(bsyms: list[BoundSymbol], name: str) -> tuple[bool, str]:
    """Whose memory ``name`` is, following views back through ``bsyms``: (True, a value they compute) or
    (False, one of their inputs)."""
    i = next((i for i in reversed(range(len(bsyms))) if any(o.name == name for o in bsyms[i].flat_proxy_outs)), None)
    if i is None:
        return False, name
    producer = bsyms[i]
    if producer.sym.id == prims.PrimIDs.COPY_:  # copy_(source, destination) returns the destination
        return _root(bsyms[:i], producer.args[1].name)
    if prims.OpTags.SHAPE_OP in (producer.sym.tags or ()):  # views and shallow copies
        source = next((t for t in producer.flat_proxy_args if isinstance(t, TensorProxy)), None)
        return (True, name) if source is None else _root(bsyms[:i], source.name)
    if producer.subsymbols:
        computed, root = _root(producer.subsymbols, name)
        return (True, root) if computed else _root(bsyms[:i], root)
    return True, name
