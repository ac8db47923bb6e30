"""Expert parallelism (EP): each rank holds n_expert / tp experts whole, and a MoE layer sends its tokens to them.

    plan = thunder_tp.plans.litgpt(model, expert_parallel=True)   # or thunder_tp.plans.hf(model, expert_parallel=True)

Styles (`thunder_tp.styles.expert`). `ExpertParallel(index, n_expert)` on each expert's linear layers: their tensors
are `StackShard`s, expert i whole on rank i // (n_expert / tp) and nothing of it elsewhere (the rank's shard of the
stacked experts, so a checkpoint saves and loads at any TP size). `RouterParallel` on the router: its weight
replicated, the layer's input constrained to the sequence shards (each rank dispatches its own tokens) and its output
to the plan's block output. Shared experts (and their gate) stay replicated: each rank runs them on its own tokens, so
no activation moves for them, and their grads are summed with the router's in the backward's one all_reduce of
replicated grads.

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

This module holds the two ops, the grad that pairs them and the collectives they declare for the trace tables; their
computation on each rank's tensors is `expert_parallel.compute`, the propagation rule that chooses them for
`moe_layer` (the strategies by sequence shard and by rows) `expert_parallel.rule`.
"""

from __future__ import annotations

import torch.distributed as dist
from thunder.core import dtypes
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.transforms import register_grad

from thunder_tp.collectives import register_issued_collectives
from thunder_tp.models.expert_parallel.compute import MoEArgs, layer_backward, layer_forward, saved_rows
from thunder_tp.models.moe import differentiable_inputs, moe_executor

__all__ = ["expert_parallel_moe"]


def _forward_meta(*args, tokens: str, group: dist.ProcessGroup) -> tuple[TensorProxy, TensorProxy, TensorProxy]:
    a = MoEArgs(*args)
    size, width = group.size(), a.x.shape[-1]
    saved = TensorProxy(like=a.x, shape=(saved_rows(a.x, a.routing, tokens, size), width))
    counts = TensorProxy(like=a.x, shape=(size, len(a.fc_1) // size), dtype=dtypes.int64, requires_grad=False)
    return TensorProxy(like=a.x), saved, counts


def _backward_meta(grad, saved, received_counts, *args, tokens: str,
                   group: dist.ProcessGroup) -> tuple[TensorProxy, ...]:
    return tuple(TensorProxy(like=t) for t in differentiable_inputs(*args))


expert_parallel_forward = moe_executor.register_operator("tp_expert_parallel_moe", meta=_forward_meta,
                                                         fn=layer_forward)
expert_parallel_backward = moe_executor.register_operator(
    "tp_expert_parallel_moe_backward", meta=_backward_meta, fn=layer_backward
)


def expert_parallel_moe(*args, tokens: str, group: dist.ProcessGroup) -> TensorProxy:
    """`moe_layer` with expert-parallel experts on this rank's tokens (`tokens`: HELD or SPLIT)."""
    y, _saved, _received_counts = expert_parallel_forward(*args, tokens=tokens, group=group)
    return y


def _expert_parallel_grad(*args, tokens: str, group: dist.ProcessGroup):
    y, saved, received_counts = expert_parallel_forward(*args, tokens=tokens, group=group)
    grads = expert_parallel_backward(get_grad(y), saved, received_counts, *args, tokens=tokens, group=group)
    for t, g in zip(differentiable_inputs(*args), grads, strict=True):
        put_grad(t, g)
    return y, saved, received_counts


register_grad(expert_parallel_forward, _expert_parallel_grad)


# --- the collectives they issue, for the trace tables (debug.collectives_table) ---------------------------------


def _pairs_bytes(bsym: BoundSymbol, a: MoEArgs) -> int:
    """Bytes of this rank's (token, expert) pairs' rows: what its dispatch sends and its combine receives."""
    group = bsym.kwargs["group"]
    rows = a.token_rows(bsym.kwargs["tokens"], dist.get_rank(group), group.size())
    return (rows.stop - rows.start) * a.routing.k * a.x.shape[-1] * a.x.dtype.bytes


def _forward_collectives(bsym: BoundSymbol) -> list[tuple[str, int]]:
    """The counts exchange (int64 per expert), the dispatch and the combine."""
    a = MoEArgs(*bsym.args)
    pairs = _pairs_bytes(bsym, a)
    return [("all_to_all", 8 * len(a.fc_1)), ("all_to_all", pairs), ("all_to_all", pairs)]


def _backward_collectives(bsym: BoundSymbol) -> list[tuple[str, int]]:
    """The dispatch of [token | grad of its result] rows and the combine of the inputs' grads."""
    _grad, _saved, _received_counts, *args = bsym.args
    pairs = _pairs_bytes(bsym, MoEArgs(*args))
    return [("all_to_all", 2 * pairs), ("all_to_all", pairs)]


register_issued_collectives(expert_parallel_forward, _forward_collectives)
register_issued_collectives(expert_parallel_backward, _backward_collectives)
