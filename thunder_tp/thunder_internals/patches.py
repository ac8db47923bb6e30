"""Thunder's speed-ups, applied to thunder_tp's compiles only: a registry of the patches of this folder.

Each module here that replaces something of Thunder's declares the replacement (`declare`: the object, the attribute
or mapping key, the replacement) instead of assigning it at import. `install()` puts every declared one in place,
once, and is called by thunder_tp's entry points (``thunder_tp.executors()``, `applied()`), never by an import.
A replacement is a dispatcher (`dispatching`): the speed-up while `active()`, Thunder's original otherwise, so
that a ``thunder.jit`` that does not use thunder_tp runs Thunder's own code even after thunder_tp compiled.
`uninstall()` puts Thunder's originals back. The model families' lookasides of their models' code
(`register_lookaside`) are in Thunder's lookaside map only while some thread is inside `applied()`.

`active()` holds inside `applied()` (thunder_tp's TP module calls, the plan search's interpretation, or a user who
wants the speed-ups for a plain ``thunder.jit``), and while Thunder compiles a jit whose executors include
thunder_tp's collectives executor (named `MARKER`; ``thunder_tp.executors()`` lists it): one device, TP, ``simulate``,
``one_rank``, the Fabric strategy and ``DecodeStep`` compile so. docs/design.md, 'Patches of Thunder and torch',
lists each patch, why, and what upstream change it waits for.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types
from collections.abc import Callable, Iterator, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from thunder.core.compile_data import get_compile_data
from thunder.core.interpreter import _interpret_call
from thunder.core.jit_ext import _general_jit_lookaside_map

__all__ = ["MARKER", "MODULES", "active", "active_for", "applied", "applying", "compiles_for_thunder_tp", "copy_of",
           "declare", "declare_lookaside", "declared", "dispatching", "install", "installed", "mark",
           "register_lookaside", "uninstall"]

#: the modules of this folder that declare patches, imported by `install()`
MODULES = ("untraced", "grad_mode", "inductor", "instructions", "global_names", "builtin_containers", "pytree",
           "signatures", "min_cuts", "collections_during_compile", "private")
#: the name of the executor whose presence in a jit's executors makes its compiles thunder_tp's
MARKER = "thunder_tp_comm"
#: the attribute of a jit's CompileData caching whether its compiles are thunder_tp's
_MARK = "_thunder_tp_compiles"

#: a mapping's original for a key it did not hold (a lookaside added)
_ABSENT = object()
_applied: ContextVar[bool] = ContextVar("thunder_tp_patches_applied", default=False)
_lock = threading.Lock()
#: the model families' lookasides (`register_lookaside`), put in Thunder's map while `_applied_depth` > 0
_family_lookasides: dict[Callable, Callable] = {}
#: how many `applied()` blocks are open, over every thread
_applied_depth = 0


@dataclass(frozen=True)
class Patch:
    """`replacement` in place of `owner`'s attribute (or, for a mapping, item) `name`; with `everywhere`, in place
    of that original in every loaded module holding it as a global too."""

    module: str
    owner: Any
    name: Any
    replacement: Any
    everywhere: bool = False


_declared: list[Patch] = []
#: the installed patches with the originals they replaced, in installation order
_installed: list[tuple[Patch, Any]] = []


def declare(owner: Any, name: Any, replacement: Any, *, everywhere: bool = False) -> None:
    """Register `replacement` for `owner`'s `name` (installed by `install()`); called by the declaring module."""
    _declared.append(Patch(_caller_module(), owner, name, replacement, everywhere))


def declare_lookaside(fn: Callable, lookaside: Callable) -> None:
    """Register `lookaside` (given the interpreter's wrapped values) for Thunder's interpreter to run in place of
    `fn` in thunder_tp's compiles; any other compile interprets `fn`'s code, as Thunder does without a lookaside."""
    interpreted = copy_of(fn)

    def dispatch(*args, **kwargs):
        return lookaside(*args, **kwargs) if active() else _interpret_call(interpreted, *args, **kwargs)

    _declared.append(Patch(_caller_module(), _general_jit_lookaside_map, fn, dispatch))


def copy_of(fn: types.FunctionType) -> types.FunctionType:
    """A function with ``fn``'s code that is not ``fn``: Thunder's interpreter diverts ``fn`` itself to its
    lookaside, which interprets this copy without being diverted again."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return copy


def register_lookaside(fn: Callable) -> Callable[[Callable], Callable]:
    """A decorator registering its lookaside of `fn` for the compiles inside `applied()` (thunder_tp's): what the
    model families divert (their code Thunder cannot trace, or traces otherwise than TP needs), registered when they
    load. The lookasides are in Thunder's map only while some thread is inside `applied()`: any other compile finds
    Thunder's map as it was and interprets `fn` as Thunder does."""

    def register(lookaside: Callable) -> Callable:
        install()  # a jit of thunder_tp's made from now on enters `applied()` as it compiles
        with _lock:
            _family_lookasides[fn] = lookaside
            if _applied_depth:
                _general_jit_lookaside_map[fn] = lookaside
        return lookaside

    return register


def declared() -> list[Patch]:
    """Every patch the modules of `MODULES` declare (imported here)."""
    for module in MODULES:
        importlib.import_module(f"{__package__}.{module}")
    return list(_declared)


def installed() -> bool:
    """Whether the declared patches are in place."""
    return bool(_installed)


def install() -> None:
    """Put every declared patch in place, once (each a dispatcher: Thunder's code outside thunder_tp's compiles)."""
    if _installed:
        return
    patches = declared()
    with _lock:
        if _installed:
            return
        for patch in patches:
            original = _get(patch.owner, patch.name)
            _replace(patch, original, patch.replacement)
            _installed.append((patch, original))


def uninstall() -> None:
    """Put Thunder's originals back in place of every installed patch."""
    with _lock:
        while _installed:
            patch, original = _installed.pop()
            _replace(patch, patch.replacement, original)


def active_for(compile_data: Any) -> bool:
    """Whether the speed-ups serve a compile of `compile_data` (a jit's CompileData, or None): inside `applied()`,
    or its executors include thunder_tp's (`MARKER`)."""
    return _applied.get() or _marked(compile_data)


def active() -> bool:
    """Whether the speed-ups serve the compile running now."""
    return _applied.get() or _marked(get_compile_data())


def compiles_for_thunder_tp(jitted: Any) -> bool:
    """Whether the compiles of `jitted` (a ``thunder.jit`` result) are thunder_tp's: its executors include
    thunder_tp's, or a TensorParallel transform marked them (`mark`)."""
    return _marked(getattr(jitted, "_lc_cd", None))


def mark(jitted: Any) -> None:
    """Make the compiles of `jitted` (a ``thunder.jit`` result) thunder_tp's, whatever its executors (a
    TensorParallel program's)."""
    setattr(jitted._lc_cd, _MARK, True)


def _marked(compile_data: Any) -> bool:
    """Whether `compile_data`'s compiles are thunder_tp's: `mark` said so, or its executors include thunder_tp's
    (kept on it)."""
    if compile_data is None:
        return False
    marked = vars(compile_data).get(_MARK)
    if marked is None:
        marked = any(getattr(ex, "name", None) == MARKER for ex in compile_data.executors_list)
        setattr(compile_data, _MARK, marked)
    return marked


@contextlib.contextmanager
def applied() -> Iterator[None]:
    """The speed-ups and the model families' lookasides for every compile inside (re-entrant; installed first if
    they are not)."""
    install()
    _enter_family_lookasides()
    token = _applied.set(True)
    try:
        yield
    finally:
        _applied.reset(token)
        _exit_family_lookasides()


def _enter_family_lookasides() -> None:
    global _applied_depth
    with _lock:
        if not _applied_depth:
            _general_jit_lookaside_map.update(_family_lookasides)
        _applied_depth += 1


def _exit_family_lookasides() -> None:
    global _applied_depth
    with _lock:
        _applied_depth -= 1
        if not _applied_depth:
            for fn in _family_lookasides:
                _general_jit_lookaside_map.pop(fn, None)


def applying(call: Callable) -> Callable:
    """`call`, run inside `applied()` (for ``private.wrap_module_call``: a jitted module compiles inside its call)."""

    @functools.wraps(call)
    def call_applied(*args, **kwargs):
        with applied():
            return call(*args, **kwargs)

    return call_applied


def dispatching(fast: Callable, original: Callable) -> Callable:
    """A function calling `fast` while `active()`, else `original` (Thunder's). Where Thunder's interpreter meets it
    (a pytree function called by code it interprets), it interprets the function the dispatcher would call, not the
    dispatcher: a plain jit runs the instructions it ran before (a lookaside declared with it)."""

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        return (fast if active() else original)(*args, **kwargs)

    def interpreted(*args, **kwargs):
        return _interpret_call(fast if active() else original, *args, **kwargs)

    _declared.append(Patch(_caller_module(), _general_jit_lookaside_map, dispatch, interpreted))
    return dispatch


def _caller_module() -> str:
    """The name, within this folder, of the module that called the caller."""
    return sys._getframe(2).f_globals["__name__"].rpartition(".")[2]


def _get(owner: Any, name: Any) -> Any:
    return owner.get(name, _ABSENT) if isinstance(owner, MutableMapping) else getattr(owner, name)


def _set(owner: Any, name: Any, value: Any) -> None:
    if value is _ABSENT:
        del owner[name]
    elif isinstance(owner, MutableMapping):
        owner[name] = value
    else:
        setattr(owner, name, value)


def _replace(patch: Patch, old: Any, new: Any) -> None:
    """`new` in place of `old` at the patch's place (and, `everywhere`, in every loaded module's globals)."""
    _set(patch.owner, patch.name, new)
    if not patch.everywhere:
        return
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            for name, value in list(namespace.items()):
                if value is old:
                    namespace[name] = new
