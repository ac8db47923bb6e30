"""The precisions ThunderTPStrategy runs: "32-true", "64-true", "bf16-true", "16-true" (the model's own dtype) and
"bf16-mixed" (autocast).

Under autocast Thunder 0.2.6 traces the model with its own autocast rules, and TP rewrites that trace: a TP-jitted
model under "bf16-mixed" computes what Thunder computes on one device. Those rules differ from eager autocast in
places (a cross-entropy inside the jitted program stays in bfloat16, where eager autocast computes it in float32);
litgpt's loops compute the loss outside the model, in eager autocast. Other precision plugins (bitsandbytes,
TransformerEngine, FSDP's) are refused.
"""

from __future__ import annotations

from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

_SUPPORTED = (DoublePrecision, HalfPrecision, MixedPrecision)


def check_precision(precision: Precision) -> None:
    """Raise for a precision plugin the strategy cannot run, naming the ones it can."""
    if type(precision) is not Precision and not isinstance(precision, _SUPPORTED):
        raise ValueError(
            f"ThunderTPStrategy does not support the precision plugin {type(precision).__name__}; use precision="
            "\"32-true\", \"64-true\", \"bf16-true\", \"16-true\" or \"bf16-mixed\""
        )
