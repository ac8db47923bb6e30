"""Ready-made TP plans for model families."""

from thunder_tp.plans.hf import hf
from thunder_tp.plans.litgpt import litgpt

__all__ = ["hf", "litgpt"]
