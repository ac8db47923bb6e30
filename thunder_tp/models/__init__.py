"""Model-family adapters: what Thunder needs to trace litgpt, HuggingFace and torchao float8 models for TP
(lookasides for code with data-dependent shapes or tensor subclasses, the `moe_layer` op and its propagation rule;
litgpt's loops sampling inside the jitted program). Each registers itself on import."""

# importing an adapter registers it
from thunder_tp.models import expert_parallel, hf, litgpt, litgpt_sampling, moe, torchao  # noqa: F401
