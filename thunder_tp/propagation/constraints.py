"""Styles as layout constraints: `annotate` calls around each op that consumes a styled weight, and around the
calls of each module styled `ModuleLayouts` (forward hooks, which run inside the traced program).

A row-parallel linear's bias is split off and added after the output constraint, so it is added
once to the reduced result rather than once per rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from numbers import Number
from typing import Any

import thunder.torch as ltorch
import torch
import torch.nn as nn
from thunder.core import prims
from thunder.core.compile_data import get_compile_data
from thunder.core.interpreter import interpreter_needs_wrap
from thunder.core.jit_ext import ensure_recursive_proxies, register_general_jit_lookaside
from thunder.core.proxies import ProxyTag, TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from thunder_tp.collectives.annotate import annotate, tp_annotate
from thunder_tp.layouts import Layout
from thunder_tp.styles import ModuleLayouts, RowwiseParallel, Style
from thunder_tp.thunder_internals.checkpointing import recompute_in_backward
from thunder_tp.thunder_internals.grad_mode import in_grad_mode_of

#: the module attribute holding the hooks `constrain_module_boundaries` registered on it
_HOOKS = "_thunder_tp_module_layouts"


def _styled_weight(bsym, styles: Mapping[str, Style]) -> Style | None:
    for a in bsym.args[1:]:
        if isinstance(a, TensorProxy) and a.name in styles:
            return styles[a.name]
    return None


class Emitted:
    """What `constrain_styled_ops` emitted, kept across calls on the same trace (a plan search constrains one trace
    for every plan it prices): a constraint or styled op emitted before is appended again as it was (the same bound
    symbols and proxies), not traced again; so are the consumers of a value it replaced."""

    def __init__(self, *, keep: bool = True) -> None:
        self.keep = keep
        self._kept: dict[tuple, tuple[tuple[BoundSymbol, ...], Any]] = {}

    def emit(self, key: tuple, into: TraceCtx, make: Callable[[], Any]) -> Any:
        """``make()``'s result, with the bound symbols it appends to `into` (the tracing context); made once per
        `key` (the ids of bound symbols in it stay taken: the kept bound symbols hold them), every time if not
        `keep`."""
        if not self.keep:
            return make()
        kept = self._kept.get(key)
        if kept is None:
            start = len(into.bound_symbols)
            result = make()
            self._kept[key] = (tuple(into.bound_symbols[start:]), result)
            return result
        into.bound_symbols.extend(kept[0])
        return kept[1]


def _constrain(t: TensorProxy | Number, layout, memo: dict, emitted: Emitted, into: TraceCtx) -> TensorProxy | Number:
    """`t` annotated with `layout`, once per (value, layout), so that consumers share one redistribution; a number
    (Gemma's RMSNorm consumes its weight in `1 + weight`) as it is."""
    if layout is None or not isinstance(t, TensorProxy):
        return t
    key = (t.name, layout)
    if key not in memo:
        memo[key] = emitted.emit(("annotate", *key), into, lambda: tp_annotate(t, layout))
    return memo[key]


def constrain_styled_ops(trace: TraceCtx, styles: Mapping[str, Style], emitted: Emitted | None = None) -> TraceCtx:
    """Insert the input/output constraints of each style (keyed by weight proxy name) into `trace`; `emitted`: what
    earlier calls on this trace emitted, reused."""
    emitted = Emitted(keep=False) if emitted is None else emitted
    new = from_trace(trace)
    swap: dict = {}
    memo: dict = {}
    with tracectx(new):
        for bsym in trace.bound_symbols:
            replaced = tuple(swap[v].name for v in map(variableify, bsym.flat_proxy_args) if v in swap)
            if replaced:  # (the rest is reused as it is)
                bsym = emitted.emit(("swapped", id(bsym), replaced), new, lambda b=bsym: b.from_bsym_swap_proxies(swap))
            style = _styled_weight(bsym, styles) if isinstance(bsym.output, TensorProxy) else None
            if style is None:
                new.bound_symbols.append(bsym)
                continue
            emitted_from = len(new.bound_symbols)
            x = _constrain(bsym.args[0], style.input_layout, memo, emitted, new)
            with in_grad_mode_of([bsym]):  # a no-grad linear's replacement is no-grad too
                y = emitted.emit(("styled", id(bsym), style, getattr(x, "name", x)), new,
                                 lambda b=bsym, s=style, x=x: _styled_op(b, s, x, memo, emitted, new))
            swap[variableify(bsym.output)] = y
            if ProxyTag.RECOMPUTE_IN_BACKWARD in bsym.output.tags:  # a checkpointed op: its replacement too
                recompute_in_backward(new.bound_symbols[emitted_from:])
    new.set_provenance(TraceProvenance("thunder_tp: style constraints"))
    return new


def _styled_op(bsym: BoundSymbol, style: Style, x: TensorProxy | Number, memo: dict, emitted: Emitted,
               into: TraceCtx) -> TensorProxy:
    """The op of `bsym` on its constrained input `x`, its output constrained; a row-parallel linear's bias added
    after the output constraint."""
    _, *rest = bsym.args
    bias = bsym.args[2] if len(bsym.args) > 2 else bsym.kwargs.get("bias")
    split_bias = bsym.sym.id == ltorch.linear.id and isinstance(style, RowwiseParallel) and bias is not None
    y = ltorch.linear(x, rest[0], None) if split_bias else bsym.sym(x, *rest, **bsym.kwargs)
    y = _constrain(y, style.output_layout, memo, emitted, into)
    return ltorch.add(y, bias) if split_bias else y


def constrain_inputs(trace: TraceCtx, layouts: Mapping[str, Layout]) -> TraceCtx:
    """`trace` with each input named in `layouts` annotated with its layout where it is unpacked, the program reading
    the annotated value (its return left as it was: the inputs Thunder returns are the inputs)."""
    new = from_trace(trace)
    swap: dict = {}
    with tracectx(new):
        for bsym in trace.bound_symbols:
            if bsym.sym.id == prims.PrimIDs.UNPACK_TRIVIAL:
                new.bound_symbols.append(bsym)
                if bsym.output.name in layouts:
                    swap[variableify(bsym.output)] = tp_annotate(bsym.output, layouts[bsym.output.name])
            else:
                last = bsym.sym.id == prims.PrimIDs.RETURN
                new.bound_symbols.append(bsym if last else bsym.from_bsym_swap_proxies(swap))
    new.set_provenance(TraceProvenance("thunder_tp: inputs constrained"))
    return new


def constrain_module_boundaries(model: nn.Module, styles: Mapping[str, Style]) -> None:
    """Hooks annotating the inputs and outputs of each module styled `ModuleLayouts` (module name -> style) where it
    is called; those of an earlier plan are removed."""
    for module in model.modules():
        for hook in module.__dict__.pop(_HOOKS, ()):
            hook.remove()
    for name, style in styles.items():
        if not isinstance(style, ModuleLayouts):
            continue
        module, hooks = model.get_submodule(name), []
        if style.inputs is not None or style.kwarg_inputs:
            hooks.append(module.register_forward_pre_hook(functools.partial(_constrain_inputs, style),
                                                          with_kwargs=True))
        if style.outputs is not None:
            hooks.append(module.register_forward_hook(functools.partial(_constrain_outputs, style)))
        module.__dict__[_HOOKS] = hooks


def _constrain_inputs(style: ModuleLayouts, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """A forward pre-hook: the module's inputs annotated with their layouts."""
    if style.inputs is not None:
        args = _constrained(module, "positional input", tuple(range(len(args))), args, style.inputs)
    if style.kwarg_inputs:
        layouts, names = dict(style.kwarg_inputs), tuple(kwargs)
        values = _constrained(module, "keyword input", names, tuple(kwargs.values()), tuple(map(layouts.get, names)))
        kwargs = dict(zip(names, values, strict=True))
    return args, kwargs


def _constrain_outputs(style: ModuleLayouts, module: nn.Module, args: tuple, output: Any) -> Any:
    """A forward hook: the module's outputs annotated with their layouts."""
    outputs = output if isinstance(output, tuple) else (output,)
    constrained_outputs = _constrained(module, "output", tuple(range(len(outputs))), outputs, style.outputs)
    return constrained_outputs if isinstance(output, tuple) else constrained_outputs[0]


def _constrained(module: nn.Module, what: str, keys: tuple, values: tuple, layouts: tuple) -> tuple:
    """`values` (their positions or names: `keys`) each annotated with its layout (None: as it comes); a count of
    layouts other than of values, or a layout for a value that is not a tensor, is an error naming `module`."""
    if len(values) != len(layouts):
        raise ValueError(
            f"thunder_tp.TensorParallel: {_label(module)} has {len(values)} {what}s but its ModuleLayouts (DTensor's "
            f"PrepareModuleInput / PrepareModuleOutput) gives {len(layouts)} layouts {layouts}; give one per value, "
            "None for those left as they come"
        )
    for key, value, layout in zip(keys, values, layouts, strict=True):
        if layout is not None and not isinstance(value, (torch.Tensor, TensorProxy)):
            raise TypeError(
                f"thunder_tp.TensorParallel: {_label(module)}: {what} {key!r} is a {type(value).__name__}, not a "
                "tensor, but its ModuleLayouts (DTensor's PrepareModuleInput / PrepareModuleOutput) gives it the "
                f"layout {layout}; give it None"
            )
    return tuple(v if layout is None else annotate(v, layout) for v, layout in zip(values, layouts, strict=True))


@register_general_jit_lookaside(_constrained)
@ensure_recursive_proxies
@interpreter_needs_wrap
def _constrained_lookaside(module: nn.Module, what: str, keys: tuple, values: tuple, layouts: tuple) -> tuple:
    """thunder.jit runs `_constrained` as it is, on proxies, rather than interpreting it (hooks run on every call of
    every constrained module while a program is traced)."""
    return _constrained(module, what, keys, values, layouts)


def _label(module: nn.Module) -> str:
    """How an error names `module`: by its name in the model being traced (the hooks carry no name, so that the
    blocks they constrain alike stay one kind: `tracing/block_keys.py`)."""
    root = getattr(get_compile_data(), "fn", None)
    name = next((n for n, m in root.named_modules() if m is module), None) if isinstance(root, nn.Module) else None
    if name is None:
        return f"a {type(module).__name__}"
    return f"module {name!r}" if name else f"the model ({type(module).__name__})"
