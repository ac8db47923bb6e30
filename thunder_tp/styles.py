"""Parallel styles and plan matching.

A style says how a module's own tensors (parameters, and a cache's buffers) are split (`tensor_layouts`) and
which layouts the input and output of the op that consumes its weight are constrained to (`input_layout`,
`output_layout`), as DTensor's styles do at module boundaries. Every style implements `Style`. The styles accept
DTensor's keyword names (`input_layouts`, `output_layouts`, `use_local_output`, `sequence_dim`) and
torch.distributed.tensor placements beside their own; plan keys match module names as DTensor's do.
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import KW_ONLY, InitVar, dataclass, fields
from fnmatch import fnmatchcase

import torch.nn as nn
from thunder.core.proxies import DistParallelType

from thunder_tp.layouts import PARTIAL, REPLICATE, Layout, Shard, Split, as_layout, canonical, check_shardable

_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


class Style(ABC):
    """What every parallel style implements (a frozen dataclass each, so that plans compare and hash).

    A new style fills in `tensor_layouts`, raising a ValueError or TypeError where it cannot split a module (the
    error gets the module's name), and where it needs them `input_layout` and `output_layout`: the layouts the input
    and the output of the op that consumes the module's weight are turned into (None leaves them to propagation).
    """

    input_layout: Layout | None = None
    output_layout: Layout | None = None

    @abstractmethod
    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Layout of each of the module's own tensors that the style splits, on `size` ranks (their divisibility
        `planned_tensors` checks)."""


def _kind(module: nn.Module, style: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if is_conv1d(module):
        return "conv1d"
    raise TypeError(
        f"{style} supports nn.Linear, nn.Embedding and transformers' Conv1D, not {type(module).__name__}; "
        "annotate its parameters with thunder_tp.annotate or leave the module out of the plan"
    )


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is HF transformers' Conv1D (GPT-2's linear layer: weight (in, out), y = addmm(b, x, w))."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def _features_dims(module: nn.Module) -> tuple[int, int]:
    """The weight dims of a linear layer's output and input features: nn.Linear's (0, 1), Conv1D's (1, 0)."""
    return (1, 0) if is_conv1d(module) else (0, 1)


def _read_layouts(style: Style, input_layouts: object, output_layouts: object, natural_output: Layout) -> None:
    """Set a style's layouts from its own keyword names or DTensor's, torch placements read as layouts.

    DTensor's `input_layouts` says how a plain tensor input arrives; a traced program knows that of every value, so
    it is only checked to be a layout. `output_layouts` is `output_layout`, where the split's own output layout
    (`natural_output`, DTensor's default) leaves the output to propagation.
    """
    as_layout(input_layouts)
    name = type(style).__name__
    if output_layouts is not None:
        if style.output_layout != _default(style, "output_layout"):
            raise ValueError(f"{name}: give output_layout or DTensor's output_layouts, not both")
        output = as_layout(output_layouts)
        object.__setattr__(style, "output_layout", None if output == natural_output else output)
    object.__setattr__(style, "input_layout", as_layout(style.input_layout))
    object.__setattr__(style, "output_layout", as_layout(style.output_layout))


def _default(style: Style, name: str) -> object:
    return next(f.default for f in fields(style) if f.name == name)


@dataclass(frozen=True)
class ColwiseParallel(Style):
    """nn.Linear: weight and bias split on dim 0 (output features); nn.Embedding: embedding dim.

    `blocks`: the output features are fused blocks (e.g. q|k|v) each split separately.
    `input_layout`: what the input is turned into (Replicate: gathered if it arrives sharded).
    `output_layout`: None keeps the output sharded on its last dim.
    `unit`: features come in indivisible groups of this size (e.g. one attention head); a TP size that does not
    divide them splits them by whole units, balanced (28 heads over 8 ranks: 4, 4, 4, 4, 3, 3, 3, 3).
    `groups`: the units of every block come in this many runs that stay together where they can (the query heads
    that share one K/V head, and the K/V heads themselves): `layouts.Split`.
    `replicable`: per block, whether it may have fewer units than ranks (K/V heads of grouped-query
    attention): each unit is then held by the ranks whose query heads use it, and its grads summed over them.
    DTensor's names: `output_layouts` (its default Shard(-1) is output_layout=None), `input_layouts` and
    `use_local_output` (accepted; a traced program knows each input's layout, and its values are local pieces).
    """

    input_layout: Layout | None = REPLICATE
    output_layout: Layout | None = None
    blocks: tuple[int, ...] | None = None
    unit: int = 1
    replicable: tuple[bool, ...] | None = None
    groups: int | None = None
    _: KW_ONLY
    input_layouts: InitVar[object] = None
    output_layouts: InitVar[object] = None
    use_local_output: InitVar[bool] = True

    def __post_init__(self, input_layouts: object, output_layouts: object, use_local_output: bool) -> None:
        _read_layouts(self, input_layouts, output_layouts, natural_output=Shard(-1))

    def _splits(self, size: int) -> list[Split]:
        """Each block's split on `size` ranks (replicated where a replicable block has fewer groups than ranks)."""
        blocks = self.blocks or ()
        return [Split(b // self.unit, self.groups, replicable and (self.groups or b // self.unit) < size).normal(size)
                for b, replicable in zip(blocks, self.replicable or (False,) * len(blocks), strict=True)]

    def tp_sizes(self, up_to: int) -> list[int]:
        """The TP sizes (at most `up_to`) over which every rank gets at least one whole unit of every block."""
        return [s for s in range(1, up_to + 1) if all(c for split in self._splits(s) for _, c in split.unit_ranges(s))]

    def _check_units(self, size: int) -> None:
        """Each rank must get whole units (heads) of every block, at least one."""
        for split in self._splits(size):
            if any(count == 0 for _, count in split.unit_ranges(size)):
                sizes = ", ".join(map(str, self.tp_sizes(size)))
                raise ValueError(
                    f"a block of {split.units} units of {self.unit} features (e.g. attention heads) cannot be split "
                    f"over {size} ranks: every rank needs at least one; TP sizes that work for this module: {sizes}"
                )

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Layout of each of the module's own parameters on `size` ranks."""
        if _kind(module, "ColwiseParallel") == "embedding":
            return {"weight": Shard(1)}
        self._check_units(size)
        out_dim = _features_dims(module)[0]
        features = module.weight.shape[out_dim]
        splits = tuple(self._splits(size)) or (Split(features // self.unit, self.groups).normal(size),)
        blocks = self.blocks if len(self.blocks or ()) > 1 else None  # one block: a plain split (by whole units)
        layout = canonical(Shard(0, blocks, splits), features, size)
        layouts = {"weight": layout.moved(out_dim)}
        if module.bias is not None:
            layouts["bias"] = layout
        return layouts


@dataclass(frozen=True)
class RowwiseParallel(Style):
    """nn.Linear: weight split on dim 1 (input features), bias replicated and added once after the reduction;
    nn.Embedding: vocabulary split (weight dim 0).

    `output_layout`: where the partial sums are reduced to (Replicate: all_reduce; Shard(1): reduce_scatter; None
    leaves them Partial). `unit`, `groups`: the input features come in whole units (attention heads), split as the
    column-parallel layer that produces them splits its output (ColwiseParallel's). DTensor's names: `output_layouts`
    (Partial() is output_layout=None), `input_layouts` and `use_local_output` (accepted, as for ColwiseParallel).
    """

    input_layout: Layout | None = None
    output_layout: Layout | None = REPLICATE
    unit: int = 1
    groups: int | None = None
    _: KW_ONLY
    input_layouts: InitVar[object] = None
    output_layouts: InitVar[object] = None
    use_local_output: InitVar[bool] = True

    def __post_init__(self, input_layouts: object, output_layouts: object, use_local_output: bool) -> None:
        _read_layouts(self, input_layouts, output_layouts, natural_output=PARTIAL)

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Layout of each of the module's own parameters."""
        if _kind(module, "RowwiseParallel") == "embedding":
            return {"weight": Shard(0)}
        in_dim = _features_dims(module)[1]
        features = module.weight.shape[in_dim]
        split = Split(features // self.unit, self.groups).normal(size)
        layouts: dict[str, Layout] = {"weight": canonical(Shard(in_dim, splits=(split,)), features, size)}
        if module.bias is not None:
            layouts["bias"] = REPLICATE
        return layouts


@dataclass(frozen=True)
class SequenceParallel(Style):
    """A norm computed on sequence-sharded activations: parameters replicated, input and output sharded on `seq_dim`
    (an input still Partial is reduce-scattered into it). DTensor's names: `sequence_dim` (`seq_dim`),
    `use_local_output` (accepted)."""

    seq_dim: int = 1
    _: KW_ONLY
    sequence_dim: InitVar[int | None] = None
    use_local_output: InitVar[bool] = False

    def __post_init__(self, sequence_dim: int | None, use_local_output: bool) -> None:
        if sequence_dim is not None:
            if self.seq_dim != _default(self, "seq_dim"):
                raise ValueError("SequenceParallel: give seq_dim or DTensor's sequence_dim, not both")
            object.__setattr__(self, "seq_dim", sequence_dim)

    @property
    def input_layout(self) -> Layout:
        return Shard(self.seq_dim)

    @property
    def output_layout(self) -> Layout:
        return Shard(self.seq_dim)

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every parameter replicated."""
        params = dict(module.named_parameters(recurse=False))
        if "weight" not in params and not isinstance(module, _NORM_TYPES):
            raise TypeError("SequenceParallel applies to normalization modules with a weight, not "
                            f"{type(module).__name__}")
        return {name: REPLICATE for name in params}


@dataclass(frozen=True)
class FeatureShardedNorm(Style):
    """A norm over a feature dim that arrives sharded (OLMo-2's q/k norm over all heads of a column-parallel
    projection): weight and bias split like the features, so each rank normalizes its own features and only
    the statistics (b*s numbers) are all_reduced; the activations are never gathered. `unit`, `groups`: the
    features' heads, split as the projection splits them (ColwiseParallel's).
    """

    unit: int = 1
    groups: int | None = None

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every parameter split on its (only) dim like the heads (whole heads are checked on the projection)."""
        layouts: dict[str, Layout] = {}
        for name, p in module.named_parameters(recurse=False):
            split = Split(p.shape[0] // self.unit, self.groups).normal(size)
            layouts[name] = canonical(Shard(0, splits=(split,)), p.shape[0], size)
        return layouts


@dataclass(frozen=True)
class KVCacheParallel(Style):
    """A KV cache (litgpt's `KVCache`: buffers `k`, `v` of shape (batch, heads, max_seq_length, head_size)) split
    by heads like the K/V heads of the attention that fills it, so writing new keys and values is local.

    With fewer heads than ranks each head is held by the ranks whose query heads use it (K/V-head replication). A cache
    starts empty: each rank's piece is allocated zeroed at its local size on the group's device (also for a
    meta-device model), the module keeps meta-device placeholders of the full size, and its `reset_parameters()`
    zeroes the pieces.
    """

    head_dim: int = 1

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Every buffer split on `head_dim` as K/V heads are (ColwiseParallel's replicable blocks)."""
        layouts: dict[str, Layout] = {}
        for name, buffer in module.named_buffers(recurse=False):
            heads = buffer.shape[self.head_dim]
            split = Split(heads, replicated=heads < size).normal(size)
            layouts[name] = canonical(Shard(self.head_dim, splits=(split,)), heads, size)
        if not layouts:
            raise TypeError(f"KVCacheParallel applies to a module with cache buffers, {type(module).__name__} has none")
        return layouts


@dataclass(frozen=True)
class ModuleLayouts(Style):
    """The inputs and outputs of a module turned into layouts where it is called, as DTensor's PrepareModuleInput and
    PrepareModuleOutput do: `inputs` one layout per positional input, `kwarg_inputs` (name, layout) pairs,
    `outputs` one per output (several for a module returning a tuple); None leaves a value as it comes. The
    module's own tensors are left to the styles of its submodules."""

    inputs: tuple[Layout | None, ...] | None = None
    kwarg_inputs: tuple[tuple[str, Layout], ...] = ()
    outputs: tuple[Layout | None, ...] | None = None

    def __post_init__(self) -> None:
        kwargs = self.kwarg_inputs.items() if isinstance(self.kwarg_inputs, Mapping) else self.kwarg_inputs
        object.__setattr__(self, "inputs", _as_layouts(self.inputs))
        object.__setattr__(self, "outputs", _as_layouts(self.outputs))
        object.__setattr__(self, "kwarg_inputs", tuple(sorted((k, as_layout(x)) for k, x in kwargs if x is not None)))

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """None: the module's own tensors are not split by this style."""
        return {}


def _as_layouts(layouts: tuple | None) -> tuple[Layout | None, ...] | None:
    return None if layouts is None else tuple(as_layout(x) for x in layouts)


def match_plan(model: nn.Module, plan: Mapping[str, Style]) -> dict[str, Style]:
    """Module name -> style for every module a plan key (a name, a glob or "": the model) matches; unmatched keys
    raise."""
    names = [name for name, _ in model.named_modules()]
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
    """Where a key matches modules deeper down (a block's plan given at the top level): how to nest it. Otherwise
    names a mistyped plan key may have meant, drawn from the modules a style can split: those holding their own
    parameters or buffers (a KV cache), never a parameterless ReLU or container."""
    nested = _nesting_hint(model, pattern)
    if nested:
        return nested
    holders = [name for name, m in model.named_modules() if name and (m._parameters or m._buffers)]
    close = difflib.get_close_matches(pattern, holders, n=5, cutoff=0.5)
    if close:
        return f"; close names: {', '.join(close)}"
    return f"; modules with parameters: {', '.join(holders)}" if 0 < len(holders) <= 10 else ""


def _nesting_hint(model: nn.Module, pattern: str) -> str:
    """For a key that matches submodules below the top level (`attention.wq` of `layers.0.attention.wq`, ...): the
    glob of the modules that hold them, and the key nested under it."""
    names = [name for name, _ in model.named_modules()]
    depth = pattern.count(".") + 1
    holders = {".".join(n.split(".")[:-depth]) for n in names
               if n.count(".") >= depth and plan_key_matches(pattern, [".".join(n.split(".")[-depth:])])}
    if not holders:
        return ""
    globbed = sorted({".".join("*" if part.isdigit() else part for part in h.split(".")) for h in holders})
    glob = globbed[0] if len(globbed) == 1 else None
    if glob is None:
        return f"; it names submodules of {', '.join(sorted(holders)[:4])}: prefix the key with one of them"
    return (f"; it names a submodule of each of {glob} ({len(holders)} modules): nest the plan under their glob, "
            f"{{{glob!r}: {{{pattern!r}: ...}}}}, or write the key as {f'{glob}.{pattern}'!r}")


def checked_plan(model: nn.Module, plan: Mapping[str, Style], tp_size: int | None) -> dict[str, Style]:
    """`plan`, checked against `tp_size` ranks now when one is given (the errors TensorParallel would raise)."""
    if tp_size is not None:
        planned_tensors(model, match_plan(model, plan), tp_size)
    return dict(plan)


@dataclass
class PlannedTensors:
    """What a plan does to a module's tensors: each styled parameter's and buffer's layout, and the style of each
    styled module's weight (its op gets the style's input/output constraints)."""

    parameters: dict[str, Layout]
    buffers: dict[str, Layout]
    weight_styles: dict[str, Style]


def planned_tensors(module: nn.Module, styles: Mapping[str, Style], size: int) -> PlannedTensors:
    """The layout of every tensor that `styles` (module name -> style) covers on `size` ranks, each checked: what
    the style checks (whole heads per rank), divisibility, agreement with a `distparallel_type` already on the
    parameter."""
    planned = PlannedTensors({}, {}, {})
    for module_name, style in styles.items():
        submodule = module.get_submodule(module_name)
        try:
            layouts = style.tensor_layouts(submodule, size)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{module_name or type(module).__name__}: {e}") from e
        for tname, layout in layouts.items():
            name = _qualified(module_name, tname)
            tensor, is_parameter = getattr(submodule, tname), tname in submodule._parameters
            check_distparallel_type(name, tensor, layout)
            check_shardable(tensor.shape, layout, size, f"{'parameter' if is_parameter else 'buffer'} {name!r}")
            (planned.parameters if is_parameter else planned.buffers)[name] = layout
        planned.weight_styles[_qualified(module_name, "weight")] = style
    return planned


def _qualified(module_name: str, tensor_name: str) -> str:
    """A tensor's name in the model ("" is the model itself)."""
    return f"{module_name}.{tensor_name}" if module_name else tensor_name


def plan_key_matches(pattern: str, names: list[str]) -> list[str]:
    """The module names a plan key matches, as DTensor's parallelize_module matches them: segment by segment between
    the dots, each a glob of one name segment (`layers.*.mlp` matches `layers.0.mlp`, not `layers.0.moe.mlp`); ""
    matches the model itself."""
    parts = pattern.split(".")
    return [n for n in names if (n == "") == (pattern == "") and _segments_match(parts, n.split("."))]


def _segments_match(patterns: list[str], segments: list[str]) -> bool:
    return len(patterns) == len(segments) and all(fnmatchcase(s, p) for s, p in zip(segments, patterns, strict=True))


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
            raise TypeError(f"{name}.weight has distparallel_type {kind.name}, but {type(module).__name__} is not "
                            "supported")
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
