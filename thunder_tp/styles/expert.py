"""The styles of expert parallelism (`thunder_tp.models.expert_parallel`): each expert's linear layers whole on one
rank (`ExpertParallel`), the router replicated with the layer's tokens split over the ranks (`RouterParallel`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from thunder_tp.layouts import REPLICATE, Layout, Shard, StackShard
from thunder_tp.styles.base import Style


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
