"""Where thunder_tp reaches into Lightning Thunder's objects: every private attribute it writes or reads, one
function each with the reason Thunder 0.2.6 has no public route, so that a Thunder upgrade has one place to look.
Where a public route exists it is used (``ThunderModule.set_buffer``, ``Executor.implmap``, and the two below).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import thunder
import thunder.torch as ltorch
import torch
from thunder.core.compile_data import get_compile_data
from thunder.core.interpreter import _interpret_call
from thunder.core.module import ThunderModule
from thunder.core.proxies import DistParallelType, TensorProxy
from thunder.core.symbol import Symbol

from thunder_tp.thunder_internals import patches


def set_parameter(tm: ThunderModule, name: str, value: torch.nn.Parameter) -> None:
    """Make `tm` compute with `value` as parameter `name` (0.2.6 has ``set_buffer`` but no ``set_parameter``)."""
    tm._overrides_parameters[name] = value


def wrap_module_call(tm: ThunderModule, wrapper) -> None:
    """Route `tm`'s calls through ``wrapper(call)`` (``ThunderModule.forward`` calls ``_forward_fn``, the jitted
    function that compiles on a cache miss and runs; 0.2.6 has no hook around a whole compile)."""
    tm._forward_fn = wrapper(tm._forward_fn)


def trace_device(t: torch.Tensor) -> torch.device | None:
    """The device Thunder traces a meta-device tensor on, if one was set (Thunder reads ``_thunder_device``)."""
    return getattr(t, "_thunder_device", None)


def set_trace_device(t: torch.Tensor, device: torch.device) -> None:
    """Trace `t` as on `device` (``_thunder_device``, set by Thunder's Materialization/FSDP transforms; no setter)."""
    t._thunder_device = device


@contextlib.contextmanager
def meta_traced_on(tensors: list[torch.Tensor], device: torch.device) -> Iterator[None]:
    """Trace the meta-device `tensors` that have no trace device yet as on `device`, for the duration only."""
    unset = [t for t in tensors if t.is_meta and trace_device(t) is None]
    for t in unset:
        set_trace_device(t, device)
    try:
        yield
    finally:
        for t in unset:
            del t._thunder_device


def set_proxy_shape(proxy: TensorProxy, shape: tuple[int, ...]) -> None:
    """Change a trace input's shape in place, as Thunder's FSDPTransform does (``replace`` makes a new proxy, but the
    prologue and the computation share this one), with the element count it keeps (as a number, or deferred under
    symbolic values)."""
    proxy._shape = tuple(shape)
    if isinstance(proxy._numel, int):
        proxy._numel = math.prod(int(d) for d in proxy._shape)


def set_proxy_distparallel_type(proxy: TensorProxy, kind: DistParallelType) -> None:
    """Set a trace input's ``distparallel_type`` in place (a read-only property; ``replace`` makes a new proxy)."""
    proxy._distparallel_type = kind


@contextlib.contextmanager
def fake_args_built_under(context: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """Build the fake tensors of Thunder's fallback for torch ops it has no symbol for inside ``context()``
    (``meta_adaptor`` runs the op on ``_get_fake_arg``'s tensors under FakeTensorMode; a mode pushed before it, such
    as LocalTensorMode, would otherwise make them its own); 0.2.6 has no hook there."""
    original = ltorch._get_fake_arg

    def built_under_context(inp):
        with context():
            return original(inp)

    ltorch._get_fake_arg = built_under_context
    try:
        yield
    finally:
        ltorch._get_fake_arg = original



def symbol_of(torch_fn: Callable) -> Symbol:
    """Thunder's symbol for the torch function `torch_fn` (``_torch_to_thunder_function_map``: 0.2.6 names some
    privately, e.g. ``torch.softmax``'s ``_softmax``, and has no public lookup)."""
    return ltorch._torch_to_thunder_function_map[torch_fn]


def torch_function_symbols() -> list[Symbol]:
    """Every symbol Thunder maps a torch function to, those it registered automatically included (the values of
    ``_torch_to_thunder_function_map``; 0.2.6 lists them nowhere public)."""
    return list(ltorch._torch_to_thunder_function_map.values())


#: ``fn(*args, **kwargs)`` interpreted from inside a lookaside, as the interpreter runs a call, its result wrapped
#: (``thunder.core.interpreter._interpret_call``: 0.2.6 has no public way for a lookaside to trace a replacement)
interpret_call = _interpret_call

# --- public routes, named here so that the callers read alike ----------------------------------------------------


def original_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ThunderModule was jitted from (``thunder.compile_data(tm).fn``); a plain module itself."""
    return thunder.compile_data(model).fn if isinstance(model, ThunderModule) else model


def applied_transforms(model: torch.nn.Module) -> list:
    """The transforms applied to a ThunderModule, in order (``thunder.list_transforms``); none for a plain module."""
    return list(thunder.list_transforms(model)) if isinstance(model, ThunderModule) else []


# --- one interpretation for the plan search and the compile ------------------------------------------------------


@dataclass
class Interpretation:
    """What Thunder's interpreter made of one call (``thunder_general_jit``'s TraceResults), and what it depended
    on: the call's inputs, the module's tensors and Thunder's cache info, as `_call_signature` describes them."""

    results: Any
    signature: tuple
    reused: bool = False


#: the attribute of a jit's CompileData holding the interpretation its next compile starts from (wrapped below)
_NEXT_INTERPRETATION = "_thunder_tp_next_interpretation"
_interpret = thunder.thunder_general_jit


@contextlib.contextmanager
def interpretations_kept() -> Iterator[list[Interpretation]]:
    """Collect the interpretations Thunder makes meanwhile (those that registered no ad-hoc operator, which
    belong to the compile that made them), each made with thunder_tp's speed-ups (``patches.applied``)."""
    kept: list[Interpretation] = []

    def keeping(fn, args, kwargs, /, **options):
        results = _interpret(fn, args, kwargs, **options)
        ad_hoc = options.get("ad_hoc_executor")
        if ad_hoc is None or not ad_hoc.implmap:
            kept.append(Interpretation(results, _call_signature(fn, args, kwargs)))
        return results

    with patches.applied():
        reusing, thunder.thunder_general_jit = thunder.thunder_general_jit, keeping
        try:
            yield kept
        finally:
            thunder.thunder_general_jit = reusing


def reuse_interpretation(model: ThunderModule, interpretation: Interpretation) -> None:
    """The next compile of `model` starts from `interpretation` instead of interpreting its module again, if its
    call, the module's tensors and Thunder's cache info are as they were (0.2.6 has no hook between the interpreter
    and the transforms: ``acquire_initial_trace`` calls ``thunder.thunder_general_jit`` by its module-level name).
    It is kept on `model`'s compile data, so it goes with that jit and no other jit sees it."""
    patches.install()
    setattr(thunder.compile_data(model), _NEXT_INTERPRETATION, interpretation)


def _reusing(fn, args, kwargs, /, **options):
    cd = get_compile_data()
    kept = vars(cd).pop(_NEXT_INTERPRETATION, None) if cd is not None and fn is cd.fn else None
    if kept is not None and kept.signature == _call_signature(fn, args, kwargs):
        kept.reused = True
        return kept.results
    if not patches.active():
        return _interpret(fn, args, kwargs, **options)
    with patches.applied():  # the model families' lookasides too, in a jit made before the patches were installed
        return _interpret(fn, args, kwargs, **options)


def _call_signature(fn, args, kwargs) -> tuple:
    """What an interpretation of ``fn(*args, **kwargs)`` depends on, beside the code: the inputs' structure and
    metadata (tensors) or values, the module's tensors' metadata, and Thunder's cache info for the call."""
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    inputs = tuple(_tensor_signature(x) if isinstance(x, torch.Tensor) else _value_signature(x) for x in leaves)
    tensors = ()
    if isinstance(fn, torch.nn.Module):
        named = (*fn.named_parameters(remove_duplicate=False), *fn.named_buffers(remove_duplicate=False))
        tensors = tuple((n, id(t), _tensor_signature(t)) for n, t in named)
    return str(spec), inputs, tensors, tuple(sorted(thunder._get_cache_info().items()))


def _value_signature(x) -> tuple:
    """A plain value by its value, any other object by its identity."""
    return (type(x), x) if isinstance(x, (int, float, str, bool, type(None), torch.dtype, torch.device)) else (type(x),
                                                                                                               id(x))


def _tensor_signature(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, trace_device(t) or t.device, t.requires_grad


patches.declare(thunder, "thunder_general_jit", _reusing)


def global_module_hooks() -> tuple[list[dict], list[dict]]:
    """torch's process-wide module hooks (forward pre, forward, backward pre, backward: id -> hook) and their flags
    (with kwargs, always called: id -> bool), as a module's own (torch has no public getter of them)."""
    m = torch.nn.modules.module
    hooks = [m._global_forward_pre_hooks, m._global_forward_hooks, m._global_backward_pre_hooks,
             m._global_backward_hooks]
    return hooks, [{}, m._global_forward_hooks_with_kwargs, m._global_forward_hooks_always_called]
