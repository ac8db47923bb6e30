"""Thunder 0.2.6's compile runs Python's cyclic garbage collector less often.

A cache miss (``acquire_initial_trace``: the interpretation; ``apply_transforms_and_build_cache_entry``: the
transforms, autodiff, fusion) allocates millions of short-lived containers: traces, bound symbols, proxies, the
interpreter's wrapped values. At Python's default threshold (a young collection every 700 allocations) the collector
ran 1,933 times in a one-device first step of pythia-14m at 8 layers on this project's machine, 4.3 s of its 60.4 s;
with the young generation's threshold at 50,000 while Thunder compiles, 16 times, 1.0 s (the step 59.7 s: each
collection has more to scan; 58.7 s against 60.2 s in a second pair). Where compiles are many and small it pays
more: 3 steps of a 2-layer litgpt model under TP=2 with its block kind checked before (tests/test_litgpt.py's),
8.9 s to 8.1 s. The old thresholds come back when the compile returns or raises; garbage made meanwhile is collected as
usual after it.
Both functions are closures of ``thunder.jit``, called by its ``get_computation_and_inputs`` (a cache lookup, on a
miss the compile, then the prologue), which ``thunder.jit`` decorates with the module-level
``_with_cache_info_ctx``: that decorator is the one name to wrap (0.2.6 has no hook around a compile), so the jits
made after ``patches.install()`` get it. The function decorated holds its jit's CompileData as the closure variable
``weakref_cd``: the threshold is raised for thunder_tp's compiles only (``patches.active_for``), and the speed-ups
apply to the whole call (``patches.applied``: the cache lookup flattens the inputs before Thunder sets the compile
data, on every call).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import thunder

from thunder_tp.thunder_internals import patches

__all__ = ["COMPILE_THRESHOLD"]

#: allocations between two young-generation collections while Thunder compiles (Python's default: 700)
COMPILE_THRESHOLD = 50_000


def compile_data_ref(fn: Callable) -> Callable[[], Any]:
    """The weak reference to its jit's CompileData that ``thunder.jit``'s ``get_computation_and_inputs`` closes over
    (a function without one: a reference to None)."""
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    return cells["weakref_cd"].cell_contents if "weakref_cd" in cells else lambda: None


def _with_fewer_collections(decorate: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """`decorate`, its result run with the young generation's threshold at least COMPILE_THRESHOLD where its jit
    compiles for thunder_tp."""
    def decorating(fn: Callable) -> Callable:
        decorated, compile_data = decorate(fn), compile_data_ref(fn)

        @functools.wraps(decorated)
        def compiling(*args, **kwargs):
            if not patches.active_for(compile_data()):
                return decorated(*args, **kwargs)
            previous = gc.get_threshold()
            gc.set_threshold(max(previous[0], COMPILE_THRESHOLD), *previous[1:])
            try:
                with patches.applied():  # the cache lookup too: it flattens the inputs before the compile data
                    return decorated(*args, **kwargs)
            finally:
                gc.set_threshold(*previous)

        return compiling

    return decorating


patches.declare(thunder, "_with_cache_info_ctx", _with_fewer_collections(thunder._with_cache_info_ctx))
