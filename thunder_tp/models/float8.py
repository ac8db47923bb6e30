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
import weakref
from dataclasses import dataclass

import thunder.torch as ltorch
import torch
import torch.distributed as dist
from thunder.core.langctxs import Languages, langctx
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import Symbol
from thunder.core.trace import TraceCtx, get_tracectx
from thunder.core.transforms import register_grad
from thunder.extend import OperatorExecutor, add_default_executor, register_executor

from thunder_tp.collectives import tp_max_all_reduce, tp_reduce_scatter
from thunder_tp.collectives.distributed import gather_shards
from thunder_tp.collectives.labels import label_collectives
from thunder_tp.collectives.symbols import register_issued_collectives
from thunder_tp.layouts import PARTIAL, REPLICATE, Pieces, Shard, rank_pieces
from thunder_tp.propagation.engine import Op, Strategy, register_rule

__all__ = ["WHOLE", "Cuts", "Recipe", "float8_executor", "float8_gathered_matmul_traced", "float8_matmul",
           "float8_matmul_traced", "float8_scaled_matmul", "float8_scaled_matmul_backward", "tp_float8_gather_to_tp"]

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

    @property
    def gathers_in_float8(self) -> bool:
        """Whether a sequence-sharded input can be cast before it is gathered (as torchao's Float8ColwiseParallel
        does): the recipe scales the input tensorwise, and by that same cast for the weight grad (so that the gathered
        float8 input serves both gemms)."""
        casts = self.casts
        return casts["input"].scaled and casts["input"].axis is None and casts["input_for_weight"] == casts["input"]

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

    def scale(self, name: str, amax: torch.Tensor) -> torch.Tensor:
        """The scale of cast `name` for `amax` (torchao's amax_to_scale)."""
        from torchao.float8.float8_utils import amax_to_scale

        dtype = self.casts[name].config.target_dtype
        return amax_to_scale(amax, dtype, round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)

    def to_float8(self, t: torch.Tensor, name: str, amax: torch.Tensor | None, hp_dtype: torch.dtype):
        """The 2-D `t` as the Float8TrainingTensor of cast `name` scaled by `amax` (`t` already float8: cast by it
        before, as a float8 all_gather's is); `t` where the cast is disabled."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, hp_tensor_and_scale_to_float8

        cast = self.casts[name]
        if not cast.scaled:
            return t
        if t.dtype == cast.config.target_dtype:
            return Float8TrainingTensor(t, self.scale(name, amax), hp_dtype, self.mm_config, cast.role, cast.axis)
        return hp_tensor_and_scale_to_float8(t, self.scale(name, amax), cast.config.target_dtype, self.mm_config,
                                             cast.role, cast.axis)


# --- amaxes (traced) ------------------------------------------------------------------------------------------------


#: torchao's gemm roles as the collectives' labels name them
_ROLES = {"input": "input", "weight": "weight", "grad_output": "output grad"}


def _rows(t: TensorProxy) -> TensorProxy:
    return ltorch.reshape(t, (-1, t.shape[-1]))


def _amax(t: TensorProxy, cast: _Cast, cut: int | None, group: dist.ProcessGroup | None) -> TensorProxy | None:
    """The amax `cast` scales the 2-D `t` by (over all of it, or along its axis, kept), reduced over the group where
    `t` is cut along it; None where the cast is disabled."""
    if not cast.scaled:
        return None
    dims = (0, 1) if cast.axis is None else (cast.axis % 2,)
    local = ltorch.amax(ltorch.abs(t), dims, cast.axis is not None)
    if not cast.reduced_over(cut):
        return local
    reduced = tp_max_all_reduce(local, group)
    label_collectives(get_tracectx().peek_scope()[-1:], f"float8: amax of the {_ROLES[cast.role.value]} (max)")
    return reduced


def float8_matmul_traced(a: TensorProxy, b: TensorProxy, recipe: Recipe, cuts: Cuts = WHOLE,
                         group: dist.ProcessGroup | None = None) -> TensorProxy:
    """``a @ b`` in float8 (`cuts`: where each operand is cut over `group`): the forward's amaxes, then
    ``float8_scaled_matmul``."""
    amax_a = _amax(_rows(a), recipe.casts["input"], cuts[0], group)
    amax_b = _amax(b, recipe.casts["weight"], cuts[1], group)
    return float8_scaled_matmul(a, b, amax_a, amax_b, recipe, cuts, group)


#: per trace being built: the float8 all_gathers made, by (input, input cast, scale rounding): the linears reading
#: one sequence-sharded value (an MLP's fc_1 and fc_2) share its gather
_gathers: weakref.WeakKeyDictionary[TraceCtx, dict] = weakref.WeakKeyDictionary()


def float8_gathered_matmul_traced(x: TensorProxy, b: TensorProxy, recipe: Recipe, dim: int, pieces: Pieces,
                                  group: dist.ProcessGroup) -> TensorProxy:
    """``all_gather(x) @ b`` in float8 with `x` cast before the gather (`x`: this rank's piece of `pieces` along
    `dim`, `b` cut along its columns): x's whole-tensor amax, the float8 all_gather (once per input and cast), then
    ``float8_scaled_matmul`` of the gathered float8 input."""
    made = _gathers.setdefault(get_tracectx(), {})
    key = (x.name, recipe.casts["input"].config, recipe.config.round_scales_to_power_of_2, dim)
    if key not in made:
        amax_x = _amax(_rows(x), recipe.casts["input"], 0, group)
        made[key] = tp_float8_gather_to_tp(x, amax_x, recipe, dim, pieces, group), amax_x
        label_collectives(get_tracectx().peek_scope()[-1:], "float8: the input gathered (cast first)")
    gathered, amax_x = made[key]
    amax_b = _amax(b, recipe.casts["weight"], 1, group)
    return float8_scaled_matmul(gathered, b, amax_x, amax_b, recipe, (None, 1, 1), group)


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
    hp = b.dtype if a.element_size() == 1 else a.dtype  # a gathered in float8: its proxy's, the weight's
    out = torch.mm(recipe.to_float8(a.reshape(-1, a.shape[-1]), "input", amax_a, hp),
                   recipe.to_float8(b, "weight", amax_b, hp))
    return out.reshape(*a.shape[:-1], b.shape[-1])


def _scaled_matmul_backward(g, a, b, amaxes: tuple, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    g_for_input, b_for_input, g_for_weight, a_for_weight = amaxes
    rows, a_rows, hp = g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1]), g.dtype
    grad_a = torch.mm(recipe.to_float8(rows, "grad_for_input", g_for_input, hp),
                      recipe.to_float8(b, "weight_for_input", b_for_input, hp).t())
    grad_w = torch.mm(recipe.to_float8(rows, "grad_for_weight", g_for_weight, hp).t(),
                      recipe.to_float8(a_rows, "input_for_weight", a_for_weight, hp))
    return grad_a.reshape(a.shape), grad_w.t()


def _float8_gathered(x, amax_x, recipe: Recipe, dim: int, pieces: Pieces, group) -> torch.Tensor:
    """`x` cast to float8 by its input cast (torchao's data) and every rank's piece gathered along `dim` (as bytes:
    torch.distributed's backends take no float8)."""
    data = recipe.to_float8(x.reshape(-1, x.shape[-1]), "input", amax_x, x.dtype)._data.reshape(x.shape)
    return gather_shards(data.view(torch.uint8), dim, pieces, group).view(data.dtype)


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


def _gathered_meta(x, amax_x, recipe: Recipe, dim, pieces, group) -> TensorProxy:
    shape = list(x.shape)
    shape[dim] = max(start + length for chunks in pieces for start, length in chunks)
    return TensorProxy(like=x, shape=tuple(shape))


#: every rank's piece of x, cast to float8 (by the amax of the whole x), gathered: an all_gather of a byte a value.
#: Its proxy keeps x's (high) precision, which its grad has: the reduce_scatter of the gathered value's grad, as a
#: gather into the TP region's. Only float8_scaled_matmul reads it (a float8 tensor at run time).
tp_float8_gather_to_tp = float8_executor.register_operator("tp_float8_gather_to_tp", meta=_gathered_meta,
                                                           fn=_float8_gathered)
register_issued_collectives(tp_float8_gather_to_tp, lambda bsym: [("all_gather", bsym.output.numel)])


def _gathered_grad(x, amax_x, recipe, dim, pieces, group):
    out = tp_float8_gather_to_tp(x, amax_x, recipe, dim, pieces, group)
    put_grad(x, tp_reduce_scatter(get_grad(out), dim, pieces, group))
    return out


register_grad(tp_float8_gather_to_tp, _gathered_grad)


def _scaled_matmul_grad(a, b, amax_a, amax_b, recipe, cuts, group):
    out = float8_scaled_matmul(a, b, amax_a, amax_b, recipe, cuts, group)
    g = get_grad(out)
    amaxes = _backward_amaxes(g, a, b, amax_a, amax_b, recipe, cuts, group)
    grad_a, grad_b = float8_scaled_matmul_backward(g, a, b, amaxes, recipe)
    put_grad(a, grad_a)
    put_grad(b, grad_b)
    return out


register_grad(float8_scaled_matmul, _scaled_matmul_grad)

#: a @ b in float8 as a Float8Linear computes it: the logical op, whose TP rule (below) computes it on pieces; on one
#: device it runs as `float8_matmul_traced`
float8_matmul = Symbol(name="float8_matmul", meta=langctx(Languages.TORCH)(float8_matmul_traced),
                       id="thunder_tp.float8_matmul", _module=sys.modules[__name__])


# --- the TP rule --------------------------------------------------------------------------------------------------


@register_rule(float8_matmul)
def float8_matmul_rule(op: Op) -> list[Strategy]:
    """a @ b (b: a weight transposed): column-parallel (b's columns: the output's features; a sequence-sharded a
    gathered in float8 where its recipe allows), row-parallel (the contracted dim: Partial), a's tokens sharded (b
    whole), or replicated. Never a Partial input: float8 scales a value, not a summand of it."""
    a, b = op.tensors
    recipe, last = op.arg("recipe"), a.ndim - 1
    columns, rows = op.shard_of(b, 1), op.shard_of(b, 0)

    def local(inputs, outputs, cuts: Cuts) -> Strategy:
        forward, backward = _amax_reductions(recipe, cuts, a)
        return Strategy(inputs, outputs, functools.partial(_on_pieces, cuts=cuts, group=op.tp.group),
                        issues=forward, backward_issues=backward)

    strategies = [
        local((REPLICATE, columns), (columns.moved(last),), (None, 1, 1)),
        local((rows.moved(last), rows), (PARTIAL,), (1, 0, None)),
        *(local((op.shard_of(a, d), REPLICATE), (op.shard_of(a, d),), (0, None, 0)) for d in range(last)),
        op.replicated(),
    ]
    held = op.layout_of(a)
    float8_gather = op.options.get("float8_all_gather", True) and recipe.gathers_in_float8
    if float8_gather and isinstance(held, Shard) and held.dim < last:  # SP into a column-parallel linear
        pieces = rank_pieces(held, a.shape[held.dim], op.tp.size)
        gathered = functools.partial(_gathered_on_pieces, dim=held.dim, pieces=pieces, group=op.tp.group)
        # priced as the gather in high precision it replaces, at a byte a value (its input's amax all_reduce is
        # priced with the gather: it is chosen wherever the recipe allows, as torchao's Float8ColwiseParallel is)
        forward, backward = _amax_reductions(recipe, (None, 1, 1), a)
        strategies.insert(0, Strategy((held, columns), (columns.moved(last),), gathered,
                                      issues=(("all_gather", a.numel), *forward),
                                      backward_issues=(*backward, ("reduce_scatter", a.numel * a.dtype.bytes))))
    return strategies


def _amax_reductions(recipe: Recipe, cuts: Cuts, a: TensorProxy) -> tuple[tuple, tuple]:
    """The amax all_reduces (kind, bytes) a strategy's float8 casts issue, forward and backward (a float32 amax a
    row of `a` for the axiswise ones: their sizes are the plan search's estimate, not the rank's exact count)."""
    casts, (cut_a, cut_b, cut_g) = recipe.casts, cuts
    rows = a.numel // a.shape[-1]

    def issue(name: str, cut: int | None, taken_by: str | None = None) -> tuple:
        cast = casts[name]
        if not cast.reduced_over(cut) or (taken_by is not None and cast.same_amax(casts[taken_by])):
            return ()
        return (("all_reduce", 4 * (1 if cast.axis is None else rows)),)

    forward = (*issue("input", cut_a), *issue("weight", cut_b))
    backward = (*issue("grad_for_input", cut_g), *issue("grad_for_weight", cut_g, "grad_for_input"),
                *issue("weight_for_input", cut_b, "weight"), *issue("input_for_weight", cut_a, "input"))
    return forward, backward


def _on_pieces(a, b, recipe, *_whole, cuts: Cuts, group):
    """The logical op's (a, b, recipe; its cuts and group those of one device) on this rank's pieces."""
    return float8_matmul_traced(a, b, recipe, cuts, group)


def _gathered_on_pieces(x, b, recipe, *_whole, dim: int, pieces: Pieces, group):
    return float8_gathered_matmul_traced(x, b, recipe, dim, pieces, group)
