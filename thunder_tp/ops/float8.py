"""Float8 training (torchao's ``Float8Linear``) as Thunder symbols, with its scales computed over a TP group.

torchao's ``Float8Linear`` multiplies through an autograd function on its ``Float8TrainingTensor`` subclass, which
Thunder 0.2.6 cannot trace. thunder_tp traces its forward (``thunder_tp.models.torchao``) as ``float8_matmul(a, b,
recipe)``: ``a @ b`` (``b``: the weight transposed) with each operand cast to float8 as the module's torchao config
says, forward and backward. Its pieces are torchao's own: ``amax_to_scale``, ``hp_tensor_and_scale_to_float8`` and
``torch.mm`` of two ``Float8TrainingTensor``s (``torch._scaled_mm``, or the emulation in high precision that
``Float8LinearConfig(emulate=True)`` asks for); which tensor is cast with which scaling for which gemm is torchao's
``matmul_with_hp_or_float8_args``.

What thunder_tp adds is where the amaxes come from. A scale is ``max_float8 / amax``, the amax over a whole tensor
(tensorwise) or along one dimension of it (axiswise: the rowwise recipe). Under TP a rank holds a piece of a sharded
operand: an amax over a dimension the piece is cut along is only its piece's and is reduced over the group
(``tp_max_all_reduce``, one small collective) so that every rank quantizes as one device does; an amax along a
dimension the piece holds whole (a per-row scale of a row-sharded tensor) stays local. So the program computes
``float8_scaled_matmul(a, b, amax_a, amax_b, recipe, cuts, group)`` with its amaxes computed before it, and its grad
rule does the same for the backward's casts: the output grad's amaxes, and the operands' where the backward scales
them along another dimension than the forward.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import thunder.torch as ltorch
import torch
import torch.distributed as dist
from thunder.core.langctxs import Languages, langctx
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import Symbol
from thunder.core.transforms import register_grad
from thunder.extend import OperatorExecutor, add_default_executor, register_executor

__all__ = ["WHOLE", "Cuts", "Recipe", "float8_executor", "float8_matmul", "float8_matmul_traced",
           "float8_scaled_matmul", "float8_scaled_matmul_backward"]

#: Runs the float8 symbols (opaque: torchao's tensor subclass inside). A Thunder default executor, so a plain
#: `thunder.jit` of a converted model runs them too.
float8_executor = OperatorExecutor("thunder_tp_float8", version="0.1")
register_executor(float8_executor)
add_default_executor(float8_executor)

#: where each operand of a float8 matmul is cut over the group: (a, b, the output grad), each 0 (along its rows), 1
#: (along its columns) or None (whole); `a` and the output grad as the 2-D matrices of their rows
Cuts = tuple[int | None, int | None, int | None]
WHOLE: Cuts = (None, None, None)


@dataclass(frozen=True)
class _Cast:
    """One cast of a float8 recipe: the tensor's torchao CastConfig, its gemm role, and the dimension of the 2-D
    tensor its axiswise amax runs along (torchao's ``get_maybe_axiswise_dim``: 0 or -1; None for tensorwise)."""

    config: object
    role: object
    axis: int | None

    @property
    def scaled(self) -> bool:
        from torchao.float8.config import ScalingType

        return self.config.scaling_type is not ScalingType.DISABLED

    def reduced_over(self, cut: int | None) -> bool:
        """Whether its amax of a tensor cut along `cut` is reduced over the group."""
        return self.scaled and cut is not None and (self.axis is None or self.axis % 2 == cut)

    def same_amax(self, other: _Cast) -> bool:
        """Whether it scales a tensor by the amax `other` takes of it."""
        return self.scaled and other.scaled and self.axis == other.axis


class Recipe:
    """A Float8Linear's torchao configs (its Float8LinearConfig and LinearMMConfig) and the six casts they give: one
    argument of the symbols, which traces show by name."""

    def __init__(self, config, mm_config):
        self.config, self.mm_config = config, mm_config

    def __eq__(self, other) -> bool:
        return isinstance(other, Recipe) and (self.config, self.mm_config) == (other.config, other.mm_config)

    def __hash__(self) -> int:
        return hash((self.config, self.mm_config))

    @functools.cached_property
    def casts(self) -> dict[str, _Cast]:
        """torchao's casts (matmul_with_hp_or_float8_args): input and weight (output gemm), output grad and weight
        (grad-input gemm), output grad and input (grad-weight gemm)."""
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_training_tensor import GemmInputRole as Role

        def cast(cast_config, role, axis: int) -> _Cast:
            axiswise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
            return _Cast(cast_config, role, axis if axiswise else None)

        c = self.config
        return {
            "input": cast(c.cast_config_input, Role.INPUT, -1),
            "weight": cast(c.cast_config_weight, Role.WEIGHT, 0),
            "grad_for_input": cast(c.cast_config_grad_output, Role.GRAD_OUTPUT, -1),
            "weight_for_input": cast(c.cast_config_weight_for_grad_input, Role.WEIGHT, -1),
            "grad_for_weight": cast(c.cast_config_grad_output_for_grad_weight, Role.GRAD_OUTPUT, 0),
            "input_for_weight": cast(c.cast_config_input_for_grad_weight, Role.INPUT, 0),
        }

    def to_float8(self, t: torch.Tensor, name: str, amax: torch.Tensor | None):
        """The 2-D `t` as the Float8TrainingTensor of cast `name` scaled by `amax`; `t` where the cast is disabled."""
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale

        cast = self.casts[name]
        if not cast.scaled:
            return t
        dtype = cast.config.target_dtype
        scale = amax_to_scale(amax, dtype, round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(t, scale, dtype, self.mm_config, cast.role, cast.axis)


# --- amaxes (traced) ------------------------------------------------------------------------------------------------


def _rows(t: TensorProxy) -> TensorProxy:
    return ltorch.reshape(t, (-1, t.shape[-1]))


def _amax(t: TensorProxy, cast: _Cast, cut: int | None, group: dist.ProcessGroup | None) -> TensorProxy | None:
    """The amax `cast` scales the 2-D `t` by (over all of it, or along its axis, kept), reduced over the group where
    `t` is cut along it; None where the cast is disabled."""
    from thunder_tp.collectives import tp_max_all_reduce

    if not cast.scaled:
        return None
    dims = (0, 1) if cast.axis is None else (cast.axis % 2,)
    local = ltorch.amax(ltorch.abs(t), dims, cast.axis is not None)
    return tp_max_all_reduce(local, group) if cast.reduced_over(cut) else local


def float8_matmul_traced(a: TensorProxy, b: TensorProxy, recipe: Recipe, cuts: Cuts = WHOLE,
                         group: dist.ProcessGroup | None = None) -> TensorProxy:
    """``a @ b`` in float8 (`cuts`: where each operand is cut over `group`): the forward's amaxes, then
    ``float8_scaled_matmul``."""
    amax_a = _amax(_rows(a), recipe.casts["input"], cuts[0], group)
    amax_b = _amax(b, recipe.casts["weight"], cuts[1], group)
    return float8_scaled_matmul(a, b, amax_a, amax_b, recipe, cuts, group)


def _backward_amaxes(g, a, b, amax_a, amax_b, recipe: Recipe, cuts: Cuts, group) -> tuple:
    """The backward casts' amaxes: the output grad's (along each dimension its casts scale it), the operands' where
    the backward scales them otherwise than the forward."""
    casts, (cut_a, cut_b, cut_g) = recipe.casts, cuts

    def amax(name: str, t: TensorProxy, cut: int | None, like: str, taken: TensorProxy | None):
        return taken if casts[name].same_amax(casts[like]) else _amax(t, casts[name], cut, group)

    rows = _rows(g)
    g_for_input = _amax(rows, casts["grad_for_input"], cut_g, group)
    return (g_for_input, amax("weight_for_input", b, cut_b, "weight", amax_b),
            amax("grad_for_weight", rows, cut_g, "grad_for_input", g_for_input),
            amax("input_for_weight", _rows(a), cut_a, "input", amax_a))


# --- the computation (torch, on real tensors) ---------------------------------------------------------------------


def _scaled_matmul(a, b, amax_a, amax_b, recipe: Recipe, cuts: Cuts, group) -> torch.Tensor:
    out = torch.mm(recipe.to_float8(a.reshape(-1, a.shape[-1]), "input", amax_a),
                   recipe.to_float8(b, "weight", amax_b))
    return out.reshape(*a.shape[:-1], b.shape[-1])


def _scaled_matmul_backward(g, a, b, amaxes: tuple, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    g_for_input, b_for_input, g_for_weight, a_for_weight = amaxes
    rows, a_rows = g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1])
    grad_a = torch.mm(recipe.to_float8(rows, "grad_for_input", g_for_input),
                      recipe.to_float8(b, "weight_for_input", b_for_input).t())
    grad_w = torch.mm(recipe.to_float8(rows, "grad_for_weight", g_for_weight).t(),
                      recipe.to_float8(a_rows, "input_for_weight", a_for_weight))
    return grad_a.reshape(a.shape), grad_w.t()


# --- symbols ------------------------------------------------------------------------------------------------------


def _scaled_matmul_meta(a, b, amax_a, amax_b, recipe, cuts, group) -> TensorProxy:
    return TensorProxy(like=a, shape=(*a.shape[:-1], b.shape[-1]))


def _backward_meta(g, a, b, amaxes, recipe) -> tuple[TensorProxy, TensorProxy]:
    return TensorProxy(like=a), TensorProxy(like=b)


#: a @ b with a and b cast to float8 by the given amaxes (already reduced over the group where `cuts` needs it)
float8_scaled_matmul = float8_executor.register_operator("float8_scaled_matmul", meta=_scaled_matmul_meta,
                                                         fn=_scaled_matmul)
#: (grad of a, grad of b) of float8_scaled_matmul from its output grad and the backward casts' amaxes
float8_scaled_matmul_backward = float8_executor.register_operator("float8_scaled_matmul_backward",
                                                                  meta=_backward_meta, fn=_scaled_matmul_backward)


def _scaled_matmul_grad(a, b, amax_a, amax_b, recipe, cuts, group):
    out = float8_scaled_matmul(a, b, amax_a, amax_b, recipe, cuts, group)
    g = get_grad(out)
    amaxes = _backward_amaxes(g, a, b, amax_a, amax_b, recipe, cuts, group)
    grad_a, grad_b = float8_scaled_matmul_backward(g, a, b, amaxes, recipe)
    put_grad(a, grad_a)
    put_grad(b, grad_b)
    return out


register_grad(float8_scaled_matmul, _scaled_matmul_grad)

#: a @ b in float8 as a Float8Linear computes it: the logical op, whose TP rule (`propagation/float8.py`) computes
#: it on pieces; on one device it runs as `float8_matmul_traced`
float8_matmul = Symbol(name="float8_matmul", meta=langctx(Languages.TORCH)(float8_matmul_traced),
                       id="thunder_tp.float8_matmul", _module=sys.modules[__name__])
