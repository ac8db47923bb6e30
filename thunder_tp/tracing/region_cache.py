"""Regions that compile to the same kernels compile once: one compiled callable per canonical region.

A model's blocks give fusion regions that are the same code on tensors of the same shapes, their proxies named
apart (``t123`` in one layer, ``t456`` in the next). `canonical_form` is a region's structure with names replaced
by their order of first appearance: the op of every bound symbol, its arguments (proxies by position, with each
input's metadata; other values as they print), its outputs. Regions of one form share one callable: Inductor's
``torch.compile`` of the region runs Dynamo and compiles once for all of them (its on-disk FX graph cache, keyed by
the graph, already serves them across processes), and a region its backend rejects falls back once for all of them
(``execution/fallback.py``). The cache lives as long as the process: a model jitted again, or another model with
the same blocks, reuses the regions.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from thunder.core.compile_data import get_compile_option, using_symbolic_values
from thunder.core.proxies import NumberProxy, Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol

__all__ = ["CompiledRegions", "canonical_form", "compile_once_option"]


def compile_once_option() -> bool | None:
    """``thunder.jit(..., compile_once=...)``: False interprets every block and compiles every region apart (None:
    not given)."""
    option = get_compile_option("compile_once", "thunder_tp: trace repeated blocks once, compile alike regions once")
    return None if option is None else bool(option)


def canonical_form(bsyms: Sequence[BoundSymbol], inputs: Sequence[Any], outputs: Any) -> Hashable:
    """The structure of a program (bound symbols reading `inputs`, returning `outputs`) up to the names of its
    values: equal for two programs that compute the same thing from inputs of the same metadata."""
    positions: dict[str, int] = {}

    def canonical(x: Any) -> Hashable:
        if isinstance(x, Proxy):
            return "value", positions.setdefault(x.name, len(positions))
        if isinstance(x, (tuple, list)):
            return type(x).__name__, tuple(canonical(item) for item in x)
        if isinstance(x, dict):
            return "dict", tuple((key, canonical(x[key])) for key in sorted(x, key=str))
        if isinstance(x, slice):
            return "slice", canonical(x.start), canonical(x.stop), canonical(x.step)
        return type(x).__name__, repr(x)

    head = tuple((canonical(x), _metadata(x)) for x in inputs)
    body = tuple((b.sym.id, canonical(b.args), canonical(b.kwargs), canonical(b.output)) for b in bsyms)
    return head, body, canonical(outputs)


def _metadata(x: Any) -> Hashable:
    if isinstance(x, TensorProxy):
        return tuple(x.shape), repr(x.dtype), repr(x.device), x.requires_grad
    if isinstance(x, NumberProxy):
        return type(x).__name__, x.python_type.__name__
    return type(x).__name__


class CompiledRegions:
    """Process-wide: what each canonical region compiled to, made once by `make` (counted in `compiles`); keyed by
    value (the canonical form), so another model's alike regions share it; `clear()` empties it."""

    def __init__(self) -> None:
        self._made: dict[Hashable, Any] = {}
        self.compiles = 0

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value of `key`, made by `make()` the first time (every time in a jit with compile_once=False, and
        under symbolic values, whose shapes hold proxies that compare as symbols, not as values)."""
        if compile_once_option() is False or using_symbolic_values():
            self.compiles += 1
            return make()
        if key not in self._made:
            self._made[key] = make()
            self.compiles += 1
        return self._made[key]

    def __len__(self) -> int:
        return len(self._made)

    def clear(self) -> None:
        """Forget every value made (their kernels stay in Inductor's on-disk cache); the count starts again."""
        self._made.clear()
        self.compiles = 0
