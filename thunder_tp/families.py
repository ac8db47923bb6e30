"""Model families hook into the core here: what a family must register before Thunder traces one of its models.

The core (TensorParallel, plans.auto) imports no model family. A family's adapter (`thunder_tp.models`) registers a
`prepare(module)` function, which the core calls on every module it is about to trace, so that a model is traced
alike whatever made its plan (HF's lookasides, for one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

Prepare = Callable[[nn.Module], None]
_preparers: list[Prepare] = []


def register_family(prepare: Prepare) -> Prepare:
    """Register a family's `prepare(module)`; called on every module before it is traced (a decorator)."""
    if prepare not in _preparers:
        _preparers.append(prepare)
    return prepare


def prepare_for_tracing(module: nn.Module) -> None:
    """Let every registered family prepare `module` for tracing (each acts only on its own models)."""
    for prepare in _preparers:
        prepare(module)
