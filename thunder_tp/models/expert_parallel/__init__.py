"""Expert parallelism: each rank holds n_expert / tp experts whole, and a MoE layer sends its tokens to them
(`op`: how, and the op that does it; `compute`: its forward and backward on each rank's tensors; `rule`: the
propagation rule of `moe_layer` that chooses it). The styles that plan it are `thunder_tp.styles.expert`."""

from thunder_tp.models.expert_parallel import op, rule  # noqa: F401  (importing them registers the op and the rule)
