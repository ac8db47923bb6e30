"""TensorParallel: shards parameters, then drives annotate -> propagate -> reshard -> rewrite on each trace."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core.proxies import DistParallelType
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import Transform, dce

from thunder_tp.collectives import gather_full
from thunder_tp.collectives.distributed import local_piece
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.composition import check_composition
from thunder_tp.execution.complex_grads import check_complex_grads
from thunder_tp.execution.overlap import MODES, Mode, decompose_for_overlap
from thunder_tp.execution.overlap_cost import Costs
from thunder_tp.execution.saved_values import recompute_matmul_inputs
from thunder_tp.families import adapt_jitted, prepare_for_tracing
from thunder_tp.layouts import REPLICATE, Layout, Replicate, Shard, TPGroup, local_shape, uneven
from thunder_tp.plans.search import AutoPlan, auto
from thunder_tp.propagation import Propagation
from thunder_tp.propagation.collectives import copies_named_as_sources
from thunder_tp.propagation.constraints import constrain_module_boundaries, constrain_styled_ops
from thunder_tp.rewriting.program import rewrite
from thunder_tp.runtimes.agreement import CompileAgreement
from thunder_tp.runtimes.divergence import CHECK_INPUTS, InputAgreement, SameWeights
from thunder_tp.runtimes.same_collectives import SameCollectives
from thunder_tp.styles import Style
from thunder_tp.styles.dtensor import read_plan
from thunder_tp.styles.matching import (
    check_tied_layouts,
    match_plan,
    planned_tensors,
    styles_from_distparallel_type,
    tied_parameters,
)
from thunder_tp.thunder_internals import patches
from thunder_tp.thunder_internals.grad_mode import detached_as_eager
from thunder_tp.thunder_internals.overlapping_inputs import separating_overlapping_views
from thunder_tp.thunder_internals.private import (
    original_module,
    reuse_interpretation,
    set_parameter,
    set_proxy_distparallel_type,
    set_trace_device,
    trace_device,
    wrap_module_call,
)
from thunder_tp.thunder_internals.prologue import flat_args, localize_prologue, trace_body, unpacked_tensor_names

_DATA_PARALLEL_TYPES = (DistParallelType.REPLICATED, DistParallelType.FULLY_SHARDED)


class TensorParallel(Transform):
    """Tensor parallelism from a plan of styles, `distparallel_type` on parameters and `annotate` calls.

    `plan`: module name (or glob, matched as DTensor matches it) -> a thunder_tp style or one of DTensor's
    (torch.distributed.tensor.parallel), or a nested plan for a submodule (thunder_tp.styles.dtensor).

    `plan="auto"`: the plan `thunder_tp.plans.auto` searches for on a trace of the model made from
    `example_inputs` (args, kwargs), at jit, on every rank alike (the TP size is the process group's).
    `check_inputs`: the ranks of the TP group compare a fingerprint of their inputs (one small all_gather) and all
    raise if they differ (thunder_tp.runtimes.divergence): before every "training" call (autograd on) and the first
    call without autograd (the default), before "every" call, the "first" call only, or "never".
    `overlap`: the collectives next to the matmuls that produce or consume them (all_gather -> matmul and matmul ->
    reduce_scatter under SP, matmul -> all_reduce and the backward's input-grad all_reduce without) decomposed into
    pieces that overlap those matmuls (thunder_tp.execution.overlap), forward and backward: "auto" where the cost
    model says it pays (the default), "always" wherever the shapes allow, "never"; or the cost model's constants
    (`thunder_tp.execution.overlap_cost.Costs`: a link and a matmul rate) to decide as "auto" for another machine.
    `check_collectives`: at the end of each compile (the first call of each program) the ranks compare a hash of the
    collectives they will issue over the TP group and all raise, naming the first that differs, where they would not
    issue the same (thunder_tp.runtimes.same_collectives).
    `check_weights`: the ranks compare checksums of the full parameters each sharded (at jit, or handed in full
    later: MaterializationTransform, load_original_state_dict) at the end of each compile and all raise, naming those
    that differ (thunder_tp.runtimes.divergence.SameWeights); False for ranks that shard from different sources on
    purpose. Both ride on the compile agreement's all_gather (thunder_tp.runtimes.agreement).
    `float8_all_gather`: under SP, the input of a float8 column-parallel linear (torchao's convert_to_float8_training)
    is cast to float8 before it is all-gathered, where its recipe allows (tensorwise input scaling), as torchao's
    Float8ColwiseParallel does: half of bf16's bytes (thunder_tp.models.float8); False gathers it in high precision.
    """

    def __init__(
        self,
        plan: Mapping[str, object] | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        *,
        example_inputs: tuple[tuple, dict] | None = None,
        check_inputs: Literal["training", "every", "first", "never"] = "training",
        overlap: Mode = "auto",
        check_collectives: bool = True,
        check_weights: bool = True,
        float8_all_gather: bool = True,
    ):
        if check_inputs not in CHECK_INPUTS:
            raise ValueError(
                f"thunder_tp.TensorParallel: check_inputs must be one of {CHECK_INPUTS}, got {check_inputs!r}"
            )
        if not isinstance(overlap, Costs) and overlap not in MODES:
            raise ValueError(f"thunder_tp.TensorParallel: overlap must be one of {MODES}, got {overlap!r}")
        switches = (("check_collectives", check_collectives), ("check_weights", check_weights),
                    ("float8_all_gather", float8_all_gather))
        for name, value in switches:
            if not isinstance(value, bool):
                raise TypeError(f"thunder_tp.TensorParallel: {name} must be True or False, got {value!r}")
        self.overlap = overlap
        self.plan = _checked_plan(plan, example_inputs)
        self.check_inputs = check_inputs
        self.check_collectives = check_collectives
        self.check_weights = check_weights
        self.float8_all_gather = float8_all_gather
        self.example_inputs = example_inputs
        self.process_group = process_group
        self.parameter_layouts: dict[str, Layout] = {}
        #: cache buffers (KVCacheParallel): each rank computes with its piece, zeroed at jit
        self.buffer_layouts: dict[str, Layout] = {}
        self.weight_styles: dict[str, Style] = {}
        self._tp: TPGroup | None = None
        self._module = None
        self._agreement: CompileAgreement | None = None
        self._weights: SameWeights | None = None
        self._tensors_at_jit: set[str] = set()

    @property
    def tp(self) -> TPGroup:
        """The TP group (resolved on first use, so a transform can be built before init_process_group)."""
        if self._tp is None:
            self._tp = TPGroup.of(self.process_group)
        return self._tp

    # --- module ---------------------------------------------------------------------------------

    def transform_module(self, model) -> None:
        """Record every styled parameter's layout and replace it by this rank's shard."""
        check_composition(self, model)  # 2-D: TP before DDP/FSDP, on a group orthogonal to theirs
        module = original_module(model)
        self._module = model
        prepare_for_tracing(module)  # a model traced alike whatever made its plan
        patches.mark(model)  # its compiles are thunder_tp's, whatever its executors
        adapt_jitted(model, module)  # the family's methods of the model run the program (HF's generate)
        _trace_meta_tensors_on(module, self.tp.group)
        styles = styles_from_distparallel_type(module) | match_plan(module, self._resolved_plan(model))
        planned = planned_tensors(module, styles, self.tp.size)
        self.parameter_layouts, self.buffer_layouts = planned.parameters, planned.buffers
        self.weight_styles = planned.weight_styles
        constrain_module_boundaries(module, styles)
        tied = tied_parameters(module)
        check_tied_layouts(tied, self.parameter_layouts)
        has_peers = self.tp.size > 1 and ranks_of(self.tp.group).has_peers  # a fake group has no peer to agree with
        if has_peers and self.check_weights:
            self._weights = SameWeights(n for n, _ in module.named_parameters(remove_duplicate=False))
            for name, param in module.named_parameters():
                self._weights.saw_whole(name, param.detach())
        local = self._local_layouts(model)
        for name, layout in local.items():
            param = model.get_parameter(name)
            shard = local_piece(param.detach(), layout, self.tp.rank, self.tp.size, self.tp.group).clone()
            set_parameter(model, name, nn.Parameter(shard, requires_grad=param.requires_grad))
        for name, first in tied.items():  # one shard under every name (a tied embedding and head)
            if first in local:
                set_parameter(model, name, model.get_parameter(first))
        self._shard_caches(model)
        self._tensors_at_jit = {n for n, _ in (*module.named_parameters(remove_duplicate=False),
                                               *module.named_buffers(remove_duplicate=False))}
        wrap_module_call(model, separating_overlapping_views)  # Thunder would read one view for the other
        wrap_module_call(model, patches.applying)  # Thunder's speed-ups for its compiles, whatever its executors
        if has_peers:
            checks = [SameCollectives(self.tp.group)] if self.check_collectives else []
            self._agreement = CompileAgreement(self.tp.group, [*checks, *filter(None, [self._weights])])
            self._agreement.install(model)
            if self.check_inputs != "never":
                InputAgreement(self.tp.group, self.check_inputs).install(model)  # runs first

    def _resolved_plan(self, model) -> Mapping[str, Style]:
        """The plan; "auto" is searched for here, once, before any parameter is sharded."""
        module = original_module(model)
        if self.plan == "auto":
            args, kwargs = self.example_inputs
            self.plan = auto(module, *args, tp_size=self.tp.size, **kwargs)
        searched = self.plan.take_interpretation() if isinstance(self.plan, AutoPlan) else None
        if searched is not None:  # one interpretation for the search and the compile, if the first call is alike
            reuse_interpretation(model, searched)
        return self.plan

    def _local_layouts(self, model) -> dict[str, Layout]:
        """The parameters that get a local piece: the sharded ones; in a simulation, all (a LocalTensor each)."""
        ranks = ranks_of(self.tp.group)
        ranks.check_jit(model)
        layouts = {name: self.parameter_layouts.get(name, REPLICATE)
                   for name, _ in original_module(model).named_parameters()}
        kept = ranks.one_trace_for_all  # a LocalTensor for every parameter
        return {name: layout for name, layout in layouts.items() if kept or not isinstance(layout, Replicate)}

    def _shard_caches(self, model) -> None:
        """Each cache buffer becomes this rank's zeroed piece; the module keeps a full-size meta placeholder (no
        full cache is held) and its reset_parameters() zeroes the pieces."""
        module = original_module(model)
        owners: dict[str, list[torch.Tensor]] = {}
        ranks = ranks_of(self.tp.group)
        for name, layout in self.buffer_layouts.items():
            full = model.get_buffer(name)
            device = ranks.device if full.is_meta else full.device
            if ranks.one_trace_for_all:  # a LocalTensor of every simulated rank's piece
                zeros = torch.zeros(full.shape, dtype=full.dtype, device=device)
                piece = local_piece(zeros, layout, self.tp.rank, self.tp.size, self.tp.group, padded=True).clone()
            else:
                piece = torch.zeros(local_shape(full.shape, layout, self.tp.size, self.tp.rank), dtype=full.dtype,
                                    device=device)
            model.set_buffer(name, piece)
            owner, _, attr = name.rpartition(".")
            placeholder = torch.empty(full.shape, dtype=full.dtype, device="meta")
            set_trace_device(placeholder, piece.device)
            module.get_submodule(owner)._buffers[attr] = placeholder
            owners.setdefault(owner, []).append(piece)
        for owner, pieces in owners.items():
            module.get_submodule(owner).reset_parameters = functools.partial(_zero_all, pieces)

    def transform_state_dict_for_submodule(self, model, submodule_name: str, state_dict: dict) -> dict:
        """Shard full tensors of a submodule's state dict (keys relative to the submodule)."""
        prefix = f"{submodule_name}." if submodule_name else ""
        if self._weights is not None:
            for k, v in state_dict.items():
                if isinstance(v, torch.Tensor):
                    self._weights.saw_whole(prefix + k, v)
        return {k: self._shard_full(prefix + k, v) for k, v in state_dict.items()}

    def loaded_from_checkpoint(self, names: list[str]) -> None:
        """Parameters that a checkpoint replaced on every rank (thunder_tp.checkpoint): the weight check no longer
        compares the values seen of them before."""
        if self._weights is not None:
            self._weights.loaded(names)

    def reverse_transform_state_dict_for_submodule(self, model, submodule_name: str, state_dict: dict) -> dict:
        """Full tensors from this rank's shards (collective: every rank of the TP group must call it)."""
        prefix = f"{submodule_name}." if submodule_name else ""
        return {k: self._gather_full(prefix + k, v) for k, v in state_dict.items()}

    def _gather_full(self, name: str, value: Any) -> Any:
        layout = self.parameter_layouts.get(name, REPLICATE)
        if (owner := layout.owner(self.tp.size)) is not None and isinstance(value, torch.Tensor):
            return self._broadcast_whole(name, value.detach(), owner)
        if not isinstance(layout, Shard) or not isinstance(value, torch.Tensor):
            return value
        n = original_module(self._module).get_parameter(name).shape[layout.dim]
        return gather_full(value.detach(), layout, n, self.tp.group)

    def _broadcast_whole(self, name: str, piece: torch.Tensor, owner: int) -> torch.Tensor:
        """A tensor that rank `owner` alone holds (an expert), whole on every rank, from that rank."""
        shape = original_module(self._module).get_parameter(name).shape
        whole = piece.clone() if self.tp.rank == owner else piece.new_empty(shape)
        dist.broadcast(whole, dist.get_global_rank(self.tp.group, owner), group=self.tp.group)
        return whole

    def _shard_full(self, name: str, value: Any) -> Any:
        layout = self.parameter_layouts.get(name, REPLICATE)
        if (isinstance(layout, Shard) or layout.owner(self.tp.size) is not None) and isinstance(value, torch.Tensor):
            return local_piece(value, layout, self.tp.rank, self.tp.size, self.tp.group).clone()
        return value

    # --- traces ---------------------------------------------------------------------------------

    def transform_traces_pre_prologue(self, prologue: TraceCtx, computation: TraceCtx, epilogue, **kwargs):
        """Rewrite the computation into the local program and fix the prologue's shape checks."""
        _check_materialized(self._module)
        check_complex_grads(computation, kwargs.get("executors_list", ()))
        detached_as_eager(computation)  # a detached value's inputs get no grad from it, as in eager
        if self.tp.size == 1:  # every layout is the whole tensor: nothing to rewrite or communicate
            return prologue, computation, epilogue
        param_names = unpacked_tensor_names(prologue)
        _check_known(param_names, self._tensors_at_jit)
        layouts = self._initial_layouts(computation, param_names)
        # (a copy over another group: context parallelism's of a replicated parameter, styled and labelled as it)
        named = copies_named_as_sources(computation, param_names, self.tp.group)
        styles = {proxy: self.weight_styles[name] for proxy, name in named.items() if name in self.weight_styles}
        # dead code first (Thunder removes it only after this hook): an unused consumer, such as the router logits
        # an HF MoE block returns and its decoder layer drops, must not decide how a live value is communicated
        logical = constrain_styled_ops(dce(computation), styles)
        propagation = Propagation(dict(layouts), self.tp, frozenset(param_names), options=self.rule_options())
        steps = propagation.run(trace_body(logical))
        one_trace = ranks_of(self.tp.group).one_trace_for_all
        # a simulation runs one trace for every rank: StackShard tensors keep their full shape there (local_piece)
        sharded = {name: layout for name, layout in layouts.items()
                   if isinstance(layout, Shard) or (layout.owner(self.tp.size) is not None and not one_trace)}
        parameters = frozenset(p for p, name in param_names.items() if name in self.parameter_layouts)
        input_shapes = {a.name: tuple(a.shape) for a in flat_args(computation)}
        # a simulation holds parameters at each rank's true size and pads them where the program reads them: their
        # shapes differ among the simulated ranks, which one check cannot say
        size, rank = self.tp.size, self.tp.rank
        uneven_pieces = frozenset(p for p in parameters if p in sharded and uneven(sharded[p], input_shapes[p], size))

        def piece_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
            return local_shape(shape, sharded[name], size, rank) if name in sharded else None

        localize_prologue(prologue, computation, piece_shape, unchecked=uneven_pieces if one_trace else frozenset())
        local = rewrite(logical, steps, propagation.layouts, self.tp, input_shapes, parameters, named)
        # the chains feeding matmuls are tagged first: a decomposition reads them through its chunks' views
        inputs = {name: (shape, layouts[name]) for name, shape in input_shapes.items()}
        return prologue, decompose_for_overlap(recompute_matmul_inputs(local), self.tp, self.overlap, inputs), epilogue

    def transform_trace_post_optimization(self, computation: TraceCtx, **kwargs) -> TraceCtx:
        """The end of a compile: every rank of the TP group compiled, or all raise (thunder_tp.runtimes.agreement)."""
        if self._agreement is not None:
            self._agreement.compiled(self._module, computation)
        return computation

    def rule_options(self) -> dict[str, object]:
        """What the propagation rules decide by besides layouts (`propagation.engine.Op.options`)."""
        return {"float8_all_gather": self.float8_all_gather}

    def _initial_layouts(self, computation: TraceCtx, param_names: dict[str, str]) -> dict[str, Layout]:
        layouts: dict[str, Layout] = {}
        tensor_layouts = self.parameter_layouts | self.buffer_layouts
        for a in flat_args(computation):
            layout = tensor_layouts.get(param_names.get(a.name, ""), REPLICATE)
            layouts[a.name] = layout
            kind = _thunder_parallel_type(layout, a.ndim)
            if kind is not None and a.distparallel_type not in _DATA_PARALLEL_TYPES:
                set_proxy_distparallel_type(a, kind)
        return layouts


def _checked_plan(plan, example_inputs) -> dict[str, Style] | str:
    """A plan mapping (DTensor's styles read as thunder_tp's), or "auto" with its example inputs."""
    if not isinstance(plan, str):
        if example_inputs is not None:
            raise ValueError("thunder_tp.TensorParallel: example_inputs= is for plan=\"auto\"; a given plan needs none")
        return read_plan(plan or {})
    if plan != "auto":
        raise ValueError("thunder_tp.TensorParallel: plan must be a mapping of module names to styles or \"auto\", "
                         f"got {plan!r}")
    if not (isinstance(example_inputs, tuple) and len(example_inputs) == 2 and isinstance(example_inputs[1], dict)):
        raise ValueError(
            "thunder_tp.TensorParallel(\"auto\") needs example_inputs=(args, kwargs), e.g. ((idx,), {}): the plan is "
            "searched on a trace of the model at jit, before any call (meta tensors are fine)"
        )
    return plan


def _zero_all(tensors: list[torch.Tensor]) -> None:
    """A sharded cache's reset_parameters(): zero this rank's pieces."""
    for t in tensors:
        t.zero_()


def _check_known(names: dict[str, str], at_jit: set[str]) -> None:
    """A buffer created after thunder.jit (e.g. by set_kv_cache) was never sharded: a clear error, not a full
    replicated cache."""
    late = sorted(n for n in names.values() if n not in at_jit)
    if late:
        raise RuntimeError(
            f"thunder_tp.TensorParallel: buffers {late[:4]}{'...' if len(late) > 4 else ''} were created after "
            "thunder.jit (e.g. by set_kv_cache on the jitted model), so they were never sharded; call "
            "model.set_kv_cache(...) before thunder.jit and build the plan after it (plans.litgpt then shards the "
            "cache)"
        )


def _trace_meta_tensors_on(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Meta-device tensors are traced as on the group's device (where ck.load or materialization puts them)."""
    for t in (*module.parameters(), *module.buffers()):
        if t.is_meta and trace_device(t) is None:
            set_trace_device(t, ranks_of(group).device)


def _check_materialized(model) -> None:
    """A clear error, instead of a device mismatch, when a meta-device model is called before materialization."""
    if model is None:
        return
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        raise RuntimeError(
            f"thunder_tp.TensorParallel: {meta[:4]}{'...' if len(meta) > 4 else ''} are still on the meta device at "
            "the first call; materialize each rank's shards first: thunder_tp.checkpoint.load(path, jm) loads them "
            "from a checkpoint, or put thunder.transforms.MaterializationTransform(device, "
            "init=MaterializationTransform.init_from_original_module_init()) after TensorParallel in transforms= for "
            "a fresh initialization"
        )


def _thunder_parallel_type(layout: Layout, ndim: int) -> DistParallelType | None:
    """Thunder's name for a layout where it has one: COLUMN_WISE = dim 0 of a 2-D weight (and of its 1-D bias),
    ROW_WISE = dim 1 of a 2-D weight; other shards (e.g. of a 3-D parameter) keep Thunder's NONE."""
    if not isinstance(layout, Shard):
        return None
    if layout.dim == 0 and ndim <= 2:
        return DistParallelType.COLUMN_WISE
    return DistParallelType.ROW_WISE if (layout.dim, ndim) == (1, 2) else None
