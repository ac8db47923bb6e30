"""The automatic plan's decisions: which modules are planned alike, and the styles each may get."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from itertools import product

import thunder.torch as ltorch
import torch.nn as nn
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx

from thunder_tp.families import wrapper_of
from thunder_tp.layouts import REPLICATE
from thunder_tp.plans.search.tracing import Traced
from thunder_tp.styles import ColwiseParallel, FeatureShardedNorm, KVCacheParallel, RowwiseParallel, Style


@dataclass(frozen=True)
class Decision:
    """Modules planned alike (one per block, or tied ones) and the styles they may get, one per module."""

    modules: tuple[str, ...]
    choices: tuple[tuple[Style | None, ...], ...]


def decisions_of(module: nn.Module, trace: Traced, size: int) -> list[Decision]:
    """One decision per kind of parameter-owning module (modules differing only in block indices alike, tied
    modules together; KV caches too), in the order their parameters enter the trace."""
    owners: dict[str, list[str]] = {}
    for name, m in module.named_modules():
        if any(True for _ in m.parameters(recurse=False)) or is_cache(m):
            owners.setdefault(block_pattern(name), []).append(name)
    for pattern, names in list(owners.items()):  # a wrapper is decided with the layer it wraps
        wrapper = wrapper_of(module.get_submodule(names[0]))
        if wrapper is not None:
            names.extend(owners.pop(f"{pattern}.{wrapper.child}", []))
    groups = _merge_tied(module, list(owners.values()))
    order = {n.rpartition(".")[0]: i for i, n in enumerate(trace.names.values())}
    groups.sort(key=lambda g: min(order.get(m, math.inf) for m in g))
    return [_decision(module, trace, g, size) for g in groups]


def _merge_tied(module: nn.Module, groups: list[list[str]]) -> list[list[str]]:
    """Groups sharing a parameter (a tied embedding and head) merged: one tensor has one layout."""
    merged: list[list[str]] = []
    index: dict[int, int] = {}  # parameter id -> its merged group
    for group in groups:
        ids = [id(p) for name in group for p in module.get_submodule(name).parameters(recurse=False)]
        i = next((index[p] for p in ids if p in index), len(merged))
        if i == len(merged):
            merged.append([])
        merged[i].extend(group)
        index.update((p, i) for p in ids)
    return merged


def _decision(module: nn.Module, trace: Traced, group: list[str], size: int) -> Decision:
    """The styles each module of `group` may get (a style per module; tied modules: the combinations that split
    their shared parameter one way; a wrapper: the style that follows its layer's)."""
    wrappers = {name: w for name in group if (w := wrapper_of(module.get_submodule(name))) is not None}
    kinds = {}
    for name in group:
        if name not in wrappers:
            kinds.setdefault(_signature(module.get_submodule(name)), name)
    per_kind = {sig: _choices(module.get_submodule(first), first, trace, size) for sig, first in kinds.items()}
    names = list(kinds)
    combos = []
    for combo in product(*(per_kind[n] for n in names)):
        by_kind = dict(zip(names, combo, strict=True))
        styles = {m: by_kind[_signature(module.get_submodule(m))] for m in group if m not in wrappers}
        for name, w in wrappers.items():
            layer = styles[f"{name}.{w.child}"]
            styles[name] = None if layer is None else w.follow(layer)
        combos.append(tuple(styles[m] for m in group))
    return Decision(tuple(group), tuple(combos))


def _signature(m: nn.Module) -> tuple:
    return (type(m).__name__, tuple((n, tuple(p.shape)) for n, p in m.named_parameters(recurse=False)))


def _choices(m: nn.Module, name: str, trace: Traced, size: int) -> list[Style | None]:
    """The styles worth trying for one module (None: replicated), sharded ones first."""
    if isinstance(m, nn.Linear):
        column = _column_style(name, trace, size)
        gathered = ColwiseParallel(REPLICATE, REPLICATE, column.blocks, column.unit, column.replicable)
        return [column, RowwiseParallel(), RowwiseParallel(output_layout=None), gathered, None]
    if isinstance(m, nn.Embedding):
        return [RowwiseParallel(), ColwiseParallel(output_layout=None), RowwiseParallel(output_layout=None), None]
    if is_cache(m):
        return [KVCacheParallel(), None]
    if all(p.ndim == 1 for p in m.parameters(recurse=False)):
        return [None, FeatureShardedNorm()]
    return [None]


def is_cache(m: nn.Module) -> bool:
    """A module with no parameters that holds (batch, heads, positions, head size) buffers: a KV cache."""
    buffers = list(m.buffers(recurse=False))
    return not any(True for _ in m.parameters(recurse=False)) and bool(buffers) and all(b.ndim == 4 for b in buffers)


def _column_style(name: str, trace: Traced, size: int) -> ColwiseParallel:
    """Column-parallel by whole heads where the trace cuts the output into blocks (a split) and heads (a view to
    (..., heads, head_size)); a block with fewer heads than ranks may be replicated."""
    weight = next((p for p, n in trace.names.items() if n == f"{name}.weight"), None)
    blocks = _output_blocks(trace.computation, weight) if weight else None
    if blocks is None:
        return ColwiseParallel()
    sizes = tuple(n for n, _ in blocks)
    unit = math.gcd(*(d for _, (h, d) in blocks))
    replicable = tuple(h < size for _, (h, _d) in blocks)
    return ColwiseParallel(blocks=sizes, unit=unit, replicable=replicable)


def _output_blocks(trace: TraceCtx, weight: str) -> list[tuple[int, tuple[int, int]]] | None:
    """[(block size, (heads, head size))] of the first linear that uses `weight`, when its output is viewed as
    heads (after a split into blocks, if any)."""
    users: dict[str, list] = {}
    for b in trace.bound_symbols:
        for a in b.flat_proxy_args:
            users.setdefault(a.name, []).append(b)
    linear = next((b for b in users.get(weight, []) if b.sym.id == ltorch.linear.id), None)
    if linear is None:
        return None
    y = linear.output
    parts = [y]
    for b in users.get(y.name, []):
        if b.sym.id == ltorch.split.id and _last_dim(b, y):
            parts = [o for o in b.output if isinstance(o, TensorProxy)]
    heads = [_heads(p, users) for p in parts]
    if any(h is None for h in heads):
        return None
    return [(p.shape[-1], h) for p, h in zip(parts, heads, strict=True)]


def _last_dim(split, t: TensorProxy) -> bool:
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    return dim in (-1, t.ndim - 1)


def _heads(t: TensorProxy, users: dict, depth: int = 12) -> tuple[int, int] | None:
    """(heads, head size) of the nearest view of `t` that cuts its last dim in two, through at most `depth`
    same-shape ops (a norm over all heads and its casts, as OLMo-2's, come before the view)."""
    frontier, seen = [t], {t.name}
    for _ in range(depth + 1):
        reached = []
        for x in frontier:
            for b in users.get(x.name, []):
                out = b.output
                if not isinstance(out, TensorProxy) or out.name in seen:
                    continue
                if b.sym.id in (ltorch.reshape.id, ltorch.view.id) and out.ndim == x.ndim + 1 and \
                        tuple(out.shape[: x.ndim - 1]) == tuple(x.shape[:-1]) and \
                        out.shape[-2] * out.shape[-1] == x.shape[-1]:
                    return out.shape[-2], out.shape[-1]
                if tuple(out.shape) == tuple(x.shape):
                    seen.add(out.name)
                    reached.append(out)
        frontier = reached
    return None


def block_pattern(name: str) -> str:
    """`name` with every block index a glob: transformer.h.3.mlp.fc -> transformer.h.*.mlp.fc."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)
