"""Rule for the routed experts of a mixture of experts: every expert's MLP sharded like a dense Megatron MLP."""

from __future__ import annotations

from thunder_tp.layouts import PARTIAL, REPLICATE, Layout, Shard
from thunder_tp.moe import moe_routed_experts
from thunder_tp.propagation.engine import Op, Strategy, register_rule

#: fc_1 / fc_2 column-parallel (weight and bias dim 0), proj row-parallel (weight dim 1)
_EXPERT_LAYOUTS = {"fc_1": Shard(0), "fc_2": Shard(0), "proj": Shard(1), "fc_1_bias": Shard(0), "fc_2_bias": Shard(0)}


@register_rule(moe_routed_experts)
def routed_experts(op: Op) -> list[Strategy]:
    """Tokens, routing weights and indices Replicate, experts sharded -> Partial: one reduction per MoE layer.

    A proj bias would be added once per rank, so experts with one stay replicated.
    """
    if op.arg("proj_bias") is not None:
        return [op.replicated()]
    by_name: dict[str, Layout] = {}
    for argument, layout in _EXPERT_LAYOUTS.items():
        for t in op.arg(argument) or ():
            by_name[t.name] = layout
    sharded = tuple(by_name.get(t.name, REPLICATE) for t in op.tensors)
    return [Strategy(sharded, (PARTIAL,)), op.replicated()]
