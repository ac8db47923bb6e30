"""Rule for a mixture-of-experts layer: every expert's MLP (and the shared experts') sharded like a dense
Megatron MLP; activations and router replicated."""

from __future__ import annotations

from thunder_tp.layouts import PARTIAL, REPLICATE, Layout, Shard
from thunder_tp.moe import moe_layer
from thunder_tp.propagation.engine import Op, Strategy, register_rule

#: fc_1 / fc_2 column-parallel (weight and bias dim 0), proj row-parallel (weight dim 1)
_EXPERT_LAYOUTS = {"fc_1": Shard(0), "fc_2": Shard(0), "proj": Shard(1), "fc_1_bias": Shard(0), "fc_2_bias": Shard(0)}
_SHARED_LAYOUTS = {"shared": (Shard(0), Shard(0), Shard(1)), "shared_bias": (Shard(0), Shard(0), REPLICATE)}


@register_rule(moe_layer)
def moe(op: Op) -> list[Strategy]:
    """Activations and router Replicate, experts sharded -> Partial: one reduction per MoE layer.

    The replicated inputs' grads are then partial sums (each rank's experts' share), reduced on entry into the
    TP region. A proj bias would be added once per rank, so experts with one stay replicated.
    """
    if op.arg("proj_bias") is not None or (op.arg("shared_bias") or (None,) * 3)[2] is not None:
        return [op.replicated()]
    by_name: dict[str, Layout] = {}
    for argument, layout in _EXPERT_LAYOUTS.items():
        for t in op.arg(argument) or ():
            by_name[t.name] = layout
    for argument, layouts in _SHARED_LAYOUTS.items():
        for t, layout in zip(op.arg(argument) or (), layouts):
            by_name[t.name] = layout
    sharded = tuple(by_name.get(t.name, REPLICATE) for t in op.tensors)
    return [Strategy(sharded, (PARTIAL,)), op.replicated()]
