"""The order of the joint forward/backward trace before fusion, and what its backward computes again.

Thunder fuses the joint trace (forward, then backward) before splitting it, and its fusion backends fuse
consecutive compute only, so the order chosen here is also where fusion regions break. ``schedule`` runs two
small passes, in this order:

- ``recompute_input_derived``: a forward value computed by pointwise, broadcast and view ops from the program's
  inputs alone (a norm weight broadcast to the activation's shape, RoPE tables, a causal mask) is computed again
  by the backward instead of being saved: saved, each is an activation-sized tensor that a region had to write
  out; recomputed, it is index arithmetic inside the region that reads it.
- ``schedule_communication``: each async collective is issued as early as its inputs allow and waited for as
  late as possible; compute that is ready at any time (input-derived values in the forward, recomputations in
  the backward) moves down to just before its first use, where it fuses with that use.
"""

from __future__ import annotations

import math

from thunder.core import prims, utils
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.core.transforms import TOPOSORT_ORDER, bsym_list_to_dag, toposort_bsym_dag

from thunder_tp.collectives import is_communication, is_wait

__all__ = ["recompute_input_derived", "schedule", "schedule_communication"]

# a recomputation must cost no more than reading the saved value would: no reductions, matmuls, random draws or
# kernels their executor keeps from being recomputed (attention)
_NOT_CHEAP = frozenset(
    {
        prims.OpTags.REDUCTION_OP,
        prims.OpTags.MATMUL_OP,
        prims.OpTags.RANDOM_OP,
        prims.OpTags.DONT_RECOMPUTE_IN_BACKWARD,
        prims.OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,
    }
)


def schedule(joint: TraceCtx) -> TraceCtx:
    """``joint`` with input-derived values recomputed by the backward, then scheduled for communication."""
    return schedule_communication(recompute_input_derived(joint))


# --- input-derived values ----------------------------------------------------------------------------------


def recompute_input_derived(joint: TraceCtx) -> TraceCtx:
    """The backward computes again the forward's cheap values that depend on the program's inputs only, instead of
    reading them saved."""
    bsyms = joint.bound_symbols
    derived = _input_derived(bsyms)
    needed = _read_by_backward(bsyms, derived)
    if not needed:
        return joint
    recomputed = from_trace(joint)
    swap: dict = {}
    copies = []
    with tracectx(recomputed):
        for bsym in needed:
            swap.update((variableify(out), TensorProxy(like=out)) for out in bsym.flat_proxy_outs)
            copy = bsym.from_bsym_swap_proxies(swap)
            copy.tags.add(BoundSymbolTag.BACKWARD)
            copies.append(copy)
    start = next(i for i, bsym in enumerate(bsyms) if _ends_forward(bsym))
    rest = [bsym.from_bsym_swap_proxies(swap) if _reads_recomputed(bsym) else bsym for bsym in bsyms[start:]]
    recomputed.bound_symbols = [*bsyms[:start], *copies, *rest]
    recomputed.set_provenance(TraceProvenance("thunder_tp: recompute input-derived values in the backward"))
    return recomputed


def _in_backward(bsym: BoundSymbol) -> bool:
    return BoundSymbolTag.BACKWARD in bsym.tags


def _is_grad_read(bsym: BoundSymbol) -> bool:
    return bsym.sym.id == prims.get_grad.id


def _reads_recomputed(bsym: BoundSymbol) -> bool:
    """A backward bound symbol that reads recomputations instead of saved forward values: any but a grad read,
    which names the forward's output itself."""
    return _in_backward(bsym) and not _is_grad_read(bsym)


def _ends_forward(bsym: BoundSymbol) -> bool:
    """The backward's first bound symbol, a grad read, or the return."""
    return _in_backward(bsym) or _is_grad_read(bsym) or _is_return(bsym)


_UNPACK_IDS = frozenset(i for i in prims.PrimIDs if i.name.startswith("UNPACK_"))


def _cheap(bsym: BoundSymbol) -> bool:
    """Pointwise, broadcast and view prims all the way down."""
    if bsym.sym.id in _UNPACK_IDS or _NOT_CHEAP & set(bsym.sym.tags or ()):
        return False
    if not bsym.subsymbols:
        return bsym.sym.is_prim
    return all(map(_cheap, bsym.subsymbols))


def _input_derived(bsyms: list[BoundSymbol]) -> dict[str, BoundSymbol]:
    """Forward tensors (by name) computed cheaply from the program's inputs alone, each with its producer."""
    produced = {out.name for bsym in bsyms if bsym.sym.id not in _UNPACK_IDS for out in bsym.flat_proxy_outs}
    derived: dict[str, BoundSymbol] = {}
    for bsym in bsyms:
        if _ends_forward(bsym):
            break
        outs = bsym.flat_proxy_outs
        from_inputs = all(a.name in derived or a.name not in produced for a in bsym.flat_proxy_args)
        tensors = bool(outs) and all(isinstance(out, TensorProxy) for out in outs)
        if from_inputs and tensors and not is_communication(bsym) and _cheap(bsym):
            derived.update((out.name, bsym) for out in outs)
    return derived


def _read_by_backward(bsyms: list[BoundSymbol], derived: dict[str, BoundSymbol]) -> list[BoundSymbol]:
    """The producers of the input-derived values the backward reads, and of what those need, in forward order."""
    pending = [a.name for bsym in bsyms if _reads_recomputed(bsym) for a in bsym.flat_proxy_args if a.name in derived]
    needed: dict[int, BoundSymbol] = {}
    while pending:
        producer = derived[pending.pop()]
        if id(producer) not in needed:
            needed[id(producer)] = producer
            pending.extend(a.name for a in producer.flat_proxy_args if a.name in derived)
    position = {id(bsym): i for i, bsym in enumerate(bsyms)}
    return sorted(needed.values(), key=lambda bsym: position[id(bsym)])


# --- communication --------------------------------------------------------------------------------------------


def schedule_communication(trace: TraceCtx) -> TraceCtx:
    """Reorders ``trace`` so each async collective is issued as early as its inputs allow and each wait runs last.

    Compute that feeds a collective goes first, the collective reachable in fewest steps first (so DDP's
    all_reduce of the last layer's grads is issued before the earlier layers' grads are computed); other
    compute comes next and waits only when nothing else is ready. Forward stays before backward. Compute that
    is ready at any time (input-derived forward values, backward compute that reads no grad) runs just before
    its first use.
    """
    bsyms = trace.bound_symbols
    ordered = bsyms
    if any(map(is_wait, bsyms)):
        keys = _schedule_keys(bsyms)
        key_of = {id(bsym): key for bsym, key in zip(bsyms, keys, strict=True)}

        def select(eligible: list) -> int:
            return min(range(len(eligible)), key=lambda k: key_of[id(eligible[k].bsym)])

        ordered = toposort_bsym_dag(bsym_list_to_dag(bsyms)[0], TOPOSORT_ORDER.TOP_DOWN, selector=select)
    movable = _ready_any_time(bsyms)
    if not movable:
        return trace
    scheduled = from_trace(trace)
    scheduled.bound_symbols = _sink_to_first_use(ordered, movable)
    scheduled.set_provenance(TraceProvenance("thunder_tp: schedule communication"))
    return scheduled


def _schedule_keys(bsyms: list[BoundSymbol]) -> list[tuple]:
    """Priority of each bound symbol (smallest first) among those whose inputs are ready."""
    producers, consumers = utils.producers(bsyms, _map_to_numbers=True), utils.consumers(bsyms, _map_to_numbers=True)
    issues = [is_communication(bsym) and not is_wait(bsym) for bsym in bsyms]
    depth = [0] * len(bsyms)  # longest chain of producers
    for i, bsym in enumerate(bsyms):
        parents = [producers[p] for p in bsym.flat_proxy_args if producers.get(p, i) < i]
        depth[i] = 1 + max((depth[j] for j in parents), default=0)
    due = [math.inf] * len(bsyms)  # depth of the nearest collective this feeds
    for i in reversed(range(len(bsyms))):
        children = [j for out in bsyms[i].flat_proxy_outs for j in consumers.get(out, ()) if j > i]
        due[i] = min([depth[i] if issues[i] else math.inf, *(due[j] for j in children)])
    keys = []
    for i, bsym in enumerate(bsyms):
        if _is_return(bsym):
            keys.append((1,))
            continue
        kind = 0 if issues[i] else 2 if is_wait(bsym) else 1
        keys.append((0, _in_backward(bsym), kind, due[i], i))
    return keys


_RETURN_IDS = (prims.PrimIDs.RETURN, prims.python_return.id)


def _is_return(bsym: BoundSymbol) -> bool:
    return bsym.sym.id in _RETURN_IDS


def _sink_to_first_use(bsyms: list[BoundSymbol], movable: set[int]) -> list[BoundSymbol]:
    """``bsyms`` with each movable one (by id) moved down to just before the first bound symbol that reads it."""
    held: dict[str, BoundSymbol] = {}
    order: list[BoundSymbol] = []

    def release(bsym: BoundSymbol) -> None:
        for name in [a.name for a in bsym.flat_proxy_args]:
            producer = held.get(name)
            if producer is not None:
                for out in producer.flat_proxy_outs:
                    held.pop(out.name, None)
                release(producer)
                order.append(producer)

    for bsym in bsyms:
        if id(bsym) in movable:
            held.update((out.name, bsym) for out in bsym.flat_proxy_outs)
            continue
        if _is_return(bsym):  # unused ones stay, in their order
            order.extend({id(b): b for b in held.values()}.values())
            held.clear()
        release(bsym)
        order.append(bsym)
    return order


def _ready_any_time(bsyms: list[BoundSymbol]) -> set[int]:
    """ids of the compute that reads neither a collective's result nor a grad: the forward's input-derived values
    and the backward's recomputations (they read saved values only, so they are ready at the backward's start)."""
    movable = {id(bsym) for bsym in _input_derived(bsyms).values()}
    from_grads: set[str] = set()
    for bsym in bsyms:
        if bsym.sym.id == prims.get_grad.id or any(a.name in from_grads for a in bsym.flat_proxy_args):
            from_grads.update(out.name for out in bsym.flat_proxy_outs)
        elif _in_backward(bsym) and not is_communication(bsym) and bsym.flat_proxy_outs:
            movable.add(id(bsym))
    return movable
