"""The torchao family: a model converted to float8 training (``torchao.float8.convert_to_float8_training``) traced
by ``thunder.jit``: each ``Float8Linear`` as ``float8_matmul`` (``thunder_tp.models.float8``), its weights kept in high
precision. Registered only where torchao is installed (``pip install thunder_tp[float8]``)."""

from __future__ import annotations

import functools

import torch
from thunder.core.interpreter import unwrap, wrap_const

from thunder_tp.models.float8 import Recipe, float8_matmul
from thunder_tp.thunder_internals import patches
from thunder_tp.thunder_internals.private import interpret_call

__all__ = ["float8_linear_forward", "recipe"]


@functools.cache
def recipe(config, mm_config) -> Recipe:
    """A Float8Linear's configs as the float8 symbols take them (one object per distinct pair)."""
    return Recipe(config, mm_config)


def float8_linear_forward(module, input: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """torchao's Float8Linear.forward, its matmul as one float8_matmul."""
    if torch.is_autocast_enabled():  # as Float8Linear: the output in autocast's (GPU) precision
        input = input.to(torch.get_autocast_gpu_dtype())
    output = float8_matmul(input, module.weight.t(), recipe)
    if module.bias is not None:
        output = output + module.bias.to(output.dtype)
    return output


try:
    from torchao.float8.float8_linear import Float8Linear
except ImportError:  # torchao is an optional extra
    Float8Linear = None

if Float8Linear is not None:

    @patches.register_lookaside(Float8Linear.forward)
    def _float8_linear_lookaside(module, input):
        """thunder.jit traces `float8_linear_forward` wherever a Float8Linear is called."""
        m = unwrap(module)
        return interpret_call(float8_linear_forward, module, input, wrap_const(recipe(m.config, m.linear_mm_config)))
