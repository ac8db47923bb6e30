"""Fusion executor that lowers compute regions to kernels and keeps every collective outside them.

Compute is fused by nvFuser where tensors are on CUDA and nvFuser is installed, otherwise by Inductor
(``torch.compile``: Triton on CUDA, C++ on CPU). Communication — thunder_tp's collectives, Thunder's
``thunder.distributed.prims`` (DDP/FSDP) and torchex's implementations of them, waits included — is
never claimed, so every collective stays a top-level symbol and a fusion-region boundary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import torch
import thunder.distributed.prims as dist_prims
from thunder.core import prims, utils
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.core.transforms import TOPOSORT_ORDER, bsym_list_to_dag, toposort_bsym_dag
from thunder.executors.torch_compile import TorchCompileExecutor
from thunder.executors.torchex import ex as pytorch_ex
from thunder.executors import nvfuserex
from thunder.extend import Executor, FusionExecutor, ImplInfo, get_default_executors, register_executor

from thunder_tp.collectives import comm_executor
from thunder_tp.simulate import is_simulating

__all__ = ["FUSION_EXECUTOR_NAME", "TPFusionExecutor", "executors", "fusion_executor", "is_communication"]

Backend = Literal["inductor", "nvfuser"] | None

FUSION_EXECUTOR_NAME = "thunder_tp_fusion"

# Thunder's distributed prims, and the ids of torchex's implementations of them (torch_all_reduce_prim_impl, ...)
_DIST_PRIM_IDS: frozenset = frozenset(dist_prims.PrimIDs)
_TORCHEX_COMM_IDS: frozenset = frozenset(
    info.symbol.id for op, info in pytorch_ex.implmap.items() if op in _DIST_PRIM_IDS and info.symbol is not None
)
_COMM_IDS: frozenset = _DIST_PRIM_IDS | _TORCHEX_COMM_IDS
_WAIT_IDS: frozenset = frozenset({dist_prims.PrimIDs.WAIT, pytorch_ex.implmap[dist_prims.PrimIDs.WAIT].symbol.id})


def is_communication(bsym: BoundSymbol) -> bool:
    """True if ``bsym`` is a collective, a wait or a DDP/FSDP prim, or contains one among its subsymbols."""
    sym = bsym.sym
    if sym.executor is comm_executor or sym.name.startswith("tp_") or sym.id in _COMM_IDS:
        return True
    return any(is_communication(sub) for sub in bsym.subsymbols)


def _on_cuda(bsym: BoundSymbol) -> bool:
    proxies = (*bsym.flat_proxy_args, *bsym.flat_proxy_outs)
    return any(isinstance(p, TensorProxy) and p.device.type == "cuda" for p in proxies)


class InductorFusionExecutor(TorchCompileExecutor):
    """torch.compile (Inductor) fusions of torchex-executable compute; refuses communication."""

    def __init__(self, name: str, *, skip_cuda: bool = False):
        super().__init__(name)
        self.skip_cuda = skip_cuda
        self.implmap.update({op: ImplInfo() for op in pytorch_ex.implmap if op not in _COMM_IDS})

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        """True for compute Inductor can take; never for communication (or CUDA ops when ``skip_cuda``)."""
        if is_communication(bsym) or (self.skip_cuda and _on_cuda(bsym)):
            return False
        return super().can_fuse(bsym)


class TPFusionExecutor(FusionExecutor):
    """Claims compute and fuses it with nvFuser (CUDA tensors) and/or Inductor; collectives are region breaks."""

    def __init__(self, name: str = FUSION_EXECUTOR_NAME, *, backend: Backend = None):
        super().__init__(name, version="0.1")
        self.backend = backend
        nvfuser = _require_nvfuser() if backend == "nvfuser" else None
        if backend is None and torch.cuda.is_available():
            nvfuser = nvfuserex.nvfuserex
        self.nvfuser: FusionExecutor | None = nvfuser
        self.inductor: InductorFusionExecutor | None = None
        if backend != "nvfuser":
            self.inductor = InductorFusionExecutor(f"{name}_inductor", skip_cuda=nvfuser is not None)

    @property
    def backends(self) -> tuple[FusionExecutor, ...]:
        """The fusion executors that lower regions, in the order their passes run."""
        return tuple(ex for ex in (self.nvfuser, self.inductor) if ex is not None)

    def _claimant(self, bsym: BoundSymbol) -> FusionExecutor | None:
        if is_communication(bsym):
            return None
        if self.nvfuser is not None and _on_cuda(bsym) and self.nvfuser.can_fuse(bsym):
            return self.nvfuser
        if self.inductor is not None and self.inductor.can_fuse(bsym):
            return self.inductor
        return None

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        """True if a backend will fuse ``bsym``; never for communication."""
        return self._claimant(bsym) is not None

    def get_execution_transform(self, bsym: BoundSymbol) -> Callable | None:
        """The claiming backend's execution transform (nvFuser has some, e.g. for SDPA), if any."""
        claimant = self._claimant(bsym)
        return None if claimant is None else claimant.get_execution_transform(bsym)

    def fusion_pass(self, trace: TraceCtx) -> TraceCtx:
        """Schedules communication for overlap, then runs each backend's fusion pass (regions stop at collectives)."""
        trace = schedule_communication(trace)
        for ex in self.backends:
            trace = ex.fusion_pass(trace)
        _check_no_fused_communication(trace)
        return trace


def _is_wait(bsym: BoundSymbol) -> bool:
    return bsym.sym.id in _WAIT_IDS


def schedule_communication(trace: TraceCtx) -> TraceCtx:
    """Reorders ``trace`` so each async collective is issued as early as its inputs allow and each wait runs last.

    Compute that feeds a collective goes first, the collective reachable in fewest steps first (so DDP's
    all_reduce of the last layer's grads is issued before the earlier layers' grads are computed); other
    compute comes next and waits only when nothing else is ready. Forward stays before backward, and backward
    compute that reads no grad (recomputations) runs just before its first use.
    Backends fuse consecutive compute only, so this order is also where regions break.
    """
    bsyms = trace.bound_symbols
    if not any(map(_is_wait, bsyms)):
        return trace
    keys = _schedule_keys(bsyms)
    key_of = {id(bsym): key for bsym, key in zip(bsyms, keys)}

    def select(eligible: list) -> int:
        return min(range(len(eligible)), key=lambda k: key_of[id(eligible[k].bsym)])

    scheduled = from_trace(trace)
    ordered = toposort_bsym_dag(bsym_list_to_dag(bsyms)[0], TOPOSORT_ORDER.TOP_DOWN, selector=select)
    scheduled.bound_symbols = _sink_saved_value_compute(ordered)
    scheduled.set_provenance(TraceProvenance("thunder_tp: schedule communication"))
    return scheduled


def _schedule_keys(bsyms: list[BoundSymbol]) -> list[tuple]:
    """Priority of each bound symbol (smallest first) among those whose inputs are ready."""
    producers, consumers = utils.producers(bsyms, _map_to_numbers=True), utils.consumers(bsyms, _map_to_numbers=True)
    issues = [is_communication(bsym) and not _is_wait(bsym) for bsym in bsyms]
    depth = [0] * len(bsyms)  # longest chain of producers
    for i, bsym in enumerate(bsyms):
        parents = [producers[p] for p in bsym.flat_proxy_args if producers.get(p, i) < i]
        depth[i] = 1 + max((depth[j] for j in parents), default=0)
    due = [math.inf] * len(bsyms)  # depth of the nearest collective this feeds
    for i in reversed(range(len(bsyms))):
        children = [j for out in bsyms[i].flat_proxy_outs for j in consumers.get(out, ()) if j > i]
        due[i] = min([depth[i] if issues[i] else math.inf, *(due[j] for j in children)])
    keys = []
    for i, bsym in enumerate(bsyms):
        if _is_return(bsym):
            keys.append((1,))
            continue
        kind = 0 if issues[i] else 2 if _is_wait(bsym) else 1
        keys.append((0, BoundSymbolTag.BACKWARD in bsym.tags, kind, due[i], i))
    return keys


def _is_return(bsym: BoundSymbol) -> bool:
    return bsym.sym.id in (prims.PrimIDs.RETURN, prims.python_return.id)


def _sink_saved_value_compute(bsyms: list[BoundSymbol]) -> list[BoundSymbol]:
    """Backward compute that reads no grad (Thunder's recomputations, reshapes of saved values) moves down to just
    before its first use: it then fuses with that use and its value lives only from there. (Reading saved values
    only, it is ready at once, and the priorities above would run all of it at the start of the backward.)"""
    movable = _reading_no_grad(bsyms)
    held: dict[str, BoundSymbol] = {}
    order: list[BoundSymbol] = []

    def release(bsym: BoundSymbol) -> None:
        for name in [a.name for a in bsym.flat_proxy_args]:
            producer = held.get(name)
            if producer is not None:
                for out in producer.flat_proxy_outs:
                    held.pop(out.name, None)
                release(producer)
                order.append(producer)

    for bsym in bsyms:
        if id(bsym) in movable:
            held.update((out.name, bsym) for out in bsym.flat_proxy_outs)
            continue
        if _is_return(bsym):  # unused ones stay, in their order
            order.extend({id(b): b for b in held.values()}.values())
            held.clear()
        release(bsym)
        order.append(bsym)
    return order


def _reading_no_grad(bsyms: list[BoundSymbol]) -> set[int]:
    """ids of the backward's compute symbols that no grad flows into."""
    from_grads: set[str] = set()
    movable = set()
    for bsym in bsyms:
        if bsym.sym.id == prims.get_grad.id or any(a.name in from_grads for a in bsym.flat_proxy_args):
            from_grads.update(out.name for out in bsym.flat_proxy_outs)
        elif BoundSymbolTag.BACKWARD in bsym.tags and not is_communication(bsym) and bsym.flat_proxy_outs:
            movable.add(id(bsym))
    return movable


def _check_no_fused_communication(trace: TraceCtx) -> None:
    for bsym in trace.bound_symbols:
        if bsym.sym.is_fusion and is_communication(bsym):
            raise AssertionError(f"{bsym.sym.name} swallowed a communication symbol; this is a thunder_tp bug")


def _require_nvfuser() -> FusionExecutor:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "thunder_tp: backend='nvfuser' needs CUDA, but torch.cuda.is_available() is False. "
            "Run on a CUDA machine, or use backend='inductor' (or None to choose automatically)."
        )
    if nvfuserex.nvfuserex is None:
        raise RuntimeError(
            "thunder_tp: backend='nvfuser' needs nvFuser, which is not installed or too old for Thunder "
            "(see thunder.executors.nvfuserex.required_nvfuser_version()). Install the nvfuser wheel matching "
            "your CUDA and torch (e.g. `pip install nvfuser-cu128-torch210`), or use backend='inductor'."
        )
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
    # Thunder's defaults are read once; other fusion executors (nvFuser, torchcompile_*) would compete with ours
    defaults = tuple(ex for ex in get_default_executors() if not isinstance(ex, FusionExecutor))
    return (comm_executor, fusion_executor(backend), *defaults)


def executors(backend: Backend = None) -> list[Executor]:
    """The ``executors=`` for ``thunder.jit``: thunder_tp's collectives, its fusion executor, Thunder's defaults.

    Inside ``thunder_tp.simulate`` (LocalTensor, which no fusion backend can compile): without the fusion executor.
    """
    if is_simulating():
        return [ex for ex in _executors(backend) if not isinstance(ex, FusionExecutor)]
    return list(_executors(backend))


fusion_executor()  # registers "thunder_tp_fusion" with Thunder at import
