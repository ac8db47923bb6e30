"""Plans written for DTensor: torch.distributed.tensor.parallel's styles read as thunder_tp's.

A plan for `parallelize_module` (torchtitan's, a `ModelParallelStrategy` `parallelize_fn`'s) runs unchanged: each
DTensor style becomes the thunder_tp style that splits the same tensors and turns the same values into the same
layouts. What DTensor needs to turn plain tensors into DTensors (`input_layouts`: how an input arrives;
`use_local_output`) has no meaning in a traced program, where every value's layout is known and every value is a
local piece: it is accepted. A mapping as a value is the plan of that submodule, as `parallelize_module(submodule,
mesh, plan)` applies it (torchtitan's per-block plans).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch.distributed.tensor import parallel as dtensor

from thunder_tp.styles import ColwiseParallel, ModuleLayouts, RowwiseParallel, SequenceParallel, Style


def read_plan(plan: Mapping[str, object]) -> dict[str, Style]:
    """The plan with every DTensor style read as a thunder_tp style and nested plans flattened (their keys prefixed);
    anything else than a style is a TypeError naming its key."""
    read: dict[str, Style] = {}
    for key, value in plan.items():
        if isinstance(value, Mapping):
            entries = {_joined(key, k): v for k, v in read_plan(value).items()}
        else:
            entries = {key: as_style(key, value)}
        for name, style in entries.items():
            if read.setdefault(name, style) != style:
                raise ValueError(f"thunder_tp.TensorParallel: the plan gives key {name!r} two styles, {read[name]} "
                                 f"and {style} (a nested plan's keys are prefixed with its own); keep one")
    return read


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
}
