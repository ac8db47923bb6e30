"""Thunder 0.2.6 binds every symbol call to its meta's signature, computed once per meta instead of once per call.

``Symbol.bind`` normalizes its arguments with ``inspect.signature(self.meta).bind(...)`` for every bound symbol it
makes: in the interpretation, and again in each of Thunder's passes that rebuilds a trace. ``inspect.signature``
unwraps and reads the function every time: 46 of the test suite's CPU seconds. A meta's signature does not change,
so it is kept, by the meta's identity (the meta held, so that its identity is not reused), and bound as Thunder
binds it.

Declared to ``patches`` (installed on thunder_tp's first use): the speed-up in thunder_tp's compiles, Thunder's code
in any other jit.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from thunder.core.symbol import Symbol

from thunder_tp.thunder_internals import patches

__all__ = ["meta_signature"]

#: metas whose signatures are kept before the cache starts again (symbols made per call would otherwise pile up)
MAX_KEPT = 8192
_signatures: dict[int, tuple[Callable, inspect.Signature]] = {}
_thunder_normalize = Symbol.normalize


def meta_signature(meta: Callable) -> inspect.Signature:
    """``inspect.signature(meta)``, computed once per meta."""
    kept = _signatures.get(id(meta))
    if kept is None or kept[0] is not meta:
        if len(_signatures) >= MAX_KEPT:
            _signatures.clear()
        kept = _signatures[id(meta)] = (meta, inspect.signature(meta))
    return kept[1]


def normalize(self: Symbol, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Thunder's ``Symbol.normalize``: the arguments bound to the meta's signature, defaults applied."""
    assert self.meta is not None
    bound = meta_signature(self.meta).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.args, bound.kwargs


patches.declare(Symbol, "normalize", patches.dispatching(normalize, _thunder_normalize))
