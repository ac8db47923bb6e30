"""A whole call as one compiled program: the computation Thunder built for it, with its fusion regions inlined as
plain torch code and its collectives as PyTorch's functional collectives, compiled at once by ``torch.compile``.

Thunder runs a decode step as a chain of fusion regions cut at every collective: each region is a torch.compile
call of its own (guards, a runtime wrapper, the kernels), and each collective is issued, named and waited for in
Python, so the host's work grows with every layer. In one program, dynamo and Inductor see the whole step: the host
runs one guarded call whose generated code launches the kernels and the collectives (Inductor's extern calls to
``torch.ops._c10d_functional``, which are what DTensor and a hand-written TP compiled with torch.compile issue). The
ops and collectives are the ones Thunder's trace holds, in its order; only their grouping into kernels changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import thunder.distributed.prims as dist_prims
import torch
from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.executors.torchex import ex as pytorch_ex
from thunder.extend import OperatorExecutor

from thunder_tp.collectives.symbols import tp_all_to_all_start, tp_name_work
from thunder_tp.thunder_internals.computation import calling, region_function
from thunder_tp.thunder_internals.distributed import FUNCTIONAL_COLLECTIVES as _functional

__all__ = ["compiled_whole", "whole_program"]

whole_step_executor = OperatorExecutor("thunder_tp_whole_step", version="0.1")

def _all_reduce(a: torch.Tensor, group_name: str) -> torch.Tensor:
    return _functional.wait_tensor(_functional.all_reduce(a, "sum", group_name))


def _all_gather(a: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    return _functional.wait_tensor(_functional.all_gather_into_tensor(a, size, group_name))


def _reduce_scatter(a: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    return _functional.wait_tensor(_functional.reduce_scatter_tensor(a, "sum", size, group_name))


def _all_to_all(a: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    splits = [a.shape[0] // size] * size
    return _functional.wait_tensor(_functional.all_to_all_single(a, splits, splits, group_name))


def _same_shape(a: TensorProxy, *_args) -> TensorProxy:
    return TensorProxy(like=a)


def _gathered(a: TensorProxy, size: int, group_name: str) -> TensorProxy:
    return TensorProxy(like=a, shape=(a.shape[0] * size, *a.shape[1:]))


def _scattered(a: TensorProxy, size: int, group_name: str) -> TensorProxy:
    return TensorProxy(like=a, shape=(a.shape[0] // size, *a.shape[1:]))


whole_all_reduce = whole_step_executor.register_operator("whole_step_all_reduce", meta=_same_shape, fn=_all_reduce)
whole_all_gather = whole_step_executor.register_operator("whole_step_all_gather", meta=_gathered, fn=_all_gather)
whole_reduce_scatter = whole_step_executor.register_operator(
    "whole_step_reduce_scatter", meta=_scattered, fn=_reduce_scatter)
whole_all_to_all = whole_step_executor.register_operator("whole_step_all_to_all", meta=_same_shape, fn=_all_to_all)

# torchex's async collectives (as thunder_tp's lowering issues them): the issued tensor is their first argument
_issued_by = {pytorch_ex.implmap[prim].symbol.id: kind for prim, kind in (
    (dist_prims.PrimIDs.ALL_REDUCE, "all_reduce"), (dist_prims.PrimIDs.ALL_GATHER, "all_gather"),
    (dist_prims.PrimIDs.REDUCE_SCATTER, "reduce_scatter"))}
_issued_by[tp_all_to_all_start.id] = "all_to_all"
_WAIT_ID = pytorch_ex.implmap[dist_prims.PrimIDs.WAIT].symbol.id


def whole_program(trace: TraceCtx) -> TraceCtx:
    """``trace`` (a final computation trace) with each fusion region calling its ops uncompiled and each issued
    collective, with its wait, as one functional collective where the wait was."""
    issued: dict[str, BoundSymbol] = {}
    bsyms = []
    for bsym in trace.bound_symbols:
        sym_id = bsym.sym.id
        if bsym.sym.is_fusion:
            bsyms.append(calling(bsym, region_function(bsym)))
        elif sym_id in _issued_by:
            issued[bsym.output.name] = bsym
        elif sym_id == tp_name_work.id:
            issued[bsym.output.name] = issued.pop(bsym.args[0].name)
        elif sym_id == _WAIT_ID:
            bsyms.append(_functional_collective(issued.pop(bsym.args[0].name), bsym.output))
        elif sym_id != prims.PrimIDs.DEL:  # names live until the program returns: dynamo frees what it no longer needs
            bsyms.append(bsym)
    if issued:
        raise AssertionError(f"thunder_tp: collectives {sorted(issued)} are never waited for; this is a thunder_tp bug")
    program = from_trace(trace)
    program.bound_symbols = bsyms
    program.set_provenance(TraceProvenance("thunder_tp: the whole step as one program"))
    return program


def _functional_collective(issue: BoundSymbol, output: TensorProxy) -> BoundSymbol:
    """The collective ``issue`` started, as the functional collective that returns ``output``."""
    kind = _issued_by[issue.sym.id]
    if kind in ("all_reduce", "reduce_scatter"):
        a, op, group = issue.args[:3]
        if op is not dist_prims.DistributedReduceOps.SUM:
            raise NotImplementedError(f"thunder_tp: the whole-step program sums; a {kind} with {op} is not supported")
    else:
        a, group = issue.args[:2]
    if kind == "all_reduce":
        return whole_all_reduce.bind(a, group.group_name, output=output)
    symbol = {"all_gather": whole_all_gather, "reduce_scatter": whole_reduce_scatter, "all_to_all": whole_all_to_all}
    return symbol[kind].bind(a, group.size(), group.group_name, output=output)


def compiled_whole(trace: TraceCtx) -> Callable[..., Any]:
    """The whole program of ``trace`` compiled by torch.compile (one graph: ``fullgraph=True``), run without autograd;
    it compiles on its first call. Inductor's checks of each input's sizes and strides are left out: dynamo's guards
    check the same before every call."""
    program = whole_program(trace).python_callable(include_decorators=False)
    return torch.no_grad()(torch.compile(program, fullgraph=True, options={"size_asserts": False}))
