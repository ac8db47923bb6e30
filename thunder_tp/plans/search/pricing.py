"""The automatic plan's prices: a choice of styles' communication per step and parameter bytes per rank."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.nn as nn

from thunder_tp.layouts import REPLICATE, Layout, TPGroup, local_shape
from thunder_tp.plans.search.decisions import Decision
from thunder_tp.plans.search.tracing import Traced
from thunder_tp.propagation import Propagation
from thunder_tp.propagation.constraints import Emitted, constrain_styled_ops
from thunder_tp.propagation.engine import Choices
from thunder_tp.rewriting.communication import Communication, schedule_collectives
from thunder_tp.styles import ModuleLayouts, Style
from thunder_tp.styles.dtensor import read_plan
from thunder_tp.styles.matching import check_tied_layouts, match_plan, planned_tensors, tied_parameters
from thunder_tp.thunder_internals.prologue import flat_args, trace_body

#: the default budget's slack over "every weight matrix sharded": room to keep a small matrix whole (a router)
#: where that saves communication
BUDGET_SLACK = 0.01



@dataclass
class Pricing:
    """Prices a choice of styles: (communication per step, parameter bytes per rank), memoized."""

    module: nn.Module
    trace: Traced
    tp: TPGroup
    training: bool
    evaluated: int = 0
    _memo: dict = field(default_factory=dict)
    #: what pricing the trace's other choices emitted and propagated, reused
    _emitted: Emitted = field(default_factory=Emitted)
    _choices: Choices = field(default_factory=Choices)

    def styles(self, decisions: list[Decision], choice: tuple[int, ...]) -> dict[str, Style]:
        """Module name -> style for a choice (an index into each decision's combinations)."""
        styles = {}
        for d, i in zip(decisions, choice, strict=True):
            styles.update((m, s) for m, s in zip(d.modules, d.choices[i], strict=True) if s is not None)
        return styles

    def price(self, decisions: list[Decision], choice: tuple[int, ...]) -> tuple[Communication, int] | None:
        """None where the choice cannot run (a split that does not divide, two layouts for a tied tensor)."""
        if choice not in self._memo:
            self._memo[choice] = self._price(self.styles(decisions, choice))
        return self._memo[choice]

    def memory_of(self, decisions: list[Decision], choice: tuple[int, ...]) -> int | None:
        """Parameter bytes per rank of a choice (no propagation); None where it does not split validly."""
        try:
            return self.memory(planned_tensors(self.module, self.styles(decisions, choice), self.tp.size).parameters)
        except (ValueError, TypeError):
            return None

    def price_plan(self, plan: dict[str, object]) -> tuple[Communication, int]:
        """A plan's price (DTensor's styles read as thunder_tp's); a ValueError if it cannot run on this model at this
        TP size."""
        styles = match_plan(self.module, read_plan(plan))
        boundaries = [name for name, style in styles.items() if isinstance(style, ModuleLayouts)]
        if boundaries:
            raise ValueError(
                f"thunder_tp.plans.auto prices a plan on the trace it searched, made without constraints at module "
                f"boundaries; {boundaries} have ModuleLayouts (DTensor's PrepareModuleInput / PrepareModuleOutput): "
                "leave them out of the plan to price"
            )
        priced = self._price(styles)
        if priced is None:
            raise ValueError(f"thunder_tp.plans.auto: the plan does not run on this model over {self.tp.size} ranks")
        return priced

    def _price(self, styles: dict[str, Style]) -> tuple[Communication, int] | None:
        try:
            planned = planned_tensors(self.module, styles, self.tp.size)
            check_tied_layouts(tied_parameters(self.module), planned.parameters)
        except (ValueError, TypeError):
            return None
        self.evaluated += 1
        comm = self.communication(planned.parameters | planned.buffers, planned.weight_styles)
        return None if comm is None else (comm, self.memory(planned.parameters))

    def communication(self, layouts: dict[str, Layout], weight_styles: dict[str, Style]) -> Communication | None:
        """The collectives of one step with these tensor layouts and styles (None: propagation refuses)."""
        computation, names = self.trace.computation, self.trace.names
        inputs = flat_args(computation)
        initial = {a.name: layouts.get(names.get(a.name, ""), REPLICATE) for a in inputs}
        styled = {p: weight_styles[n] for p, n in names.items() if n in weight_styles}
        logical = constrain_styled_ops(computation, styled, self._emitted)
        propagation = Propagation(dict(initial), self.tp, frozenset(names), choices=self._choices)
        try:
            steps = propagation.run(trace_body(logical))
        except NotImplementedError:
            return None
        return schedule_collectives(logical, steps, propagation.layouts, self.tp, training=self.training).price()

    def memory(self, layouts: dict[str, Layout], only: str | None = None) -> int:
        """Parameter bytes per rank (of parameter `only`, if given)."""
        return sum(
            math.prod(local_shape(p.shape, layouts.get(n, REPLICATE), self.tp.size, self.tp.rank)) * p.element_size()
            for n, p in self.module.named_parameters() if only in (None, n)
        )


def default_budget(module: nn.Module, decisions: list[Decision], pricing: Pricing) -> int:
    """Every weight matrix of a Linear / Embedding split by its first valid style (column / vocabulary first; K/V
    heads replicated where a block has fewer heads than ranks), every other parameter whole; plus BUDGET_SLACK."""
    layouts: dict[str, Layout] = {}
    for d in decisions:
        for j, name in enumerate(d.modules):
            if isinstance(module.get_submodule(name), (nn.Linear, nn.Embedding)):
                layouts |= next(filter(None, (split_alone(pricing, name, c[j]) for c in d.choices)), {})
    return int(pricing.memory({n: x for n, x in layouts.items() if n.endswith(".weight")}) * (1 + BUDGET_SLACK))


def split_alone(pricing: Pricing, name: str, style: Style | None) -> dict[str, Layout] | None:
    """The layouts of module `name`'s parameters under `style`, if it shards them validly on its own."""
    if style is None:
        return None
    try:
        return planned_tensors(pricing.module, {name: style}, pricing.tp.size).parameters
    except (ValueError, TypeError):
        return None
