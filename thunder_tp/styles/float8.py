"""torchao's float8 styles (``torchao.float8.float8_tensor_parallel``), for plans written for DTensor with them
(torchtitan's float8 TP plan), read as thunder_tp's.

``Float8ColwiseParallel`` and ``PrepareFloat8ModuleInput`` cast a sequence-sharded input to float8 before its
all_gather; thunder_tp does so for every float8 linear whose recipe scales its input tensorwise
(``TensorParallel(float8_all_gather=True)``, the default), so they split what ``ColwiseParallel`` and
``PrepareModuleInput`` split. ``Float8RowwiseParallel`` casts its output's grad to float8 before that grad's
redistribution; thunder_tp casts it where the linear's backward gemm does, by the same whole-tensor amax (the same
values, the redistribution in high precision). What torchao refuses is refused here with the fix: these styles on a
module that is no Float8Linear, or the float8 gather (Float8ColwiseParallel) for a recipe that scales the input per
row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from thunder_tp.layouts import Layout
from thunder_tp.styles.dtensor_like import ColwiseParallel, RowwiseParallel

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "torchao_readers"]


@dataclass(frozen=True)
class Float8ColwiseParallel(ColwiseParallel):
    """ColwiseParallel of a torchao Float8Linear whose input, sequence-sharded, is gathered in float8."""

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """ColwiseParallel's, for a Float8Linear that scales its input tensorwise."""
        config = _float8_config(module, "Float8ColwiseParallel", "ColwiseParallel")
        from torchao.float8.config import ScalingGranularity

        if config.cast_config_input.scaling_granularity is not ScalingGranularity.TENSORWISE:
            raise ValueError(
                "torchao's Float8ColwiseParallel gathers the input in float8 by one tensorwise scale, but this "
                "Float8Linear's recipe scales its input per row (rowwise); give it ColwiseParallel(): thunder_tp then "
                "gathers the input in high precision and casts it as the recipe says"
            )
        return super().tensor_layouts(module, size)


@dataclass(frozen=True)
class Float8RowwiseParallel(RowwiseParallel):
    """RowwiseParallel of a torchao Float8Linear."""

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """RowwiseParallel's, for a Float8Linear."""
        _float8_config(module, "Float8RowwiseParallel", "RowwiseParallel")
        return super().tensor_layouts(module, size)


def _float8_config(module: nn.Module, style: str, plain: str):
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        raise TypeError(
            f"torchao's {style} needs a Float8Linear, got a {type(module).__name__}: convert the model with "
            f"torchao.float8.convert_to_float8_training first, or give this module {plain}()"
        )
    return module.config


def torchao_readers(colwise, rowwise, prepare_input) -> dict[type, object]:
    """DTensor-style readers of torchao's float8 styles (none without torchao), from the readers of their bases."""
    try:
        from torchao.float8 import float8_tensor_parallel as torchao_tp
    except ImportError:
        return {}

    def float8(reader, style_type):
        def read(style):
            plain = reader(style)
            return style_type(input_layout=plain.input_layout, output_layout=plain.output_layout)
        return read

    return {torchao_tp.Float8ColwiseParallel: float8(colwise, Float8ColwiseParallel),
            torchao_tp.Float8RowwiseParallel: float8(rowwise, Float8RowwiseParallel),
            torchao_tp.PrepareFloat8ModuleInput: prepare_input}
