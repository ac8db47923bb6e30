"""The styles DTensor also has: `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`, and `ModuleLayouts` (its
PrepareModuleInput / PrepareModuleOutput).

They accept DTensor's keyword names (`input_layouts`, `output_layouts`, `use_local_output`, `sequence_dim`) and
torch.distributed.tensor placements beside their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, InitVar, dataclass, fields

import torch.nn as nn

from thunder_tp.layouts import PARTIAL, REPLICATE, Layout, Shard, Split, as_layout, canonical
from thunder_tp.styles.base import Style

_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


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
