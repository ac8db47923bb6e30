"""The modes ``bench_rank.py`` runs as one rank of a fake TP group: each builds its module on the meta device and
materializes this rank's share with random weights (no full model is ever allocated).

Training (``llama.py``'s Llama, the model compare.py trains, at Llama-3 shapes; its loss inside; under one of
``PLANS``, by default sequence parallel and loss parallel, torchtitan's defaults):
- (a) thunder_tp with nvFuser regions (CUDA only), (b) thunder_tp with Inductor regions: ``llama.thunder_tp_plan``;
- (c) DTensor TP with torchtitan's plan (``compare_modes.dtensor_plan``: "sp" with sequence parallel, else
  "best"; ``loss_parallel`` where the plan has it) under ``torch.compile``.
Decode (litgpt's GPT with a KV cache, one token per step; thunder_tp's model jitted with ``plans.litgpt`` and
``thunder_tp.executors()``, then called through a ``thunder_tp.DecodeStep``: parameters and caches bound once):
- (d) the decode step compiled as one program (strategy ``"compiled"``), (e) replayed as a CUDA graph (``"graph"``,
  CUDA only), (h) Thunder's computation as compiled, without the prologue (``"bound"``);
- (f) bench_generate.py's hand-written gpt-fast-style TP (``shard_by_hand``) under
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs; on CPU the default mode);
- (g) thunder_tp through the jitted module's own call (Thunder's prologue checks every input on every step);
- (i) one device: the whole GPT (no TP, no collectives) under ``torch.compile`` as (f).
``quick`` builds (a)/(b)/(d)/(g) with Thunder's default executors ((d) with the bound strategy) and compiles (c)/(f)
with ``backend="eager"``: no code generation, for smoke tests of the plumbing, not for timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.lib.compare_modes import dtensor_plan
from benchmarks.lib.harness import thunder_default_executors
from benchmarks.lib.llama import Llama, LlamaConfig, WithLoss, shard_by_hand, thunder_tp_plan

#: the training plans by name: (sequence parallel, loss parallel)
PLANS = {"tp": (False, False), "tp_sp": (True, False), "tp_lp": (False, True), "tp_sp_lp": (True, True)}


@dataclass(frozen=True)
class RankMode:
    """A way to run one rank: ``build(config, device, dtype, quick)`` gives the module (training modes take the
    plan's name too, ``plan=``, and thunder_tp's ``overlap=``); ``cuda_only`` modes skip on the CPU with
    ``skip_reason``."""

    key: str
    description: str
    runtime: str  # "thunder" or "compile"
    build: Callable[..., nn.Module]
    cuda_only: bool = False
    skip_reason: str = ""


# --- materializing one rank's share -----------------------------------------------------------------------------


def random_weights(device: torch.device) -> object:
    """Thunder's MaterializationTransform after TensorParallel: each module's own init (``reset_parameters``) at full
    size, one module at a time, then this rank's shard, on ``device``."""
    from thunder.transforms import MaterializationTransform

    return MaterializationTransform(device, init=MaterializationTransform.init_from_original_module_init())


def _init_local(module: nn.Module, device: torch.device) -> None:
    """A meta-device module (DTensor or hand-sharded) on ``device`` with random local weights: matrices N(0, 0.02),
    vectors (norm weights) ones, buffers recomputed by their modules' ``reset_parameters``."""
    from torch.distributed.tensor import DTensor

    module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.normal_(0.0, 0.02) if local.ndim > 1 else local.fill_(1.0)
        for m in module.modules():
            if m._non_persistent_buffers_set and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def per_layer_keys_dropped(plan: dict, layers: int) -> dict:
    """The plan without its per-layer (glob) keys for a model of no layers, which they would not match (measured at
    depth 0 for the extrapolation)."""
    return plan if layers else {k: v for k, v in plan.items() if "*" not in k}


# --- training ---------------------------------------------------------------------------------------------------


def llama_on_meta(cfg: LlamaConfig, dtype: torch.dtype) -> nn.Module:
    """compare.py's Llama with its loss, on the meta device."""
    with torch.device("meta"):
        return WithLoss(Llama(cfg)).to(dtype)


def _thunder_training(backend: str | None) -> Callable[..., nn.Module]:
    def build(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype, quick: bool, plan: str = "tp_sp_lp",
              overlap: str = "auto") -> nn.Module:
        import thunder

        import thunder_tp

        executors = thunder_default_executors() if quick else thunder_tp.executors(backend)
        sequence_parallel, loss_parallel = PLANS[plan]
        plan = thunder_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        tp = thunder_tp.TensorParallel(per_layer_keys_dropped(plan, cfg.n_layers), overlap=overlap)
        return thunder.jit(llama_on_meta(cfg, dtype), transforms=[tp, random_weights(device)], executors=executors)

    return build


def _dtensor_training(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype, quick: bool,
                      plan: str = "tp_sp_lp", overlap: str = "auto") -> nn.Module:
    """torchtitan's TP plan on the Llama (with loss parallel: the targets replicated as DTensors), compiled
    (``overlap`` is thunder_tp's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    sequence_parallel, with_loss_parallel = PLANS[plan]
    model = llama_on_meta(cfg, dtype)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    styles = dtensor_plan("sp" if sequence_parallel else "best", loss_parallel=with_loss_parallel)
    parallelize_module(model.model, mesh, per_layer_keys_dropped(styles, cfg.n_layers))
    _init_local(model, device)
    if with_loss_parallel:
        model.register_forward_pre_hook(lambda _m, args: (args[0], DTensor.from_local(args[1], mesh, [Replicate()])))
        model.step_context = loss_parallel  # harness.step_context: forward and backward of the loss inside it
    return torch.compile(model, backend="eager" if quick else "inductor")


TRAINING = (
    RankMode("a", "thunder_tp, nvFuser regions", "thunder", _thunder_training("nvfuser"), cuda_only=True,
             skip_reason="nvFuser runs on CUDA only"),
    RankMode("b", "thunder_tp, Inductor regions", "thunder", _thunder_training("inductor")),
    RankMode("c", "DTensor (torchtitan plan), torch.compile", "compile", _dtensor_training),
)


# --- decode -------------------------------------------------------------------------------------------------------


def gpt_on_meta(config, context: int, dtype: torch.dtype) -> nn.Module:
    """litgpt's GPT on the meta device, for ``context`` cached positions plus the decoded one."""
    from litgpt import GPT

    with torch.device("meta"):
        model = GPT(config).to(dtype)
    model.max_seq_length = context + 1
    return model.eval()


class SteppedDecode:
    """A jitted GPT called through a ``thunder_tp.DecodeStep`` of ``strategy``; the jitted module is ``jitted`` (its
    parameters and buffers are the figures' own)."""

    def __init__(self, jitted: nn.Module, strategy: str):
        import thunder_tp

        self.jitted = jitted
        self.step = thunder_tp.DecodeStep(jitted, strategy)

    def __call__(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.step(idx, input_pos)


def _thunder_decode(strategy: str | None) -> Callable[..., nn.Module]:
    """thunder_tp's decode: through a DecodeStep of ``strategy``, or (None) the jitted module's own call."""

    def build(config, context: int, batch: int, device: torch.device, dtype: torch.dtype,
              quick: bool) -> nn.Module | SteppedDecode:
        import thunder
        from litgpt.model import build_mask_cache

        import thunder_tp

        model = gpt_on_meta(config, context, dtype)
        model.set_kv_cache(batch_size=batch, device=torch.device("meta"), dtype=dtype)
        model.mask_cache = build_mask_cache(context + 1, device)  # a plain attribute, not a buffer
        plan = per_layer_keys_dropped(thunder_tp.plans.litgpt(model), config.n_layer)
        executors = thunder_default_executors() if quick else thunder_tp.executors()
        jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan), random_weights(device)],
                         executors=executors)
        if strategy is None:
            return jm
        return SteppedDecode(jm, "bound" if quick and strategy == "compiled" else strategy)

    return build


def _hand_decode(config, context: int, batch: int, device: torch.device, dtype: torch.dtype, quick: bool) -> nn.Module:
    """bench_generate.py's gpt-fast-style TP, sharded on the meta device, materialized, compiled."""
    model = gpt_on_meta(config, context, dtype)
    model.collectives = shard_by_hand(model, dist.get_rank(), dist.get_world_size())
    return _compiled_decode(model, batch, device, dtype, quick)


def _one_device_decode(config, context: int, batch: int, device: torch.device, dtype: torch.dtype,
                       quick: bool) -> nn.Module:
    """The whole GPT on this device (no TP, so no collectives), materialized, compiled as (f)."""
    model = gpt_on_meta(config, context, dtype)
    model.collectives = []
    return _compiled_decode(model, batch, device, dtype, quick)


def _compiled_decode(model: nn.Module, batch: int, device: torch.device, dtype: torch.dtype, quick: bool) -> nn.Module:
    """A meta-device GPT with random weights on ``device``, its KV cache, under ``torch.compile`` (CUDA graphs on a
    GPU; ``backend="eager"`` when ``quick``)."""
    _init_local(model, device)
    model.set_kv_cache(batch_size=batch, device=device, dtype=dtype)
    if quick:
        return torch.compile(model, backend="eager")
    return torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else "default")


DECODE = (
    RankMode("d", "thunder_tp decode step, compiled whole", "thunder", _thunder_decode("compiled")),
    RankMode("e", "thunder_tp decode step, CUDA graph", "thunder", _thunder_decode("graph"), cuda_only=True,
             skip_reason="CUDA graphs need CUDA"),
    RankMode("f", "hand-written TP (gpt-fast style), torch.compile reduce-overhead", "compile", _hand_decode),
    RankMode("g", "thunder_tp, the jitted module's call", "thunder", _thunder_decode(None)),
    RankMode("h", "thunder_tp decode step, bound (Thunder's regions, no prologue)", "thunder",
             _thunder_decode("bound")),
    RankMode("i", "one device, the whole GPT, torch.compile", "compile", _one_device_decode),
)
