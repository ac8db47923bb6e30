"""Rules for elementwise ops (unary, binary, ternary, with broadcasting) and type conversions."""

from __future__ import annotations

import thunder.core.prims as prims
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy

from thunder_tp.collectives import tp_to_partial
from thunder_tp.layouts import PARTIAL, REPLICATE, Layout, Partial, Shard
from thunder_tp.propagation.engine import LocalFn, Op, Strategy, register_rule

_UNARY = ("abs", "exp", "log", "log1p", "expm1", "gelu", "silu", "relu", "tanh", "sigmoid", "rsqrt", "sqrt",
          "erf", "reciprocal", "sin", "cos", "square", "logical_not", "clamp", "to", "type_as", "clone",
          "contiguous", "dropout")
_BINARY = ("pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
           "bitwise_and", "masked_fill", "where")
_PRIMS = ("abs", "exp", "log", "log1p", "expm1", "erf", "tanh", "rsqrt", "sqrt", "reciprocal", "sin", "cos",
          "convert_element_type", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "where",
          "bitwise_and", "bitwise_not")


def elementwise_strategies(op: Op) -> list[Strategy]:
    """Keep a shard of any output dim that every non-broadcast input can be sharded on."""
    out = op.outputs[0]
    strategies = []
    has_partial = any(isinstance(x, Partial) for x in op.layouts)
    for d in range(out.ndim):
        if has_partial and not _sharded_on(op, d):  # a reduce_scatter here would need an all_gather later
            continue
        shard = _shard_on(op, d)
        layouts: list[Layout] = []
        for t, current in zip(op.tensors, op.layouts, strict=True):
            td = d - (out.ndim - t.ndim)
            # a size-1 dim of a replicated input is a broadcast even where the output's dim is 1 as well
            sharded = td >= 0 and t.shape[td] == out.shape[d] and (t.shape[td] != 1 or current == shard.moved(td))
            layouts.append(shard.moved(td) if sharded else REPLICATE)
        strategies.append(Strategy(tuple(layouts), (shard.moved(d),)))
    strategies.append(op.replicated())
    return strategies


def _sharded_on(op: Op, d: int) -> bool:
    """Whether some input is currently sharded on output dim d."""
    out = op.outputs[0]
    return any(isinstance(x, Shard) and x.dim == d - (out.ndim - t.ndim) for t, x in zip(op.tensors, op.layouts,
                                                                                         strict=True))


def _shard_on(op: Op, d: int) -> Shard:
    """How the first input currently sharded on output dim d is split there (blocks, replicas), else plainly."""
    out = op.outputs[0]
    for t, layout in zip(op.tensors, op.layouts, strict=True):
        if isinstance(layout, Shard) and layout.dim == d - (out.ndim - t.ndim):
            return layout
    return Shard(d)


def _all_partial(op: Op) -> Strategy:
    return Strategy((PARTIAL,) * len(op.tensors), (PARTIAL,))


def _partial_in(op: Op, position: int) -> Strategy:
    """Partial through the tensor at `position` (the op is linear in it), the others Replicate."""
    layouts = [REPLICATE] * len(op.tensors)
    layouts[position] = PARTIAL
    return Strategy(tuple(layouts), (PARTIAL,))


@register_rule(*(getattr(ltorch, n) for n in _UNARY + _BINARY), *(getattr(prims, n) for n in _PRIMS))
def elementwise(op: Op) -> list[Strategy]:
    """Elementwise ops that are not linear."""
    return elementwise_strategies(op)


@register_rule(ltorch.neg, prims.neg)
def negation(op: Op) -> list[Strategy]:
    """Linear: a Partial stays Partial."""
    return [_all_partial(op), *elementwise_strategies(op)]


@register_rule(ltorch.add, ltorch.sub, prims.add, prims.sub)
def addition(op: Op) -> list[Strategy]:
    """Sum of Partials is Partial (not with a number, constant or NumberProxy: it would be added once per rank);
    so is a Partial plus a Replicate term that the first rank alone adds: the all_reduce waits for the next
    Partial (a parallel-residual block's attention and MLP outputs take one all_reduce, not two)."""
    numbers = [a for a in op.bsym.args[:2] if not isinstance(a, TensorProxy)]
    if numbers or not any(isinstance(x, Partial) for x in op.layouts):
        return elementwise_strategies(op)
    return [*_partial_plus_replicated(op), _all_partial(op), *elementwise_strategies(op)]


def _partial_plus_replicated(op: Op) -> list[Strategy]:
    """The term at one position Replicate, added by the first rank only; the other Partial and of the output's
    shape (a broadcast Partial would wait to be all-reduced at the larger size)."""
    strategies = []
    for replicated, partial in ((0, 1), (1, 0)):
        if op.tensors[partial].shape != op.outputs[0].shape:
            continue
        layouts = [PARTIAL, PARTIAL]
        layouts[replicated] = REPLICATE
        strategies.append(Strategy(tuple(layouts), (PARTIAL,), _first_rank_adds(op, replicated), whole_grads=True))
    return strategies


def _first_rank_adds(op: Op, position: int) -> LocalFn:
    """The op with its tensor argument at `position` kept on the first rank only (zeros elsewhere)."""

    def local(*args, **kwargs):
        args = list(args)
        args[position] = tp_to_partial(args[position], op.tp.group)
        return op.bsym.sym(*args, **kwargs)

    return local


@register_rule(ltorch.mul, prims.mul)
def multiplication(op: Op) -> list[Strategy]:
    """Partial times a Replicate factor is Partial."""
    return [*(_partial_in(op, i) for i in range(len(op.tensors))), *elementwise_strategies(op)]


@register_rule(ltorch.true_divide, ltorch.div, prims.div)
def division(op: Op) -> list[Strategy]:
    """Partial numerator over a Replicate denominator is Partial."""
    linear = isinstance(op.bsym.args[0], TensorProxy) and op.arg("rounding_mode") is None
    return [*([_partial_in(op, 0)] if linear else []), *elementwise_strategies(op)]
