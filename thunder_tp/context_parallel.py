"""Context parallelism: the sequence of every activation split over a process group (the CP group), for sequences
longer than one device holds.

A TP transform of its own, over the CP group, with no plan: every parameter replicated, and the model's inputs that
carry a sequence (the token ids and targets; `sequence_dims`) split along it where the model is called. Everything
else follows from layout propagation: embeddings, norms, MLPs and the rotary embedding's tables computed on each
rank's tokens; attention with each rank's queries over every key and value (the keys and values gathered, their
grads reduce-scattered back; the causal mask made of each query's true position); the loss of each rank's tokens,
its mean over the global tokens (one all_reduce of the sum and the count); the grads of the replicated parameters
summed over the group, in one all_reduce per dtype at the end of the backward.

`load_balance` (causal attention): the sequence is cut into 2 x CP chunks and rank r holds chunks r and 2 CP - 1 - r
(head-tail order, as PyTorch's context_parallel's `_HeadTailLoadBalancer`), so that every rank attends to as many
keys; it is a layout like any other (a two-block split, the second block's pieces in reverse rank order), so the
positions, masks, gathers and what the model returns whole follow it.

With tensor parallelism on a (cp x tp) mesh: `transforms=[ContextParallel(mesh.cp_group), TensorParallel(plan,
mesh.tp_group)]` (CP first: TP then splits heads and features of the CP-local program).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Literal

import torch.distributed as dist
from thunder.core.dtypes import to_torch_dtype
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx

from thunder_tp.execution.overlap_cost import device_costs, ring_attention_pays
from thunder_tp.layouts import Shard, Split, TPGroup
from thunder_tp.propagation.attention import ROTATIONS
from thunder_tp.propagation.constraints import constrain_inputs
from thunder_tp.thunder_internals.private import original_module
from thunder_tp.thunder_internals.prologue import call_inputs
from thunder_tp.transform import TensorParallel

__all__ = ["ContextParallel", "sequence_layout"]


class ContextParallel(TensorParallel):
    """Context parallelism over `process_group` (None: the default group): the module docstring.

    `sequence_dims`: the forward's tensor inputs that carry a sequence, by parameter name -> their sequence dim
    (PyTorch's `context_parallel(buffers=, buffer_seq_dims=)`; buffers of the model, as the rotary tables, follow by
    themselves); None: every tensor input of two or more dims, along dim 1 (token ids, targets, masks of shape
    (batch, sequence, ...)). `load_balance`: head-tail order for causal attention (the sequence a multiple of 2 x CP;
    without it, of CP). `rotate`: how the keys and values reach every rank's queries: "allgather" (all of them
    gathered before attention), "ring" (passed around the ring of ranks one rank's at a time, each chunk's
    attention merged by its running softmax statistics: no rank holds all keys at once outside the backward's
    saved values), as PyTorch's `set_rotate_method`, or "auto": each attention's choice by the cost model
    (`execution.overlap_cost.ring_attention_pays`: the ring where the chunks' transfers hide behind their
    attention). The checks of TensorParallel apply (`check_inputs`, `check_collectives`, `check_weights`).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        sequence_dims: Mapping[str, int] | None = None,
        load_balance: bool = True,
        rotate: Literal["auto", "allgather", "ring"] = "auto",
        check_inputs: Literal["training", "every", "first", "never"] = "training",
        check_collectives: bool = True,
        check_weights: bool = True,
    ):
        super().__init__({}, process_group, check_inputs=check_inputs, overlap="never",
                         check_collectives=check_collectives, check_weights=check_weights)
        if not isinstance(load_balance, bool):
            raise TypeError(f"thunder_tp.ContextParallel: load_balance must be True or False, got {load_balance!r}")
        if rotate not in ROTATIONS:
            raise ValueError(f"thunder_tp.ContextParallel: rotate must be one of {ROTATIONS}, got {rotate!r}")
        self.sequence_dims = None if sequence_dims is None else dict(sequence_dims)
        self.load_balance, self.rotate = load_balance, rotate
        self._parameters: list[str] = []

    def transform_module(self, model) -> None:
        """TensorParallel's (every parameter replicated); the names of the forward's parameters, checked against
        `sequence_dims`."""
        super().transform_module(model)
        module = original_module(model)
        self._parameters = list(inspect.signature(module.forward).parameters)
        unknown = sorted(set(self.sequence_dims or ()) - set(self._parameters))
        if unknown:
            raise ValueError(f"thunder_tp.ContextParallel: sequence_dims names {unknown}, which are not parameters of "
                             f"{type(module).__name__}.forward {tuple(self._parameters)}")

    def rule_options(self) -> dict[str, object]:
        """TensorParallel's, and how attention rotates keys and values."""
        return super().rule_options() | {"rotate": self.rotate, "ring_pays": ring_pays}

    def transform_traces_pre_prologue(self, prologue: TraceCtx, computation: TraceCtx, epilogue, **kwargs):
        """The call's sequence inputs split where the program reads them, then TensorParallel's rewrite."""
        layouts = {}
        for key, proxy in call_inputs(prologue).items():
            name = key if isinstance(key, str) else self._parameters[key] if key < len(self._parameters) else None
            dim = _sequence_dim(self.sequence_dims, name, proxy)
            if dim is not None:
                layouts[proxy.name] = sequence_layout(proxy.shape[dim], dim, self.tp.size, self.load_balance)
        computation = constrain_inputs(computation, layouts)
        return super().transform_traces_pre_prologue(prologue, computation, epilogue, **kwargs)


def sequence_layout(length: int, dim: int, size: int, load_balance: bool) -> Shard:
    """How a sequence of `length` is split over `size` ranks along `dim`: in order, or head-tail; a length that
    cannot be is a ValueError naming the lengths that can."""
    parts = 2 * size if load_balance else size
    if length % parts:
        how = f"2 x CP = {parts} chunks (load-balanced causal attention)" if load_balance else f"CP = {size} pieces"
        fix = f" or ContextParallel(load_balance=False) (a multiple of {size})" if load_balance else ""
        raise ValueError(f"thunder_tp.ContextParallel: a sequence of {length} cannot be cut into {how}; use a "
                         f"sequence length that is a multiple of {parts}{fix}")
    if not load_balance:
        return Shard(dim)
    half = length // 2
    return Shard(dim, blocks=(half, half), splits=(None, Split(half, reversed=True)))


def _sequence_dim(sequence_dims: Mapping[str, int] | None, name: str | None, t: TensorProxy) -> int | None:
    if sequence_dims is None:
        return 1 if t.ndim >= 2 else None
    return None if name not in sequence_dims else sequence_dims[name] % t.ndim


def ring_pays(q: TensorProxy, k: TensorProxy, cp: TPGroup) -> bool:
    """Whether one attention's keys and values should go around the ring: priced with the group's link and the
    device's matmul rate (`execution.overlap_cost`)."""
    backend = dist.get_backend(cp.group) if dist.is_initialized() else ""
    costs = device_costs(backend, q.device.type, to_torch_dtype(q.dtype))
    chunk_flops = 4 * q.numel * k.shape[-2]  # q k^T and the probabilities times v, over one rank's keys
    return ring_attention_pays(costs, 2 * k.numel * k.dtype.bytes, chunk_flops, cp.size)
