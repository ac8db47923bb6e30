"""Thunder 0.2.6's interpreter reads a global or builtin name from its module's dict without interpreting a lookup.

The interpreter's ``globals_lookup`` (every ``LOAD_GLOBAL``) interprets ``lambda d, k: d[k]`` on the wrapped globals
dict, and for a builtin (``len``, ``isinstance``, ``super``: most of the names torch's and litgpt's code loads) twice,
once for ``__builtins__`` and once in it. Each is a Python frame, a ``BINARY_SUBSCR`` and a method call interpreted
to reach the dict wrapper's ``__getitem__``: nearly half of the interpretation of a litgpt step on this project's
machine. What that call returns is the dict's item wrapper (``populate_single_dict_item_wrapper``, provenance
``BINARY_SUBSCR`` of the dict and the name), so a plain dict answers here with that same wrapper; anything else (a
missing name, ``__builtins__`` as a module, a dict subclass, no provenance tracking) takes Thunder's own path.

Declared to ``patches`` (installed on thunder_tp's first use): the speed-up in thunder_tp's compiles, Thunder's code
in any other jit.
"""

from __future__ import annotations

from typing import Any

import thunder.core.interpreter as interpreter
from thunder.core.interpreter import WrappedValue, get_interpretercompilectx, populate_single_dict_item_wrapper

from thunder_tp.thunder_internals import patches

__all__ = ["globals_lookup"]

_thunder_globals_lookup = interpreter.globals_lookup


def _item(wrapped: Any, key: str) -> WrappedValue | None:
    """`wrapped[key]` as the dict wrapper's ``__getitem__`` gives it, or None where Thunder's path must answer."""
    if not isinstance(wrapped, WrappedValue) or type(wrapped.value) is not dict:
        return None
    if not isinstance(wrapped.item_wrappers, dict) or key not in wrapped.value:
        return None
    value = wrapped.value[key]
    populate_single_dict_item_wrapper(value, wrapped, key)
    item = wrapped.item_wrappers[key]
    return item if value is item.value or value is item.original_value else None


def globals_lookup(globals_dict: Any, name: Any) -> Any:
    """Thunder's ``globals_lookup``: a global, else a builtin, of a plain module dict read directly."""
    if get_interpretercompilectx()._with_provenance_tracking and isinstance(name, WrappedValue):
        key = name.value
        found = _item(globals_dict, key)
        if found is None and isinstance(globals_dict, WrappedValue) and key not in globals_dict.value:
            builtins = _item(globals_dict, "__builtins__")
            found = None if builtins is None else _item(builtins, key)
        if found is not None:
            return found
    return _thunder_globals_lookup(globals_dict, name)


patches.declare(interpreter, "globals_lookup", patches.dispatching(globals_lookup, _thunder_globals_lookup))
