"""Which backend lowers which region, and what happens when a backend rejects one.

- Where nvFuser fuses, the cross-entropy's symbols (the loss-parallel head's log-sum-exp, target logit, their upcast
  and the loss from the gathered stats) go to Inductor, never to nvFuser: nvFuser is replaced by a stand-in that
  records the regions it is handed and runs them with torch, so thunder_tp's nvFuser branch runs on CPU tensors.
- A region that its backend fails to compile falls back to the next backend (nvFuser -> Inductor -> torch), once,
  with one warning, and the step's loss and grads are those of the run without the failure.
"""

from __future__ import annotations

import contextlib
import warnings
from unittest import mock

import pytest
import thunder
import torch
import torch.nn as nn

import thunder_tp
from tests.dist import assert_close, run_ranks
from tests.test_loss_parallel import Head, _inputs
from tests.tp_checks import compare_with_single_device
from thunder_tp.execution.executor import INDUCTOR_ONLY, InductorFusionExecutor, TPFusionExecutor, executors_around
from thunder_tp.execution.fallback import FallbackRegion, RegionFallbackWarning, is_backend_error

#: the ops of the cross-entropy's decompositions that must reach no nvFuser region
LOSS_OPS = {"exp", "log", "amax", "stack"}
#: how nvFuser 0.2.35 rejected the loss-parallel head on an H200 (docs/gpu.md)
NVFUSER_ASSERT = ("INTERNAL ASSERT FAILED at /workspace/Fuser/csrc/fusion_segmenter.cpp:4716, please report a bug "
                  "with repro script to NVFuser at https://github.com/NVIDIA/Fuser/issues. revertPrivatizedOps")


# --- stand-ins (module level: the gloo workers import them) ---------------------------------------------------


def _ops(bsym) -> list[str]:
    """The names of ``bsym`` and of everything it decomposes into."""
    return [bsym.sym.name, *(name for sub in bsym.subsymbols for name in _ops(sub))]


class StandInNvFuser(InductorFusionExecutor):
    """In nvFuser's place: claims what Inductor would (the cross-entropy's symbols too, if still offered), records
    each region it is handed (name -> ops), runs it with torch; ``reject``: the op whose regions raise the assert
    nvFuser 0.2.35 raised."""

    def __init__(self, reject: str | None = None):
        super().__init__("stand_in_nvfuser", region_name="nvFusion")
        self.reject = reject
        self.regions: dict[str, list[str]] = {}

    def fuse(self, region, fusion_counter: int):
        fusion = super().fuse(region, fusion_counter)
        ops = [op for bsym in region.bound_symbols for op in _ops(bsym)]
        self.regions[fusion.sym.name] = ops
        run = _run_with_torch(fusion._call_ctx[fusion.sym.name], rejected=self.reject in ops)
        return self.register_temporary_operation(fusion.sym.name, run, inputs=list(fusion.args),
                                                 outputs=list(fusion.output), bsyms=list(fusion.subsymbols))


def _run_with_torch(compiled, rejected: bool):
    def run(*args):
        if rejected:
            raise RuntimeError(NVFUSER_ASSERT)
        with torch.compiler.set_stance("force_eager"):
            return compiled(*args)

    return run


@contextlib.contextmanager
def stand_in_nvfuser(reject: str | None = None):
    """thunder_tp's executors with ``StandInNvFuser`` as nvFuser, every op taken for a CUDA one; yields (executors,
    the stand-in)."""
    stand_in = StandInNvFuser(reject)
    with mock.patch("thunder_tp.execution.executor._require_nvfuser", return_value=stand_in), \
            mock.patch("thunder_tp.execution.executor._on_cuda", return_value=True):
        yield list(executors_around(TPFusionExecutor("thunder_tp_fusion_stand_in", backend="nvfuser"))), stand_in


def _regions(trace) -> list[tuple[str, str, list[str]]]:
    """(executor, name, ops) of each fusion region of a final trace."""
    return [(b.sym.executor.name, b.sym.name, _ops(b)) for b in trace.bound_symbols if b.sym.is_fusion]


# --- where the loss-parallel head's pieces go --------------------------------------------------------------------


def _head_with_stand_in() -> dict:
    with stand_in_nvfuser() as (executors, stand_in), _compile_failing_on(None, []):
        info = compare_with_single_device(
            lambda: Head("mean"), _inputs, thunder_tp.TensorParallel({"proj": thunder_tp.ColwiseParallel()}),
            executors=executors, rtol=1e-7, atol=1e-7,
            inspect=lambda jm: [_regions(thunder.last_traces(jm)[-1]), _regions(thunder.last_backward_traces(jm)[-1])])
    return {"collectives": (info["forward"], info["backward"]), "regions": info["inspected"],
            "stand_in": stand_in.regions}


def test_loss_parallel_head_keeps_the_loss_off_nvfuser():
    """Loss and grads as on one device; nvFuser (the stand-in) is handed regions, none holding the loss's pieces;
    Inductor lowers the cross-entropy's symbols, forward (stats, loss) and backward, in regions named apart; one
    all_gather of the stats forward, one all_reduce of the input's grad backward: the minimum."""
    for rank, r in enumerate(run_ranks(_head_with_stand_in, 2)):
        assert r["collectives"] == ({"all_gather": 1}, {"all_reduce": 1}), (rank, r["collectives"])
        assert r["stand_in"], f"rank {rank}: the stand-in nvFuser was handed no region"
        for name, ops in r["stand_in"].items():
            assert not LOSS_OPS & set(ops), f"rank {rank}: nvFuser region {name} holds {LOSS_OPS & set(ops)}: {ops}"
        for part, regions, wanted in zip(("forward", "backward"), r["regions"], (
                {"cross_entropy_stats", "cross_entropy_of_stats"},
                {"cross_entropy_stats_backward", "cross_entropy_of_stats_backward"}), strict=True):
            names = [name for _, name, _ in regions]
            assert len(set(names)) == len(names), f"rank {rank} {part}: regions of one name (one callable): {names}"
            inductor = {op for ex, name, ops in regions if ex.endswith("_inductor_only") and
                        name.startswith("InductorOnly") for op in ops}
            assert wanted <= inductor, f"rank {rank} {part}: Inductor's regions hold {inductor}"
            on_nvfuser = {op for ex, _, ops in regions if ex == "stand_in_nvfuser" for op in ops}
            assert not {f"thunder_tp.{op}" for op in on_nvfuser} & INDUCTOR_ONLY, (rank, part, on_nvfuser)


# --- a backend that rejects a region ----------------------------------------------------------------------------


class _Exp(nn.Module):
    """fc2(exp(fc1(x))): exp in one region of the forward, in none of the backward (its grad reuses its output)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32, dtype=torch.float64)
        self.fc2 = nn.Linear(32, 16, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.exp(self.fc1(x)))


def _compile_failing_on(op: str | None, compiled_graphs: list[bool]):
    """torch.compile without code generation (Dynamo's "eager" backend: Inductor's C++ compile is not the point) whose
    backend raises, as Inductor failing would, for a graph that holds ``op`` (Dynamo wraps that in
    BackendCompilerFailed). Records whether each graph it saw failed."""
    real_compile = torch.compile

    def backend(gm, example_inputs):
        fails = any(getattr(node.target, "__name__", "") == op for node in gm.graph.nodes)
        compiled_graphs.append(fails)
        if fails:
            raise RuntimeError(f"simulated Inductor failure on {op}")
        return gm.forward

    def compile(fn, *, mode=None, fullgraph=True):
        return real_compile(fn, backend=backend, fullgraph=fullgraph)

    return mock.patch.object(torch, "compile", compile)


def _training_steps(jm: nn.Module, steps: int = 2) -> list[tuple[torch.Tensor, dict]]:
    results = []
    torch.manual_seed(3)
    for _ in range(steps):
        x = torch.randn(8, 16, dtype=torch.float64)
        loss = jm(x).square().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in jm.named_parameters()}))
        jm.zero_grad()
    return results


def _tp_exp_model() -> nn.Module:
    torch.manual_seed(0)
    plan = {"fc1": thunder_tp.ColwiseParallel(), "fc2": thunder_tp.RowwiseParallel()}
    # compile_once=False: the ranks outlive the test, and a region compiled by an earlier jit would be reused
    return thunder.jit(_Exp(), transforms=[thunder_tp.TensorParallel(plan)], executors=thunder_tp.executors(),
                       compile_once=False)


def _steps_with_a_failing_region() -> dict:
    with _compile_failing_on(None, []):
        expected = _training_steps(_tp_exp_model())
    compiled_graphs: list[bool] = []
    with _compile_failing_on("exp", compiled_graphs), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jm = _tp_exp_model()
        actual = _training_steps(jm)
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(actual, expected, strict=True)):
        assert_close(loss, want_loss, rtol=1e-9, atol=0, name=f"loss of step {step}")
        for name in want_grads:
            assert_close(grads[name], want_grads[name], rtol=1e-9, atol=1e-12, name=f"grad of {name}, step {step}")
    exp_regions = [name for t in (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
                   for _, name, ops in _regions(t) if "exp" in ops]
    return {"warnings": [str(w.message) for w in caught if w.category is RegionFallbackWarning],
            "exp_regions": exp_regions, "compiled_graphs": compiled_graphs}


def test_region_inductor_rejects_runs_on_torch_with_one_warning():
    """Two training steps on 2 gloo ranks, Inductor failing to compile the one region that holds an exp: loss and
    grads equal the run without the failure; one warning per rank naming the region, its ops and the error; the
    failing compile is tried once (the region keeps torch)."""
    for rank, r in enumerate(run_ranks(_steps_with_a_failing_region, 2)):
        assert len(r["exp_regions"]) == 1, (rank, r["exp_regions"])
        assert len(r["warnings"]) == 1, (rank, r["warnings"])
        message = r["warnings"][0]
        for part in (r["exp_regions"][0], "exp", "Inductor raised BackendCompilerFailed (RuntimeError: simulated "
                     "Inductor failure on exp)", "runs on torch from now on"):
            assert part in message, (rank, part, message)
        assert r["compiled_graphs"].count(True) == 1, (rank, r["compiled_graphs"])


def test_region_nvfuser_rejects_runs_on_inductor():
    """The stand-in nvFuser rejects the regions holding an exp as nvFuser 0.2.35 did: Inductor runs them from then
    on, with one warning each over two calls, quoting nvFuser's error; output and grads as without the failure."""
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        return torch.exp(torch.tanh(x @ w)).sum(1)

    expected = f(x, w)
    expected_grads = torch.autograd.grad(expected.sum(), (x, w))
    with stand_in_nvfuser(reject="exp") as (executors, stand_in), _compile_failing_on(None, []), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jf = thunder.jit(f, executors=executors)
        for _ in range(2):
            out = jf(x, w)
            grads = torch.autograd.grad(out.sum(), (x, w))
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=0)
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12)
    messages = [str(w.message) for w in caught if w.category is RegionFallbackWarning]
    rejected = [name for t in (thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1])
                for ex, name, ops in _regions(t) if ex == stand_in.name and "exp" in ops]
    assert len(rejected) == len(messages) == 2, (rejected, messages)  # exp, and its recomputation in the backward
    for name, message in zip(rejected, messages, strict=True):
        assert f"region {name} (" in message and "nvFuser raised RuntimeError: INTERNAL ASSERT" in message, message
        assert "runs on Inductor from now on" in message, message


# --- what a backend error is --------------------------------------------------------------------------------------


def _backend_compiler_failed() -> Exception:
    def fail(gm, example_inputs):
        raise RuntimeError("backend bug")

    try:
        torch.compile(lambda t: t + 1, backend=fail, fullgraph=True)(torch.ones(2))
    except Exception as e:  # the exception is the point
        return e
    raise AssertionError("the failing backend did not fail")


def test_backend_errors_are_told_from_the_programs():
    shape_mismatch = RuntimeError("The size of tensor a (3) must match the size of tensor b (4) at non-singleton dim 1")
    nvfuser_check = RuntimeError("Expected ... Exception raised from validate at /workspace/Fuser/csrc/ops/arith.cpp")
    assert is_backend_error(_backend_compiler_failed(), "inductor")
    assert is_backend_error(torch._dynamo.exc.Unsupported("graph break"), "inductor")
    assert not is_backend_error(torch._dynamo.exc.TorchRuntimeError("size mismatch while tracing"), "inductor")
    assert is_backend_error(RuntimeError(NVFUSER_ASSERT), "nvfuser") and is_backend_error(nvfuser_check, "nvfuser")
    assert not is_backend_error(RuntimeError(NVFUSER_ASSERT), "inductor")
    for error in (shape_mismatch, IndexError("index 9 is out of bounds"), torch.OutOfMemoryError("CUDA out of memory"),
                  ValueError("nvFuser")):
        for backend in ("nvfuser", "inductor", "torch"):
            assert not is_backend_error(error, backend), (error, backend)


@pytest.mark.parametrize("error", [RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"),
                                   IndexError("index out of range in self")], ids=["shape", "index"])
def test_a_programs_error_in_a_region_propagates_unchanged(error):
    def call(*args):
        raise error

    region = FallbackRegion("nvFusion0", "nvfuser", call, bsyms=(), inputs=(), outputs=())
    with warnings.catch_warnings(record=True) as caught, pytest.raises(type(error)) as info:
        warnings.simplefilter("always")
        region.callable(torch.ones(2))
    assert info.value is error and not caught and region.backend == "nvfuser"
