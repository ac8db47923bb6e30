"""Layout propagation: one rule per op proposes strategies; the cheapest one under the cost model wins.

A rule maps an op (its tensor inputs with their current layouts) to candidate `Strategy`s: the layout
each tensor input must have and the layout of each tensor output. An op without a rule is tried
through its subsymbols (Thunder's decomposition); without those, everything is Replicate.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol, Symbol

from thunder_tp.collectives.reshard import collective_cost, redistribute_cost
from thunder_tp.layouts import REPLICATE, Layout, Partial, Replicate, Shard, TPGroup, check_shardable, normalize

LocalFn = Callable[..., Any]


@dataclass(frozen=True)
class Strategy:
    """Required layout of each tensor input, resulting layout of each tensor output.

    `local` computes the op on local pieces, called like the op (tensors replaced by local ones);
    None means the op itself does. `whole_grads`: its Replicate inputs get whole grads on every rank.
    `issues`: (kind, bytes of the full result) of each collective `local` issues itself (priced by plans.auto);
    `backward_issues`: the same for its backward (an opaque op whose grad is its own, e.g. expert parallelism's).
    """

    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]
    local: LocalFn | None = None
    whole_grads: bool = False
    issues: tuple[tuple[str, int], ...] = ()
    backward_issues: tuple[tuple[str, int], ...] = ()

    @property
    def enters_tp_region(self) -> bool:
        """Whether its Replicate inputs get Partial grads (summed where they enter the TP region): some input or
        output is not Replicate, and the strategy does not say otherwise."""
        return not self.whole_grads and any(not isinstance(x, Replicate) for x in (*self.inputs, *self.outputs))


DECOMPOSE = object()  # marker: propagate through the op's subsymbols instead
#: a Partial output's sum is still to be reduced: between strategies that are otherwise free, the finished one wins
PENDING_SUM_COST = 1e-3

Rule = Callable[["Op"], Iterable[Strategy]]
_RULES: dict[Any, Rule] = {}


def register_rule(*syms: Symbol | str) -> Callable[[Rule], Rule]:
    """Register a propagation rule for the given symbols (or symbol ids)."""

    def decorator(rule: Rule) -> Rule:
        for sym in syms:
            _RULES[sym.id if isinstance(sym, Symbol) else sym] = rule
        return rule

    return decorator


@dataclass
class Op:
    """What a rule sees: one bound symbol, its tensor inputs and their current layouts; `options`: what the transform
    was asked for that a rule decides by (TensorParallel's `float8_all_gather`)."""

    bsym: BoundSymbol
    layouts: list[Layout]
    tp: TPGroup
    options: Mapping[str, Any] = field(default_factory=dict)

    @cached_property
    def tensors(self) -> list[TensorProxy]:
        """Tensor inputs, in pytree order of (args, kwargs)."""
        return [x for x in tree_flatten((self.bsym.args, self.bsym.kwargs))[0] if isinstance(x, TensorProxy)]

    @cached_property
    def outputs(self) -> list[TensorProxy]:
        """Tensor outputs, in pytree order."""
        return [x for x in tree_flatten(self.bsym.output)[0] if isinstance(x, TensorProxy)]

    @cached_property
    def arguments(self) -> dict[str, Any]:
        """The op's arguments bound to its signature, defaults applied."""
        meta = self.bsym.sym.meta or self.bsym.sym.__call__
        try:
            bound = inspect.signature(meta).bind(*self.bsym.args, **self.bsym.kwargs)
        except (TypeError, ValueError):
            return {}
        bound.apply_defaults()
        return dict(bound.arguments)

    def arg(self, name: str, default: Any = None) -> Any:
        """One bound argument by name."""
        return self.arguments.get(name, default)

    def layout_of(self, t: TensorProxy) -> Layout:
        """Current layout of one of the op's tensor inputs."""
        return self.layouts[[x.name for x in self.tensors].index(t.name)]

    def shard_of(self, t: TensorProxy, dim: int) -> Shard:
        """How input `t` is split on `dim` where it is sharded there (its blocks and splits: an uneven split of whole
        heads stays what it is), else a plain Shard(dim)."""
        layout = self.layout_of(t)
        return layout if isinstance(layout, Shard) and layout.dim == dim else Shard(dim)

    def replicated(self) -> Strategy:
        """Everything Replicate."""
        return Strategy((REPLICATE,) * len(self.tensors), (REPLICATE,) * len(self.outputs))


@dataclass
class Step:
    """One op of the local program: the (logical) bound symbol and the strategy it runs with."""

    bsym: BoundSymbol
    strategy: Strategy


class Choices:
    """The strategies chosen for bound symbols, kept across propagations over the same bound symbols (a plan search
    propagates one trace for every plan it prices): a choice depends only on the op, its inputs' layouts and which
    of them a strategy already needs Replicate, for one TP group and one set of parameters."""

    def __init__(self) -> None:
        self._tensors: dict[int, tuple[BoundSymbol, list[TensorProxy], list[TensorProxy]]] = {}
        self._chosen: dict[tuple, tuple[BoundSymbol, Strategy | object]] = {}

    def op(self, bsym: BoundSymbol, layouts: dict[str, Layout], tp: TPGroup, options: Mapping[str, Any]) -> Op:
        """`bsym`'s Op with its inputs' `layouts` (its tensor inputs and outputs flattened once per bound symbol)."""
        known = self._tensors.get(id(bsym))
        if known is None:
            first = Op(bsym, [], tp, options)
            known = self._tensors[id(bsym)] = (bsym, first.tensors, first.outputs)
        op = Op(bsym, [layouts[t.name] for t in known[1]], tp, options)
        op.__dict__.update(tensors=known[1], outputs=known[2])  # the cached properties' values
        return op

    def choice(self, propagation: Propagation, op: Op) -> Strategy | object:
        """``propagation.choose(op)``, chosen once per op, input layouts and inputs already needed Replicate."""
        key = (id(op.bsym), tuple(op.layouts), tuple(t.name in propagation.replicated for t in op.tensors))
        known = self._chosen.get(key)
        if known is None:  # (the value holds the bound symbol: its id stays taken)
            known = self._chosen[key] = (op.bsym, propagation.choose(op))
        return known[1]


@dataclass
class Propagation:
    """Drives the rules over a trace; `layouts` maps proxy names to layouts. `choices`: strategies kept from earlier
    propagations with the same TP group and parameters (None: every op chosen afresh)."""

    layouts: dict[str, Layout]
    tp: TPGroup
    parameters: frozenset[str] = frozenset()
    steps: list[Step] = field(default_factory=list)
    #: proxies whose Replicate version a chosen strategy already needs (the rewrite makes it once)
    replicated: set[str] = field(default_factory=set)
    choices: Choices | None = None
    #: the rules' `Op.options`
    options: Mapping[str, Any] = field(default_factory=dict)

    def run(self, bsyms: Iterable[BoundSymbol]) -> list[Step]:
        """Choose a strategy for every bound symbol, decomposing rule-less ops where needed."""
        for bsym in bsyms:
            if self.choices is None:
                op = Op(bsym, [self.layouts[t.name] for t in _tensor_inputs(bsym)], self.tp, self.options)
                strategy = self.choose(op)
            else:
                op = self.choices.op(bsym, self.layouts, self.tp, self.options)
                strategy = self.choices.choice(self, op)
            if strategy is DECOMPOSE:
                self.run(bsym.subsymbols)
                continue
            _check_written_in_place(op, strategy)
            for t, layout in zip(op.outputs, strategy.outputs, strict=True):
                self.layouts[t.name] = normalize(layout, t.ndim)
            self.replicated.update(t.name for t, x in zip(op.tensors, strategy.inputs, strict=True)
                                   if isinstance(x, Replicate))
            self.steps.append(Step(bsym, strategy))
        return self.steps

    def choose(self, op: Op) -> Strategy | object:
        """The cheapest valid candidate of the op's rule (ties: the rule's order)."""
        # rules lay out tensor outputs: number-only ops (the shape arithmetic of symbolic values) have none
        rule = _RULES.get(op.bsym.sym.id) if op.outputs else None
        candidates = [s for s in rule(op) if self._valid(op, s)] if rule is not None else []
        if candidates:
            return min(candidates, key=lambda s: self._cost(op, s))
        if all(isinstance(x, Replicate) for x in op.layouts) or not _decomposable(op.bsym):
            return op.replicated()
        return DECOMPOSE

    def _valid(self, op: Op, s: Strategy) -> bool:
        if len(s.inputs) != len(op.tensors) or len(s.outputs) != len(op.outputs):
            return False
        for t, layout in (*zip(op.tensors, s.inputs, strict=True), *zip(op.outputs, s.outputs, strict=True)):
            try:
                check_shardable(t.shape, normalize(layout, t.ndim), self.tp.size, t.name)
            except ValueError:
                return False
        return True

    def _cost(self, op: Op, s: Strategy) -> float:
        needed = {(t.name, normalize(req, t.ndim)): (t, cur) for t, cur, req in zip(op.tensors, op.layouts, s.inputs,
                                                                                    strict=True)}
        inputs = sum(  # a tensor used twice in one layout (x * x) is redistributed once
            0.0 if isinstance(req, Replicate) and name in self.replicated
            else redistribute_cost(cur, req, t, self.tp.size, is_parameter=name in self.parameters)
            for (name, req), (t, cur) in needed.items()
        )
        issued = sum(collective_cost(kind, full_bytes, self.tp.size) for kind, full_bytes in s.issues)
        return inputs + issued + PENDING_SUM_COST * sum(isinstance(x, Partial) for x in s.outputs)


def _check_written_in_place(op: Op, strategy: Strategy) -> None:
    """An in-place op writes its first input: resharding that input first would write a copy, and the tensor
    (e.g. a KV cache) would silently keep its old value."""
    if OpTags.IN_PLACE not in (op.bsym.sym.tags or ()) or not op.tensors:
        return
    target, current = op.tensors[0], op.layouts[0]
    required = normalize(strategy.inputs[0], target.ndim)
    if required != current:
        raise NotImplementedError(
            f"thunder_tp: {op.bsym.sym.name} writes {target.name} in place, which is {current}, but the only way to "
            f"run it here needs it {required}: the write would land in a resharded copy. Give the written tensor the "
            "layout of what is written into it (for a KV cache: thunder_tp.KVCacheParallel on the cache module, "
            "which plans.litgpt adds when set_kv_cache was called before the plan was made)"
        )


def _decomposable(bsym: BoundSymbol) -> bool:
    """Whether every op of the decomposition has a rule (prims without one may also lack a grad)."""
    return bool(bsym.subsymbols) and all(s.sym.id in _RULES or _decomposable(s) for s in bsym.subsymbols)


def _tensor_inputs(bsym: BoundSymbol) -> list[TensorProxy]:
    return [x for x in tree_flatten((bsym.args, bsym.kwargs))[0] if isinstance(x, TensorProxy)]

