"""Mixture of experts that Thunder can trace: a whole MoE layer as one opaque symbol, `moe_layer`.

litgpt's `LLaMAMoE.forward` gathers each expert's tokens with `torch.where(mask)`, whose result shape depends
on the data, so Thunder cannot trace it. `moe_layer` takes the whole layer: activations (B, T, C), the
router's weight, every expert's parameters and the shared experts' in; (B, T, C) out. Inside, the router
picks k experts per token (softmax top-k, or litgpt's grouped top-k), rows are sorted by expert, each
expert's SwiGLU MLP runs on its rows, and the weighted results are added back to their tokens.

Under TP the router and the activations are the layer's only replicated inputs: their grads are partial
sums (each rank's experts' share) reduced by the rewrite's entry into the TP region, so a layer costs what
a dense Megatron MLP does (one reduction each way; with SP one reduce_scatter and one all_gather each way),
plus one all_reduce of the router weight's grad.

litgpt's and HF's MoE blocks are traced as this op by their families' lookasides (`thunder_tp.models.litgpt`,
`thunder_tp.models.hf.moe`), so a plain `thunder.jit` of such a model traces once thunder_tp is imported. The
symbol's grad is `moe_layer_backward`, which recomputes the forward through torch.autograd (the forward keeps no
data-dependent residuals). Its propagation rule for experts split like dense MLPs is at the end; with experts whole
on their ranks (expert parallelism) the layer runs as `thunder_tp.models.expert_parallel.op` describes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import register_grad
from thunder.extend import OperatorExecutor, add_default_executor, register_executor

from thunder_tp.layouts import PARTIAL, REPLICATE, Layout, Shard
from thunder_tp.propagation.engine import Op, Strategy

__all__ = [
    "Routing", "differentiable_inputs", "expert_mlp", "expert_order", "expert_parameters", "mlp_parameters",
    "moe_executor", "moe_layer", "moe_layer_backward", "moe_layer_torch", "route", "shared_experts", "sharded_experts",
    "weighted_sum",
]

#: Runs the MoE symbols (opaque: never fused). A Thunder default executor, so `executors()`, tests' executor
#: lists and a plain `thunder.jit` all include it.
moe_executor = OperatorExecutor("thunder_tp_moe", version="0.1")
register_executor(moe_executor)
add_default_executor(moe_executor)

Tensors = Sequence[torch.Tensor]
OptionalTensors = Sequence[torch.Tensor] | None


@dataclass(frozen=True)
class Routing:
    """The router's settings: k experts per token, expert groups, routed scaling (a litgpt Config's), or
    `softmax_first` (HF's routers: softmax over all experts in float32, then top-k, renormalized when
    `norm_topk_prob`)."""

    k: int
    n_expert_groups: int | None = None
    n_topk_groups: int | None = None
    n_topk_scores_per_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    softmax_first: bool = False

    @classmethod
    def of(cls, config) -> Routing:
        """The routing of a litgpt Config."""
        return cls(config.n_expert_per_token, config.n_expert_groups, config.n_topk_groups,
                   config.n_topk_scores_per_group, config.norm_topk_prob, config.routed_scaling_factor)


def expert_mlp(x, fc_1, fc_2, proj, fc_1_bias, fc_2_bias, proj_bias) -> torch.Tensor:
    """litgpt's LLaMAMLP: proj(silu(fc_1(x)) * fc_2(x))."""
    return F.linear(F.silu(F.linear(x, fc_1, fc_1_bias)) * F.linear(x, fc_2, fc_2_bias), proj, proj_bias)


def _grouped_choice(scores: torch.Tensor, score_bias: torch.Tensor, r: Routing) -> torch.Tensor:
    """Grouped top-k (DeepSeek-V3, as litgpt's GroupedTopkRouter): the k experts of each token, chosen among
    the experts of its best groups (a group scored by the sum of its best few biased scores)."""
    biased = scores + score_bias
    n, n_expert = biased.shape
    per_group = biased.view(n, r.n_expert_groups, -1)
    group_scores = per_group.topk(r.n_topk_scores_per_group, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(r.n_topk_groups, dim=-1, sorted=False).indices
    in_best = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best_groups, True)
    candidates = biased.masked_fill(~in_best.repeat_interleave(n_expert // r.n_expert_groups, dim=1), 0.0)
    return candidates.topk(r.k, dim=-1, sorted=False).indices


def route(tokens: torch.Tensor, gate_weight: torch.Tensor, score_bias, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights and expert indices (tokens x k) as litgpt's LLaMAMoE (or HF's sparse MoE block) computes them."""
    if r.softmax_first:
        weights, indices = torch.topk(F.linear(tokens, gate_weight).softmax(dim=1, dtype=torch.float), r.k, dim=-1)
        if r.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(tokens.dtype)
    elif not r.n_expert_groups:
        logits, indices = torch.topk(F.linear(tokens, gate_weight), r.k)
        weights = logits.softmax(dim=1, dtype=torch.float).to(tokens.dtype)
    else:  # litgpt's GroupedTopkRouter: sigmoid scores in float32, choice without grad
        scores = F.linear(tokens.float(), gate_weight.float()).sigmoid()
        with torch.no_grad():
            indices = _grouped_choice(scores, score_bias, r)
        weights = scores.gather(1, indices)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * r.routed_scaling_factor if r.routed_scaling_factor != 1.0 else weights), indices


def expert_order(indices: torch.Tensor, n_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed (token, expert) pairs grouped by expert, tokens ascending within each (positions in the flattened
    tokens x k pairs: pair p is token p // k's), and how many pairs each expert has."""
    flat = indices.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=n_expert)


def expert_parameters(fc_1, fc_2, proj, fc_1_bias, fc_2_bias, proj_bias) -> list[tuple]:
    """Each expert's (fc_1, fc_2, proj, fc_1_bias, fc_2_bias, proj_bias), None for absent biases."""
    none = (None,) * len(fc_1)
    return list(zip(fc_1, fc_2, proj, fc_1_bias or none, fc_2_bias or none, proj_bias or none, strict=True))


def weighted_sum(tokens: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                 outputs: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * output of pair (t, j) for every token t; `outputs`: the pairs' expert outputs in
    `order`."""
    weighted = (outputs * weights.reshape(-1)[order, None]).to(tokens.dtype)
    return torch.zeros_like(tokens).index_add_(0, order // weights.shape[1], weighted)


def _routed_experts(tokens, weights, indices, *experts) -> torch.Tensor:
    """sum_j weights[t, j] * expert[indices[t, j]](tokens[t]) for every token t."""
    params = expert_parameters(*experts)
    order, counts = expert_order(indices, len(params))
    rows = tokens[order // indices.shape[1]].split(counts.tolist())
    outputs = torch.cat([expert_mlp(x, *p) for x, p in zip(rows, params, strict=True)])
    return weighted_sum(tokens, weights, order, outputs)


def shared_experts(tokens: torch.Tensor, shared: Tensors, shared_bias: OptionalTensors,
                   shared_gate: OptionalTensors) -> torch.Tensor:
    """The shared experts' output, scaled by sigmoid(tokens @ shared_gate) where given (Qwen2-MoE)."""
    out = expert_mlp(tokens, *shared, *(shared_bias or (None,) * 3))
    return out if shared_gate is None else torch.sigmoid(F.linear(tokens, shared_gate[0])) * out


def moe_layer_torch(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    score_bias: torch.Tensor | None,
    fc_1: Tensors,
    fc_2: Tensors,
    proj: Tensors,
    fc_1_bias: OptionalTensors,
    fc_2_bias: OptionalTensors,
    proj_bias: OptionalTensors,
    shared: OptionalTensors,
    shared_bias: OptionalTensors,
    shared_gate: OptionalTensors,
    routing: Routing,
) -> torch.Tensor:
    """A MoE layer on x (B, T, C): routed experts plus shared experts, these scaled by sigmoid(x @ shared_gate)
    where given (Qwen2-MoE) (torch implementation)."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, indices = route(tokens, gate_weight, score_bias, routing)
    y = _routed_experts(tokens, weights, indices, fc_1, fc_2, proj, fc_1_bias, fc_2_bias, proj_bias)
    if shared is not None:
        y = y + shared_experts(tokens, shared, shared_bias, shared_gate)
    return y.view(x.shape)


def differentiable_inputs(x, gate_weight, score_bias, *params_and_routing) -> list[torch.Tensor]:
    """The inputs that get a grad, in the order the backward returns them."""
    params = params_and_routing[:-1]
    return [x, gate_weight, *(t for group in params if group is not None for t in group)]


def _moe_layer_backward(grad: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
    """Grads of x, the router weight and every expert parameter, by recomputing the forward under torch.autograd."""
    inputs = differentiable_inputs(*args)
    with torch.enable_grad():
        leaves = {id(t): t.detach().requires_grad_() for t in inputs}
        relinked = [[leaves[id(t)] for t in a] if isinstance(a, (list, tuple)) else leaves.get(id(a), a) for a in args]
        y = moe_layer_torch(*relinked)
        grads = torch.autograd.grad(y, list(leaves.values()), grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves.values(), grads, strict=True))


def _forward_meta(x, gate_weight, score_bias, fc_1, fc_2, proj, fc_1_bias, fc_2_bias, proj_bias, shared, shared_bias,
                  shared_gate, routing) -> TensorProxy:
    """Same signature as `moe_layer_torch`: propagation rules read the arguments by name."""
    return TensorProxy(like=x)


def _backward_meta(grad: TensorProxy, *args) -> tuple[TensorProxy, ...]:
    return tuple(TensorProxy(like=t) for t in differentiable_inputs(*args))


moe_layer = moe_executor.register_operator("moe_layer", meta=_forward_meta, fn=moe_layer_torch)
moe_layer_backward = moe_executor.register_operator("moe_layer_backward", meta=_backward_meta, fn=_moe_layer_backward)


def _moe_layer_grad(*args) -> TensorProxy:
    y = moe_layer(*args)
    grads = moe_layer_backward(get_grad(y), *args)
    for t, g in zip(differentiable_inputs(*args), grads, strict=True):
        put_grad(t, g)
    return y


register_grad(moe_layer, _moe_layer_grad)


def mlp_parameters(experts, layers: tuple[str, str, str] = ("fc_1", "fc_2", "proj")) -> tuple:
    """The gate, up and down projections' weights of every MLP in `experts` (named `layers`), then their biases
    (None without biases)."""
    weights = tuple([getattr(e, layer).weight for e in experts] for layer in layers)
    biased = getattr(experts[0], layers[0]).bias is not None
    biases = tuple([getattr(e, layer).bias for e in experts] if biased else None for layer in layers)
    return (*weights, *biases)


# --- its propagation rule -------------------------------------------------------------------------------

#: fc_1 / fc_2 column-parallel (weight and bias dim 0), proj row-parallel (weight dim 1)
_EXPERT_LAYOUTS = {"fc_1": Shard(0), "fc_2": Shard(0), "proj": Shard(1), "fc_1_bias": Shard(0), "fc_2_bias": Shard(0)}
_SHARED_LAYOUTS = {"shared": (Shard(0), Shard(0), Shard(1)), "shared_bias": (Shard(0), Shard(0), REPLICATE)}


def sharded_experts(op: Op) -> list[Strategy]:
    """Experts split like dense MLPs: activations and router Replicate, experts sharded -> Partial: one reduction
    per MoE layer (the rule of `moe_layer` unless its experts are expert-parallel: `models.expert_parallel.rule`).

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
        for t, layout in zip(op.arg(argument) or (), layouts, strict=False):
            by_name[t.name] = layout
    sharded = tuple(by_name.get(t.name, REPLICATE) for t in op.tensors)
    return [Strategy(sharded, (PARTIAL,)), op.replicated()]
