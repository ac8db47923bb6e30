"""Model-family adapters: what Thunder needs to trace litgpt and HuggingFace models for TP (lookasides for code
with data-dependent shapes, the `moe_layer` op and its propagation rule). Each registers itself on import."""

from thunder_tp.models import expert_parallel, hf, litgpt, moe  # noqa: F401  (importing an adapter registers it)
