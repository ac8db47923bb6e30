"""Fusion executor that lowers compute regions to kernels and keeps every collective outside them.

Compute is fused by nvFuser where tensors are on CUDA and nvFuser is installed and able to run, otherwise by
Inductor (``torch.compile``: Triton on CUDA, C++ on CPU). An nvFuser that Thunder registers but cannot run (0.2.36
under Thunder 0.2.6) is an error when asked for, and left to Inductor with a warning when chosen automatically.
Where nvFuser fuses, the cross-entropy's symbols (``ops/cross_entropy.py``) are still lowered by Inductor, in a pass
before nvFuser's, as Thunder's own ``torchcompile_xentropy`` does for its cross-entropy: nvFuser 0.2.35's segmenter
asserts (``revertPrivatizedOps``) on the fusion of a vocabulary-parallel loss in bf16. A region that a backend
rejects anyway is lowered again by the next one (``execution/fallback.py``).
Communication — thunder_tp's collectives, Thunder's ``thunder.distributed.prims`` (DDP/FSDP) and torchex's
implementations of them, waits included — is never claimed, so every collective stays a top-level symbol and a
fusion-region boundary.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Literal

import torch
from thunder.core.compile_data import get_compile_option
from thunder.core.proxies import Proxy, TensorProxy, unvariableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx
from thunder.executors import nvfuserex
from thunder.executors.torch_compile import TorchCompileExecutor, make_compiled, torch_compile_xentropy_ex
from thunder.executors.torchex import ex as pytorch_ex
from thunder.executors.utils import Region
from thunder.extend import Executor, FusionExecutor, ImplInfo, get_default_executors, register_executor

from thunder_tp.collectives import COMM_IDS, comm_executor, is_communication
from thunder_tp.collectives.lowering import reduce_in_place
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.execution.complex_grads import complex_grads_executor, touches_complex
from thunder_tp.execution.cpu_attention import cpu_attention_executor
from thunder_tp.execution.cuda_attention import cuda_attention_executor
from thunder_tp.execution.fallback import RegionBackend, with_fallback
from thunder_tp.execution.schedule import schedule
from thunder_tp.families import load_families
from thunder_tp.ops.cross_entropy import CROSS_ENTROPY_SYMBOLS
from thunder_tp.thunder_internals import patches
from thunder_tp.thunder_internals.private import torch_function_symbols
from thunder_tp.tracing import repeated_blocks  # noqa: F401  (blocks traced once, in jits with these executors)
from thunder_tp.tracing.region_cache import CompiledRegions, canonical_form

__all__ = ["FUSION_EXECUTOR_NAME", "TPFusionExecutor", "executors", "fusion_executor", "is_communication",
           "thunder_default_executors"]

Backend = Literal["inductor", "nvfuser"] | None

FUSION_EXECUTOR_NAME = "thunder_tp_fusion"
#: the nvFuser wheel of the ``nvfuser`` extra (pyproject.toml); 0.2.36 lacks the ``nvfuser`` module Thunder 0.2.6 needs
NVFUSER_WHEEL = "nvfuser-cu128-torch210==0.2.35.dev20260215"


def _on_cuda(bsym: BoundSymbol) -> bool:
    proxies = (*bsym.flat_proxy_args, *bsym.flat_proxy_outs)
    return any(isinstance(p, TensorProxy) and p.device.type == "cuda" for p in proxies)


def _regionable(bsym: BoundSymbol) -> bool:
    """Whether a torch.compile region may hold ``bsym``: it computes a tensor (shape queries and number arithmetic
    of symbolic values are no kernel's work), and neither it nor a subsymbol outputs a plain number, as shape
    queries do for dims that symbolic values leave constant (Thunder's region would fail on it:
    ``AttributeError: 'int' object has no attribute 'name'``); no complex tensor (Inductor's fake tensors reject
    ``view_as_complex`` of a region's views: they run unfused)."""
    return any(isinstance(o, TensorProxy) for o in bsym.flat_outs) and _outputs_proxies(bsym) and \
        bsym.sym.id not in _automatic_backwards() and not touches_complex(bsym)


@functools.cache
def _automatic_backwards() -> frozenset:
    """The backward ops of the torch functions Thunder registers automatically (no symbol of its own, e.g.
    `Tensor.index_copy_` in litgpt's LoRA): they call torch.autograd.functional.vjp, which dynamo cannot trace."""
    from thunder.core.prims import OpTags
    from thunder.core.transforms import backward_impls

    automatic = (s for s in torch_function_symbols()
                 if OpTags.AUTO_REGISTERED in (getattr(s, "tags", None) or ()))
    return frozenset(backward_impls[s.id].id for s in automatic if s.id in backward_impls)


def _outputs_proxies(bsym: BoundSymbol) -> bool:
    """Whether every output of ``bsym`` and of its subsymbols is a proxy (or None)."""
    outputs = all(o is None or isinstance(o, Proxy) for o in bsym.flat_outs)
    return outputs and all(map(_outputs_proxies, bsym.subsymbols))


#: the torch.compile callable of every canonical Inductor region made in this process
COMPILED_REGIONS = CompiledRegions()

#: the ids of the symbols that Inductor lowers even where nvFuser fuses (kept whole until then: torchex runs their
#: decompositions inside the region)
INDUCTOR_ONLY = frozenset(sym.id for sym in CROSS_ENTROPY_SYMBOLS)


class InductorFusionExecutor(TorchCompileExecutor):
    """torch.compile (Inductor) fusions of torchex-executable compute and of ``INDUCTOR_ONLY``'s symbols; refuses
    communication. ``skip_cuda``: no CUDA ops (nvFuser's) but those symbols; ``only``: nothing but those symbols.
    Its regions are named ``{region_name}{n}``: a trace's regions need distinct names (each is its callable's key)."""

    def __init__(self, name: str, *, skip_cuda: bool = False, only: bool = False,
                 region_name: str = "TorchCompile"):
        super().__init__(name)
        self.skip_cuda = skip_cuda
        self.only = only
        self.region_name = region_name
        # torchex's checkers come along: a region is lowered by torchex alone before torch.compile, so what torchex
        # refuses (e.g. number-only prims such as the shape arithmetic of symbolic values) is left to pythonex
        self.implmap.update(
            {op: ImplInfo(checker=info.checker) for op, info in pytorch_ex.implmap.items() if op not in COMM_IDS}
        )
        self.implmap.update({op: ImplInfo() for op in INDUCTOR_ONLY})

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        """True for tensor compute Inductor can take; never for communication (or CUDA ops when ``skip_cuda``), nor
        for shape queries and number arithmetic (symbolic values), which no kernel computes."""
        if bsym.sym.id in INDUCTOR_ONLY:
            return True
        if self.only or is_communication(bsym) or not _regionable(bsym) or (self.skip_cuda and _on_cuda(bsym)):
            return False
        return super().can_fuse(bsym)

    def fuse(self, region: Region, fusion_counter: int) -> BoundSymbol:
        """Thunder's torch.compile region, named ``{region_name}{fusion_counter}``; its callable made once per
        canonical region (``tracing/region_cache.py``: the same region of every block is compiled once)."""
        inputs = [unvariableify(x) for x in region.inputs]
        outputs = [unvariableify(x) for x in region.outputs]
        fullgraph = get_compile_option("torch_compile_fullgraph", "Whether to enable `fullgraph` from `torch.compile`.")
        key = self.mode, fullgraph, canonical_form(region.bound_symbols, inputs, outputs)
        compiled = COMPILED_REGIONS.get(key, lambda: make_compiled(region.bound_symbols, inputs, outputs,
                                                                   mode=self.mode))
        return self.register_temporary_operation(f"{self.region_name}{fusion_counter}", compiled, inputs=inputs,
                                                 outputs=outputs, bsyms=list(region.bound_symbols))


class TPFusionExecutor(FusionExecutor):
    """Claims compute and fuses it with nvFuser (CUDA tensors) and/or Inductor; collectives are region breaks."""

    def __init__(self, name: str = FUSION_EXECUTOR_NAME, *, backend: Backend = None):
        super().__init__(name, version="0.1")
        self.backend = backend
        if backend == "nvfuser":
            nvfuser = _require_nvfuser()
        else:
            nvfuser = _automatic_nvfuser() if backend is None else None
        self.nvfuser: FusionExecutor | None = nvfuser
        #: beside nvFuser, the Inductor pass that takes INDUCTOR_ONLY's symbols before nvFuser's pass could
        self.inductor_only: InductorFusionExecutor | None = None
        if nvfuser is not None:
            self.inductor_only = InductorFusionExecutor(f"{name}_inductor_only", only=True, region_name="InductorOnly")
        self.inductor: InductorFusionExecutor | None = None
        if backend != "nvfuser":  # beside nvFuser, for what is not on CUDA (named apart from torchcompile_xentropy's)
            self.inductor = InductorFusionExecutor(f"{name}_inductor", skip_cuda=nvfuser is not None,
                                                   region_name="TorchCompile" if nvfuser is None else "InductorCPU")

    @property
    def backends(self) -> tuple[FusionExecutor, ...]:
        """The fusion executors that lower regions, in the order their passes run."""
        return tuple(self.backend_kinds)

    @property
    def backend_kinds(self) -> dict[FusionExecutor, RegionBackend]:
        """Each fusion executor that lowers regions, in the order their passes run, and which backend it is."""
        kinds = ((self.inductor_only, "inductor"), (self.nvfuser, "nvfuser"), (self.inductor, "inductor"))
        return {ex: kind for ex, kind in kinds if ex is not None}

    def _claimant(self, bsym: BoundSymbol) -> FusionExecutor | None:
        if is_communication(bsym):
            return None
        return next((ex for ex in self.backends if ex.can_fuse(bsym) and (ex is not self.nvfuser or _on_cuda(bsym))),
                    None)

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        """True if a backend will fuse ``bsym``; never for communication."""
        return self._claimant(bsym) is not None

    def get_execution_transform(self, bsym: BoundSymbol) -> Callable | None:
        """The claiming backend's execution transform (nvFuser has some, e.g. for SDPA), if any."""
        claimant = self._claimant(bsym)
        return None if claimant is None else claimant.get_execution_transform(bsym)

    def fusion_pass(self, trace: TraceCtx) -> TraceCtx:
        """Schedules the trace (``thunder_tp.execution.schedule``), runs each backend's fusion pass (regions stop at
        collectives), lets all_reduces of values nothing else reads run in place, and gives every region the next
        backend to fall back on (``thunder_tp.execution.fallback``)."""
        trace = schedule(trace)
        for ex in self.backends:
            trace = ex.fusion_pass(trace)
        _check_no_fused_communication(trace)
        return with_fallback(reduce_in_place(trace), self.backend_kinds)


def _check_no_fused_communication(trace: TraceCtx) -> None:
    for bsym in trace.bound_symbols:
        if bsym.sym.is_fusion and is_communication(bsym):
            raise AssertionError(f"{bsym.sym.name} swallowed a communication symbol; this is a thunder_tp bug")


def _nvfuser_missing() -> str | None:
    """What keeps Thunder's nvFuser executor from running fusions here, with how to get it; None if nothing."""
    if not torch.cuda.is_available():
        return "CUDA, but torch.cuda.is_available() is False. Run on a CUDA machine"
    if nvfuserex.nvfuserex is None:
        return ("nvFuser, which is not installed or too old for Thunder (see thunder.executors.nvfuserex."
                "required_nvfuser_version()). Install it with `pip install thunder_tp[nvfuser]` "
                f"({NVFUSER_WHEEL}; with CUDA 13, nvfuser-cu130-torch210 of the same version)")
    try:
        from thunder.executors.nvfuserex_impl import compute_contiguity

        compute_contiguity((2, 3), (3, 1))  # what Thunder's nvFuser executor runs before every fusion call
    except ImportError as e:
        return (f"the `nvfuser` module that Thunder's nvFuser executor imports before every fusion call ({e}); "
                f"nvFuser 0.2.36 ships only `nvfuser_direct`. Install {NVFUSER_WHEEL} (with CUDA 13, "
                "nvfuser-cu130-torch210 of the same version)")
    return None


def _require_nvfuser() -> FusionExecutor:
    missing = _nvfuser_missing()
    if missing is not None:
        raise RuntimeError(f"thunder_tp: backend='nvfuser' needs {missing}, or use backend='inductor' "
                           "(or None to choose automatically).")
    return nvfuserex.nvfuserex


def _automatic_nvfuser() -> FusionExecutor | None:
    """nvFuser where it is installed and runs on this CUDA machine; a warning where it is installed but cannot."""
    if not torch.cuda.is_available() or nvfuserex.nvfuserex is None:
        return None
    missing = _nvfuser_missing()
    if missing is not None:
        warnings.warn(f"thunder_tp: nvFuser is installed but cannot run, for want of {missing}. "
                      "Fusing with Inductor instead.", stacklevel=2)
        return None
    return nvfuserex.nvfuserex


_fusion_executors: dict[Backend, TPFusionExecutor] = {}


def fusion_executor(backend: Backend = None) -> TPFusionExecutor:
    """The fusion executor for ``backend`` (one instance per backend); the automatic one is registered by name."""
    if backend not in _fusion_executors:
        if backend not in (None, "inductor", "nvfuser"):
            raise ValueError(f"thunder_tp: unknown backend {backend!r}; expected 'inductor', 'nvfuser' or None")
        name = FUSION_EXECUTOR_NAME if backend is None else f"{FUSION_EXECUTOR_NAME}_{backend}"
        _fusion_executors[backend] = register_executor(TPFusionExecutor(name, backend=backend))
    return _fusion_executors[backend]


@functools.cache
def _executors(backend: Backend) -> tuple[Executor, ...]:
    return executors_around(fusion_executor(backend))  # Thunder's defaults are read once


def executors_around(fusion: TPFusionExecutor) -> tuple[Executor, ...]:
    """``executors()``'s list with ``fusion`` as its fusion executor."""
    # Other fusion executors of Thunder's defaults (nvFuser, torchcompile_*) would compete with ours, but for
    # Thunder's cross-entropy one beside nvFuser (see _kept_default).
    # The complex-grads executor first: it claims only ops on complex tensors, and Thunder's autograd takes the grad
    # rule of the first executor that can run an op (thunder_tp.execution.complex_grads).
    # Attention executors (ours for CPU; for CUDA, ours for a mask shared by the batch, which Thunder's sdpa
    # executor claims and then fails on, then Thunder's sdpa, cudnn) come before the fusion executor, as in
    # Thunder's defaults: its autograd takes the grad rule of the first executor that can run an op, and Inductor
    # can run SDPA (as its decomposition, which saves the probabilities for the backward).
    defaults = tuple(ex for ex in get_default_executors() if _kept_default(ex, fusion))
    return (complex_grads_executor, comm_executor, cpu_attention_executor, cuda_attention_executor, *defaults, fusion)


def _kept_default(ex: Executor, fusion: TPFusionExecutor) -> bool:
    """Whether one of Thunder's default executors stays in front of thunder_tp's fusion executor: every operator
    executor, and, where nvFuser fuses, Thunder's ``torchcompile_xentropy``, which as in Thunder's defaults gives
    the cross-entropy of CUDA tensors to Inductor before nvFuser sees it (without it the step's peak memory rose by
    about one logits-sized buffer above Thunder's defaults: docs/gpu.md, "Earlier GPU runs", has the figures). It
    claims only the cross-entropy and its helper ops, never communication."""
    if not isinstance(ex, FusionExecutor):
        return True
    return fusion.nvfuser is not None and ex is torch_compile_xentropy_ex


def executors(backend: Backend = None) -> list[Executor]:
    """The ``executors=`` for ``thunder.jit``: complex arithmetic's grads (thunder_tp.execution.complex_grads),
    thunder_tp's collectives, attention executors (CPU: thunder_tp's; CUDA: thunder_tp's for a mask shared by the
    batch, otherwise Thunder's), thunder_tp's fusion executor; Thunder appends its torch and python executors.

    Inside ``thunder_tp.simulate`` (LocalTensor, which no fusion backend can compile): without the fusion executor.
    The model families register themselves first (lookasides for code Thunder cannot trace), and Thunder's
    speed-ups are installed for the compiles of jits given these executors (``thunder_internals.patches``).
    """
    _prepare_compiles()
    if ranks_of().one_trace_for_all:
        return [ex for ex in _executors(backend) if not isinstance(ex, FusionExecutor)]
    return list(_executors(backend))


def thunder_default_executors() -> list[Executor]:
    """thunder_tp's collectives executor before Thunder's default executors (Thunder's fusion, none of thunder_tp's),
    prepared as ``executors()`` prepares its jits' compiles."""
    _prepare_compiles()
    return [comm_executor, *get_default_executors()]


def _prepare_compiles() -> None:
    """The model families registered, Thunder's speed-ups installed for thunder_tp's compiles."""
    load_families()
    patches.install()


fusion_executor()  # registers "thunder_tp_fusion" with Thunder at import
