"""The propagation rule of `moe_layer`: with its experts expert-parallel (`StackShard`, `thunder_tp.styles.expert`)
the layer runs as `expert_parallel.op` on each rank's tokens; otherwise its experts are split like dense MLPs
(`thunder_tp.models.moe.sharded_experts`)."""

from __future__ import annotations

import math
from functools import partial

from thunder_tp.layouts import PARTIAL, REPLICATE, Layout, Shard, StackShard
from thunder_tp.models.expert_parallel.compute import EXPERT_ARGUMENTS, HELD, SPLIT
from thunder_tp.models.expert_parallel.op import expert_parallel_moe
from thunder_tp.models.moe import moe_layer, sharded_experts
from thunder_tp.propagation.engine import Op, Strategy, register_rule

__all__ = ["moe_layer_rule"]

Issued = tuple[tuple[str, int], ...]


@register_rule(moe_layer)
def moe_layer_rule(op: Op) -> list[Strategy]:
    """Experts whole on their ranks (StackShard): the layer on each rank's tokens; else split like dense MLPs."""
    experts = _expert_layouts(op)
    if not any(layout.owner(op.tp.size) is not None for layout in experts.values()):
        return sharded_experts(op)
    x, *others = op.tensors
    forward, backward = _issued(op)

    def strategy(x_layout: Layout, output: Layout, tokens: str) -> Strategy:
        inputs = (x_layout, *(experts.get(t.name, REPLICATE) for t in others))
        local = partial(expert_parallel_moe, tokens=tokens, group=op.tp.group)
        return Strategy(inputs, (output,), local, issues=forward, backward_issues=backward)

    return [*(strategy(Shard(d), Shard(d), HELD) for d in range(x.ndim - 1)), strategy(REPLICATE, PARTIAL, SPLIT)]


def _issued(op: Op) -> tuple[Issued, Issued]:
    """The all_to_alls of the forward and of the backward for pricing, (kind, bytes of all ranks' parts): the counts,
    the dispatch and the combine of all tokens x k rows (the backward's dispatch twice as wide). How many rows leave
    each rank depends on the routing: they are priced as an even one."""
    x, size = op.arg("x"), op.tp.size
    pairs = math.prod(int(s) for s in x.shape) * op.arg("routing").k * x.dtype.bytes
    forward = (("all_to_all", size * 8 * len(op.arg("fc_1"))), ("all_to_all", pairs), ("all_to_all", pairs))
    return forward, (("all_to_all", 2 * pairs), ("all_to_all", pairs))


def _expert_layouts(op: Op) -> dict[str, Layout]:
    """The current layout of every expert tensor of the layer, checked: all expert-parallel in the order of the
    experts, or none."""
    layouts = {t.name: op.layout_of(t) for argument in EXPERT_ARGUMENTS for t in op.arg(argument) or ()}
    stacked = [layout.owner(op.tp.size) is not None for layout in layouts.values()]
    n_expert = len(op.arg("fc_1"))
    misplaced = [
        t.name for argument in EXPERT_ARGUMENTS for i, t in enumerate(op.arg(argument) or ())
        if any(stacked) and layouts[t.name] != StackShard(i, n_expert)
    ]
    if misplaced:
        raise NotImplementedError(
            f"thunder_tp: a MoE layer's experts are either all expert-parallel (ExpertParallel(i, {n_expert}) on "
            f"expert i's layers) or all split like dense MLPs; {misplaced[:4]} are not laid out as the others. Plan "
            "every expert of the layer alike (plans.litgpt / plans.hf with expert_parallel=True do)"
        )
    return layouts
