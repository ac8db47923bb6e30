"""Tests of thunder_tp.execution.executor: compute is fused, communication never is."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import thunder
import thunder.distributed.prims as dist_prims
import thunder.torch as ltorch
import torch
import torch.nn.functional as F
from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.executors import nvfuserex, torchex
from thunder.executors.torch_compile import torch_compile_xentropy_ex

from tests.dist import REPO_ROOT, assert_close, run_ranks
from thunder_tp.collectives import comm_executor
from thunder_tp.execution.complex_grads import complex_grads_executor
from thunder_tp.execution.cpu_attention import cpu_attention_executor
from thunder_tp.execution.cuda_attention import cuda_attention_executor
from thunder_tp.execution.executor import (
    FUSION_EXECUTOR_NAME,
    NVFUSER_WHEEL,
    TPFusionExecutor,
    _kept_default,
    executors,
    fusion_executor,
    is_communication,
)

TORCHEX_COMM_IMPLS = (
    "torch_all_gather_prim_impl",
    "torch_all_reduce_prim_impl",
    "torch_broadcast_prim_impl",
    "torch_reduce_scatter_prim_impl",
    "torch_wait_prim_impl",
    "torch_pack_prim_impl",
    "torch_unpack_prim_impl",
    "torch_unpack_for_fsdp_prim_impl",
    "torch_update_bucket_view_prim_impl",
    "torch_pack_for_fsdp_prim_impl",
    "torch_stash_grad_for_fsdp_prim_impl",
)
ALL_REDUCE = torchex.all_reduce_prim_impl.id
WAIT = torchex.wait_prim_impl.id


# --- helpers (module level: the gloo workers import them) ---------------------------------------


def _bsym(sym, *subsymbols) -> SimpleNamespace:
    """A stand-in for a BoundSymbol: is_communication reads only .sym and .subsymbols."""
    return SimpleNamespace(sym=sym, subsymbols=subsymbols)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _train_step(jm: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    y = jm(x)
    y.square().sum().backward()
    return y.detach(), {name: p.grad.clone() for name, p in jm.named_parameters()}


def _fusions(trace) -> list:
    return [bsym for bsym in trace.bound_symbols if bsym.sym.is_fusion]


def _ours(fusion) -> bool:
    return any(fusion.sym.executor is ex for ex in fusion_executor().backends)


def _fused_communication(trace) -> list[str]:
    """Names of the fusion regions that contain a communication symbol (must be empty)."""
    return [bsym.sym.name for bsym in _fusions(trace) if is_communication(bsym)]


def _summary(trace) -> dict:
    """What the parent process checks about a final trace."""
    return {
        "fused_communication": _fused_communication(trace),
        "our_fusions": sum(map(_ours, _fusions(trace))),
        "top_level": [bsym.sym.id for bsym in trace.bound_symbols if is_communication(bsym)],
        "overlapped": _overlapped_collectives(trace),
    }


def _overlapped_collectives(trace) -> list[list[str]]:
    """For each async all_reduce, in trace order: the ops fused in regions that run between it and its wait."""
    bsyms = trace.bound_symbols
    result = []
    for i, bsym in enumerate(bsyms):
        if bsym.sym.id != ALL_REDUCE:
            continue
        future = bsym.output
        j = next(j for j in range(i + 1, len(bsyms)) if bsyms[j].sym.id == WAIT and bsyms[j].args[0] is future)
        regions = [b for b in bsyms[i + 1 : j] if b.sym.is_fusion]
        result.append([sub.sym.name for region in regions for sub in region.subsymbols])
    return result


def _data_parallel_rank(kind: str) -> dict:
    import torch.distributed as dist
    from thunder.distributed import ddp, fsdp

    def wrap(jm):
        return ddp(jm) if kind == "ddp" else fsdp(jm, device=torch.device("cpu"))

    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(4, 16)
    expected = _train_step(wrap(thunder.jit(_mlp())), x)
    jm = wrap(thunder.jit(_mlp(), executors=executors()))
    actual = _train_step(jm, x)
    return {
        "expected": expected,
        "actual": actual,
        "forward": _summary(thunder.last_traces(jm)[-1]),
        "backward": _summary(thunder.last_backward_traces(jm)[-1]),
    }


def _async_all_reduce_rank() -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD

    def f(a, b, w):
        future = dist_prims.all_reduce(a, dist_prims.DistributedReduceOps.SUM, group, True)
        reduced = future.wait()  # written before the independent matmul: the schedule must move it after
        return reduced + torch.nn.functional.gelu(b @ w)

    torch.manual_seed(0)
    a, b, w = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)
    jf = thunder.jit(f, executors=executors())
    out = jf(a + dist.get_rank(), b, w)
    expected = (2 * a + 1) + torch.nn.functional.gelu(b @ w)
    return {"out": out, "expected": expected, "trace": _summary(thunder.last_traces(jf)[-1])}


def _check_data_parallel(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        (y0, grads0), (y1, grads1) = r["expected"], r["actual"]
        assert_close(y1, y0, name=f"output, rank {rank}")
        assert grads1.keys() == grads0.keys()
        for name in grads0:
            assert_close(grads1[name], grads0[name], name=f"grad of {name}, rank {rank}")
        for part in ("forward", "backward"):
            s = r[part]
            assert s["fused_communication"] == [], f"rank {rank} {part}: fusions swallowed communication"
            assert s["our_fusions"] >= 1, f"rank {rank} {part}: no fusion region from thunder_tp's executor"
        assert r["backward"]["top_level"], f"rank {rank}: the backward has no top-level collective"


# --- is_communication ---------------------------------------------------------------------------


@pytest.mark.parametrize("prim_id", list(dist_prims.PrimIDs), ids=lambda p: p.name)
def test_dist_prims_are_communication(prim_id):
    assert is_communication(_bsym(SimpleNamespace(id=prim_id, name=prim_id.name.lower(), executor=None)))


@pytest.mark.parametrize("name", TORCHEX_COMM_IMPLS)
def test_torchex_comm_impls_are_communication(name):
    assert is_communication(_bsym(torchex.ex.opmap[name]))


def test_thunder_tp_collectives_are_communication():
    fake = comm_executor.register_operator("tp_fake_for_test_executor", meta=lambda a: TensorProxy(like=a), fn=abs)
    assert is_communication(_bsym(fake))
    assert all(is_communication(_bsym(sym)) for sym in comm_executor.opmap.values())
    # found by name too, e.g. a composite symbol of thunder_tp that no executor owns
    assert is_communication(_bsym(SimpleNamespace(id="thunder_tp.x", name="tp_x", executor=None)))


def test_nested_communication_is_found():
    wait = _bsym(dist_prims.wait)
    composite = _bsym(ltorch.add, _bsym(prims.add), _bsym(ltorch.mul, wait))
    assert is_communication(composite)
    assert not is_communication(_bsym(ltorch.add, _bsym(prims.add)))


COMPUTE = [ltorch.add, ltorch.linear, prims.matmul, prims.linear, torchex.ex.opmap["torch_slice_prim_impl"]]


@pytest.mark.parametrize("sym", COMPUTE, ids=lambda s: s.name)
def test_compute_is_not_communication(sym):
    assert not is_communication(_bsym(sym))


def test_fusion_executor_refuses_communication():
    ex = fusion_executor()
    comm_ids = set(dist_prims.PrimIDs) | {torchex.ex.opmap[n].id for n in TORCHEX_COMM_IMPLS}
    assert not comm_ids & set(ex.inductor.implmap), "the Inductor backend's implmap contains communication"
    for sym in (dist_prims.all_reduce, dist_prims.wait, torchex.all_reduce_prim_impl):
        assert not ex.can_fuse(_bsym(sym))
    # Thunder's own torchcompile executor would claim the dist prims: this is what thunder_tp avoids
    from thunder.executors.torch_compile import torch_compile_ex

    assert dist_prims.PrimIDs.ALL_REDUCE in torch_compile_ex.implmap


def test_swallowed_communication_is_detected():
    """The invariant used by the distributed tests does fail on a region that swallowed a collective."""
    fusion = SimpleNamespace(is_fusion=True, name="TorchCompile0", executor=None, id="TorchCompile0")
    region = _bsym(fusion, _bsym(prims.mul), _bsym(torchex.all_reduce_prim_impl))
    assert _fused_communication(SimpleNamespace(bound_symbols=[region])) == ["TorchCompile0"]


# --- executors() --------------------------------------------------------------------------------


def test_executors_list():
    exs = executors()
    assert exs[:4] == [complex_grads_executor, comm_executor, cpu_attention_executor, cuda_attention_executor]
    assert exs[-1] is fusion_executor() is thunder.extend.get_executor(FUSION_EXECUTOR_NAME)
    beside_nvfuser = [torch_compile_xentropy_ex] if exs[-1].nvfuser is not None else []
    assert [e for e in exs if isinstance(e, thunder.extend.FusionExecutor)] == [*beside_nvfuser, exs[-1]]
    assert thunder.extend.get_executor("sdpa") in exs[:-1], "attention executors come before the fusion executor"
    assert executors() == exs and executors()[-1] is exs[-1]  # cached
    assert executors("inductor")[-1] is fusion_executor("inductor") is not exs[-1]
    with pytest.raises(ValueError, match="unknown backend"):
        executors("triton")


def test_thunders_cross_entropy_executor_stays_in_front_of_nvfuser_only():
    """Where nvFuser fuses, Thunder's torchcompile_xentropy keeps the cross-entropy for Inductor, as in Thunder's
    defaults; no other fusion executor of Thunder's competes with thunder_tp's."""
    with_nvfuser, without = SimpleNamespace(nvfuser=object()), SimpleNamespace(nvfuser=None)
    assert _kept_default(torch_compile_xentropy_ex, with_nvfuser)
    assert not _kept_default(torch_compile_xentropy_ex, without)
    assert not _kept_default(thunder.extend.get_executor("torchcompile_cat"), with_nvfuser)
    assert _kept_default(thunder.extend.get_executor("sdpa"), without)


@pytest.mark.skipif(torch.cuda.is_available(), reason="automatic choice on a CPU-only machine")
def test_auto_backend_is_inductor_without_cuda():
    ex = fusion_executor()
    assert ex.nvfuser is None and ex.backends == (ex.inductor,)


@pytest.mark.skipif(
    torch.cuda.is_available() and nvfuserex.nvfuserex is not None, reason="nvFuser is available here"
)
def test_nvfuser_backend_unavailable_error():
    missing = "nvFuser" if torch.cuda.is_available() else "CUDA"
    with pytest.raises(RuntimeError, match=f"backend='nvfuser' needs {missing}") as info:
        executors("nvfuser")
    assert "backend='inductor'" in str(info.value)


def test_nvfuser_without_the_module_thunder_runs_is_refused_or_left_to_inductor(monkeypatch):
    """nvFuser 0.2.36 installed on CUDA: Thunder's executor registers, then fails at the first fusion call for want
    of the `nvfuser` module. Asked for, nvFuser is a clear error naming the wheel; chosen automatically, Inductor."""

    def compute_contiguity(shape, stride):
        raise ModuleNotFoundError("No module named 'nvfuser'")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nvfuserex, "nvfuserex", SimpleNamespace(name="nvfuser"))
    impl = SimpleNamespace(compute_contiguity=compute_contiguity)
    monkeypatch.setitem(sys.modules, "thunder.executors.nvfuserex_impl", impl)
    with pytest.raises(RuntimeError, match=r"needs the `nvfuser` module .* Install nvfuser-cu128-torch210==0\.2\.35"):
        TPFusionExecutor("probe_nvfuser", backend="nvfuser")
    with pytest.warns(UserWarning, match="installed but cannot run.*Fusing with Inductor instead"):
        automatic = TPFusionExecutor("probe_automatic")
    assert automatic.backends == (automatic.inductor,) and not automatic.inductor.skip_cuda


def test_nvfuser_extra_pins_the_wheel_the_errors_name():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["nvfuser"] == [NVFUSER_WHEEL]


# --- single device ------------------------------------------------------------------------------


def _check_single_device(device: str, backend: str | None, fusion_prefix: str) -> None:
    lowering = fusion_executor(backend).backends  # nvFuser's executor among them where it fuses
    model = _mlp().to(device)
    x = torch.randn(4, 16, device=device)
    expected = _train_step(model, x)
    model.zero_grad()
    jm = thunder.jit(model, executors=executors(backend))
    y, grads = _train_step(jm, x)
    assert_close(y, expected[0], name="output")
    for name, grad in grads.items():
        assert_close(grad, expected[1][name], name=f"grad of {name}")
    for trace in (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]):
        ours = [f.sym.name for f in _fusions(trace) if f.sym.executor in lowering]
        assert any(name.startswith(fusion_prefix) for name in ours), f"no {fusion_prefix} region in:\n{trace}"


def test_single_device_mlp_fuses_with_inductor():
    _check_single_device("cpu", None, "TorchCompile")


@pytest.mark.parametrize("fn", [torch.mul, lambda x, w: (x * w).exp()], ids=["mul", "mul_exp"])
def test_output_computed_from_inputs_alone_trains(fn):
    # the schedule recomputes input-derived values in the backward; the grad read of the output must stay the output
    x, w = (torch.randn(4, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    expected_out = fn(x, w)
    expected = torch.autograd.grad(expected_out, (x, w), torch.ones_like(expected_out))
    out = thunder.jit(fn, executors=executors())(x, w)
    assert_close(out, expected_out, name="output")
    for name, grad, want in zip("xw", torch.autograd.grad(out, (x, w), torch.ones_like(out)), expected, strict=True):
        assert_close(grad, want, name=f"grad of {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inductor_backend():
    _check_single_device("cuda", "inductor", "TorchCompile")


@pytest.mark.skipif(
    not torch.cuda.is_available() or nvfuserex.nvfuserex is None, reason="needs CUDA and nvFuser"
)
@pytest.mark.parametrize("backend", ["nvfuser", None])
def test_cuda_nvfuser_backend(backend):
    _check_single_device("cuda", backend, "nvFusion")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", [None, "inductor"])
def test_cuda_attention_runs_on_thunders_attention_executors(backend):
    # Inductor can run SDPA too (as its decomposition): the attention executors come first, as in Thunder's defaults
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    jfn = thunder.jit(attention, executors=executors(backend))
    out = jfn(q, k, v)
    out.float().square().sum().backward()
    assert_close(out, attention(q, k, v), rtol=2e-2, atol=2e-2, name="output")
    for trace in (thunder.last_traces(jfn)[-1], thunder.last_backward_traces(jfn)[-1]):
        runners = {getattr(bsym.sym.executor, "name", None) for bsym in trace.bound_symbols}
        assert runners & {"sdpa", "cudnn"}, f"SDPA not on Thunder's attention executors:\n{trace}"


# --- data parallel on 2 gloo ranks --------------------------------------------------------------


def test_ddp_matches_default_executors_and_keeps_collectives_out_of_fusions():
    results = run_ranks(_data_parallel_rank, 2, "ddp")
    _check_data_parallel(results)
    for r in results:
        # the first grad all_reduce is issued before the first layer's backward matmuls, which overlap it
        overlapped = r["backward"]["overlapped"]
        assert overlapped and "matmul" in overlapped[0], f"no matmul between all_reduce and wait: {overlapped}"


def test_fsdp_matches_default_executors_and_keeps_collectives_out_of_fusions():
    results = run_ranks(_data_parallel_rank, 2, "fsdp")
    _check_data_parallel(results)
    for r in results:
        assert r["forward"]["top_level"], "FSDP's forward all_gathers should be top-level symbols"


def test_wait_is_scheduled_after_independent_compute():
    for rank, r in enumerate(run_ranks(_async_all_reduce_rank, 2)):
        assert_close(r["out"], r["expected"], name=f"rank {rank}")
        s = r["trace"]
        assert s["fused_communication"] == []
        assert s["top_level"] == [ALL_REDUCE, WAIT]
        assert len(s["overlapped"]) == 1 and "matmul" in s["overlapped"][0], "the matmul should run before the wait"
