"""Ready-made TP plans for model families, and the automatic plan.

`thunder_tp.plans.litgpt` and `thunder_tp.plans.hf` are the modules, so that every name in them resolves as written
(`thunder_tp.plans.litgpt.GPTWithLoss`, `thunder_tp.plans.hf.CausalLMLoss`), and each is called as its plan
function: `thunder_tp.plans.litgpt(model)` is `thunder_tp.plans.litgpt.litgpt(model)`.
"""

import types
from collections.abc import Callable

import torch.nn as nn

from thunder_tp.plans import hf, litgpt
from thunder_tp.plans.search import auto
from thunder_tp.styles import Style
from thunder_tp.styles.dtensor import read_parallelize_fn


class _PlanModule(types.ModuleType):
    """A family's plan module, called as the plan function of the same name."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


for _family in (hf, litgpt):
    _family.__class__ = _PlanModule


def from_parallelize_fn(fn: Callable, model: nn.Module, *args, **kwargs) -> dict[str, Style]:
    """The plan a DTensor parallelize function gives `model` (torchtitan's `apply_tp(model, tp_mesh, ...)`, a
    `ModelParallelStrategy` `parallelize_fn(model, device_mesh)`): `fn(model, *args, **kwargs)` runs with its
    `parallelize_module` calls recorded instead of applied."""
    return read_parallelize_fn(fn, model, *args, **kwargs).plan


__all__ = ["auto", "from_parallelize_fn", "hf", "litgpt"]
