"""Expert parallelism (EP): each rank holds n_expert / tp experts whole, and a MoE layer sends its tokens to them.

    plan = thunder_tp.plans.litgpt(model, expert_parallel=True)   # or thunder_tp.plans.hf(model, expert_parallel=True)

Styles. `ExpertParallel(index, n_expert)` on each expert's linear layers: their tensors are `StackShard`s, expert i
whole on rank i // (n_expert / tp) and nothing of it elsewhere (the rank's shard of the stacked experts, so a
checkpoint saves and loads at any TP size). `RouterParallel` on the router: its weight replicated, the layer's input
constrained to the sequence shards (each rank dispatches its own tokens) and its output to the plan's block output.
Shared experts (and their gate) stay replicated: each rank runs them on its own tokens, so no activation moves for
them, and their grads are summed with the router's in the backward's one all_reduce of replicated grads.

The layer. With expert-parallel experts `moe_layer` runs as `tp_expert_parallel_moe` on the tokens this rank holds:
its sequence shard (under SP as it arrives; without SP the router's constraint slices the replicated activations
locally and the output is all-gathered, so no token is computed twice, and an all_gather moves half the bytes of the
all_reduce a Partial output needs), or where the ranks cannot split the sequence (a decode step's one token) its
share of the rows of the replicated activations, the output then a Partial sum (zeros on the others' rows),
all-reduced. Per layer, each rank
1. routes its tokens (the single-device router, token by token) and groups the (token, expert) pairs by expert;
2. exchanges the counts of pairs per expert (an all_to_all of n_expert numbers);
3. dispatch: sends each pair's row to its expert's rank (all_to_all_single with uneven split sizes);
4. runs each of its experts' SwiGLU on the rows it received, from every rank;
5. combine: sends the results back (the inverse all_to_all);
6. weights them and adds them to their tokens as `moe_layer` does, plus the shared experts.
Dropless (no capacity, no token dropped), so the layer computes exactly what one device does.

The backward, `tp_expert_parallel_moe_backward`, is the conjugate: the grads of the pairs' results travel to the
experts' ranks (dispatch), the grads of the experts' inputs come back (combine). One opaque op each way, not trace-level
all_to_alls, because how many rows a rank receives depends on the routing, while a trace needs every shape when it is
made. So the expert side keeps nothing for the backward (the dispatch sends the tokens again and each expert's
forward is recomputed, as activation checkpointing would), and the token side saves only what has a shape known at
trace time: the pairs' results (tokens x k rows) and the counts it received. The exchanges themselves, on real ranks,
simulated ones and one_rank's fake group, are `thunder_tp.collectives.exchange`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core import dtypes
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.transforms import register_grad

from thunder_tp.collectives import register_issued_collectives
from thunder_tp.collectives.exchange import RankExchange
from thunder_tp.layouts import PARTIAL, REPLICATE, Layout, Shard, StackShard
from thunder_tp.models.moe import (
    Routing,
    differentiable_inputs,
    expert_mlp,
    expert_order,
    expert_parameters,
    moe_executor,
    moe_layer,
    route,
    sharded_experts,
    shared_experts,
    weighted_sum,
)
from thunder_tp.propagation.engine import Op, Strategy, register_rule
from thunder_tp.styles import Style

__all__ = ["ExpertParallel", "RouterParallel", "expert_parallel_moe", "expert_parallel_plan"]

#: the tokens of a rank: all rows of its (sharded) activations, or its share of the rows of replicated ones
HELD, SPLIT = "held", "split"
_EXPERT_ARGUMENTS = ("fc_1", "fc_2", "proj", "fc_1_bias", "fc_2_bias", "proj_bias")


@dataclass(frozen=True)
class ExpertParallel(Style):
    """One expert's linear layer (expert `index` of `n_expert`) held whole by one rank: each rank holds
    n_expert / size experts (StackShard)."""

    index: int
    n_expert: int

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every parameter whole on the expert's rank; the ranks must share the experts evenly."""
        if self.n_expert % size:
            sizes = ", ".join(str(s) for s in range(1, self.n_expert + 1) if self.n_expert % s == 0)
            raise ValueError(
                f"expert parallelism holds each of the {self.n_expert} experts whole on one rank, and {size} ranks "
                f"cannot share {self.n_expert} experts evenly; use a TP size that divides {self.n_expert} ({sizes}), "
                "or split the experts like dense MLPs (expert_parallel=False)"
            )
        return {name: StackShard(self.index, self.n_expert) for name, _ in module.named_parameters(recurse=False)}


@dataclass(frozen=True)
class RouterParallel(Style):
    """The router of an expert-parallel MoE layer: its parameters replicated, the layer's tokens split over the ranks
    (`input_layout`: the sequence dim; a sequence the ranks cannot split stays whole, each rank then dispatching its
    share of the rows) and its output made `output_layout`."""

    input_layout: Layout | None = Shard(1)
    output_layout: Layout | None = REPLICATE

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every parameter replicated."""
        return {name: REPLICATE for name, _ in module.named_parameters(recurse=False)}


def expert_parallel_plan(n_expert: int, expert_layers: tuple[str, ...], output_layout: Layout,
                         router: str = "gate") -> dict[str, ExpertParallel | RouterParallel]:
    """The styles of a MoE block's router and experts (keys relative to the block), the layer's output made
    `output_layout`."""
    plan: dict[str, ExpertParallel | RouterParallel] = {router: RouterParallel(output_layout=output_layout)}
    plan |= {f"experts.{i}.{layer}": ExpertParallel(i, n_expert) for i in range(n_expert) for layer in expert_layers}
    return plan


# --- the propagation rule of moe_layer ------------------------------------------------------------------------


@register_rule(moe_layer)
def moe_layer_rule(op: Op) -> list[Strategy]:
    """Experts whole on their ranks (StackShard): the layer on each rank's tokens; else split like dense MLPs."""
    experts = _expert_layouts(op)
    if not any(isinstance(layout, StackShard) for layout in experts.values()):
        return sharded_experts(op)
    x, group = op.tensors[0], op.tp.group
    forward, backward = _issued(op)

    def strategy(x_layout: Layout, output: Layout, tokens: str) -> Strategy:
        inputs = (x_layout, *(experts.get(t.name, REPLICATE) for t in op.tensors[1:]))
        local = partial(expert_parallel_moe, tokens=tokens, group=group)
        return Strategy(inputs, (output,), local, issues=forward, backward_issues=backward)

    return [*(strategy(Shard(d), Shard(d), HELD) for d in range(x.ndim - 1)), strategy(REPLICATE, PARTIAL, SPLIT)]


def _issued(op: Op) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
    """The all_to_alls of the forward and of the backward for pricing, (kind, bytes of all ranks' parts): the counts,
    the dispatch and the combine of all tokens x k rows (the backward's dispatch twice as wide). How many rows leave
    each rank depends on the routing: they are priced as an even one."""
    x, size = op.tensors[0], op.tp.size
    pairs = math.prod(int(s) for s in x.shape) * op.arg("routing").k * x.dtype.bytes
    forward = (("all_to_all", size * 8 * len(op.arg("fc_1"))), ("all_to_all", pairs), ("all_to_all", pairs))
    return forward, (("all_to_all", 2 * pairs), ("all_to_all", pairs))


def _expert_layouts(op: Op) -> dict[str, Layout]:
    """The current layout of every expert tensor of the layer, checked: all expert-parallel in the order of the
    experts, or none."""
    layouts = {t.name: op.layout_of(t) for argument in _EXPERT_ARGUMENTS for t in op.arg(argument) or ()}
    stacked = [isinstance(layout, StackShard) for layout in layouts.values()]
    n_expert = len(op.arg("fc_1"))
    misplaced = [
        t.name for argument in _EXPERT_ARGUMENTS for i, t in enumerate(op.arg(argument) or ())
        if any(stacked) and layouts[t.name] != StackShard(i, n_expert)
    ]
    if misplaced:
        raise NotImplementedError(
            f"thunder_tp: a MoE layer's experts are either all expert-parallel (ExpertParallel(i, {n_expert}) on "
            f"expert i's layers) or all split like dense MLPs; {misplaced[:4]} are not laid out as the others. Plan "
            "every expert of the layer alike (plans.litgpt / plans.hf with expert_parallel=True do)"
        )
    return layouts


# --- the op ------------------------------------------------------------------------------------------------------


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
        n = _tokens(self.x)
        return slice(0, n) if tokens == HELD else slice(rank * n // size, (rank + 1) * n // size)

    def local_experts(self, rank: int, size: int) -> list[tuple]:
        """The parameters of each expert `rank` holds."""
        per_rank = len(self.fc_1) // size
        return expert_parameters(*self[3:9])[rank * per_rank : (rank + 1) * per_rank]


def _tokens(x) -> int:
    """Tokens of activations (..., C), a tensor or a proxy."""
    return math.prod(int(s) for s in x.shape[:-1])


def _saved_rows(x, routing: Routing, tokens: str, size: int) -> int:
    """Rows of the pairs' results the forward saves: tokens x k (a split's largest share, so every rank's alike)."""
    n = _tokens(x)
    return routing.k * (n if tokens == HELD else -(-n // size))


def _routed(tokens: torch.Tensor, a: MoEArgs, gate_weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Routing weights (tokens x k), the pairs grouped by expert (`expert_order`) and the pairs per expert."""
    weights, indices = route(tokens, gate_weight, a.score_bias, a.routing)
    return (weights, *expert_order(indices, len(a.fc_1)))


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
    if rows.stop - rows.start == _tokens(x):
        return y.view(x.shape)
    full = y.new_zeros((_tokens(x), x.shape[-1]))
    full[rows] = y
    return full.view(x.shape)


def _forward(*args, tokens: str, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output on this rank, the pairs' results it saves for the backward, and the counts it received."""
    ex = RankExchange(group)
    with ex.computing():
        layers = [MoEArgs(*(ex.values(a, r) for a in args)) for r in ex.ranks]
        rows = [a.token_rows(tokens, r, ex.size) for a, r in zip(layers, ex.ranks, strict=True)]
        token_rows = [a.x.reshape(-1, a.x.shape[-1])[s] for a, s in zip(layers, rows, strict=True)]
        routed = [_routed(t, a, a.gate_weight) for t, a in zip(token_rows, layers, strict=True)]
        received_counts = ex.counts([counts for *_, counts in routed])
        send = [_per_rank(counts, ex.size) for *_, counts in routed]
        recv = [c.sum(1).tolist() for c in received_counts]
        k = layers[0].routing.k
        received = ex.rows([t[order // k] for t, (_, order, _) in zip(token_rows, routed, strict=True)], send, recv)
        outputs = [_experts_forward(rows_in, c, a.local_experts(r, ex.size))
                   for rows_in, c, a, r in zip(received, received_counts, layers, ex.ranks, strict=True)]
        returned = ex.rows(outputs, recv, send)
        ys, saved = [], []
        for a, s, t, (weights, order, _), results in zip(layers, rows, token_rows, routed, returned, strict=True):
            y = weighted_sum(t, weights, order, results)
            if a.shared is not None:
                y = y + shared_experts(t, a.shared, a.shared_bias, a.shared_gate)
            ys.append(_placed(a.x, s, y))
            padding = _saved_rows(a.x, a.routing, tokens, ex.size) - results.shape[0]
            saved.append(torch.cat([results, results.new_zeros((padding, results.shape[1]))]) if padding else results)
        return ex.joined(ys), ex.joined(saved), ex.joined(received_counts)


def _token_side_grads(a: MoEArgs, token_rows: torch.Tensor, saved: torch.Tensor, grad: torch.Tensor) -> tuple:
    """The grads of the token side, through the router and the shared experts: (tokens, router weight, the pairs'
    results, shared experts' parameters), and the pairs grouped by expert with the pairs per expert."""
    shared = [None if group is None else [t.detach().requires_grad_() for t in group]
              for group in (a.shared, a.shared_bias, a.shared_gate)]
    tokens, gate = token_rows.detach().requires_grad_(), a.gate_weight.detach().requires_grad_()
    with torch.enable_grad():
        weights, order, counts = _routed(tokens, a, gate)
        results = saved[: order.numel()].detach().requires_grad_()
        y = weighted_sum(tokens, weights, order, results)
        if a.shared is not None:
            y = y + shared_experts(tokens, *shared)
        leaves = [tokens, gate, results, *(t for group in shared if group is not None for t in group)]
        grads = torch.autograd.grad(y, leaves, grad, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True)]
    return grads, order, counts


def _experts_backward(received: torch.Tensor, received_counts: torch.Tensor, experts: list[tuple]) -> tuple:
    """From received rows [expert input | grad of its output]: the grads of the inputs (in the received order) and
    of each local expert's parameters (None for absent biases); each expert's forward is recomputed."""
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
        parameter_grads.append([None if p is None else next(grads) for p in leaves])
    result = torch.empty((received.shape[0], width), dtype=received.dtype, device=received.device)
    result[order] = torch.cat(input_grads)
    return result, parameter_grads


def _backward(grad, saved, received_counts, *args, tokens: str, group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
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
            sides.append((flat[s], *_token_side_grads(a, flat[s], ex.values(saved, r), g)))
        k = layers[0].routing.k
        counts = [ex.values(received_counts, r) for r in ex.ranks]
        send = [_per_rank(c, ex.size) for *_, c in sides]
        recv = [c.sum(1).tolist() for c in counts]
        sent = [torch.cat([t[order // k], grads[2]], dim=1) for t, grads, order, _ in sides]
        backward = [_experts_backward(rows_in, c, a.local_experts(r, ex.size))
                    for rows_in, c, a, r in zip(ex.rows(sent, send, recv), counts, layers, ex.ranks, strict=True)]
        returned = ex.rows([input_grads for input_grads, _ in backward], recv, send)
        per_rank = []
        for a, s, r, (_, grads, order, _), input_grads, (_, parameter_grads) in zip(
                layers, rows, ex.ranks, sides, returned, backward, strict=True):
            token_grads = grads[0].index_add(0, order // k, input_grads)
            x_grad = _placed(a.x, s, token_grads)
            per_rank.append(_all_grads(a, r, ex.size, x_grad, grads[1], grads[3:], parameter_grads))
        return tuple(ex.joined(list(g)) for g in zip(*per_rank, strict=True))


def _all_grads(a: MoEArgs, rank: int, size: int, x_grad, gate_grad, shared_grads, parameter_grads) -> list:
    """The grads in `differentiable_inputs` order: the experts of other ranks get zeros (of their empty pieces)."""
    first = rank * (len(a.fc_1) // size)
    grads = [x_grad, gate_grad]
    for j, argument in enumerate(_EXPERT_ARGUMENTS):
        for i, t in enumerate(getattr(a, argument) or ()):
            local = i - first
            held = 0 <= local < len(parameter_grads)
            grads.append(parameter_grads[local][j] if held else torch.zeros_like(t))
    return grads + list(shared_grads)


def _forward_meta(*args, tokens: str, group: dist.ProcessGroup) -> tuple[TensorProxy, TensorProxy, TensorProxy]:
    a = MoEArgs(*args)
    size, width = group.size(), a.x.shape[-1]
    saved = TensorProxy(like=a.x, shape=(_saved_rows(a.x, a.routing, tokens, size), width))
    counts = TensorProxy(like=a.x, shape=(size, len(a.fc_1) // size), dtype=dtypes.int64, requires_grad=False)
    return TensorProxy(like=a.x), saved, counts


def _backward_meta(grad, saved, received_counts, *args, tokens: str,
                   group: dist.ProcessGroup) -> tuple[TensorProxy, ...]:
    return tuple(TensorProxy(like=t) for t in differentiable_inputs(*args))


expert_parallel_forward = moe_executor.register_operator("tp_expert_parallel_moe", meta=_forward_meta, fn=_forward)
expert_parallel_backward = moe_executor.register_operator(
    "tp_expert_parallel_moe_backward", meta=_backward_meta, fn=_backward
)


def expert_parallel_moe(*args, tokens: str, group: dist.ProcessGroup) -> TensorProxy:
    """`moe_layer` with expert-parallel experts on this rank's tokens (`tokens`: HELD or SPLIT)."""
    return expert_parallel_forward(*args, tokens=tokens, group=group)[0]


def _expert_parallel_grad(*args, tokens: str, group: dist.ProcessGroup):
    y, saved, received_counts = expert_parallel_forward(*args, tokens=tokens, group=group)
    grads = expert_parallel_backward(get_grad(y), saved, received_counts, *args, tokens=tokens, group=group)
    for t, g in zip(differentiable_inputs(*args), grads, strict=True):
        put_grad(t, g)
    return y, saved, received_counts


register_grad(expert_parallel_forward, _expert_parallel_grad)


# --- the collectives they issue, for the trace tables (debug.collectives_table) ---------------------------------


def _pairs_bytes(bsym: BoundSymbol, args: tuple) -> int:
    """Bytes of this rank's (token, expert) pairs' rows: what its dispatch sends and its combine receives."""
    a = MoEArgs(*args)
    group = bsym.kwargs["group"]
    rows = a.token_rows(bsym.kwargs["tokens"], dist.get_rank(group), group.size())
    return (rows.stop - rows.start) * a.routing.k * a.x.shape[-1] * a.x.dtype.bytes


def _forward_collectives(bsym: BoundSymbol) -> list[tuple[str, int]]:
    """The counts exchange (int64 per expert), the dispatch and the combine."""
    pairs = _pairs_bytes(bsym, bsym.args)
    return [("all_to_all", 8 * len(bsym.args[3])), ("all_to_all", pairs), ("all_to_all", pairs)]


def _backward_collectives(bsym: BoundSymbol) -> list[tuple[str, int]]:
    """The dispatch of [token | grad of its result] rows and the combine of the inputs' grads."""
    pairs = _pairs_bytes(bsym, bsym.args[3:])
    return [("all_to_all", 2 * pairs), ("all_to_all", pairs)]


register_issued_collectives(expert_parallel_forward, _forward_collectives)
register_issued_collectives(expert_parallel_backward, _backward_collectives)
