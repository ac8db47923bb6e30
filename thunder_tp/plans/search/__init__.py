"""An automatic plan: the styles that minimize a training step's communication under a parameter-memory budget.

The model is traced once from example inputs (Thunder's interpreter, stopped before anything runs, so meta tensors
and meta-device models work). Every module that owns parameters is a decision; modules that differ only in their
block index (`transformer.h.3.mlp.fc`) are one decision, searched once. Each decision picks a style (or none) for
its modules; propagation lays out everything in between, and `rewriting/communication.py` prices the result: the forward
and backward collectives of one step under reshard.py's alpha-beta cost. The search is coordinate descent (the
cheapest single move first) from "every weight matrix sharded" (plain column splits, by whole heads where the trace
splits the output into heads), deterministic, so every rank finds the same plan. The interpretation is kept: a
compile of the same module whose first call is like the example starts from it (`TensorParallel` hands it over).
"""

from __future__ import annotations

import time

import torch.nn as nn

from thunder_tp.layouts import TPGroup
from thunder_tp.plans.search.decisions import decisions_of
from thunder_tp.plans.search.keys import plan_of
from thunder_tp.plans.search.pricing import Pricing, default_budget
from thunder_tp.plans.search.search import search
from thunder_tp.plans.search.tracing import traced
from thunder_tp.rewriting.communication import Communication
from thunder_tp.styles import Style
from thunder_tp.thunder_internals.private import Interpretation, original_module

__all__ = ["AutoPlan", "auto"]


class AutoPlan(dict):
    """A plan (module name or glob -> style) found by `auto`, with what the search measured."""

    def __init__(self, plan: dict[str, Style], pricing: Pricing, *, comm: Communication, bytes_per_rank: int,
                 budget: int, seconds: float, trace_seconds: float):
        super().__init__(plan)
        self.tp_size, self.communication = pricing.tp.size, comm
        self.bytes_per_rank, self.budget = bytes_per_rank, budget
        self.seconds, self.trace_seconds, self.evaluated = seconds, trace_seconds, pricing.evaluated
        self._pricing, self._handed = pricing, False

    @property
    def trace_reused(self) -> bool:
        """Whether a compile started from the search's trace instead of interpreting the model again."""
        interpretation = self._pricing.trace.interpretation
        return interpretation is not None and interpretation.reused

    def take_interpretation(self) -> Interpretation | None:
        """Thunder's interpretation of the traced call, once (a compile that starts from it rewrites it in place)."""
        handed, self._handed = self._handed, True
        return None if handed else self._pricing.trace.interpretation

    def price(self, plan: dict[str, Style]) -> tuple[Communication, int]:
        """Another plan's communication per step and parameter bytes per rank, priced on the same trace."""
        if self.trace_reused:
            raise RuntimeError("thunder_tp.plans.auto: price other plans before the first call of a model jitted with "
                               "this plan: its compile started from the search's trace and rewrote it for TP")
        return self._pricing.price_plan(plan)

    def __str__(self) -> str:
        head = (
            f"thunder_tp.plans.auto (TP={self.tp_size}): parameters {self.bytes_per_rank / 2**20:.2f} MiB per rank "
            f"(budget {self.budget / 2**20:.2f} MiB); per step {self.communication}; search {self.seconds:.2f} s "
            f"(trace {self.trace_seconds:.2f} s, {self.evaluated} plans priced)"
        )
        return "\n".join([head, *(f"  {k!r}: {v!r}" for k, v in self.items())])


def auto(model: nn.Module, *example_args, tp_size: int, memory: int | None = None, for_inference: bool = False,
         **example_kwargs) -> AutoPlan:
    """The plan with the least communication per step (forward and backward; forward only `for_inference`) whose
    parameters fit `memory` bytes per rank (default: every weight matrix sharded, K/V heads replicated where a
    block has fewer heads than ranks, 1-D parameters whole, plus 1%), searched on a trace of `model(*example_args,
    **example_kwargs)` (shapes only: meta tensors and meta-device models are fine)."""
    start = time.perf_counter()
    module = original_module(model)
    trace = traced(module, example_args, example_kwargs)
    trace_seconds = time.perf_counter() - start
    pricing = Pricing(module, trace, TPGroup(None, tp_size, 0), training=not for_inference)
    decisions = decisions_of(module, trace, tp_size)
    budget = memory if memory is not None else default_budget(module, decisions, pricing)
    choice, (comm, used) = search(decisions, pricing, budget)
    plan = plan_of(module, decisions, choice)
    return AutoPlan(plan, pricing, comm=comm, bytes_per_rank=used, budget=budget,
                    seconds=time.perf_counter() - start, trace_seconds=trace_seconds)
