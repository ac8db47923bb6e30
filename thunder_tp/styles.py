"""Parallel styles (ColwiseParallel, RowwiseParallel, SequenceParallel) and plan matching.

A style says how a module's own tensors (parameters, and a cache's buffers) are split (`tensor_layouts`) and
which layouts the input and output of the op that consumes its weight are constrained to (`input_layout`,
`output_layout`), as DTensor's styles do at module boundaries.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import torch.nn as nn
from thunder.core.proxies import DistParallelType

from thunder_tp.layouts import REPLICATE, Layout, Shard, check_shardable

_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


def _kind(module: nn.Module, style: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    raise TypeError(
        f"{style} supports nn.Linear and nn.Embedding, not {type(module).__name__}; "
        "annotate its parameters with thunder_tp.annotate or leave the module out of the plan"
    )


@dataclass(frozen=True)
class ColwiseParallel:
    """nn.Linear: weight and bias split on dim 0 (output features); nn.Embedding: embedding dim.

    `blocks`: the output features are fused blocks (e.g. q|k|v) each split separately.
    `input_layout`: what the input is turned into (Replicate: gathered if it arrives sharded).
    `output_layout`: None keeps the output sharded on its last dim.
    `unit`: features come in indivisible groups of this size (e.g. one attention head).
    `replicable`: per block, whether it may have fewer units than ranks (K/V heads of grouped-query
    attention): each unit is then held by size/units consecutive ranks, and its grads summed over them.
    """

    input_layout: Layout | None = REPLICATE
    output_layout: Layout | None = None
    blocks: tuple[int, ...] | None = None
    unit: int = 1
    replicable: tuple[bool, ...] | None = None

    def _units(self) -> list[tuple[int, bool]]:
        blocks = self.blocks or ()
        return [(b // self.unit, r) for b, r in zip(blocks, self.replicable or (False,) * len(blocks))]

    def tp_sizes(self, up_to: int) -> list[int]:
        """The TP sizes (at most `up_to`) over which every block splits into whole units."""
        return [s for s in range(1, up_to + 1) if all(_splits(u, s, r) for u, r in self._units())]

    def check(self, module_name: str, size: int) -> None:
        """Each rank must own whole units (heads) of every block, or one replicated unit of a replicable block."""
        for units, replicable in self._units():
            if not _splits(units, size, replicable):
                also = " nor a multiple of it (K/V heads are then replicated)" if replicable else ""
                sizes = ", ".join(map(str, self.tp_sizes(max(u for u, _ in self._units()))))
                raise ValueError(
                    f"{module_name}: a block of {units} units of {self.unit} features (e.g. attention heads or K/V "
                    f"query groups) cannot be split over {size} ranks: {size} is not a divisor of {units}{also}; "
                    f"TP sizes that work for this module: {sizes}"
                )

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Layout of each of the module's own parameters on `size` ranks."""
        if _kind(module, "ColwiseParallel") == "embedding":
            return {"weight": Shard(1)}
        replicas = tuple(size // u if r and u < size else 1 for u, r in self._units())
        blocks = self.blocks if len(self.blocks or ()) > 1 else None  # one block: a plain split (by whole units)
        layout = Shard(0, blocks, replicas if any(r > 1 for r in replicas) else None)
        layouts = {"weight": layout}
        if module.bias is not None:
            layouts["bias"] = layout
        return layouts


def _splits(units: int, size: int, replicable: bool) -> bool:
    """Whether `units` split evenly over `size` ranks (or, if replicable, `size` ranks split evenly over them)."""
    return units % size == 0 or (replicable and size % units == 0)


@dataclass(frozen=True)
class RowwiseParallel:
    """nn.Linear: weight split on dim 1 (input features), bias replicated and added once after the reduction;
    nn.Embedding: vocabulary split (weight dim 0).

    `output_layout`: where the partial sums are reduced to (Replicate: all_reduce; Shard(1): reduce_scatter).
    """

    input_layout: Layout | None = None
    output_layout: Layout | None = REPLICATE

    def check(self, module_name: str, size: int) -> None:
        """Nothing beyond divisibility of the weight."""

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Layout of each of the module's own parameters."""
        if _kind(module, "RowwiseParallel") == "embedding":
            return {"weight": Shard(0)}
        layouts: dict[str, Layout] = {"weight": Shard(1)}
        if module.bias is not None:
            layouts["bias"] = REPLICATE
        return layouts


@dataclass(frozen=True)
class SequenceParallel:
    """A norm computed on sequence-sharded activations: parameters replicated, input and output sharded on `seq_dim`
    (an input still Partial is reduce-scattered into it)."""

    seq_dim: int = 1

    @property
    def input_layout(self) -> Layout:
        return Shard(self.seq_dim)

    @property
    def output_layout(self) -> Layout:
        return Shard(self.seq_dim)

    def check(self, module_name: str, size: int) -> None:
        """Nothing to check: parameters are replicated."""

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every parameter replicated."""
        params = dict(module.named_parameters(recurse=False))
        if "weight" not in params and not isinstance(module, _NORM_TYPES):
            raise TypeError(f"SequenceParallel applies to normalization modules with a weight, not {type(module).__name__}")
        return {name: REPLICATE for name in params}


@dataclass(frozen=True)
class FeatureShardedNorm:
    """A norm over a feature dim that arrives sharded (OLMo-2's q/k norm over all heads of a column-parallel
    projection): weight and bias split like the features, so each rank normalizes its own features and only
    the statistics (b*s numbers) are all_reduced; the activations are never gathered.
    """

    input_layout = None
    output_layout = None

    def check(self, module_name: str, size: int) -> None:
        """Nothing beyond divisibility of the parameters (whole heads are checked on the projection)."""

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every parameter split on its (only) dim."""
        return {name: Shard(0) for name, _ in module.named_parameters(recurse=False)}


@dataclass(frozen=True)
class KVCacheParallel:
    """A KV cache (litgpt's `KVCache`: buffers `k`, `v` of shape (batch, heads, max_seq_length, head_size)) split
    by heads like the K/V heads of the attention that fills it, so writing new keys and values is local.

    With fewer heads than ranks each head is held by size/heads consecutive ranks (K/V-head replication). A cache
    starts empty: each rank's piece is allocated zeroed at its local size on the group's device (also for a
    meta-device model), the module keeps meta-device placeholders of the full size, and its `reset_parameters()`
    zeroes the pieces.
    """

    head_dim: int = 1
    input_layout = None
    output_layout = None

    def check(self, module_name: str, size: int) -> None:
        """Whole heads per rank, checked against the buffers in `tensor_layouts`."""

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every buffer split on `head_dim`, each head replicated where there are fewer heads than ranks."""
        layouts: dict[str, Layout] = {}
        for name, buffer in module.named_buffers(recurse=False):
            heads = buffer.shape[self.head_dim]
            replicas = size // heads if heads < size and size % heads == 0 else 1
            layouts[name] = Shard(self.head_dim, replicas=(replicas,) if replicas > 1 else None)
        if not layouts:
            raise TypeError(f"KVCacheParallel applies to a module with cache buffers, {type(module).__name__} has none")
        return layouts


Style = ColwiseParallel | RowwiseParallel | SequenceParallel | FeatureShardedNorm | KVCacheParallel


def match_plan(model: nn.Module, plan: Mapping[str, Style]) -> dict[str, Style]:
    """Module name -> style for every module a plan key (exact or glob) matches; unmatched keys raise."""
    names = [name for name, _ in model.named_modules() if name]
    matched: dict[str, Style] = {}
    for pattern, style in plan.items():
        hits = plan_key_matches(pattern, names)
        if not hits:
            raise ValueError(f"TP plan key {pattern!r} matches no module of {type(model).__name__}"
                             f"{_suggestions(model, pattern)}")
        for name in hits:
            if name in matched and matched[name] != style:
                raise ValueError(f"Module {name!r} matches two plan keys with different styles")
            matched[name] = style
    return matched


def _suggestions(model: nn.Module, pattern: str) -> str:
    """Names a mistyped plan key may have meant, drawn from the modules a style can split: those holding their own
    parameters or buffers (a KV cache), never a parameterless ReLU or container."""
    holders = [name for name, m in model.named_modules() if name and (m._parameters or m._buffers)]
    close = difflib.get_close_matches(pattern, holders, n=5, cutoff=0.5)
    if close:
        return f"; close names: {', '.join(close)}"
    return f"; modules with parameters: {', '.join(holders)}" if 0 < len(holders) <= 10 else ""


@dataclass
class PlannedTensors:
    """What a plan does to a module's tensors: each styled parameter's and buffer's layout, and the style of each
    styled module's weight (its op gets the style's input/output constraints)."""

    parameters: dict[str, Layout]
    buffers: dict[str, Layout]
    weight_styles: dict[str, Style]


def planned_tensors(module: nn.Module, styles: Mapping[str, Style], size: int) -> PlannedTensors:
    """The layout of every tensor that `styles` (module name -> style) covers on `size` ranks, each checked: whole
    units (heads) per rank, divisibility, agreement with a `distparallel_type` already on the parameter."""
    planned = PlannedTensors({}, {}, {})
    for module_name, style in styles.items():
        submodule = module.get_submodule(module_name)
        style.check(module_name, size)
        for tname, layout in style.tensor_layouts(submodule, size).items():
            name = f"{module_name}.{tname}"
            tensor, is_parameter = getattr(submodule, tname), tname in submodule._parameters
            check_distparallel_type(name, tensor, layout)
            check_shardable(tensor.shape, layout, size, f"{'parameter' if is_parameter else 'buffer'} {name!r}")
            (planned.parameters if is_parameter else planned.buffers)[name] = layout
        planned.weight_styles[f"{module_name}.weight"] = style
    return planned


def plan_key_matches(pattern: str, names: list[str]) -> list[str]:
    """The module names a plan key (a name or a glob) matches."""
    return [n for n in names if fnmatch.fnmatchcase(n, pattern)]


def styles_from_distparallel_type(model: nn.Module) -> dict[str, Style]:
    """Styles implied by COLUMN_WISE / ROW_WISE set on parameters (Thunder's meaning: weight dim 0 / dim 1)."""
    styles: dict[str, Style] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        kind = getattr(weight, "distparallel_type", None)
        if kind not in (DistParallelType.COLUMN_WISE, DistParallelType.ROW_WISE):
            continue
        dim0 = kind is DistParallelType.COLUMN_WISE
        if isinstance(module, nn.Embedding):
            styles[name] = RowwiseParallel() if dim0 else ColwiseParallel()
        elif isinstance(module, nn.Linear):
            styles[name] = ColwiseParallel() if dim0 else RowwiseParallel()
        else:
            raise TypeError(f"{name}.weight has distparallel_type {kind.name}, but {type(module).__name__} is not supported")
    return styles


def check_distparallel_type(name: str, param, layout: Layout) -> None:
    """A COLUMN_WISE / ROW_WISE already on a planned parameter must agree with the plan."""
    kind = getattr(param, "distparallel_type", None)
    expected = {DistParallelType.COLUMN_WISE: Shard(0), DistParallelType.ROW_WISE: Shard(1)}.get(kind)
    if expected is None:
        return
    if not isinstance(layout, Shard) or layout.dim != expected.dim:
        raise ValueError(
            f"Parameter {name!r} has distparallel_type {kind.name} (shard dim {expected.dim}) but the TP plan gives "
            f"it {layout}; remove the attribute or change the plan"
        )


def tied_parameters(module: nn.Module) -> dict[str, str]:
    """Name -> the first name of the same parameter, for a parameter registered under several names (tied)."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            tied[name] = first[id(p)]
    return tied


def check_tied_layouts(tied: dict[str, str], layouts: dict[str, Layout]) -> None:
    """A tied parameter is one tensor: the plan must split it the same way under each of its names."""
    for name, first in tied.items():
        a, b = layouts.get(first, REPLICATE), layouts.get(name, REPLICATE)
        if a != b:
            raise ValueError(
                f"thunder_tp.TensorParallel: {name!r} is tied to {first!r} (one tensor), but the plan gives them "
                f"different layouts ({b} and {a}); plan their modules so that the tensor is split one way (e.g. a "
                "RowwiseParallel embedding with a ColwiseParallel head both split the vocabulary)"
            )
