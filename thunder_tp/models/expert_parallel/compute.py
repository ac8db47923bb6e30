"""The expert-parallel MoE layer on the tensors of the ranks this process computes: the forward and the backward of
`thunder_tp.models.expert_parallel.op`, each through its exchanges (`thunder_tp.collectives.exchange`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from thunder_tp.collectives.exchange import RankExchange
from thunder_tp.models.moe import (
    Routing,
    expert_mlp,
    expert_order,
    expert_parameters,
    route,
    shared_experts,
    weighted_sum,
)

#: the tokens of a rank: all rows of its (sharded) activations, or its share of the rows of replicated ones
HELD, SPLIT = "held", "split"
#: the arguments of `moe_layer` that hold one tensor per expert, in the order of each expert's parameters
EXPERT_ARGUMENTS = ("fc_1", "fc_2", "proj", "fc_1_bias", "fc_2_bias", "proj_bias")


class MoEArgs(NamedTuple):
    """The arguments of `moe_layer`."""

    x: torch.Tensor
    gate_weight: torch.Tensor
    score_bias: torch.Tensor | None
    fc_1: list
    fc_2: list
    proj: list
    fc_1_bias: list | None
    fc_2_bias: list | None
    proj_bias: list | None
    shared: list | None
    shared_bias: list | None
    shared_gate: list | None
    routing: Routing

    def token_rows(self, tokens: str, rank: int, size: int) -> slice:
        """The rows of the flattened activations whose tokens `rank` routes."""
        n = tokens_of(self.x)
        return slice(0, n) if tokens == HELD else slice(rank * n // size, (rank + 1) * n // size)

    def local_experts(self, rank: int, size: int) -> list[tuple]:
        """The parameters of each expert `rank` holds."""
        per_rank = len(self.fc_1) // size
        experts = expert_parameters(self.fc_1, self.fc_2, self.proj, self.fc_1_bias, self.fc_2_bias, self.proj_bias)
        return experts[rank * per_rank : (rank + 1) * per_rank]


class Routed(NamedTuple):
    """A rank's tokens routed: the routing weights (tokens x k), the pairs grouped by expert (`expert_order`) and the
    pairs per expert."""

    weights: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor


class TokenSide(NamedTuple):
    """The token side of a rank's backward: its token rows, the grads through the router, the weighted sum and the
    shared experts (of the rows, the router weight, the pairs' results, the shared experts' parameters), and its
    tokens routed again."""

    rows: torch.Tensor
    rows_grad: torch.Tensor
    gate_grad: torch.Tensor
    results_grad: torch.Tensor
    shared_grads: list[torch.Tensor]
    routed: Routed


class ExpertGrads(NamedTuple):
    """The expert side of a rank's backward: the grads of the received rows (in the received order) and, per local
    expert, of each of its parameters by argument name (None for absent biases)."""

    inputs: torch.Tensor
    parameters: list[dict[str, torch.Tensor | None]]


def tokens_of(x) -> int:
    """Tokens of activations (..., C), a tensor or a proxy."""
    return math.prod(int(s) for s in x.shape[:-1])


def saved_rows(x, routing: Routing, tokens: str, size: int) -> int:
    """Rows of the pairs' results the forward saves: tokens x k (a split's largest share, so every rank's alike)."""
    n = tokens_of(x)
    return routing.k * (n if tokens == HELD else -(-n // size))


def _routed(tokens: torch.Tensor, a: MoEArgs, gate_weight: torch.Tensor) -> Routed:
    """The tokens routed by the router of weight `gate_weight`."""
    weights, indices = route(tokens, gate_weight, a.score_bias, a.routing)
    return Routed(weights, *expert_order(indices, len(a.fc_1)))


def _per_rank(counts: torch.Tensor, size: int) -> list[int]:
    """Pairs per destination rank, from the pairs per expert."""
    return counts.view(size, -1).sum(1).tolist()


def _by_expert(received_counts: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The order that groups received rows (by source rank, then expert) by expert, and the rows of each expert."""
    size, local = received_counts.shape
    expert_of_row = torch.arange(local, device=received_counts.device).repeat(size)
    expert_of_row = expert_of_row.repeat_interleave(received_counts.reshape(-1))
    return torch.argsort(expert_of_row, stable=True), received_counts.sum(0).tolist()


def _experts_forward(received: torch.Tensor, received_counts: torch.Tensor, experts: list[tuple]) -> torch.Tensor:
    """Each local expert's SwiGLU on its received rows, the results in the received order."""
    order, per_expert = _by_expert(received_counts)
    outputs = torch.cat([expert_mlp(x, *p) for x, p in zip(received[order].split(per_expert), experts, strict=True)])
    result = torch.empty_like(outputs)
    result[order] = outputs
    return result


def _placed(x: torch.Tensor, rows: slice, y: torch.Tensor) -> torch.Tensor:
    """`y` (this rank's token rows) at `rows` of a tensor like x, zeros on the others' rows."""
    if rows.stop - rows.start == tokens_of(x):
        return y.view(x.shape)
    full = y.new_zeros((tokens_of(x), x.shape[-1]))
    full[rows] = y
    return full.view(x.shape)


def layer_forward(*args, tokens: str, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output on this rank, the pairs' results it saves for the backward, and the counts it received."""
    ex = RankExchange(group)
    with ex.computing():
        layers = [MoEArgs(*(ex.values(a, r) for a in args)) for r in ex.ranks]
        rows = [a.token_rows(tokens, r, ex.size) for a, r in zip(layers, ex.ranks, strict=True)]
        token_rows = [a.x.reshape(-1, a.x.shape[-1])[s] for a, s in zip(layers, rows, strict=True)]
        routed = [_routed(t, a, a.gate_weight) for t, a in zip(token_rows, layers, strict=True)]
        received_counts = ex.counts([r.counts for r in routed])
        send = [_per_rank(r.counts, ex.size) for r in routed]
        recv = [c.sum(1).tolist() for c in received_counts]
        k = layers[0].routing.k
        received = ex.rows([t[r.order // k] for t, r in zip(token_rows, routed, strict=True)], send, recv)
        outputs = [_experts_forward(rows_in, c, a.local_experts(r, ex.size))
                   for rows_in, c, a, r in zip(received, received_counts, layers, ex.ranks, strict=True)]
        returned = ex.rows(outputs, recv, send)
        ys, saved = [], []
        for a, s, t, r, results in zip(layers, rows, token_rows, routed, returned, strict=True):
            y = weighted_sum(t, r.weights, r.order, results)
            if a.shared is not None:
                y = y + shared_experts(t, a.shared, a.shared_bias, a.shared_gate)
            ys.append(_placed(a.x, s, y))
            padding = saved_rows(a.x, a.routing, tokens, ex.size) - results.shape[0]
            saved.append(torch.cat([results, results.new_zeros((padding, results.shape[1]))]) if padding else results)
        return ex.joined(ys), ex.joined(saved), ex.joined(received_counts)


def _token_side(a: MoEArgs, token_rows: torch.Tensor, saved: torch.Tensor, grad: torch.Tensor) -> TokenSide:
    """The backward of the token side: through the router, the weighted sum and the shared experts."""
    shared = [None if group is None else [t.detach().requires_grad_() for t in group]
              for group in (a.shared, a.shared_bias, a.shared_gate)]
    tokens, gate = token_rows.detach().requires_grad_(), a.gate_weight.detach().requires_grad_()
    with torch.enable_grad():
        routed = _routed(tokens, a, gate)
        results = saved[: routed.order.numel()].detach().requires_grad_()
        y = weighted_sum(tokens, routed.weights, routed.order, results)
        if a.shared is not None:
            y = y + shared_experts(tokens, *shared)
        leaves = [tokens, gate, results, *(t for group in shared if group is not None for t in group)]
        grads = torch.autograd.grad(y, leaves, grad, allow_unused=True)
    rows_grad, gate_grad, results_grad, *shared_grads = (
        torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True))
    return TokenSide(token_rows, rows_grad, gate_grad, results_grad, shared_grads, routed)


def _experts_backward(received: torch.Tensor, received_counts: torch.Tensor, experts: list[tuple]) -> ExpertGrads:
    """From received rows [expert input | grad of its output]: the grads of the inputs and of each local expert's
    parameters; each expert's forward is recomputed."""
    order, per_expert = _by_expert(received_counts)
    width = received.shape[1] // 2
    inputs, output_grads = received[order].split(width, dim=1)
    input_grads, parameter_grads = [], []
    for x, g, params in zip(inputs.split(per_expert), output_grads.split(per_expert), experts, strict=True):
        x = x.detach().requires_grad_()
        leaves = [p.detach().requires_grad_() if p is not None else None for p in params]
        with torch.enable_grad():
            wanted = [x, *(p for p in leaves if p is not None)]
            grads = torch.autograd.grad(expert_mlp(x, *leaves), wanted, g, allow_unused=True)
        grads = iter(torch.zeros_like(t) if d is None else d for t, d in zip(wanted, grads, strict=True))
        input_grads.append(next(grads))
        parameter_grads.append({argument: None if p is None else next(grads)
                                for argument, p in zip(EXPERT_ARGUMENTS, leaves, strict=True)})
    result = torch.empty((received.shape[0], width), dtype=received.dtype, device=received.device)
    result[order] = torch.cat(input_grads)
    return ExpertGrads(result, parameter_grads)


def layer_backward(grad, saved, received_counts, *args, tokens: str,
                   group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    """Grads of x, the router weight, every expert's parameters (zeros for the experts of other ranks) and the shared
    experts', by the conjugate exchanges."""
    ex = RankExchange(group)
    with ex.computing():
        layers = [MoEArgs(*(ex.values(a, r) for a in args)) for r in ex.ranks]
        rows = [a.token_rows(tokens, r, ex.size) for a, r in zip(layers, ex.ranks, strict=True)]
        sides = []
        for a, s, r in zip(layers, rows, ex.ranks, strict=True):
            flat = a.x.reshape(-1, a.x.shape[-1])
            g = ex.values(grad, r).reshape(flat.shape)[s]
            sides.append(_token_side(a, flat[s], ex.values(saved, r), g))
        k = layers[0].routing.k
        counts = [ex.values(received_counts, r) for r in ex.ranks]
        send = [_per_rank(side.routed.counts, ex.size) for side in sides]
        recv = [c.sum(1).tolist() for c in counts]
        sent = [torch.cat([side.rows[side.routed.order // k], side.results_grad], dim=1) for side in sides]
        experts = [_experts_backward(rows_in, c, a.local_experts(r, ex.size))
                   for rows_in, c, a, r in zip(ex.rows(sent, send, recv), counts, layers, ex.ranks, strict=True)]
        returned = ex.rows([e.inputs for e in experts], recv, send)
        per_rank = []
        for a, s, r, side, input_grads, e in zip(layers, rows, ex.ranks, sides, returned, experts, strict=True):
            x_grad = _placed(a.x, s, side.rows_grad.index_add(0, side.routed.order // k, input_grads))
            per_rank.append(_all_grads(a, r, ex.size, x_grad, side, e.parameters))
        return tuple(ex.joined(list(g)) for g in zip(*per_rank, strict=True))


def _all_grads(a: MoEArgs, rank: int, size: int, x_grad: torch.Tensor, side: TokenSide,
               parameter_grads: list[dict[str, torch.Tensor | None]]) -> list[torch.Tensor]:
    """The grads in `differentiable_inputs` order: the experts of other ranks get zeros (of their empty pieces)."""
    first = rank * (len(a.fc_1) // size)
    grads = [x_grad, side.gate_grad]
    for argument in EXPERT_ARGUMENTS:
        for i, t in enumerate(getattr(a, argument) or ()):
            local = i - first
            held = 0 <= local < len(parameter_grads)
            grads.append(parameter_grads[local][argument] if held else torch.zeros_like(t))
    return grads + side.shared_grads
