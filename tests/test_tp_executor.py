"""thunder_tp's executors under TP: fusions exist, hold no communication, and collectives overlap compute."""

from types import SimpleNamespace

import pytest
import thunder
import torch
from thunder.core import prims
from thunder.core.proxies import TensorProxy

import thunder_tp
from tests.dist import run_ranks
from tests.parallel_mlp import MLP, PLAN, mlp_input
from thunder_tp.execution.executor import is_communication

_COLLECTIVE = "torch_all_reduce_prim_impl"  # how thunder_tp's all_reduce is lowered (any backend)
_NAME_WORK = "tp_name_work"  # wraps its work handle so that a failed wait names the collective
_WAIT = "torch_wait_prim_impl"


def _summary(trace) -> dict:
    bsyms = trace.bound_symbols
    fusions = [b for b in bsyms if b.sym.is_fusion]
    names = [b.sym.name for b in bsyms]
    gaps = []
    for i, b in enumerate(bsyms):
        if b.sym.name == _COLLECTIVE:
            future = next(c.output.name for c in bsyms[i + 1 :]
                          if c.sym.name == _NAME_WORK and c.args[0].name == b.output.name)
            wait = next(j for j in range(i + 1, len(bsyms))
                        if bsyms[j].sym.name == _WAIT and bsyms[j].args[0].name == future)
            gaps.append(sum(1 for c in bsyms[i + 1 : wait] if not is_communication(c) and c.sym.name != "del"))
    return {
        "fusions": len(fusions),
        "fused_communication": [b.sym.name for f in fusions for b in f.subsymbols if is_communication(b)],
        "top_level_collectives": names.count(_COLLECTIVE),
        "compute_between_collective_and_wait": gaps,
    }


def _tp_mlp_traces():
    torch.manual_seed(0)
    jm = thunder.jit(MLP(), transforms=[thunder_tp.TensorParallel(PLAN)], executors=thunder_tp.executors())
    (x,) = mlp_input()
    jm(x).sum().backward()
    return _summary(thunder.last_traces(jm)[-1]), _summary(thunder.last_backward_traces(jm)[-1])


def test_tp_fusions_hold_no_communication_and_backward_overlaps():
    forward, backward = run_ranks(_tp_mlp_traces, 2)[0]
    for trace in (forward, backward):
        assert trace["fusions"] >= 1, trace
        assert trace["fused_communication"] == [], trace
        assert trace["top_level_collectives"] == 1, trace
    # the input-grad all_reduce is issued before the fc1 weight/bias grads are computed, and waited for after
    assert backward["compute_between_collective_and_wait"][0] >= 1, backward


class _MatmulOperands(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, for every aten mm/addmm/bmm, whether each operand is dense (contiguous, or the transpose of a
    contiguous tensor: what BLAS takes as is) — a strided view of a larger buffer is not."""

    MATMULS = ("mm", "addmm", "bmm")

    def __init__(self):
        super().__init__()
        self.dense: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.MATMULS:
            operands = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            self.dense.append(all(a.is_contiguous() or a.mT.is_contiguous() for a in operands))
        return func(*args, **(kwargs or {}))


def _gathered_linear_matmuls():
    torch.manual_seed(0)
    plan = {"0": thunder_tp.ColwiseParallel(output_layout=thunder_tp.Replicate())}
    jm = thunder.jit(torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False)),
                     transforms=[thunder_tp.TensorParallel(plan)],
                     executors=thunder_tp.executors())
    x = torch.randn(4, 32, 64, requires_grad=True)
    loss = jm(x).square().sum()
    with _MatmulOperands() as operands:
        loss.backward()
    return operands.dense


def test_grad_of_a_gathered_output_reaches_its_matmuls_dense():
    # the rank keeps its columns of the gathered output's grad: as a dense piece, not a strided view of the whole
    # (on the benchmark Llama's lm_head that view made the weight-grad matmul up to 2x slower and kept 32 MB alive)
    dense = run_ranks(_gathered_linear_matmuls, 2)[0]
    assert len(dense) == 2 and all(dense), dense


def _all_reduces_in_place(model_cls, make_input, plan):
    """Whether each all_reduce of the final forward and backward traces runs in place (skip_clone), vs one device."""
    from tests.tp_checks import compare_with_single_device

    def in_place(jm):
        traces = (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
        return [[b.args[4] for b in t.bound_symbols if b.sym.name == _COLLECTIVE] for t in traces]

    info = compare_with_single_device(model_cls, make_input, thunder_tp.TensorParallel(plan),
                                      executors=thunder_tp.executors(), inspect=in_place)
    return info["inspected"]


def test_all_reduce_of_a_value_nothing_else_reads_runs_in_place():
    # fc2's output (forward) and the input grad (backward) are fresh fusion outputs that only the all_reduce reads:
    # no copy of them is made before reducing
    forward, backward = run_ranks(_all_reduces_in_place, 2, MLP, mlp_input, PLAN)[0]
    assert forward == [True] and backward == [True], (forward, backward)


def _in_place_with_another_reader():
    """reduce_in_place on the TP MLP's final forward trace (its all_reduce reset to copying), as it is and with one
    more reader of the reduced value inserted after the all_reduce."""
    from thunder.core import prims
    from thunder.core.trace import from_trace, tracectx

    from thunder_tp.collectives.lowering import reduce_in_place

    torch.manual_seed(0)
    jm = thunder.jit(MLP(), transforms=[thunder_tp.TensorParallel(PLAN)], executors=thunder_tp.executors())
    jm(*mlp_input())
    trace = thunder.last_traces(jm)[-1]
    i = next(i for i, b in enumerate(trace.bound_symbols) if b.sym.name == _COLLECTIVE)
    reduce = trace.bound_symbols[i]
    copying = from_trace(trace)
    copying.bound_symbols = [*trace.bound_symbols[:i], reduce.from_bsym(args=(*reduce.args[:4], False)),
                             *trace.bound_symbols[i + 1 :]]
    read_again = from_trace(copying)
    with tracectx(read_again):
        reader = prims.neg.bind(reduce.args[0], output=thunder.core.proxies.TensorProxy(like=reduce.args[0]))
    read_again.bound_symbols = [*copying.bound_symbols[: i + 1], reader, *copying.bound_symbols[i + 1 :]]
    return [[b.args[4] for b in reduce_in_place(t).bound_symbols if b.sym.name == _COLLECTIVE]
            for t in (copying, read_again)]


def test_all_reduce_of_a_value_read_elsewhere_copies_it():
    # in place, a reader of the all_reduce's input that runs after it is issued would see the sum, not its summand
    alone, read_again = run_ranks(_in_place_with_another_reader, 2)[0]
    assert alone == [True] and read_again == [False], (alone, read_again)


def _region(build):
    """A stand-in fusion region: the bound symbols ``build(x)`` records on a (4, 8) input, and its outputs."""
    from thunder.core.trace import TraceCtx, tracectx

    trace = TraceCtx()
    with tracectx(trace):
        x = TensorProxy(shape=(4, 8), device=thunder.devices.cpu, dtype=thunder.dtypes.float32, requires_grad=False)
        outputs = build(x)
    return SimpleNamespace(subsymbols=trace.bound_symbols, flat_proxy_outs=list(outputs)), outputs


@pytest.mark.parametrize("build, fresh", [
    (lambda x: (prims.neg(x),), [True]),  # computed
    (lambda x: (prims.reshape(prims.neg(x), (32,)),), [True]),  # a view of what the region computed
    (lambda x: (prims.reshape(x, (32,)),), [False]),  # a view of the region's input
    (lambda x: (lambda y: (y, prims.reshape(y, (32,))))(prims.neg(x)), [False, False]),  # two outputs, one memory
    (lambda x: (prims.copy_(prims.neg(x), x, grad_enabled=False),), [False]),  # written into the input
], ids=["computed", "view-of-computed", "view-of-input", "shared-by-outputs", "copied-into-input"])
def test_which_region_outputs_an_all_reduce_may_overwrite(build, fresh):
    from thunder_tp.collectives.lowering import _computed_fresh

    region, outputs = _region(build)
    assert [_computed_fresh(region, out) for out in outputs] == fresh
