"""Model families hook into the core here: what the core must know of a family's models.

The core (TensorParallel, plans.auto) imports no model family, and neither does this registry: the package
(`thunder_tp/__init__.py`, which runs first wherever thunder_tp is entered from) registers how they load
(`register_loader`), and the registry runs that on its first use. A family's adapter registers
- a `prepare(module)` function, which the core calls on every module it is about to trace, so that a model is traced
  alike whatever made its plan (HF's lookasides, for one);
- a jit hook `hook(jitted, module)`, which a TensorParallel transform calls with the ThunderModule it takes `module`
  into, so that a family's methods of its models run the program (HF's `generate`);
- a wrapper rule: which of its modules wrap a layer whose style their own parameters follow (a LoRA pair around its
  base Linear), so that the automatic plan decides the two together;
- index attributes: attributes that number its blocks and that their forward does not read (litgpt's `block_idx`),
  so that blocks differing only in them are traced once (`thunder_tp.tracing.repeated_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (nothing heavy at import: the package's __init__ imports this module)
    import torch.nn as nn

Prepare = Callable[["nn.Module"], None]
_preparers: list[Prepare] = []


def register_family(prepare: Prepare) -> Prepare:
    """Register a family's `prepare(module)`; called on every module before it is traced (a decorator)."""
    if prepare not in _preparers:
        _preparers.append(prepare)
    return prepare


Loader = Callable[[], None]
_loaders: list[Loader] = []
_loaded: set[Loader] = set()


def register_loader(load: Loader) -> Loader:
    """Register how model families load (a function importing their adapters), run on the registry's first use
    (a decorator)."""
    if load not in _loaders:
        _loaders.append(load)
    return load


def load_families() -> None:
    """Run the registered loaders: the model-family adapters register themselves (lookasides, op rules, preparers),
    once (a loader that raised runs again on the next use)."""
    for load in _loaders:
        if load not in _loaded:
            load()
            _loaded.add(load)


def prepare_for_tracing(module: nn.Module) -> None:
    """Let every registered family prepare `module` for tracing (each acts only on its own models)."""
    load_families()
    for prepare in _preparers:
        prepare(module)


JitHook = Callable[["nn.Module", "nn.Module"], None]
_jit_hooks: list[JitHook] = []


def register_jit_hook(hook: JitHook) -> JitHook:
    """Register a family's `hook(jitted, module)`, called when a TensorParallel program takes `module` (a
    decorator)."""
    if hook not in _jit_hooks:
        _jit_hooks.append(hook)
    return hook


def adapt_jitted(jitted: nn.Module, module: nn.Module) -> None:
    """Let every registered family adapt `jitted`, the ThunderModule of `module` (each acts only on its own models)."""
    load_families()
    for hook in _jit_hooks:
        hook(jitted, module)


@dataclass(frozen=True)
class Wrapper:
    """A module whose own parameters follow the style of the layer it wraps (`child`, an attribute name):
    `follow(style)` is their style when the layer gets `style`."""

    child: str
    follow: Callable[[Any], Any]


WrapperRule = Callable[["nn.Module"], Wrapper | None]
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
