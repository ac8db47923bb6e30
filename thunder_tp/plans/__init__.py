"""Ready-made TP plans for model families."""

from thunder_tp.plans.litgpt import litgpt

__all__ = ["litgpt"]
