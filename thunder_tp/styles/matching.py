"""Plans matched to a model: which module each plan key names (as DTensor's `parallelize_module` matches them, with
suggestions where a key matches nothing), the layout each style gives each tensor on a number of ranks, checked, and
the other sources of layouts a plan must agree with (Thunder's `distparallel_type`, tied parameters)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch.nn as nn
from thunder.core.proxies import DistParallelType

from thunder_tp.layouts import REPLICATE, Layout, Shard, check_shardable
from thunder_tp.styles.base import Style
from thunder_tp.styles.dtensor_like import ColwiseParallel, RowwiseParallel


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
