"""The communication of a propagated program, read off its steps without rewriting the trace: the collectives it
issues each way in one training step and their alpha-beta cost (reshard.py's), as the rewrite will emit them.

Backward collectives are the conjugates of the forward ones (DESIGN.md's table) for values that need a grad; a
Replicate value entering the TP region gets its grad all_reduced (values computed from the inputs alone, such as
replicated parameters, in one all_reduce per dtype, as the rewrite coalesces them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from thunder.core import dtypes
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten

from thunder_tp.layouts import REPLICATE, Layout, Replicate, Shard, TPGroup, normalize
from thunder_tp.propagation.engine import Step
from thunder_tp.reshard import ALPHA_BYTES, collective_cost, collective_kind, nbytes

@dataclass
class Communication:
    """Collectives per step each way (kind -> count) and their summed alpha-beta cost (bytes-equivalent)."""

    forward: Counter = field(default_factory=Counter)
    backward: Counter = field(default_factory=Counter)
    cost: float = 0.0

    @property
    def count(self) -> int:
        """Collectives per step, both ways."""
        return sum(self.forward.values()) + sum(self.backward.values())

    def add(self, kind: str, t: TensorProxy | int, size: int, *, backward: bool = False) -> None:
        """One collective of `kind` on `t` (or on a tensor of `t` bytes)."""
        (self.backward if backward else self.forward)[kind] += 1
        self.cost += collective_cost(kind, t if isinstance(t, int) else nbytes(t), size)

    def __str__(self) -> str:
        each = lambda c: " + ".join(f"{n} {k}" for k, n in sorted(c.items())) or "none"  # noqa: E731
        return f"forward {each(self.forward)}; backward {each(self.backward)}; cost {self.cost / 2**20:.2f} MiB-equivalent"


@dataclass
class _Walk:
    layouts: dict[str, Layout]
    tp: TPGroup
    needs_grad: set[str]
    from_inputs: set[str]
    result: Communication = field(default_factory=Communication)
    done: set = field(default_factory=set)
    coalesced: set = field(default_factory=set)  # dtypes of the input-derived values copied into the TP region

    def need(self, t: TensorProxy, required: Layout, into_tp_region: bool) -> None:
        """`t` is needed in `required` (memoized per (value, layout), as the rewrite does)."""
        required = normalize(required, t.ndim)
        current = self.layouts[t.name]
        into_tp_region = into_tp_region and isinstance(required, Replicate) and t.name in self.needs_grad
        if (t.name, required) not in self.done:
            self.done.add((t.name, required))
            kind = collective_kind(current, required)
            if kind:
                self.result.add(kind, t, self.tp.size)
            if current != required and t.name in self.needs_grad and isinstance(required, Shard):
                # the conjugate: a slice's (or a reduce_scatter's) grad is all_gathered, an all_to_all's sent back
                self.result.add("all_to_all" if kind == "all_to_all" else "all_gather", t, self.tp.size, backward=True)
        if into_tp_region and (t.name, "into") not in self.done:
            self.done.add((t.name, "into"))
            self.grad_summed(t, gathered=isinstance(current, Shard))

    def grad_summed(self, t: TensorProxy, gathered: bool) -> None:
        """The backward of a Replicate value used by sharded compute: its Partial grad reduced."""
        if gathered:  # gather_to_tp: the grad is reduce-scattered back into the shard
            self.result.add("reduce_scatter", t, self.tp.size, backward=True)
        elif t.name in self.from_inputs:  # coalesced: one all_reduce per dtype, its latency paid once
            first = t.dtype not in self.coalesced
            self.coalesced.add(t.dtype)
            self.result.backward["all_reduce"] += first
            self.result.cost += collective_cost("all_reduce", nbytes(t), self.tp.size) - (0 if first else ALPHA_BYTES)
        else:
            self.result.add("all_reduce", t, self.tp.size, backward=True)


#: ops that read their later tensor arguments for metadata only (`mask.to(query)`: query's dtype and device)
_GRAD_FROM_FIRST = frozenset(s.id for s in (ltorch.to, ltorch.type_as, ltorch.expand_as, ltorch.view_as, ltorch.reshape_as))
#: ops whose result has no grad whatever their arguments
_NO_GRAD = frozenset(s.id for s in (ltorch.zeros_like, ltorch.ones_like, ltorch.full_like, ltorch.empty_like))


def _differentiable(bsym, tensors: list[TensorProxy]) -> list[TensorProxy]:
    """The tensor arguments an op's result is differentiable in."""
    if bsym.sym.id in _NO_GRAD:
        return []
    return tensors[:1] if bsym.sym.id in _GRAD_FROM_FIRST else tensors


def communication(
    steps: list[Step], returned, layouts: dict[str, Layout], tp: TPGroup, inputs: list[TensorProxy], *, training: bool
) -> Communication:
    """The collectives the rewrite of `steps` issues, forward and (when `training`) backward; `returned`: what the
    program returns (made Replicate); `inputs`: the trace's tensor inputs."""
    needs_grad = {t.name for t in inputs if training and t.requires_grad}
    walk = _Walk(layouts, tp, needs_grad, {t.name for t in inputs})
    for t in inputs:  # chunks held by several ranks (replicated K/V heads): their grads summed over the group
        layout = layouts[t.name]
        if t.name in needs_grad and isinstance(layout, Shard) and layout.is_replicated:
            walk.grad_summed(t, gathered=False)
    for step in steps:
        tensors = [x for x in tree_flatten((step.bsym.args, step.bsym.kwargs))[0] if isinstance(x, TensorProxy)]
        outputs = [x for x in tree_flatten(step.bsym.output)[0] if isinstance(x, TensorProxy)]
        if not outputs:  # a shape or metadata query: answered locally
            continue
        for t, required in zip(tensors, step.strategy.inputs):
            walk.need(t, required, step.strategy.enters_tp_region)
        for kind, full_bytes in step.strategy.issues:
            walk.result.add(kind, full_bytes, tp.size)
        if any(t.name in needs_grad for t in _differentiable(step.bsym, tensors)):  # a mask's ints/bools have no grad
            needs_grad.update(o.name for o in outputs if dtypes.is_inexact_dtype(o.dtype))
        if tensors and all(t.name in walk.from_inputs and layouts[t.name] == normalize(r, t.ndim)
                           for t, r in zip(tensors, step.strategy.inputs)):
            walk.from_inputs.update(o.name for o in outputs)
    for t in tree_flatten(returned)[0]:
        if isinstance(t, TensorProxy) and t.name not in {i.name for i in inputs}:
            walk.need(t, REPLICATE, False)
    return walk.result
