"""The automatic plan's trace: the model's logical program, traced from example inputs without running it."""

from __future__ import annotations

from dataclasses import dataclass

import thunder
import torch
import torch.nn as nn
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import Transform, dce

from thunder_tp.families import prepare_for_tracing
from thunder_tp.thunder_internals.private import Interpretation, interpretations_kept, meta_traced_on
from thunder_tp.thunder_internals.prologue import unpacked_tensor_names
from thunder_tp.thunder_internals.torch_pytree import tree_map_only


@dataclass
class Traced:
    """The logical computation trace of a module call, parameter proxy name -> qualified parameter name, and the
    interpretation it came from (which the compile of the same call can start from)."""

    computation: TraceCtx
    names: dict[str, str]
    interpretation: Interpretation | None = None


class _Stop(Exception):
    pass


class _Capture(Transform):
    """Keeps the computation trace and stops the compile before anything else happens."""

    def transform_traces_pre_prologue(self, prologue, computation, epilogue, **kwargs):
        self.traced = Traced(dce(computation), unpacked_tensor_names(prologue))  # as TensorParallel propagates it
        raise _Stop


def traced(module: nn.Module, args: tuple, kwargs: dict) -> Traced:
    """Trace `module(*args, **kwargs)` with Thunder's interpreter, running nothing. Meta-device tensors are traced as
    CPU ones (HF's rotary embedding, for one, opens an autocast region on its inputs' device, which meta is not)."""
    prepare_for_tracing(module)
    tensors = [*module.parameters(), *module.buffers()]
    args, kwargs = tree_map_only(torch.Tensor, _off_meta, (args, kwargs))
    capture = _Capture()
    with meta_traced_on(tensors, torch.device("cpu")), interpretations_kept() as kept:
        try:
            thunder.jit(module, transforms=[capture])(*args, **kwargs)
        except _Stop:
            capture.traced.interpretation = kept[-1] if kept else None
            return capture.traced
    raise RuntimeError("thunder_tp.plans.auto: Thunder compiled the model without reaching the TP transform stage")


def _off_meta(t: torch.Tensor) -> torch.Tensor:
    """An example input on the CPU (a meta one becomes zeros of its shape: only shapes are traced)."""
    return torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t
