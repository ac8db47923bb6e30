"""What TensorParallel reads from Thunder's unpacking of inputs and fixes in the prologue: a trace's tensor inputs
and body, which proxies are parameters and buffers, and the local shapes of the sharded ones."""

from __future__ import annotations

from collections.abc import Callable

from thunder.core import prims
from thunder.core.proxies import TensorProxy, pyval
from thunder.core.trace import TraceCtx

from thunder_tp.thunder_internals.private import set_proxy_shape

_UNPACK_TENSOR = ("unpack_parameter", "unpack_buffer")


def flat_args(trace: TraceCtx) -> list[TensorProxy]:
    """The trace's unpacked tensor inputs."""
    return [
        b.output
        for b in trace.bound_symbols
        if b.sym.id == prims.PrimIDs.UNPACK_TRIVIAL and isinstance(b.output, TensorProxy)
    ]


def trace_body(trace: TraceCtx) -> list:
    """The trace's bound symbols without its input unpacking and its return: what propagation walks."""
    return [b for b in trace.bound_symbols if b.sym.id not in (prims.PrimIDs.UNPACK_TRIVIAL, prims.PrimIDs.RETURN)]


def call_inputs(prologue: TraceCtx) -> dict[int | str, TensorProxy]:
    """The tensors the call was given: position (an int) or keyword (a str) -> proxy (inputs nested in containers
    left out)."""
    return {
        b.args[1]: b.output
        for b in prologue.bound_symbols
        if b.sym.id == prims.PrimIDs.UNPACK_GETITEM and isinstance(b.output, TensorProxy)
        and getattr(b.args[0], "name", None) in ("args", "kwargs")
    }


def unpacked_tensor_names(prologue: TraceCtx) -> dict[str, str]:
    """Proxy name -> qualified parameter/buffer name, from the prologue's unpacking."""
    return {
        b.output.name: b.args[1]
        for b in prologue.bound_symbols
        if b.sym.name in _UNPACK_TENSOR and isinstance(b.output, TensorProxy)
    }


#: (input name, traced shape) -> the shape of this rank's piece of that input, or None where it is not sharded
LocalShape = Callable[[str, tuple[int, ...]], "tuple[int, ...] | None"]


def localize_prologue(prologue: TraceCtx, computation: TraceCtx, local_shape: LocalShape,
                      unchecked: frozenset[str] = frozenset()) -> None:
    """Sharded inputs arrive as local pieces: give their proxies this rank's local shapes and check those (but for
    `unchecked` ones, whose pieces differ in length among the simulated ranks of one program)."""
    proxies = {id(p): p for p in (*prologue.output[0], *flat_args(computation)) if isinstance(p, TensorProxy)}
    for proxy in proxies.values():
        if (local := local_shape(proxy.name, tuple(proxy.shape))) is not None:
            set_proxy_shape(proxy, local)
    kept = []
    for b in prologue.bound_symbols:
        if b.sym.id == prims.PrimIDs.CHECK_TENSOR_SHAPE_AND_METADATA:
            b = _with_traced_shape(b)
            t, shape, *rest = b.args
            if (local := local_shape(t.name, shape)) is not None:
                if t.name in unchecked:
                    continue
                b = b.from_bsym(args=(t, local, *rest))
        kept.append(b)
    prologue.bound_symbols = kept


def _with_traced_shape(check):
    """A shape check on the traced sizes: under cache="symbolic values" it holds size proxies, but each rank's pieces
    are computed from the traced sizes, so a call of other shapes must trace again (numbers stay symbolic)."""
    t, shape, *rest = check.args
    return check.from_bsym(args=(t, tuple(pyval(s) for s in shape), *rest))
