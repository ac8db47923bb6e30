"""Ready-made TP plans for model families, and the automatic plan.

`thunder_tp.plans.litgpt` and `thunder_tp.plans.hf` are the modules, so that every name in them resolves as written
(`thunder_tp.plans.litgpt.GPTWithLoss`, `thunder_tp.plans.hf.CausalLMLoss`), and each is called as its plan
function: `thunder_tp.plans.litgpt(model)` is `thunder_tp.plans.litgpt.litgpt(model)`.
"""

import types

from thunder_tp.plan_search import auto
from thunder_tp.plans import hf, litgpt


class _PlanModule(types.ModuleType):
    """A family's plan module, called as the plan function of the same name."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


for _family in (hf, litgpt):
    _family.__class__ = _PlanModule

__all__ = ["auto", "hf", "litgpt"]
