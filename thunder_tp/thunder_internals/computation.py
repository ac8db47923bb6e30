"""The program behind one call of a jitted module, reached without going through Thunder's call: the cache entry a
call selects and the inputs its prologue unpacks, and a fusion region's ops as a plain function.

Thunder 0.2.6 runs, on every call, the prologue of each cache entry until one accepts the arguments (checking every
parameter's and buffer's metadata), then the entry's computation. It has no public way to keep what the prologue
returned and call the computation again; ``CompileData.get_computation_and_inputs`` (which ``thunder.jit`` sets and
each call runs) is that first half. A fusion region's torch.compile wrapper is built by ``make_compiled``, which has no
option to leave it uncompiled; ``region_function`` lowers the same region trace to torch ops the same way, through
``sub_program``, which makes a function of any run of a trace's symbols (a trace's private ``_siginfo`` names its
parameters: Thunder sets it the same way for its regions). A compile hands its final traces to the transforms one by one
(the forward, then the backward where there is one); ``backward_follows`` tells from the forward whether a backward
comes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import thunder
from thunder.core import prims
from thunder.core.codeutils import SigInfo
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceTag, tracectx
from thunder.executors.passes import transform_for_execution
from thunder.executors.torchex import ex as pytorch_ex


def computation_and_inputs(jm: Any, args: tuple, kwargs: dict) -> tuple[Any, list, tuple]:
    """The cache entry ``jm(*args, **kwargs)`` runs (compiling it on a miss), the computation's inputs the prologue
    unpacked (the call's tensors, the module's parameters and buffers) and what the prologue passes to the epilogue."""
    return thunder.compile_data(jm).get_computation_and_inputs(*args, **kwargs)


def backward_follows(trace: TraceCtx) -> bool:
    """Whether a backward trace of the same compile certainly reaches the transforms after this final trace: ``trace``
    is a forward that returns values saved for it. Thunder 0.2.6's ``split_into_forward_and_backward`` returns the
    forward as ``return outputs, (saved tensors, saved others)``, what its backward symbols read, and a backward
    wherever there is one. A backward that reads nothing saved (the grad of a slice) is not announced: False there, as
    after the last trace of a compile."""
    if TraceTag.BACKWARD in trace.tags:
        return False
    ret = trace.bound_symbols[-1] if trace.bound_symbols else None
    if ret is None or ret.sym.id != prims.PrimIDs.RETURN or len(ret.args) != 2:
        return False
    saved = ret.args[1]
    return isinstance(saved, (tuple, list)) and any(saved)


def sub_program(bsyms: list[BoundSymbol], inputs: list, outputs: list, name: str, *,
                executors: tuple | None = None) -> Callable:
    """``bsyms`` as a plain Python function of ``inputs`` (proxies) returning the list of ``outputs``, lowered by
    ``executors`` first if given (as Thunder's ``make_compiled`` lowers a fusion region to torch ops)."""
    trace = TraceCtx(None)
    trace.args = list(inputs)
    with tracectx(trace):
        for a in trace.args:
            prims.unpack_trivial(a, name=a.name)
    trace.bound_symbols += list(bsyms)
    trace.bound_symbols.append(prims.python_return.bind(list(outputs), output=None))
    trace.names = {a.name for a in trace.args}
    for bsym in trace.bound_symbols:
        trace.names.update(o.name for b in (bsym, *bsym.subsymbols) for o in b.flat_outs if o is not None)
    trace._siginfo = SigInfo(name)
    trace._siginfo.args = [(a.name, None) for a in trace.args]
    if executors is not None:
        trace = transform_for_execution(trace, executors_list=executors)
    return trace.python_callable(include_decorators=False)


def region_function(region: BoundSymbol) -> Callable:
    """A fusion region's ops as a plain Python function of its inputs, lowered to torch ops."""
    return sub_program(region.subsymbols, region.flat_proxy_args, region.flat_proxy_outs, region.sym.name,
                       executors=(pytorch_ex,))


def calling(bsym: BoundSymbol, fn: Callable) -> BoundSymbol:
    """``bsym`` (a fusion region, printed as a call of its symbol's name) calling ``fn`` instead."""
    return bsym.from_bsym(_call_ctx={bsym.sym.name: fn})
