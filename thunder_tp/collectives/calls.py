"""The collectives a final trace issues, in program order: kind, group, bytes and what issued them.

Collectives are found among the top-level bound symbols of a trace (the fusion executor never puts one inside a
fusion region):

- torchex's implementations of Thunder's distributed prims (``torch_all_reduce_prim_impl``, ...), which is what
  thunder_tp's collectives (and Thunder's DDP/FSDP) are lowered to in the final traces;
- Thunder's ``thunder.distributed.prims`` themselves (``all_reduce``, ``all_gather``, ...);
- thunder_tp's own collective symbols (``tp_reduce_from_tp``, ``tp_gather``, ...; ``COLLECTIVE_KINDS``), where they
  were not lowered (comm executor not listed);
- opaque ops that issue collectives inside them (``ISSUED_INSIDE``: expert parallelism's exchange of counts,
  dispatch and combine, each an all_to_all; its bytes are this rank's pairs' rows, which its dispatch sends and its
  combine receives).

Sizes are per rank: the trace is the rank's local program, so its proxies have local shapes. The trace tables
(``tools/debug.py``) and the ranks' agreement on their collectives (``runtimes/agreement.py``) read them from here.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from thunder_tp.collectives.labels import label_of
from thunder_tp.collectives.reshard import nbytes
from thunder_tp.collectives.symbols import COLLECTIVE_KINDS, ISSUED_INSIDE

__all__ = ["KINDS", "UNLABELLED", "collective_calls", "collective_kind", "group_size"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

#: top-level symbol name -> collective kind: torchex implementations, Thunder's distributed prims, thunder_tp
_SYMBOL_KINDS: dict[str, str] = {
    **{f"torch_{kind}_prim_impl": kind for kind in KINDS},
    **{kind: kind for kind in KINDS},
    **COLLECTIVE_KINDS,
}

#: the label of a collective thunder_tp did not insert (Thunder's DDP / FSDP)
UNLABELLED = "(data parallelism)"


def collective_kind(bsym: BoundSymbol) -> str | None:
    """The kind of collective a top-level bound symbol issues (all_reduce, ...), or None."""
    sym = bsym.sym
    kind = _SYMBOL_KINDS.get(sym.name)
    if kind is None:
        return None
    if sym.name in KINDS:
        # a bare name such as "all_reduce" must be Thunder's distributed prim, not some other symbol
        from thunder.distributed.prims import PrimIDs

        if not isinstance(sym.id, PrimIDs):
            return None
    return kind


def _group(bsym: BoundSymbol) -> Any:
    for a in (*bsym.args, *bsym.kwargs.values()):
        if isinstance(a, dist.ProcessGroup):
            return a
    return None


def group_size(group: Any) -> int:
    """The size of a collective's group (None: the default group)."""
    if group is not None:
        return group.size()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def collective_calls(trace: TraceCtx) -> list[dict]:
    """Every collective of ``trace`` in program order: kind, group (None: the default group) and its size, bytes (the
    padding of unequal pieces included, and apart: ``padding``), the bound symbol, and what issued it (``issued_by``:
    "module: what it does")."""
    padding = {b.args[0].name: b.args[4] for b in trace.bound_symbols if b.sym.name == "tp_name_work" and
               len(b.args) > 4}
    calls = []
    for bsym in trace.bound_symbols:
        issued_by = label_of(bsym) or UNLABELLED
        if bsym.sym.name in ISSUED_INSIDE:  # an opaque op with collectives inside (expert parallelism's all_to_alls)
            group = _group(bsym)
            calls += [{"kind": kind, "group_size": group_size(group), "bytes": moved, "padding": 0, "group": group,
                       "bsym": bsym, "issued_by": issued_by} for kind, moved in ISSUED_INSIDE[bsym.sym.name](bsym)]
            continue
        kind = collective_kind(bsym)
        if kind is None:
            continue
        tensor = next((a for a in bsym.flat_args if isinstance(a, TensorProxy)), None)
        if tensor is None:
            continue
        group = _group(bsym)
        size = group_size(group)
        moved = nbytes(tensor) * (size if kind == "all_gather" else 1)  # all_gather: the gathered output
        padded = padding.get(getattr(bsym.output, "name", None), 0)
        calls.append({"kind": kind, "group_size": size, "bytes": moved, "padding": padded, "group": group,
                      "bsym": bsym, "issued_by": issued_by})
    return calls
