"""HuggingFace sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) as one `moe_layer` call, as litgpt's LLaMAMoE.

Their forward loops over the experts that received tokens (`nonzero`, `torch.where(mask)`: data-dependent shapes),
which Thunder cannot trace. `register_lookasides(model)` (the HF family's hook) diverts the forward of every such
block class in the model to `hf_moe_forward`: the same router (softmax over all experts in float32, top-k,
renormalized when the block says so), the same experts, Qwen2-MoE's sigmoid-gated shared expert, and the router
logits the decoder layer expects back.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from thunder_tp.models.moe import Routing, mlp_parameters, moe_layer
from thunder_tp.thunder_internals import patches
from thunder_tp.thunder_internals.private import interpret_call

#: block class name -> the names of each expert's gate, up and down projections
EXPERT_LAYERS = {
    "MixtralSparseMoeBlock": ("w1", "w3", "w2"),
    "Qwen2MoeSparseMoeBlock": ("gate_proj", "up_proj", "down_proj"),
    "Qwen3MoeSparseMoeBlock": ("gate_proj", "up_proj", "down_proj"),
}
_registered: set[type] = set()


def is_moe_block(module: nn.Module) -> bool:
    """Whether `module` is a sparse MoE block that `hf_moe_forward` computes."""
    return type(module).__name__ in EXPERT_LAYERS


def expert_layers(module: nn.Module) -> tuple[str, str, str]:
    """The names of the gate, up and down projections of the block's experts (and shared expert)."""
    return EXPERT_LAYERS[type(module).__name__]


def _shared_expert(module: nn.Module) -> tuple:
    """Qwen2-MoE's shared expert: its [gate, up, down] weights, biases (None) and [sigmoid gate weight]."""
    shared = getattr(module, "shared_expert", None)
    if shared is None:
        return None, None, None
    gate, up, down = mlp_parameters([shared], expert_layers(module))[:3]
    return [gate[0], up[0], down[0]], None, [module.shared_expert_gate.weight]


def check_supported(module: nn.Module, name: str) -> None:
    """A clear error for what `hf_moe_forward` does not compute as the block does."""
    act = getattr(module.experts[0], "act_fn", None)
    if not isinstance(act, nn.SiLU):
        raise NotImplementedError(
            f"thunder_tp: the experts of {name} ({type(module).__name__}) use {type(act).__name__}, not SiLU; "
            "thunder_tp's moe_layer computes SwiGLU experts only"
        )
    if any(getattr(e, layer).bias is not None for e in module.experts for layer in expert_layers(module)):
        raise NotImplementedError(f"thunder_tp: the experts of {name} have biases; moe_layer shards bias-free experts")


def hf_moe_forward(module: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's forward as one `moe_layer` call: (output, router logits)."""
    if module.training and getattr(module, "jitter_noise", 0) > 0:
        raise NotImplementedError("thunder_tp: Mixtral's router jitter noise (router_jitter_noise > 0) is not traced")
    routing = Routing(k=module.top_k, norm_topk_prob=getattr(module, "norm_topk_prob", True), softmax_first=True)
    shared = _shared_expert(module)
    experts = mlp_parameters(module.experts, expert_layers(module))
    y = moe_layer(hidden_states, module.gate.weight, None, *experts, *shared, routing)
    router_logits = F.linear(hidden_states.reshape(-1, hidden_states.shape[-1]), module.gate.weight)
    return y, router_logits


def register_lookasides(model: nn.Module) -> None:
    """Make thunder.jit trace `hf_moe_forward` wherever the forward of a sparse MoE block class of `model` is called."""
    for module in model.modules():
        cls = type(module)
        if is_moe_block(module) and cls not in _registered:
            patches.register_lookaside(cls.forward)(
                lambda block, hidden_states: interpret_call(hf_moe_forward, block, hidden_states)
            )
            _registered.add(cls)
