"""thunder_tp's flattening of Thunder's pytrees (thunder_internals/pytree.py) gives Thunder's leaves, specs,
registrations and errors."""

import collections
import dataclasses

import pytest
import thunder
import thunder.core.pytree as thunder_pytree
import torch
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, tracectx

from thunder_tp.thunder_internals import pytree

pytestmark = pytest.mark.usefixtures("speedups_applied")  # Thunder's speed-ups in this module's jits

Pair = collections.namedtuple("Pair", "first second")


def _dataclasses() -> tuple[type, type]:
    """A fresh dataclass holding another, neither registered with Thunder yet."""

    @dataclasses.dataclass
    class Inner:
        value: object

    @dataclasses.dataclass
    class Outer:
        inner: object
        count: int

    return Outer, Inner


def _trees() -> list:
    with tracectx(TraceCtx()):
        proxy = TensorProxy(shape=(2, 3), device=thunder.devices.cpu, dtype=thunder.dtypes.float32,
                            requires_grad=False)
    return [proxy, None, 3, (proxy, [1, {"a": proxy, "b": None}], 2.5), {"k": (proxy, torch.float32)},
            Pair(proxy, (None, 4)), (slice(1, 2), Ellipsis, "s", torch.Size([2]))]


def test_the_replacements_are_in_place_of_thunders():
    """Every module that imported Thunder's functions by name calls one dispatcher (to the replacement in thunder_tp's
    compiles, to Thunder's function outside them: tests/test_patches.py)."""
    import thunder.core.symbol as symbol

    for name, thunders in pytree._thunder_functions.items():
        installed = getattr(thunder_pytree, name)
        assert getattr(symbol, name) is installed and installed.__wrapped__ is thunders


@pytest.mark.parametrize("name", ["tree_flatten", "tree_flatten_with_dataclass"])
def test_leaves_and_specs_are_thunders(name):
    ours, thunders = getattr(pytree, name), pytree._thunder_functions[name]
    for tree in _trees():
        (leaves, spec), (thunder_leaves, thunder_spec) = ours(tree), thunders(tree)
        assert len(leaves) == len(thunder_leaves)
        assert all(a is b for a, b in zip(leaves, thunder_leaves, strict=True))
        assert spec == thunder_spec, tree


@pytest.mark.parametrize("name", ["tree_flatten", "tree_flatten_with_dataclass"])
def test_the_types_refused_are_thunders(name):
    ours, thunders = getattr(pytree, name), pytree._thunder_functions[name]
    for refused in (object(), {1, 2}, torch.nn.Linear(1, 1)):
        with pytest.raises(TypeError) as raised:
            thunders(refused)
        with pytest.raises(TypeError, match=str(raised.value).replace("(", r"\(").replace(")", r"\)")):
            ours(refused)


def test_dataclasses_met_as_leaves_are_registered_as_thunder_registers_them():
    """The outer dataclass met as a leaf is registered and flattened; the one inside it is registered when it is met
    as a leaf, on the next call (as Thunder registers them)."""
    flattened = []
    for function in (pytree._thunder_functions["tree_flatten_with_dataclass"], pytree.tree_flatten_with_dataclass):
        outer, inner = _dataclasses()
        leaves, spec = function((outer(inner(7), 3), outer(inner(8), 4), 5))
        assert outer in thunder_pytree._registered_dataclasses and inner not in thunder_pytree._registered_dataclasses
        flattened.append(([type(leaf).__name__ if dataclasses.is_dataclass(leaf) else leaf for leaf in leaves],
                          spec.num_leaves, spec.num_nodes))
        assert function((outer(inner(9), 1),))[0] == [1, 9]  # the inner one met as a leaf: registered (keys sorted)
        assert inner in thunder_pytree._registered_dataclasses
    assert flattened[0] == flattened[1] == ([3, "Inner", 4, "Inner", 5], 5, 8)
