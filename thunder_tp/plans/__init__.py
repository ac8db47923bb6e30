"""Ready-made TP plans for model families, and the automatic plan."""

from thunder_tp.plan_search import auto
from thunder_tp.plans.hf import hf
from thunder_tp.plans.litgpt import litgpt

__all__ = ["auto", "hf", "litgpt"]
