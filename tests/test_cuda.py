"""TP on a GPU: litgpt under TP / TP+SP / TP+loss parallel with each fusion backend, against one device.

NCCL takes one GPU per rank, so on a one-GPU machine the two ranks share the GPU and talk over gloo, which moves
CUDA tensors through host memory. Everything else runs as under NCCL: the rewrite on CUDA proxies, the fusion
regions (nvFuser, or Inductor's Triton kernels) stopping at every collective, Thunder's attention executors on the
sharded heads, and the waits of the async collectives on CUDA streams. Skipped without a GPU (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import thunder
import torch
from thunder.executors import nvfuserex

import thunder_tp
from thunder_tp import TensorParallel
from thunder_tp.executor import fusion_executor, is_communication
from thunder_tp.layouts import REPLICATE, shard_tensor
from tests.dist import run_ranks
from tests.litgpt_models import MODES, GPTWithLoss, batch, expected_counts, make_config
from tests.tp_checks import assert_close_scaled, collective_counts, rank_and_size

pytestmark = pytest.mark.cuda

#: fp32 on the GPU (no TF32): sharded matmuls sum in another order than the full ones; a wrong shard is off by O(1)
RTOL, ATOL = 1e-4, 1e-4
#: fusion executors beside the chosen backend's: Thunder's cross-entropy one, kept in front of nvFuser
BESIDE = {"nvfuser": {"torchcompile_xentropy"}, "inductor": set()}


def _tp_on_shared_gpu(mode: str, backend: str) -> dict:
    """One training step of the llama-like litgpt model under TP on cuda:0, checked against the full model there."""
    rank, size = rank_and_size()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    reference = GPTWithLoss(make_config("llama")).to(device)
    model = GPTWithLoss(make_config("llama")).to(device)
    model.load_state_dict(reference.state_dict())
    transform = TensorParallel(thunder_tp.plans.litgpt(model, **MODES[mode]))
    jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors(backend))
    idx, targets = (t.to(device) for t in batch(0))
    expected, actual = reference(idx, targets), jm(idx, targets)
    assert_close_scaled(actual, expected, rtol=RTOL, atol=ATOL, what="loss")
    expected.backward()
    actual.backward()
    for name, p in reference.named_parameters():
        want = shard_tensor(p.grad, transform.parameter_layouts.get(name, REPLICATE), rank, size)
        assert_close_scaled(jm.get_parameter(name).grad, want, rtol=RTOL, atol=ATOL, what=f"grad of {name}")
    traces = {"forward": thunder.last_traces(jm)[-1], "backward": thunder.last_backward_traces(jm)[-1]}
    return {
        "counts": tuple(collective_counts(t) for t in traces.values()),
        "regions": {b.sym.executor.name for t in traces.values() for b in t.bound_symbols if b.sym.is_fusion},
        "backend": {ex.name for ex in fusion_executor(backend).backends},
        "fused_communication": [b.sym.name for t in traces.values() for b in t.bound_symbols
                                if b.sym.is_fusion and is_communication(b)],
        "attention": {getattr(b.sym.executor, "name", None) for b in traces["forward"].bound_symbols}
        & {"sdpa", "cudnn"},
    }


@pytest.mark.parametrize("backend", ["nvfuser", "inductor"])
@pytest.mark.parametrize("mode", list(MODES))
def test_litgpt_tp_on_one_gpu_matches_single_device(mode, backend):
    if backend == "nvfuser" and nvfuserex.nvfuserex is None:
        pytest.skip("nvFuser is not installed (pip install thunder_tp[nvfuser])")
    for rank, r in enumerate(run_ranks(_tp_on_shared_gpu, 2, mode, backend)):
        assert r["counts"] == expected_counts(make_config("llama"), mode, 2), f"rank {rank}: {r['counts']}"
        assert r["regions"] & r["backend"], f"rank {rank}: no region of {r['backend']} in {r['regions']}"
        assert r["regions"] <= r["backend"] | BESIDE[backend], f"rank {rank}: regions of {r['regions']}"
        assert not r["fused_communication"], f"rank {rank}: collectives inside {r['fused_communication']}"
        assert r["attention"], f"rank {rank}: attention not on Thunder's sdpa/cudnn executors"
