"""What a repeated block's call can observe, as a key: two calls with equal keys interpret to one program.

A replayed block (`thunder_tp.tracing.repeated_blocks`) is not interpreted, so its key must hold everything its
forward, its submodules' and its hooks' could read and that could differ from the recorded call:

- the block's structure: every submodule's name and class, its parameters' and buffers' metadata;
- every attribute of every submodule, of any type, by value: numbers, strings, enums, numpy scalars and arrays,
  tuples, lists, dicts and sets of them, objects by their attributes (a config, a small settings object), functions
  by their code, defaults, closure cells and the globals their code names, bound methods by their function and the
  object they are bound to (a module of the block by its name in the block), partials by what they hold;
- the hooks on each submodule (the dicts are attributes: their functions keyed as above) and the process-wide ones;
- the code each submodule's class runs as `forward`, with the globals it names;
- the interpreter's modes that change what a symbol records: grad mode (a no-grad block's outputs are constants of
  the autograd), autocast, the default dtype;
- the call's arguments (tensor metadata, plain values).

An object that is none of the above is keyed by identity: blocks holding one each are interpreted each, those
sharing one are one kind. A key holds such an object by a weak reference (a strong one where it can have none), so
it equals no key made after the object is gone (a later object may take its id). Attributes a registered model
family declares as numbering its blocks (`thunder_tp.families`, litgpt's `block_idx`) are left out. What no key can
see (a hook comparing the module it is given with a global by identity) is what the repeated blocks' second
interpretation checks.
"""

from __future__ import annotations

import enum
import functools
import types
import weakref
from collections.abc import Hashable
from typing import Any

import torch
import torch.nn as nn
from thunder.core.compile_data import get_compile_data
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from thunder_tp.families import is_index_attribute
from thunder_tp.thunder_internals.private import global_module_hooks

__all__ = ["block_key"]

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, range, slice,
          type(Ellipsis), torch.memory_format, torch.layout)
_CONTAINERS = (tuple, list, dict, set, frozenset)
#: nn.Module's hooks of a call (id -> hook), and its flags of them (id -> bool)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
#: nn.Module's own bookkeeping that no forward reads (the tensors and children are keyed by `_Keys.structure`), and
#: its hooks (keyed by `_Keys.hooks`)
_MODULE_BOOKKEEPING = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", *_HOOKS, *_HOOK_FLAGS,
})


def block_key(module: nn.Module, args: tuple, kwargs: dict) -> Hashable | None:
    """What two calls of repeated blocks must share to be one program up to names (the module docstring); None where
    the call's arguments cannot be keyed (a symbolic number, an object)."""
    call = _call_key(args, kwargs)
    if call is None:
        return None
    keys = _Keys(module)
    return type(module), keys.structure(), _modes(keys), call


def _call_key(args: tuple, kwargs: dict) -> tuple | None:
    leaves, spec = tree_flatten((args, kwargs))
    call: list[tuple] = [(str(spec),)]
    for leaf in leaves:
        if isinstance(leaf, TensorProxy):
            call.append(("tensor", tuple(leaf.shape), repr(leaf.dtype), repr(leaf.device), leaf.requires_grad))
        elif isinstance(leaf, _ATOMS) and not isinstance(leaf, NumberProxy):
            call.append((type(leaf).__name__, repr(leaf)))
        else:
            return None
    return tuple(call)


def _modes(keys: _Keys) -> tuple:
    """The interpreter's state that changes what the block's symbols record."""
    cd = get_compile_data()
    autocast = () if cd is None else tuple((d, repr(dt), e) for d, dt, e in cd.autocast_stack.stack)
    grad = torch.is_grad_enabled() if cd is None else cd.is_grad_enabled
    hooks, flags = global_module_hooks()
    return grad, autocast, torch.get_default_dtype(), keys.hooks(hooks, flags)


class _Keys:
    """Value keys of what one block holds; its own modules keyed by their names in it."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.names = {id(m): name for name, m in block.named_modules(remove_duplicate=False)}
        self.visiting: set[int] = set()
        # the objects several submodules hold (a config) keyed once; each held, so no temporary's id is reused
        self.memo: dict[int, tuple[Any, Hashable]] = {}

    def structure(self) -> tuple:
        """Every submodule: its name, class, attributes, hooks, forward's code, tensors' metadata."""
        return tuple((name, type(m), self._attributes(m), self.hooks([getattr(m, h) for h in _HOOKS],
                                                                      [getattr(m, f) for f in _HOOK_FLAGS]),
                      self.of(type(m).forward), _tensors(m))
                     for name, m in self.block.named_modules(remove_duplicate=False))

    def hooks(self, hooks: list[dict], flags: list[dict]) -> tuple:
        """Hook dicts (id -> hook) in order, each hook with the flags (id -> bool) that name it; not their ids,
        which count every hook of the process."""
        return tuple(tuple((self.of(h), tuple(i in f for f in flags)) for i, h in d.items()) for d in hooks)

    def _attributes(self, m: nn.Module) -> tuple:
        return tuple((k, self.of(v)) for k, v in vars(m).items()
                     if k not in _MODULE_BOOKKEEPING and not is_index_attribute(m, k))

    def of(self, v: Any) -> Hashable:
        """The value key of `v` (the module docstring)."""
        if isinstance(v, _ATOMS) and not isinstance(v, NumberProxy):
            return type(v).__qualname__, repr(v)
        if isinstance(v, enum.Enum):
            return type(v), v.name
        if isinstance(v, nn.Module):
            return ("module", self.names[id(v)]) if id(v) in self.names else ("object", _Identity(v))
        if isinstance(v, torch.Tensor):
            return "tensor", tuple(v.shape), v.dtype, v.device, v.requires_grad
        if isinstance(v, (type, types.ModuleType, types.BuiltinFunctionType)):
            return _identity(v)
        if isinstance(v, RemovableHandle):  # the handle of a hook (the hook itself is keyed where it is)
            return ("handle",)
        if id(v) in self.memo:
            return self.memo[id(v)][1]
        if id(v) in self.visiting:
            return ("cycle", _Identity(v))
        self.visiting.add(id(v))
        try:
            key = self._composite(v)
            self.memo[id(v)] = v, key
        finally:
            self.visiting.discard(id(v))
        return key

    def _composite(self, v: Any) -> Hashable:
        if isinstance(v, _CONTAINERS):
            if isinstance(v, (set, frozenset)):
                return type(v), frozenset(map(self.of, v))
            return type(v), tuple(map(self.of, v.items() if isinstance(v, dict) else v))
        if isinstance(v, functools.partial):
            return "partial", self.of(v.func), self.of(v.args), self.of(v.keywords)
        if isinstance(v, types.MethodType):
            return "method", self.of(v.__func__), self.of(v.__self__)
        if isinstance(v, types.FunctionType):
            return self._function(v)
        if type(v).__module__ == "numpy" and hasattr(v, "tobytes"):
            return "numpy", type(v).__name__, str(getattr(v, "dtype", "")), getattr(v, "shape", ()), v.tobytes()
        if hasattr(v, "__dict__"):
            return "object", type(v), self.of(vars(v))
        return _identity(v)

    def _function(self, fn: types.FunctionType) -> Hashable:
        """A function by its code, defaults, closure cells and the globals its code names (by value where they are
        plain values, else by identity: a global function's own globals are not followed)."""
        cells = tuple(self.of(c.cell_contents) if _filled(c) else ("empty",) for c in fn.__closure__ or ())
        named = tuple((name, _global_key(self, fn.__globals__[name])) for name in _names(fn.__code__)
                      if name in fn.__globals__)
        return "function", fn.__code__, self.of(fn.__defaults__), self.of(fn.__kwdefaults__), cells, named


def _global_key(keys: _Keys, value: Any) -> Hashable:
    if isinstance(value, (*_ATOMS, enum.Enum, *_CONTAINERS)) or type(value).__module__ == "numpy":
        return keys.of(value)
    return _identity(value)


def _identity(v: Any) -> Hashable:
    return "id", _Identity(v)


class _Identity:
    """`v` as a key by identity: equal to the key of the same object while it lives, to none after."""

    __slots__ = ("_hash", "_ref")

    def __init__(self, v: Any):
        self._hash = id(v)
        try:
            self._ref = weakref.ref(v)
        except TypeError:  # no weak reference (a builtin function): held, so no other object takes its id
            self._ref = functools.partial(_itself, v)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Identity):
            return NotImplemented
        mine = self._ref()
        return mine is not None and mine is other._ref()


def _itself(v: Any) -> Any:
    return v


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


@functools.cache
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The names a code object and the code nested in it look up (globals among them)."""
    nested = (n for c in code.co_consts if isinstance(c, types.CodeType) for n in _names(c))
    return tuple(dict.fromkeys((*code.co_names, *nested)))


def _tensors(m: nn.Module) -> tuple:
    return tuple((kind, name, tuple(t.shape), t.dtype, t.device, t.requires_grad)
                 for kind, tensors in (("_parameters", m._parameters), ("_buffers", m._buffers))
                 for name, t in tensors.items() if t is not None)
