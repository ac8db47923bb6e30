"""The traced `annotate(t, layout)` symbol: a layout constraint inside a jitted program."""

from __future__ import annotations

import torch
from thunder.core.interpreter import interpreter_needs_wrap
from thunder.core.jit_ext import ensure_recursive_proxies, register_general_jit_lookaside
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import register_grad

from thunder_tp.collectives import comm_executor
from thunder_tp.layouts import Layout, as_layout

tp_annotate = comm_executor.register_operator(
    "tp_annotate", meta=lambda t, layout: TensorProxy(like=t), fn=lambda t, layout: t
)
comm_executor.register_implementation(tp_annotate, tp_annotate)


def _annotate_grad(t: TensorProxy, layout: Layout) -> TensorProxy:
    out = tp_annotate(t, layout)
    put_grad(t, get_grad(out))
    return out


register_grad(tp_annotate, _annotate_grad)


def annotate(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Constrain `t` to `layout` (or a torch.distributed.tensor placement) on the TP group (identity outside a
    TensorParallel program)."""
    if isinstance(t, TensorProxy):
        return tp_annotate(t, as_layout(layout))
    return t


@register_general_jit_lookaside(annotate)
@ensure_recursive_proxies
@interpreter_needs_wrap
def _annotate_lookaside(t: TensorProxy, layout: Layout) -> TensorProxy:
    return tp_annotate(t, as_layout(layout))
