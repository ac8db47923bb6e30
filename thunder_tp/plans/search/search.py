"""The automatic plan's search: coordinate descent over the decisions, the cheapest single move first, deterministic,
under a memory budget."""

from __future__ import annotations

from itertools import product

from thunder_tp.layouts import REPLICATE
from thunder_tp.plans.search.decisions import Decision
from thunder_tp.plans.search.pricing import Pricing, split_alone
from thunder_tp.rewriting.communication import Communication
from thunder_tp.styles import FeatureShardedNorm, KVCacheParallel, Style
from thunder_tp.styles.matching import planned_tensors


def search(decisions: list[Decision], pricing: Pricing, budget: int) -> tuple[tuple[int, ...], tuple]:
    """Coordinate descent (`_descended`: the cheapest single move first) from two starts, the better end winning (ties:
    the first): from the most sharded plan in trace order, and from a greedy pass (`_built`) with the weight matrices
    first (norms then decide once the matrices around them have found their pattern)."""
    sharded = _most_sharded(decisions, pricing, budget)
    trace_order = list(range(len(decisions)))
    vectors = [all(s is None or isinstance(s, (FeatureShardedNorm, KVCacheParallel)) for c in d.choices for s in c)
               for d in decisions]
    matrices_first = sorted(trace_order, key=lambda i: vectors[i])
    ends = [_descended(decisions, pricing, budget, sharded, trace_order),
            _descended(decisions, pricing, budget, _built(decisions, pricing, budget, sharded, matrices_first),
                       matrices_first)]
    choice = min(ends, key=lambda c: _score(pricing.price(decisions, c)))
    pairs = [i for i in range(len(decisions) - 1) if vectors[i] != vectors[i + 1]]
    while (better := _pair_moved(decisions, pricing, budget, choice, pairs)) != choice:
        choice = _descended(decisions, pricing, budget, better, trace_order)
    return choice, pricing.price(decisions, choice)


def _pair_moved(decisions: list[Decision], pricing: Pricing, budget: int, choice: tuple[int, ...],
                pairs: list[int]) -> tuple[int, ...]:
    """The best change of a norm and the layer next to it in trace order (decisions i and i + 1 for i in `pairs`),
    which single changes cannot reach (a feature-split norm feeding a row-parallel head, against a replicated one
    feeding a column-parallel head); `choice` itself if none is cheaper."""
    best, moved = _score(pricing.price(decisions, choice)), choice
    for i in pairs:
        for a, b in product(range(len(decisions[i].choices)), range(len(decisions[i + 1].choices))):
            trial = (*choice[:i], a, b, *choice[i + 2:])
            priced = pricing.price(decisions, trial)
            if priced is not None and priced[1] <= budget and _score(priced) < best:
                best, moved = _score(priced), trial
    return moved


def _descended(decisions: list[Decision], pricing: Pricing, budget: int, choice: tuple[int, ...],
               order: list[int]) -> tuple[int, ...]:
    """Steepest descent: of every single change (one decision's combination, the others fixed) the cheapest one is
    made (communication cost, then memory; ties: the first in `order`, then the earlier combination), until none
    is cheaper."""
    best = _score(pricing.price(decisions, choice))
    while True:
        moved = choice
        for i in order:
            for j in range(len(decisions[i].choices)):
                trial = (*choice[:i], j, *choice[i + 1:])
                priced = pricing.price(decisions, trial)
                if priced is not None and priced[1] <= budget and _score(priced) < best:
                    moved, best = trial, _score(priced)
        if moved == choice:
            return choice
        choice = moved


def _built(decisions: list[Decision], pricing: Pricing, budget: int, sharded: tuple[int, ...],
           order: list[int]) -> tuple[int, ...]:
    """Each decision (in `order`) takes its cheapest choice given those before it, with those after it replicated
    (so that a column-parallel layer finds its row-parallel partner next, as Megatron pairs them); the budget is
    checked as if those after it were most sharded, so that it still holds at the end."""
    replicated = [d.choices.index((None,) * len(d.modules)) for d in decisions]
    chosen = list(sharded)
    for k, i in enumerate(order):
        later = set(order[k + 1:])
        best = None
        for j in range(len(decisions[i].choices)):
            at_most = tuple(sharded[x] if x in later else chosen[x] for x in range(len(decisions)))
            used = pricing.memory_of(decisions, (*at_most[:i], j, *at_most[i + 1:]))
            if used is None or used > budget:
                continue
            trial = tuple(replicated[x] if x in later else chosen[x] for x in range(len(decisions)))
            priced = pricing.price(decisions, (*trial[:i], j, *trial[i + 1:]))
            if priced is not None and (best is None or priced[0].cost < best[0]):
                best = (priced[0].cost, j)
        chosen[i] = best[1] if best else sharded[i]
    return tuple(chosen)


def _score(priced: tuple[Communication, int]) -> tuple[float, int]:
    return priced[0].cost, priced[1]


def _most_sharded(decisions: list[Decision], pricing: Pricing, budget: int) -> tuple[int, ...]:
    """Each decision's first combination that splits its own parameters validly (column-parallel first: K/V heads
    replicated where they are too few); where that is over budget, each decision's combination with the fewest
    parameter bytes; an error if even that is over budget."""
    first = tuple(
        next((j for j, c in enumerate(d.choices) if all(s is None or split_alone(pricing, m, s) is not None
                                                         for m, s in zip(d.modules, c, strict=True))),
                                                         len(d.choices) - 1)
        for d in decisions
    )
    choice = first
    if (pricing.memory_of(decisions, first) or 0) > budget:
        fewest = list(first)
        for i, d in enumerate(decisions):
            sizes = {j: pricing.memory_of(decisions, (*first[:i], j, *first[i + 1:])) for j in range(len(d.choices))}
            fewest[i] = min((j for j in sizes if sizes[j] is not None), key=lambda j: (sizes[j], j), default=first[i])
        choice = tuple(fewest)
    priced = pricing.price(decisions, choice)
    if priced is None:
        raise RuntimeError("thunder_tp.plans.auto: the plan with every weight matrix sharded does not run on this "
                           "model (propagation refused it); please report the model, and pass a hand plan meanwhile")
    if priced[1] > budget:
        raise MemoryError(_over_budget(pricing, pricing.styles(decisions, choice), priced[1], budget))
    return choice


def _over_budget(pricing: Pricing, styles: dict[str, Style], used: int, budget: int) -> str:
    """Which parameters dominate when even the most sharded plan does not fit."""
    layouts = planned_tensors(pricing.module, styles, pricing.tp.size).parameters
    sizes = sorted(((pricing.memory({n: layouts.get(n, REPLICATE)}, only=n), n)
                    for n, _ in pricing.module.named_parameters()), reverse=True)
    top = ", ".join(f"{n} ({b / 2**20:.2f} MiB)" for b, n in sizes[:5])
    return (f"thunder_tp.plans.auto: no plan fits {budget / 2**20:.2f} MiB of parameters per rank on {pricing.tp.size} "
            f"ranks: the most sharded one needs {used / 2**20:.2f} MiB; the largest per rank: {top}. Raise memory=, "
            "use more ranks, or also shard the data-parallel way (FSDP)")
