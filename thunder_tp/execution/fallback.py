"""A fusion region that its backend rejects is lowered again by the next backend: nvFuser, then Inductor, then torch.

nvFuser and ``torch.compile`` both compile a region at its first call (and again for inputs of new shapes or
strides), so every region of thunder_tp's fusion executor is called through a ``FallbackRegion``. When the call
raises a backend error, the region's bound symbols are lowered by the next backend and run; the first that runs them
is kept for every later call, and one warning (``RegionFallbackWarning``) names the region, its ops and each
rejecting backend's error. The results are that backend's. Torch is the region run op by op by Thunder's torch
executor (Inductor's lowering with compilation off, ``torch.compiler.set_stance("force_eager")``), which generates
no code to reject.

What is a backend error (``is_backend_error``), and what is the program's:
- Inductor: an exception of Dynamo's or Inductor's own (``torch._dynamo.exc``, ``torch._inductor.exc``: Dynamo
  wraps what a backend raises while compiling in ``BackendCompilerFailed``), or Triton's; except
  ``TorchRuntimeError``, an op of the region failing on these inputs while Dynamo traced it (the program's error).
- nvFuser: a ``RuntimeError`` whose message points into nvFuser (its sources, ``csrc/...``, or its name), as its
  failed checks and internal asserts do.
- Never: out of memory, and everything else: a shape, index or value error raised by an op, an interrupt.
The program's errors propagate unchanged. A backend error whose next backend then raises one of the program's
propagates that one (the program's error, as the next backend reports it), and the region keeps its backend.

Regions of one canonical form (``tracing/region_cache.py``: the same code on inputs of the same metadata, e.g. the
same region of every block) share one ``FallbackRegion``, in the process: they run one compiled callable (one
compilation for all of them, whatever the backend), and a region rejected in one block falls back once for all.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from thunder.core.proxies import Proxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.executors.torch_compile import make_compiled
from thunder.extend import FusionExecutor

from thunder_tp.thunder_internals.dynamo import is_program_error
from thunder_tp.tracing.region_cache import CompiledRegions, canonical_form

__all__ = ["BACKEND_NAMES", "SHARED_REGIONS", "FallbackRegion", "RegionBackend", "RegionFallbackWarning",
           "is_backend_error", "with_fallback"]

RegionBackend = Literal["nvfuser", "inductor", "torch"]

#: the backends a region of each falls back on, in order
NEXT_BACKENDS: dict[RegionBackend, tuple[RegionBackend, ...]] = {
    "nvfuser": ("inductor", "torch"), "inductor": ("torch",), "torch": ()}
BACKEND_NAMES: dict[RegionBackend, str] = {"nvfuser": "nvFuser", "inductor": "Inductor", "torch": "torch"}
#: how nvFuser's errors read: NVF_CHECK / NVF_ERROR name the source file under csrc/ ("INTERNAL ASSERT FAILED at
#: /workspace/Fuser/csrc/fusion_segmenter.cpp:4716")
_NVFUSER_MESSAGE = re.compile(r"nvfuser|Fuser/csrc|csrc/[\w/]+\.(?:cpp|h)\b", re.IGNORECASE)
_INDUCTOR_MODULES = ("torch._dynamo", "torch._inductor", "triton")
#: ops named in a warning before it abbreviates
_OPS_NAMED = 12


class RegionFallbackWarning(UserWarning):
    """A fusion region that its backend rejected runs on the next backend (``warnings.simplefilter("error",
    RegionFallbackWarning)`` makes that an error)."""


def is_backend_error(error: BaseException, backend: RegionBackend) -> bool:
    """Whether ``error`` is ``backend`` failing to compile or run a region (see the module docstring), not the
    program's error."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if backend == "nvfuser":
        return isinstance(error, RuntimeError) and _NVFUSER_MESSAGE.search(str(error)) is not None
    if backend == "inductor":
        return type(error).__module__.startswith(_INDUCTOR_MODULES) and \
            not is_program_error(error)
    return False


class FallbackRegion:
    """A region's lowering (``call``, by ``backend``) and what it falls back to on a backend error: the next
    backend's lowering of its symbols."""

    def __init__(self, name: str, backend: RegionBackend, call: Callable, bsyms: Sequence[BoundSymbol],
                 inputs: Sequence[Proxy], outputs: Sequence[Proxy]):
        self.name, self.backend, self.call = name, backend, call
        self.bsyms, self.inputs, self.outputs = tuple(bsyms), tuple(inputs), tuple(outputs)
        #: what the trace calls: the current lowering, or on a backend error the next
        self.callable = self._callable()

    def _callable(self) -> Callable:
        """A closure (about 0.15 us per call, a class's ``__call__`` twice that)."""

        def call(*args):
            try:
                return self.call(*args)
            except Exception as error:
                if not is_backend_error(error, self.backend):
                    raise
                return self._fall_back(error, args)

        return call

    def _fall_back(self, error: Exception, args: tuple):
        rejected = [(self.backend, error)]
        compiled = None
        for backend in NEXT_BACKENDS[self.backend]:
            compiled = compiled or make_compiled(list(self.bsyms), list(self.inputs), list(self.outputs))
            call = compiled if backend == "inductor" else _eager(compiled)
            try:
                result = call(*args)
            except Exception as next_error:
                if not is_backend_error(next_error, backend):
                    raise
                rejected.append((backend, next_error))
                continue
            warnings.warn(self._message(rejected, backend), RegionFallbackWarning, stacklevel=2)
            self.backend, self.call = backend, call
            return result
        raise error

    def _message(self, rejected: list[tuple[RegionBackend, Exception]], backend: RegionBackend) -> str:
        errors = "; ".join(f"{BACKEND_NAMES[b]} raised {_summary(e)}" for b, e in rejected)
        return (f"thunder_tp: fusion region {self.name} ({_ops(self.bsyms)}) was rejected: {errors}. It runs on "
                f"{BACKEND_NAMES[backend]} from now on (its results are {BACKEND_NAMES[backend]}'s).")


def _eager(compiled: Callable) -> Callable:
    """``compiled`` (torch.compile of the region's torch-executor trace) run without compiling: op by op."""

    def run(*args):
        with torch.compiler.set_stance("force_eager"):
            return compiled(*args)

    return run


def _summary(error: BaseException) -> str:
    """``Type: first line of the message``; for Dynamo's BackendCompilerFailed, what the backend raised inside."""
    inner = getattr(error, "inner_exception", None)
    if inner is not None:
        return f"{type(error).__name__} ({_summary(inner)})"
    text = str(error).strip()
    return f"{type(error).__name__}: {(text.splitlines()[0] if text else '')[:300]}"


def _ops(bsyms: Sequence[BoundSymbol]) -> str:
    """The region's ops, each named once in order, e.g. ``matmul, exp, sum (+3 more; 14 ops)``."""
    names = list(dict.fromkeys(b.sym.name for b in bsyms))
    more = f" (+{len(names) - _OPS_NAMED} more; {len(bsyms)} ops)" if len(names) > _OPS_NAMED else ""
    return ", ".join(names[:_OPS_NAMED]) + more


#: the FallbackRegion of every canonical region of this process (regions alike share it: one compilation)
SHARED_REGIONS = CompiledRegions()


def with_fallback(trace: TraceCtx, backends: Mapping[FusionExecutor, RegionBackend]) -> TraceCtx:
    """``trace`` with every region of ``backends`` (executor -> its kind) called through a ``FallbackRegion``, one
    per canonical region."""
    guarded = from_trace(trace)
    guarded.bound_symbols = [_guarded(b, backends[b.sym.executor]) if b.sym.is_fusion and b.sym.executor in backends
                             else b for b in trace.bound_symbols]
    guarded.set_provenance(TraceProvenance("thunder_tp: regions fall back to the next backend"))
    return guarded


def _guarded(region: BoundSymbol, backend: RegionBackend) -> BoundSymbol:
    """``region`` bound to a new fusion symbol of the same name and executor, whose callable falls back: the
    FallbackRegion of its canonical form (made from the first region of that form)."""
    name = region.sym.name
    inputs, outputs = list(region.args), list(region.output)
    key = backend, canonical_form(region.subsymbols, inputs, outputs)
    fallback = SHARED_REGIONS.get(key, lambda: FallbackRegion(name, backend, region._call_ctx[name],
                                                              region.subsymbols, inputs, outputs))
    return region.sym.executor.register_temporary_operation(name, fallback.callable, inputs=inputs,
                                                            outputs=outputs, bsyms=list(region.subsymbols))
