"""Where thunder_tp reaches into Lightning Thunder's objects: every private attribute it writes or reads, one
function each with the reason Thunder 0.2.6 has no public route, so that a Thunder upgrade has one place to look.
Where a public route exists it is used (``ThunderModule.set_buffer``, ``Executor.implmap``, and the two below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import thunder
import thunder.torch as ltorch
import torch
from thunder.core.module import ThunderModule
from thunder.core.proxies import DistParallelType, TensorProxy


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
    """Trace `t` as on `device` (``_thunder_device``, which Thunder's Materialization/FSDP transforms set; no setter)."""
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
    prologue and the computation share this one)."""
    proxy._shape = tuple(shape)


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


# --- public routes, named here so that the callers read alike ----------------------------------------------------


def original_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ThunderModule was jitted from (``thunder.compile_data(tm).fn``); a plain module itself."""
    return thunder.compile_data(model).fn if isinstance(model, ThunderModule) else model


def applied_transforms(model: torch.nn.Module) -> list:
    """The transforms already applied to a ThunderModule, in order (``thunder.list_transforms``); none for a plain one."""
    return list(thunder.list_transforms(model)) if isinstance(model, ThunderModule) else []
