"""The precisions ThunderTPStrategy supports: "32-true", "64-true", "bf16-true" and "16-true" (the model's own dtype).

"bf16-mixed" / "16-mixed" (autocast) are refused with the alternative: see `check_precision`.
"""

from __future__ import annotations

from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

_SUPPORTED = (DoublePrecision, HalfPrecision)


def check_precision(precision: Precision) -> None:
    """Raise for a precision plugin the strategy cannot run, naming the alternative."""
    if isinstance(precision, MixedPrecision):
        raise ValueError(
            f"ThunderTPStrategy does not support precision={precision.precision!r} (autocast): {AUTOCAST_REASON} "
            "Use precision=\"bf16-true\" (parameters and activations in bfloat16; keep an fp32 copy in the optimizer "
            "if you need one) or \"32-true\"."
        )
    if type(precision) is not Precision and not isinstance(precision, _SUPPORTED):
        raise ValueError(
            f"ThunderTPStrategy does not support the precision plugin {type(precision).__name__}; use precision="
            "\"32-true\", \"64-true\", \"bf16-true\" or \"16-true\""
        )


#: why autocast is refused (the evidence is in docs/fabric.md)
AUTOCAST_REASON = "to be measured"
