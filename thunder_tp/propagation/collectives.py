"""Rules for the collectives of another transform over another group (context parallelism's, run before TP on a
(cp x tp) mesh): a collective over the other group moves pieces along one dim of it, or sums over it, and leaves how
the values are split over this group as they are, where that is along another dim."""

from __future__ import annotations

from collections.abc import Mapping

from thunder_tp import collectives as C
from thunder_tp.collectives.shift import tp_shift
from thunder_tp.layouts import Partial, Shard
from thunder_tp.propagation.engine import Op, Strategy, register_rule

#: collectives along a dim of their input (args: tensor, dim, ...)
_ALONG_A_DIM = (C.tp_gather, C.tp_gather_to_tp, C.tp_scatter, C.tp_reduce_scatter)
#: collectives that keep their input's shape: identities forward (their grads sum), or sums and maxima over the group
_ELEMENTWISE = (C.tp_copy_to_tp, C.tp_copy_all_to_tp, C.tp_reduce_from_tp, C.tp_max_all_reduce, tp_shift)
_ALONG_A_DIM_IDS = frozenset(sym.id for sym in _ALONG_A_DIM)


@register_rule(*_ALONG_A_DIM, *_ELEMENTWISE)
def other_groups_collective(op: Op) -> list[Strategy]:
    """Over this group: never (its own collectives come after propagation); over another: every input's split over
    this group carries to its output, but along the dim the collective moves (a max of summands is no sum)."""
    group = op.bsym.args[-1]
    if group is op.tp.group:
        return [op.replicated()]
    dim = op.bsym.args[1] % op.tensors[0].ndim if op.bsym.sym.id in _ALONG_A_DIM_IDS else None
    if any(_crosses(layout, dim, op) for layout in op.layouts):
        return [op.replicated()]
    # each output is its input's value (or a sum over the other group): a replicated input's grad is whole here
    return [Strategy(tuple(op.layouts), tuple(op.layouts), whole_grads=True), op.replicated()]


def _crosses(layout, dim: int | None, op: Op) -> bool:
    if isinstance(layout, Partial):
        return op.bsym.sym.id == C.tp_max_all_reduce.id
    return isinstance(layout, Shard) and layout.dim == dim


#: another group's identity copies (context parallelism's copy of a replicated parameter, whose grad it sums)
_COPIES = frozenset(sym.id for sym in (C.tp_copy_to_tp, C.tp_copy_all_to_tp))


def copies_named_as_sources(trace, names: Mapping[str, str], group) -> dict[str, str]:
    """`names` (proxy name -> parameter name) and, named as what they copy, the copies of those proxies over another
    group than `group`: a style or a label keyed by a parameter then reaches the ops that read its copy."""
    named = dict(names)
    for bsym in trace.bound_symbols:
        if bsym.sym.id not in _COPIES or bsym.args[-1] is group:
            continue
        copied = bsym.args[0] if isinstance(bsym.args[0], (list, tuple)) else (bsym.args[0],)
        copies = bsym.output if isinstance(bsym.output, (list, tuple)) else (bsym.output,)
        named |= {c.name: named[t.name] for t, c in zip(copied, copies, strict=True) if t.name in named}
    return named
