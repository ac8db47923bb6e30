"""Thunder 0.2.6's pytree flattening without rebuilding its type set or mapping a tree to find dataclasses.

``thunder.core.pytree.tree_flatten`` builds a set of 30 types (unpacking ``torch.types.py_sym_types``, asking
``torch.distributed.is_available()``) on every call only to test its argument's type, and
``tree_flatten_with_dataclass``, which every bound symbol's ``flat_args`` and ``flat_outs`` run, first maps the whole
tree with a Python function per leaf (registering each dataclass met as a leaf), then flattens the mapped tree. Across
this project's test suite the two took 290 of 1,360 CPU seconds of Thunder's compilation.

Here the type set is built once, and the leaves of a tree are scanned for dataclass instances of unregistered classes
in one loop (each type's answer kept) instead of a call per leaf; the tree rebuilt from its leaves, as Thunder's map
rebuilds it, is flattened. The types refused, the leaves, the spec and the registrations are Thunder's. Installed
(``patches.install``), dispatchers to them take the place of Thunder's functions in ``thunder.core.pytree`` and in
every loaded module that imported them by name; outside thunder_tp's compiles they call Thunder's.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import optree
import thunder.core.pytree as pytree
import torch
from thunder.core import devices, dtypes
from thunder.core.baseutils import ProxyInterface, is_likely_from_collections_namedtuple

from thunder_tp.thunder_internals import patches

__all__ = ["tree_flatten", "tree_flatten_with_dataclass"]

_FLATTENABLE_TYPES = frozenset({
    types.FunctionType, dict, list, str, int, bool, tuple, torch.dtype, float,
    dtypes.floating, dtypes.bool_, devices.Device, torch.memory_format, type(None), slice, complex, type,
    type(Ellipsis), torch.Size, torch.finfo, dtypes.signedinteger, torch._subclasses.fake_tensor.FakeTensor,
    torch.device, torch.autograd.function.FunctionCtx, pytree.immutable_list, *torch.types.py_sym_types,
    *((torch.distributed._tensor.DTensor,) if torch.distributed.is_available() else ()),
})
_NOT_DATACLASSES: set[type] = set()
_thunder_functions = {"tree_flatten": pytree.tree_flatten,
                      "tree_flatten_with_dataclass": pytree.tree_flatten_with_dataclass}


def _flattenable(tree: Any) -> bool:
    """Whether Thunder's ``tree_flatten`` takes `tree` (its test, in its order)."""
    return (type(tree) in _FLATTENABLE_TYPES or isinstance(tree, ProxyInterface)
            or is_likely_from_collections_namedtuple(tree) or dataclasses.is_dataclass(tree)
            or type(tree).__module__.startswith("torch.return_types"))


def tree_flatten(tree: Any, namespace: str = pytree.OPTREE_NAMESPACE) -> tuple[list, optree.PyTreeSpec]:
    """Thunder's ``tree_flatten``: the same types refused, with the same error, the same leaves and spec."""
    if not _flattenable(tree):
        raise TypeError(f"tree_flatten of type {type(tree)} is not supported.")
    return optree.tree_flatten(tree, none_is_leaf=True, namespace=namespace)


def _unregistered_dataclasses(leaves: list) -> dict[type, None]:
    """The classes of the leaves that are dataclass instances Thunder has not registered, in order of appearance."""
    found: dict[type, None] = {}
    for leaf in leaves:
        if type(leaf) in _NOT_DATACLASSES:
            continue
        if pytree._maybe_register_dataclass(leaf):
            found[leaf.__class__] = None
        elif not dataclasses.is_dataclass(type(leaf)):
            _NOT_DATACLASSES.add(type(leaf))
    return found


def tree_flatten_with_dataclass(tree: Any) -> tuple[list, optree.PyTreeSpec]:
    """Thunder's ``tree_flatten_with_dataclass``: dataclasses met as leaves registered, then the tree rebuilt from its
    leaves (a ``torch.Size`` becomes a tuple, as Thunder's map makes it) flattened."""
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True, namespace=pytree.OPTREE_NAMESPACE)
    for cls in _unregistered_dataclasses(leaves):
        pytree.register_pytree_node_dataclass(cls)
        pytree._registered_dataclasses.add(cls)
    return tree_flatten(spec.unflatten(leaves))


for _name in _thunder_functions:
    patches.declare(pytree, _name, patches.dispatching(globals()[_name], _thunder_functions[_name]), everywhere=True)
