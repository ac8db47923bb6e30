"""Styles as layout constraints: `annotate` calls around each op that consumes a styled weight.

A row-parallel linear's bias is split off and added after the output constraint, so it is added
once to the reduced result rather than once per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Number

import thunder.torch as ltorch
from thunder.core.proxies import ProxyTag, TensorProxy, variableify
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from thunder_tp.annotate import tp_annotate
from thunder_tp.rewrite import recompute_in_backward
from thunder_tp.styles import RowwiseParallel, Style


def _styled_weight(bsym, styles: Mapping[str, Style]) -> Style | None:
    for a in bsym.args[1:]:
        if isinstance(a, TensorProxy) and a.name in styles:
            return styles[a.name]
    return None


def _constrain(t: TensorProxy | Number, layout, memo: dict) -> TensorProxy | Number:
    """`t` annotated with `layout`, once per (value, layout), so that consumers share one redistribution; a number
    (Gemma's RMSNorm consumes its weight in `1 + weight`) as it is."""
    if layout is None or not isinstance(t, TensorProxy):
        return t
    key = (t.name, layout)
    if key not in memo:
        memo[key] = tp_annotate(t, layout)
    return memo[key]


def constrain_styled_ops(trace: TraceCtx, styles: Mapping[str, Style]) -> TraceCtx:
    """Insert the input/output constraints of each style (keyed by weight proxy name) into `trace`."""
    new = from_trace(trace)
    swap: dict = {}
    memo: dict = {}
    with tracectx(new):
        for bsym in trace.bound_symbols:
            if any(variableify(p) in swap for p in bsym.flat_proxy_args):  # (the rest is reused as it is)
                bsym = bsym.from_bsym_swap_proxies(swap)
            style = _styled_weight(bsym, styles) if isinstance(bsym.output, TensorProxy) else None
            if style is None:
                new.bound_symbols.append(bsym)
                continue
            emitted_from = len(new.bound_symbols)
            x, *rest = bsym.args
            x = _constrain(x, style.input_layout, memo)
            bias = bsym.args[2] if len(bsym.args) > 2 else bsym.kwargs.get("bias")
            split_bias = bsym.sym.id == ltorch.linear.id and isinstance(style, RowwiseParallel) and bias is not None
            y = ltorch.linear(x, rest[0], None) if split_bias else bsym.sym(x, *rest, **bsym.kwargs)
            y = _constrain(y, style.output_layout, memo)
            if split_bias:
                y = ltorch.add(y, bias)
            swap[variableify(bsym.output)] = y
            if ProxyTag.RECOMPUTE_IN_BACKWARD in bsym.output.tags:  # a checkpointed op: its replacement too
                recompute_in_backward(new.bound_symbols[emitted_from:])
    new.set_provenance(TraceProvenance("thunder_tp: style constraints"))
    return new
