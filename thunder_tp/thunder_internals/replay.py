"""Thunder 0.2.6's interpreter, for a module interpreted once and its bound symbols appended again for its likes
(`thunder_tp.tracing.repeated_blocks`).

What this relies on, with no public route in Thunder 0.2.6:

- `register_general_jit_lookaside` on `torch.nn.Module._wrapped_call_impl` (what `module(...)` runs): the
  handler given to `set_module_call_handler` takes every module call of a jitted program (Thunder's lookaside map
  holds it, no variable of this module); `interpret_module_call` interprets one as Thunder would (a copy of the
  method's code under another function object: the lookaside map holds the original). General lookasides receive
  the interpreter's wrapped values; `unwrap` gives the module and the proxies.
- `_interpret_call` on wrapped values from inside a lookaside, and `wrap(..., ProvenanceRecord(PseudoInst.OPAQUE))`
  for a value the interpreter did not compute (a replayed block's output, derived from the module and the call's
  arguments).
- `TraceCtx.scopes[-1]`: the bound symbols the interpretation appends to the trace being built, read and appended
  to.
- Parameters and buffers read through `module._modules[...]._parameters[...]` by an interpreted function: the
  prologue unpacks and checks them as the model's own, as any access would (without interpreting
  `Module.__getattr__`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn
from thunder.core.interpreter import (
    ProvenanceRecord,
    PseudoInst,
    _interpret_call,
    unwrap,
    wrap,
    wrap_const,
    wrapped_build_tuple,
)
from thunder.core.jit_ext import register_general_jit_lookaside
from thunder.core.proxies import Proxy, variableify
from thunder.core.pytree import tree_map
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import get_tracectx

__all__ = ["append_replayed", "interpret_module_call", "module_tensors", "opaque", "recorded",
           "set_module_call_handler", "unwrap", "unwrapped_call", "wrap_const"]

#: Module._wrapped_call_impl's code under another function object, interpreted as Thunder interprets a module call
_module_call_code = types.FunctionType(nn.Module._wrapped_call_impl.__code__, nn.Module._wrapped_call_impl.__globals__,
                                       "module_call", nn.Module._wrapped_call_impl.__defaults__,
                                       nn.Module._wrapped_call_impl.__closure__)

ModuleCallHandler = Callable[[Any, tuple, dict], Any]


def set_module_call_handler(handler: ModuleCallHandler) -> None:
    """`handler(module, args, kwargs)` (wrapped values) runs every module call of a jitted program (Thunder's
    lookaside of `Module._wrapped_call_impl`: one handler, the latest)."""

    def module_call(module, *args, **kwargs):
        return handler(module, args, kwargs)

    register_general_jit_lookaside(nn.Module._wrapped_call_impl)(module_call)


def interpret_module_call(module, args: tuple, kwargs: dict):
    """The module call, interpreted as Thunder would (hooks, `forward`)."""
    return _interpret_call(_module_call_code, module, *args, **kwargs)


def unwrapped_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments (the interpreter's wrapped values) as values and proxies."""
    return tuple(unwrap(a) for a in args), {k: unwrap(v) for k, v in kwargs.items()}


def recorded(fn: Callable[[], Any]) -> tuple[Any, list[BoundSymbol]]:
    """`fn()`'s result and the bound symbols its interpretation appended to the trace."""
    scope = get_tracectx().scopes[-1]
    start = len(scope)
    result = fn()
    return result, list(scope[start:])


_getters: dict[tuple[tuple[str, str], ...], Callable] = {}


def module_tensors(module, names: tuple[tuple[str, str], ...]) -> tuple:
    """The proxies of the module's tensors `names` ((kind, qualified name): kind "_parameters" or "_buffers"),
    read by an interpreted function, so that the prologue unpacks them as the model's own."""
    if names not in _getters:
        def path(kind: str, name: str) -> str:
            *owners, leaf = name.split(".")
            return "m" + "".join(f"._modules[{o!r}]" for o in owners) + f".{kind}[{leaf!r}]"

        source = "lambda m: (" + "".join(f"{path(kind, name)}, " for kind, name in names) + ")"
        _getters[names] = eval(source)  # names are the module's own attribute names, each quoted by repr
    return unwrap(_interpret_call(_getters[names], module))


def append_replayed(bsyms: Sequence[BoundSymbol], swap: dict) -> None:
    """`bsyms` appended to the trace with the proxies of `swap` (variableified -> proxy) swapped in and every
    value they produce, in subsymbols too, given a fresh name (its tags copied, not shared)."""
    scope = get_tracectx().scopes[-1]
    for bsym in bsyms:
        for p in _produced(bsym):
            v = variableify(p)
            if v not in swap:
                swap[v] = p.replace(name=None, tags=set(p.tags))
        scope.append(_swapped(bsym, swap))


def _produced(bsym: BoundSymbol):
    yield from (p for p in bsym.flat_proxy_outs if isinstance(p, Proxy))
    for sub in bsym.subsymbols:
        yield from _produced(sub)


def _swapped(bsym: BoundSymbol, swap: dict) -> BoundSymbol:
    """`bsym` with each proxy replaced by its entry in `swap`, once (Thunder's ``from_bsym_swap_proxies`` follows
    chains: a call's argument named as a value the recording produced, the recorded block's output passed straight
    to the next block, would be swapped again), and tag sets of its own (Thunder's passes add tags in place)."""

    def one(x: Any) -> Any:
        return swap.get(variableify(x), x) if isinstance(x, Proxy) else x

    return bsym.from_bsym(args=tree_map(one, bsym.args), kwargs=tree_map(one, bsym.kwargs),
                          output=tree_map(one, bsym.output), tags=set(bsym.tags),
                          subsymbols=[_swapped(s, swap) for s in bsym.subsymbols])


def opaque(value: Any, module, args: Sequence):
    """`value` (a proxy, or a tuple of proxies and constants), a result the interpreter did not compute, wrapped as
    derived from the module and `args` (wrapped values)."""
    if isinstance(value, tuple):
        return wrapped_build_tuple([opaque(item, module, args) for item in value])
    if not isinstance(value, Proxy):
        return wrap_const(value)
    inputs = [module.provenance, *(a.provenance for a in args if hasattr(a, "provenance"))]
    return wrap(value, provenance=ProvenanceRecord(inst=PseudoInst.OPAQUE, inputs=inputs))
