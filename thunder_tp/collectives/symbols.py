"""The TP collectives as Thunder symbols of `comm_executor`, with their result shapes and conjugate grads.

Each symbol's `fn` is its synchronous torch.distributed implementation (used when the executor is not listed); its
grad is the conjugate collective (Megatron's f/g operator pairs).
"""

from __future__ import annotations

from collections.abc import Callable

import thunder.distributed.prims as dist_prims
import thunder.torch as ltorch
import torch.distributed as dist
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.transforms import register_grad
from thunder.executors.torchex import ex as pytorch_ex
from thunder.extend import OperatorExecutor, register_executor

from thunder_tp.collectives import distributed as D
from thunder_tp.collectives.packing import pack, unpack
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.layouts import Pieces, padded_lengths

comm_executor = OperatorExecutor("thunder_tp_comm", version="0.1")
register_executor(comm_executor)


# --- shapes of the results --------------------------------------------------------------------


def _like(a: TensorProxy, *_args) -> TensorProxy:
    return TensorProxy(like=a)


def _gathered_meta(a: TensorProxy, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> TensorProxy:
    shape = list(a.shape)
    shape[dim] = max(start + length for chunks in pieces for start, length in chunks)
    return TensorProxy(like=a, shape=tuple(shape))


def _scattered_meta(a: TensorProxy, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> TensorProxy:
    shape = list(a.shape)
    shape[dim] = sum(length for _, length in pieces[dist.get_rank(group)])
    return TensorProxy(like=a, shape=tuple(shape))


def _all_to_all_meta(a: TensorProxy, src_dim: int, dst_dim: int, group: dist.ProcessGroup) -> TensorProxy:
    shape = list(a.shape)
    shape[dst_dim] //= group.size()
    shape[src_dim] *= group.size()
    return TensorProxy(like=a, shape=tuple(shape))


def _packed_meta(a: TensorProxy, dim: int, pieces: Pieces | None) -> TensorProxy:
    if pieces is None:
        return TensorProxy(like=a)
    shape = list(a.shape)
    shape[dim] = sum(padded_lengths(pieces))
    shape[0] *= len(pieces)
    return TensorProxy(like=a, shape=tuple(shape))


def _unpacked_meta(a: TensorProxy, dim: int, pieces: Pieces, piece: tuple[int, ...]) -> TensorProxy:
    shape = list(piece)
    shape[dim] = max(start + length for chunks in pieces for start, length in chunks)
    return TensorProxy(like=a, shape=tuple(shape))


def _all_like(tensors: list[TensorProxy], group: dist.ProcessGroup) -> tuple[TensorProxy, ...]:
    return tuple(TensorProxy(like=t) for t in tensors)


def _placed_meta(a: TensorProxy, dim: int, starts: tuple[int, ...], full: int, group) -> TensorProxy:
    shape = list(a.shape)
    shape[dim] = full
    return TensorProxy(like=a, shape=tuple(shape))


def _taken_meta(a: TensorProxy, dim: int, starts: tuple[int, ...], length: int, group) -> TensorProxy:
    shape = list(a.shape)
    shape[dim] = length
    return TensorProxy(like=a, shape=tuple(shape))


def _rank_value_meta(like: TensorProxy, values: tuple[int, ...], group: dist.ProcessGroup) -> TensorProxy:
    return TensorProxy(like=like, shape=(), dtype=like.dtype)


# --- the TP collectives ---------------------------------------------------------------------------

tp_copy_to_tp = comm_executor.register_operator("tp_copy_to_tp", meta=_like, fn=lambda a, group: a)
#: tp_copy_to_tp of several tensors of one dtype whose grads are all-reduced together: one collective, not one each
tp_copy_all_to_tp = comm_executor.register_operator(
    "tp_copy_all_to_tp", meta=_all_like, fn=lambda tensors, group: tuple(tensors)
)
tp_reduce_from_tp = comm_executor.register_operator("tp_reduce_from_tp", meta=_like, fn=D.all_reduce)
#: the elementwise max over the group (a float8 scale's amax of a sharded tensor): no grad flows through it
tp_max_all_reduce = comm_executor.register_operator("tp_max_all_reduce", meta=_like, fn=D.all_reduce_max)
tp_gather = comm_executor.register_operator("tp_gather", meta=_gathered_meta, fn=D.gather_shards)
tp_gather_to_tp = comm_executor.register_operator("tp_gather_to_tp", meta=_gathered_meta, fn=D.gather_shards)
tp_scatter = comm_executor.register_operator("tp_scatter", meta=_scattered_meta, fn=D.local)
tp_reduce_scatter = comm_executor.register_operator("tp_reduce_scatter", meta=_scattered_meta, fn=D.reduce_scatter)
tp_all_to_all = comm_executor.register_operator("tp_all_to_all", meta=_all_to_all_meta, fn=D.all_to_all)
#: a Replicate value as a Partial sum (kept on the first rank, zeros elsewhere): local; its grad is the identity
tp_to_partial = comm_executor.register_operator("tp_to_partial", meta=_like, fn=D.first_rank_only)

#: symbol name -> the kind of collective it issues
COLLECTIVE_KINDS: dict[str, str] = {
    "tp_reduce_from_tp": "all_reduce",
    "tp_max_all_reduce": "all_reduce",
    "tp_gather": "all_gather",
    "tp_gather_to_tp": "all_gather",
    "tp_reduce_scatter": "reduce_scatter",
    "tp_all_to_all": "all_to_all",
    "tp_all_to_all_start": "all_to_all",
    # a decomposed all_gather / reduce_scatter's pieces (collectives/shift.py): each rank's bytes to one peer
    "tp_shift": "send_recv",
    "tp_shift_start": "send_recv",
}

#: opaque ops that issue collectives inside them (expert parallelism's exchanges, whose sizes depend on the data):
#: symbol name -> the (kind, bytes) of each collective one call issues, from its bound symbol
ISSUED_INSIDE: dict[str, Callable[[BoundSymbol], list[tuple[str, int]]]] = {}


def register_issued_collectives(sym, issued: Callable[[BoundSymbol], list[tuple[str, int]]]) -> None:
    """Declare the collectives an opaque op issues inside it (listed in the trace tables); the op then counts as
    communication: never fused, never recomputed."""
    ISSUED_INSIDE[sym.name] = issued


# --- helpers of the lowering: packing for dim-0 collectives, named work handles ------------------------------

tp_pack = comm_executor.register_operator("tp_pack", meta=_packed_meta, fn=pack)
tp_unpack = comm_executor.register_operator("tp_unpack", meta=_unpacked_meta, fn=unpack)
tp_all_to_all_start = comm_executor.register_operator(
    "tp_all_to_all_start", meta=lambda packed, group: FutureTensorProxy(like=packed), fn=D.all_to_all_start
)
tp_name_work = comm_executor.register_operator(
    "tp_name_work", meta=lambda future, kind, a, group, padding=0: FutureTensorProxy(like=future), fn=D.name_work
)

# --- the rank inside traced programs ------------------------------------------------------------------------

tp_rank_value = comm_executor.register_operator("tp_rank_value", meta=_rank_value_meta, fn=D.rank_value_tensor)
# simulated tp_scatter
tp_rank_piece = comm_executor.register_operator("tp_rank_piece", meta=_scattered_meta, fn=D.local)

# simulated uneven pieces: one trace runs for every simulated rank, so every rank holds its piece padded to the longest
# (rank 0's: `layouts.balanced`), each block's part followed by zeros; a parameter, held at its true size, is padded
# where the program reads it, its grad trimmed back; what would mix the padding into real values masks it first
tp_padded_piece = comm_executor.register_operator("tp_padded_piece", meta=_like, fn=D.padded_pieces)
tp_trimmed_piece = comm_executor.register_operator("tp_trimmed_piece", meta=_like, fn=D.trimmed_pieces)
tp_padding_filled = comm_executor.register_operator("tp_padding_filled", meta=_like, fn=D.padding_filled)
#: a piece in zeros `full` long, at this rank's start (`starts[rank]`), and back: where chunks held by several ranks
#: (replicated K/V heads) sum their grads
tp_placed = comm_executor.register_operator("tp_placed", meta=_placed_meta, fn=D.placed)
tp_taken = comm_executor.register_operator("tp_taken", meta=_taken_meta, fn=D.taken)


def rank_value(tp, values: tuple[int, ...], like: TensorProxy) -> int | TensorProxy:
    """``values[rank]`` for a traced program: a constant on a real rank; in a simulation a per-rank tensor
    (``tp_rank_value``, a 0-d tensor of ``like``'s dtype), since one trace runs for every simulated rank."""
    rank = ranks_of(tp.group).traced_rank
    return tp_rank_value(like, tuple(values), tp.group) if rank is None else values[rank]


# --- conjugate grads ----------------------------------------------------------------------------


def _copy_to_tp_grad(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    out = tp_copy_to_tp(a, group)
    put_grad(a, tp_reduce_from_tp(get_grad(out), group))
    return out


def _copy_all_to_tp_grad(tensors: list[TensorProxy], group: dist.ProcessGroup) -> tuple[TensorProxy, ...]:
    outs = tp_copy_all_to_tp(tensors, group)
    flat = ltorch.cat([ltorch.reshape(get_grad(out), (-1,)) for out in outs], 0)
    summed, at = tp_reduce_from_tp(flat, group), 0
    for t in tensors:
        put_grad(t, ltorch.reshape(summed[at : at + t.numel], t.shape))
        at += t.numel
    return outs


def _max_all_reduce_grad(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    return tp_max_all_reduce(a, group)  # an amax: what it scales is differentiated, not the scale


def _reduce_from_tp_grad(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    out = tp_reduce_from_tp(a, group)
    put_grad(a, get_grad(out))
    return out


def _to_partial_grad(a: TensorProxy, group: dist.ProcessGroup) -> TensorProxy:
    out = tp_to_partial(a, group)
    put_grad(a, get_grad(out))  # the sum over ranks of `out` is `a`, and every rank holds the grad of that sum
    return out


def _all_to_all_grad(a: TensorProxy, src_dim: int, dst_dim: int, group: dist.ProcessGroup) -> TensorProxy:
    out = tp_all_to_all(a, src_dim, dst_dim, group)
    put_grad(a, tp_all_to_all(get_grad(out), dst_dim, src_dim, group))
    return out


def _conjugate(forward, backward):
    def grad(a: TensorProxy, dim: int, pieces: Pieces, group: dist.ProcessGroup) -> TensorProxy:
        out = forward(a, dim, pieces, group)
        put_grad(a, backward(get_grad(out), dim, pieces, group))
        return out

    return grad


def _placed_grad(a: TensorProxy, dim: int, starts: tuple[int, ...], full: int, group) -> TensorProxy:
    out = tp_placed(a, dim, starts, full, group)
    put_grad(a, tp_taken(get_grad(out), dim, starts, a.shape[dim], group))
    return out


def _taken_grad(a: TensorProxy, dim: int, starts: tuple[int, ...], length: int, group) -> TensorProxy:
    out = tp_taken(a, dim, starts, length, group)
    put_grad(a, tp_placed(get_grad(out), dim, starts, a.shape[dim], group))
    return out


def _padding_filled_grad(a: TensorProxy, dim: int, pieces: Pieces, value: float, group) -> TensorProxy:
    out = tp_padding_filled(a, dim, pieces, value, group)
    put_grad(a, tp_padding_filled(get_grad(out), dim, pieces, 0.0, group))
    return out


register_grad(tp_copy_to_tp, _copy_to_tp_grad)
register_grad(tp_copy_all_to_tp, _copy_all_to_tp_grad)
register_grad(tp_reduce_from_tp, _reduce_from_tp_grad)
register_grad(tp_max_all_reduce, _max_all_reduce_grad)
register_grad(tp_all_to_all, _all_to_all_grad)
register_grad(tp_to_partial, _to_partial_grad)
register_grad(tp_gather, _conjugate(tp_gather, tp_scatter))
register_grad(tp_gather_to_tp, _conjugate(tp_gather_to_tp, tp_reduce_scatter))
register_grad(tp_scatter, _conjugate(tp_scatter, tp_gather))
register_grad(tp_reduce_scatter, _conjugate(tp_reduce_scatter, tp_gather))
register_grad(tp_padded_piece, _conjugate(tp_padded_piece, tp_trimmed_piece))
register_grad(tp_padding_filled, _padding_filled_grad)
register_grad(tp_placed, _placed_grad)
register_grad(tp_taken, _taken_grad)


# --- what counts as communication (never fused, never recomputed) -------------------------------------

# Thunder's distributed prims, and the ids of torchex's implementations of them (torch_all_reduce_prim_impl, ...)
_DIST_PRIM_IDS: frozenset = frozenset(dist_prims.PrimIDs)
_TORCHEX_COMM_IDS: frozenset = frozenset(
    info.symbol.id for op, info in pytorch_ex.implmap.items() if op in _DIST_PRIM_IDS and info.symbol is not None
)
COMM_IDS: frozenset = _DIST_PRIM_IDS | _TORCHEX_COMM_IDS
_WAIT_IDS: frozenset = frozenset({dist_prims.PrimIDs.WAIT, pytorch_ex.implmap[dist_prims.PrimIDs.WAIT].symbol.id})


def is_communication(bsym: BoundSymbol) -> bool:
    """True if ``bsym`` is a collective, a wait or a DDP/FSDP prim, or contains one among its subsymbols."""
    sym = bsym.sym
    if sym.executor is comm_executor or sym.name.startswith("tp_") or sym.id in COMM_IDS or sym.name in ISSUED_INSIDE:
        return True
    return any(is_communication(sub) for sub in bsym.subsymbols)


def is_wait(bsym: BoundSymbol) -> bool:
    """True if ``bsym`` waits for an async collective."""
    return bsym.sym.id in _WAIT_IDS
