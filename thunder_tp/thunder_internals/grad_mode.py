"""``torch.no_grad()`` inside a jitted program as Thunder 0.2.6 records it, and what thunder_tp adds so that a TP
program's grads are eager's.

Thunder tags the new outputs of every symbol called while the compile data's ``is_grad_enabled`` is off
``ProxyTag.DETACHED_AUTOGRAD_GRAPH``, and its autograd takes a symbol with such an output for a constant. Three gaps:

- a pass that calls symbols again in place of a recorded one (the TP rewrite, the style constraints, the overlap
  decomposition) records them in the grad mode of the pass: ``in_grad_mode_of`` calls them in the recorded one's;
- ``torch.inference_mode()`` inside a jitted function is ignored (Thunder 0.2.6 has no lookaside for it): the
  lookasides below record it as ``no_grad`` (``mode=False``: as it comes) in thunder_tp's compiles (declared to
  ``patches``; any other jit interprets it as Thunder does);
- ``x.detach()`` gives its input a zero grad where eager gives none (an optimizer then decays a frozen weight):
  ``detached_as_eager`` tags its outputs, so that nothing upstream of it gets a grad from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import thunder.torch as ltorch
import torch
from thunder.core.compile_data import get_compile_data
from thunder.core.interpreter import ProvenanceRecord, PseudoInst, _interpret_call, unwrap, wrap, wrap_const
from thunder.core.proxies import ProxyTag, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from thunder_tp.thunder_internals import patches

__all__ = ["detached_as_eager", "grad_reaches", "in_grad_mode_of", "is_no_grad"]

#: where an inference_mode context keeps the grad mode it restores
_BEFORE = "_thunder_tp_grad_enabled_before"


def is_no_grad(bsym: BoundSymbol) -> bool:
    """Whether `bsym` was recorded under no_grad (a tensor output of it is detached from the autograd graph)."""
    return any(ProxyTag.DETACHED_AUTOGRAD_GRAPH in o.tags for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy))


@contextlib.contextmanager
def in_grad_mode_of(recorded: Iterable[BoundSymbol]) -> Iterator[None]:
    """Symbols called inside record under no_grad where any of `recorded` was recorded so, as they would otherwise."""
    cd = get_compile_data()
    if cd is None or not cd.is_grad_enabled or not any(map(is_no_grad, recorded)):
        yield
        return
    cd.is_grad_enabled = False
    try:
        yield
    finally:
        cd.is_grad_enabled = True


def grad_reaches(bsyms: list[BoundSymbol]) -> set[str]:
    """The names of the tensors of a program (`bsyms`, its return last) that a grad of its outputs reaches: through
    symbols recorded with grad, from the returned values back."""
    reached = {t.name for t in bsyms[-1].flat_proxy_args if isinstance(t, TensorProxy)}
    for bsym in reversed(bsyms[:-1]):
        if not is_no_grad(bsym) and any(o.name in reached for o in bsym.flat_proxy_outs):
            reached.update(t.name for t in bsym.flat_proxy_args if isinstance(t, TensorProxy))
    return reached


def detached_as_eager(trace: TraceCtx) -> None:
    """Tag the outputs of `trace`'s detach calls detached from the autograd graph: their inputs get no grad from
    them (None), as in eager, rather than zeros."""
    for bsym in trace.bound_symbols:
        if bsym.sym.id == ltorch.detach.id:
            for o in bsym.flat_proxy_outs:
                if isinstance(o, TensorProxy):
                    o.tags.add(ProxyTag.DETACHED_AUTOGRAD_GRAPH)


def _inference_mode_enter(context):
    # the context's attributes as the interpreter holds them (it keeps the ones its interpreted __init__ set)
    before = wrap_const(get_compile_data().is_grad_enabled)
    _interpret_call(lambda c, b: setattr(c, _BEFORE, b), context, before)
    if unwrap(_interpret_call(lambda c: c.mode, context)):
        ltorch._set_grad_enabled_with_warning(False)
    return wrap(None, provenance=ProvenanceRecord(PseudoInst.LOOKASIDE, inputs=[context.provenance]))


def _inference_mode_exit(context, exc_type, exc_value, traceback):
    ltorch._set_grad_enabled_with_warning(unwrap(_interpret_call(lambda c: getattr(c, _BEFORE), context)))
    return wrap(None, provenance=ProvenanceRecord(PseudoInst.LOOKASIDE, inputs=[context.provenance]))


patches.declare_lookaside(torch.inference_mode.__enter__, _inference_mode_enter)
patches.declare_lookaside(torch.inference_mode.__exit__, _inference_mode_exit)
