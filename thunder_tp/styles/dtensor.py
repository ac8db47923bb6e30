"""Plans written for DTensor: torch.distributed.tensor.parallel's styles read as thunder_tp's.

A plan for `parallelize_module` (torchtitan's, a `ModelParallelStrategy` `parallelize_fn`'s) runs unchanged: each
DTensor style becomes the thunder_tp style that splits the same tensors and turns the same values into the same
layouts. What DTensor needs to turn plain tensors into DTensors (`input_layouts`: how an input arrives;
`use_local_output`) has no meaning in a traced program, where every value's layout is known and every value is a
local piece: it is accepted. A mapping as a value is the plan of that submodule, as `parallelize_module(submodule,
mesh, plan)` applies it (torchtitan's per-block plans); one style alone is the plan of the whole module.

A function that parallelizes a model with DTensor (a `ModelParallelStrategy` `parallelize_fn`, torchtitan's
`apply_tp`) is read by running it with its `parallelize_module` calls recorded instead of applied
(`read_parallelize_fn`); its FSDP2 `fully_shard` (or composable `replicate`) says which data parallelism to put
around TP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch.nn as nn
from torch.distributed.tensor import parallel as dtensor

from thunder_tp.styles import ColwiseParallel, ModuleLayouts, RowwiseParallel, SequenceParallel, Style
from thunder_tp.styles.float8 import torchao_readers
from thunder_tp.thunder_internals.dtensor import entry_points, rebound_everywhere


def read_plan(plan: Mapping[str, object] | object) -> dict[str, Style]:
    """The plan with every DTensor style read as a thunder_tp style and nested plans flattened (their keys prefixed);
    one style alone is the plan of the whole module (key ""); anything else than a style is a TypeError naming its
    key."""
    if not isinstance(plan, Mapping):
        return {"": as_style("", plan)}
    read: dict[str, Style] = {}
    for key, value in plan.items():
        if isinstance(value, Mapping):
            entries = {_joined(key, k): v for k, v in read_plan(value).items()}
        else:
            entries = {key: as_style(key, value)}
        for name, style in entries.items():
            _add(read, name, style)
    return read


def _add(read: dict[str, Style], name: str, style: Style) -> None:
    if read.setdefault(name, style) != style:
        raise ValueError(f"thunder_tp.TensorParallel: the plan gives key {name!r} two styles, {read[name]} "
                         f"and {style} (a nested plan's keys are prefixed with its own); keep one")


def as_style(key: str, style: object) -> Style:
    """The thunder_tp style for `style` (a thunder_tp style or one of DTensor's), or an error naming the plan key."""
    if isinstance(style, Style):
        return style
    reader = _READERS.get(type(style))  # exact types: a subclass (Float8ColwiseParallel, ...) does more
    if reader is None:
        base = next((t for t in _READERS if isinstance(style, t)), None)
        what = (f"a subclass of DTensor's {base.__name__}, whose additions thunder_tp cannot read" if base else
                f"neither a thunder_tp style nor one of DTensor's that thunder_tp reads "
                f"({', '.join(sorted(t.__name__ for t in _READERS))})")
        raise TypeError(
            f"thunder_tp.TensorParallel: plan key {key!r} has {style!r}, {what}; use a thunder_tp style (e.g. "
            "thunder_tp.ColwiseParallel()) or one of DTensor's own"
        )
    try:
        return reader(style)
    except (TypeError, ValueError) as e:
        raise type(e)(f"thunder_tp.TensorParallel: plan key {key!r}, {style!r}: {e}") from e


def _joined(prefix: str, key: str) -> str:
    return ".".join(k for k in (prefix, key) if k)


def _colwise(style: dtensor.ColwiseParallel) -> ColwiseParallel:
    return ColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0])


def _rowwise(style: dtensor.RowwiseParallel) -> RowwiseParallel:
    return RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0])


def _sequence(style: dtensor.SequenceParallel) -> SequenceParallel:
    return SequenceParallel(sequence_dim=style.sequence_sharding[0].dim)


def _received(arriving: object, desired: object) -> object:
    """The layout a module receives a value in, from DTensor's pair: the desired one, else the arriving one; None
    (as it comes) without an arriving one, as DTensor leaves such a value."""
    return None if arriving is None else arriving if desired is None else desired


def _all_received(arriving: tuple | None, desired: tuple | None) -> tuple | None:
    if arriving is None:
        return None
    return tuple(_received(a, d) for a, d in zip(arriving, desired or (None,) * len(arriving), strict=True))


def _prepare_input(style: dtensor.PrepareModuleInput) -> ModuleLayouts:
    desired = style.desired_input_kwarg_layouts
    kwargs = {k: _received(a, desired.get(k)) for k, a in style.input_kwarg_layouts.items()}
    return ModuleLayouts(inputs=_all_received(style.input_layouts, style.desired_input_layouts), kwarg_inputs=kwargs)


def _prepare_output(style: dtensor.PrepareModuleOutput) -> ModuleLayouts:
    return ModuleLayouts(outputs=_all_received(style.output_layouts, style.desired_output_layouts))


def _prepare_input_output(style: dtensor.PrepareModuleInputOutput) -> ModuleLayouts:
    inputs, outputs = _prepare_input(style.prepare_module_input), _prepare_output(style.prepare_module_output)
    return ModuleLayouts(inputs=inputs.inputs, kwarg_inputs=inputs.kwarg_inputs, outputs=outputs.outputs)


_READERS: dict[type, Callable[[object], Style]] = {
    dtensor.ColwiseParallel: _colwise,
    dtensor.RowwiseParallel: _rowwise,
    dtensor.SequenceParallel: _sequence,
    dtensor.PrepareModuleInput: _prepare_input,
    dtensor.PrepareModuleOutput: _prepare_output,
    dtensor.PrepareModuleInputOutput: _prepare_input_output,
    **torchao_readers(_colwise, _rowwise, _prepare_input),
}


# --- a parallelize_fn, read ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelizeFnPlan:
    """What a DTensor parallelize function asks for: the TP plan of its `parallelize_module` calls, and the data
    parallelism it puts around them ("fsdp" for FSDP2's `fully_shard`, "ddp" for composable `replicate`, else None)."""

    plan: dict[str, Style]
    data_parallel: Literal["fsdp", "ddp"] | None


def read_parallelize_fn(fn: Callable, model: nn.Module, *args, **kwargs) -> ParallelizeFnPlan:
    """Run `fn(model, *args, **kwargs)` with DTensor's `parallelize_module`, FSDP2's `fully_shard` and composable
    `replicate` recorded instead of applied (wherever the function and its helpers imported them from), and return
    what they asked for; whatever else it does happens. `distribute_module` / `distribute_tensor` raise: their
    partition functions cannot be read as layouts."""
    recorder = _Recorder(model)
    with rebound_everywhere(recorder.stand_ins(), getattr(fn, "__globals__", None)):
        fn(model, *args, **kwargs)
    return ParallelizeFnPlan(recorder.plan, recorder.data_parallel)


class _Recorder:
    """Stand-ins for DTensor's and FSDP2's entry points that note what a parallelize function asks of them."""

    def __init__(self, model: nn.Module):
        self.names = {id(m): name for name, m in reversed(list(model.named_modules(remove_duplicate=False)))}
        self.model_type = type(model).__name__
        self.plan: dict[str, Style] = {}
        self.data_parallel: Literal["fsdp", "ddp"] | None = None

    def parallelize_module(self, module: nn.Module, device_mesh=None, parallelize_plan=None, **kwargs) -> nn.Module:
        prefix = self._name(module, "parallelize_module")
        for name, style in read_plan({prefix: parallelize_plan} if parallelize_plan is not None else {}).items():
            _add(self.plan, name, style)
        return module

    def fully_shard(self, module: nn.Module, *args, **kwargs) -> nn.Module:
        self._name(module, "fully_shard")
        self.data_parallel = "fsdp"
        return module

    def replicate(self, module: nn.Module, *args, **kwargs) -> nn.Module:
        self._name(module, "replicate")
        self.data_parallel = self.data_parallel or "ddp"
        return module

    def refuse(self, what: str) -> Callable:
        def refused(*args, **kwargs):
            raise TypeError(f"thunder_tp: the parallelize function calls torch.distributed.tensor.{what}, whose "
                            "partition functions thunder_tp cannot read as layouts; give the module styles through "
                            "parallelize_module(module, mesh, plan)")

        return refused

    def _name(self, module: nn.Module, call: str) -> str:
        if id(module) not in self.names:
            raise ValueError(f"thunder_tp: the parallelize function calls {call} on a {type(module).__name__} that is "
                             f"not part of the {self.model_type} it was given")
        return self.names[id(module)]

    def stand_ins(self) -> list[tuple[Callable, Callable]]:
        """Each entry point with the stand-in that notes its call (or refuses it)."""
        noted = {"parallelize_module": self.parallelize_module, "fully_shard": self.fully_shard,
                 "replicate": self.replicate}
        return [(fn, noted[name] if name in noted else self.refuse(name)) for name, fn in entry_points().items()]
