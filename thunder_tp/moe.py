"""Mixture of experts that Thunder can trace: litgpt's `LLaMAMoE` with its routed experts as one opaque symbol.

litgpt's `LLaMAMoE.forward` gathers each expert's tokens with `torch.where(mask)`, whose result shape depends
on the data, so Thunder cannot trace it. Here the router (gate, top-k, softmax or grouped top-k, routed
scaling) stays ordinary traced ops, and the routed experts become `moe_routed_experts`: tokens x C and
tokens x k routing weights and expert indices in, tokens x C out. Inside, rows are sorted by expert, each
expert's SwiGLU MLP runs on its rows, and the weighted results are added back to their tokens.

A jit lookaside for `LLaMAMoE.forward` calls this form, so a plain `thunder.jit` of a litgpt MoE model
traces once thunder_tp is imported. The symbol's grad is `moe_routed_experts_backward`, which recomputes
the forward through torch.autograd (the forward keeps no data-dependent residuals).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from thunder.core.interpreter import _interpret_call
from thunder.core.jit_ext import register_general_jit_lookaside
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import register_grad
from thunder.extend import OperatorExecutor, add_default_executor, register_executor

from thunder_tp.annotate import annotate
from thunder_tp.layouts import REPLICATE

__all__ = ["moe_executor", "moe_routed_experts", "moe_routed_experts_backward", "routed_experts"]

#: Runs the MoE symbols (opaque: never fused). A Thunder default executor, so `executors()`, tests' executor
#: lists and a plain `thunder.jit` all include it.
moe_executor = OperatorExecutor("thunder_tp_moe", version="0.1")
register_executor(moe_executor)
add_default_executor(moe_executor)

Tensors = Sequence[torch.Tensor]
OptionalTensors = Sequence[torch.Tensor] | None


def _expert_mlp(x, fc_1, fc_2, proj, fc_1_bias, fc_2_bias, proj_bias) -> torch.Tensor:
    """litgpt's LLaMAMLP: proj(silu(fc_1(x)) * fc_2(x))."""
    return F.linear(F.silu(F.linear(x, fc_1, fc_1_bias)) * F.linear(x, fc_2, fc_2_bias), proj, proj_bias)


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    fc_1: Tensors,
    fc_2: Tensors,
    proj: Tensors,
    fc_1_bias: OptionalTensors = None,
    fc_2_bias: OptionalTensors = None,
    proj_bias: OptionalTensors = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert[indices[t, j]](x[t]) for every token t (torch implementation)."""
    n_expert, k = len(fc_1), indices.shape[1]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # routed rows grouped by expert, tokens ascending within each
    tokens = order // k
    counts = torch.bincount(flat, minlength=n_expert).tolist()
    none = (None,) * n_expert
    outputs = [
        _expert_mlp(rows, *params)
        for rows, *params in zip(
            x[tokens].split(counts), fc_1, fc_2, proj, fc_1_bias or none, fc_2_bias or none, proj_bias or none
        )
    ]
    weighted = (torch.cat(outputs) * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, weighted)


def _differentiable(x, weights, indices, *params) -> list[torch.Tensor]:
    """The inputs that get a grad, in the order the backward returns them."""
    return [x, weights, *(t for group in params if group is not None for t in group)]


def _routed_experts_backward(grad: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
    """Grads of x, weights and every expert parameter, by recomputing the forward under torch.autograd."""
    inputs = _differentiable(*args)
    with torch.enable_grad():
        leaves = {id(t): t.detach().requires_grad_() for t in inputs}
        x, weights, indices, *groups = (
            [leaves[id(t)] for t in a] if isinstance(a, (list, tuple)) else leaves.get(id(a), a) for a in args
        )
        y = routed_experts(x, weights, indices, *groups)
        grads = torch.autograd.grad(y, list(leaves.values()), grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves.values(), grads))


def _forward_meta(x, weights, indices, fc_1, fc_2, proj, fc_1_bias=None, fc_2_bias=None, proj_bias=None) -> TensorProxy:
    """Same signature as `routed_experts`: propagation rules read the arguments by name."""
    return TensorProxy(like=x)


def _backward_meta(grad: TensorProxy, *args) -> tuple[TensorProxy, ...]:
    return tuple(TensorProxy(like=t) for t in _differentiable(*args))


moe_routed_experts = moe_executor.register_operator("moe_routed_experts", meta=_forward_meta, fn=routed_experts)
moe_routed_experts_backward = moe_executor.register_operator(
    "moe_routed_experts_backward", meta=_backward_meta, fn=_routed_experts_backward
)


def _routed_experts_grad(*args) -> TensorProxy:
    y = moe_routed_experts(*args)
    grads = moe_routed_experts_backward(get_grad(y), *args)
    for t, g in zip(_differentiable(*args), grads):
        put_grad(t, g)
    return y


register_grad(moe_routed_experts, _routed_experts_grad)


# --- litgpt ----------------------------------------------------------------------------------------------


def _expert_parameters(experts) -> tuple:
    """fc_1, fc_2 and proj weights of every expert, then their biases (None without biases)."""
    layers = ("fc_1", "fc_2", "proj")
    weights = tuple([getattr(e, layer).weight for e in experts] for layer in layers)
    biased = experts[0].fc_1.bias is not None
    biases = tuple([getattr(e, layer).bias for e in experts] if biased else None for layer in layers)
    return (*weights, *biases)


def grouped_topk_route(gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """litgpt's GroupedTopkRouter.forward without its in-place normalization (Thunder 0.2.6 differentiates
    `topk_weights /= topk_weights.sum(...)` through the updated value: wrong grads)."""
    scores = F.linear(x.type(torch.float32), gate.weight.type(torch.float32)).sigmoid()
    indices = gate.get_topk_indices(scores)
    weights = scores.gather(1, indices)
    if gate.config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, indices


def llama_moe_forward(module, x: torch.Tensor) -> torch.Tensor:
    """litgpt's LLaMAMoE.forward with the routed experts as `moe_routed_experts` (same router, same result)."""
    config = module.config
    B, T, C = x.size()
    tokens = x.view(-1, C)
    if not config.n_expert_groups:
        router = module.gate(tokens)
        probs, indices = torch.topk(router, config.n_expert_per_token)
        probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
    else:
        probs, indices = grouped_topk_route(module.gate, tokens)
    if config.routed_scaling_factor != 1.0:
        probs = probs * config.routed_scaling_factor
    y = moe_routed_experts(tokens, probs, indices, *_expert_parameters(module.experts))
    if config.n_shared_expert:  # on the same (B*T, C) tokens: under TP one copy of them, one grad reduction
        y = y + module.shared_experts(tokens)
    return annotate(y, REPLICATE).view(B, T, C)  # under TP: experts' partial sums reduced here, once per layer


try:
    from litgpt.model import LLaMAMoE
except ImportError:  # litgpt is optional: without it there is nothing to divert
    LLaMAMoE = None

if LLaMAMoE is not None:

    @register_general_jit_lookaside(LLaMAMoE.forward)
    def _llama_moe_lookaside(module, x):
        """thunder.jit traces `llama_moe_forward` wherever litgpt's LLaMAMoE.forward is called."""
        return _interpret_call(llama_moe_forward, module, x)
