"""Model families hook into the core here: what the core must know of a family's models.

The core (TensorParallel, plans.auto) imports no model family: the registry loads them (`thunder_tp.models`) on its
first use, wherever thunder_tp was entered from. A family's adapter registers
- a `prepare(module)` function, which the core calls on every module it is about to trace, so that a model is traced
  alike whatever made its plan (HF's lookasides, for one);
- a wrapper rule: which of its modules wrap a layer whose style their own parameters follow (a LoRA pair around its
  base Linear), so that the automatic plan decides the two together;
- index attributes: attributes that number its blocks and that their forward does not read (litgpt's `block_idx`),
  so that blocks differing only in them are traced once (`thunder_tp.execution.repeated_blocks`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

Prepare = Callable[[nn.Module], None]
_preparers: list[Prepare] = []


def register_family(prepare: Prepare) -> Prepare:
    """Register a family's `prepare(module)`; called on every module before it is traced (a decorator)."""
    if prepare not in _preparers:
        _preparers.append(prepare)
    return prepare


@functools.cache
def load_families() -> None:
    """Import the model-family adapters, which register themselves (lookasides, op rules, preparers), once."""
    importlib.import_module("thunder_tp.models")


def prepare_for_tracing(module: nn.Module) -> None:
    """Let every registered family prepare `module` for tracing (each acts only on its own models)."""
    load_families()
    for prepare in _preparers:
        prepare(module)


@dataclass(frozen=True)
class Wrapper:
    """A module whose own parameters follow the style of the layer it wraps (`child`, an attribute name):
    `follow(style)` is their style when the layer gets `style`."""

    child: str
    follow: Callable[[Any], Any]


WrapperRule = Callable[[nn.Module], Wrapper | None]
_wrapper_rules: list[WrapperRule] = []


def register_wrapper_rule(rule: WrapperRule) -> WrapperRule:
    """Register a family's rule telling its wrapping modules (a decorator)."""
    if rule not in _wrapper_rules:
        _wrapper_rules.append(rule)
    return rule


def wrapper_of(module: nn.Module) -> Wrapper | None:
    """How `module` wraps a layer, if a registered family says it does."""
    load_families()
    return next((w for rule in _wrapper_rules if (w := rule(module)) is not None), None)


_index_attributes: set[tuple[str, str]] = set()


def register_index_attribute(package: str, name: str) -> None:
    """Attribute `name` of the modules of classes from `package` (a module-name prefix) numbers a block and is read
    only where it is built."""
    _index_attributes.add((package, name))


def is_index_attribute(module: nn.Module, name: str) -> bool:
    """Whether a registered family says attribute `name` of `module` only numbers it."""
    load_families()
    owner = type(module).__module__
    return any(name == n and owner.startswith(p) for p, n in _index_attributes)
