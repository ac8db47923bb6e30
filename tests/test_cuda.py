"""TP on a GPU against one device: litgpt training under TP / TP+SP / TP+loss parallel / TP+SP+loss parallel with
each fusion backend, in fp32 and bf16; greedy generation with the KV cache sharded, fp32 and bf16, also with decode
steps replayed as CUDA graphs; an HF transformers model under plans.hf; litgpt under the automatic plan.

NCCL takes one GPU per rank, so on a one-GPU machine the two ranks share the GPU and talk over gloo, which moves
CUDA tensors through host memory. Everything else runs as under NCCL: the rewrite on CUDA proxies, the fusion
regions (nvFuser, or Inductor's Triton kernels) stopping at every collective, Thunder's attention executors on the
sharded heads, and the waits of the async collectives on CUDA streams. Skipped without a GPU (tests/conftest.py).
"""

from __future__ import annotations

import warnings

import pytest
import thunder
import torch
from thunder.executors import nvfuserex

import thunder_tp
from tests.dist import run_ranks
from tests.generation import MAX_SEQ, NEW_TOKENS, PROMPT, gen_config, greedy, local_cache_shapes, models_with_cache
from tests.litgpt_models import MODES, GPTWithLoss, batch, expected_counts, make_config
from tests.tp_checks import assert_close_scaled, assert_grads_are_shards, collective_counts, rank_and_size
from thunder_tp import TensorParallel
from thunder_tp.execution.executor import fusion_executor, is_communication
from thunder_tp.execution.fallback import RegionFallbackWarning
from thunder_tp.generate.generation import Decoder

pytestmark = pytest.mark.cuda

#: fp32 on the GPU (no TF32): sharded matmuls sum in another order than the full ones; a wrong shard is off by O(1)
RTOL, ATOL = 1e-4, 1e-4
#: each dtype's tolerance (rtol, atol of the largest entry): bf16 rounds every op's output to 8 bits of mantissa
TOLERANCES = {torch.float32: (RTOL, ATOL), torch.bfloat16: (3e-2, 3e-2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: the plans of the GPU tests: the CPU tests' modes, and sequence parallel with loss parallel (bench_rank's plan)
GPU_MODES = {**MODES, "tp_sp_lp": {"sequence_parallel": True, "loss_parallel": True}}
#: fusion executors beside the chosen backend's: Thunder's cross-entropy one, kept in front of nvFuser
BESIDE = {"nvfuser": {"torchcompile_xentropy"}, "inductor": set()}


def _gpu() -> torch.device:
    """cuda:0, the GPU every rank shares, made the current device."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def _same_step(reference: torch.nn.Module, jm: torch.nn.Module, transform: TensorParallel, loss,
               dtype: torch.dtype = torch.float32) -> None:
    """One training step of both: the loss (`loss(module)`) and every grad, each rank's shard of the full one."""
    rank, size = rank_and_size()
    rtol, atol = TOLERANCES[dtype]
    expected, actual = loss(reference), loss(jm)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert_close_scaled(actual, expected, rtol=rtol, atol=atol, what="loss")
    expected.backward()
    actual.backward()
    assert_grads_are_shards(reference, jm, transform.parameter_layouts, rank, size, rtol=rtol, atol=atol)


def _step_counts(jm: torch.nn.Module) -> tuple[dict, dict]:
    """The collectives of the last forward and backward traces."""
    return collective_counts(thunder.last_traces(jm)[-1]), collective_counts(thunder.last_backward_traces(jm)[-1])


def _skip_without_nvfuser(backend: str) -> None:
    if backend == "nvfuser" and nvfuserex.nvfuserex is None:
        pytest.skip("nvFuser is not installed (pip install thunder_tp[nvfuser])")


def _tp_on_shared_gpu(mode: str, backend: str, dtype: torch.dtype = torch.float32) -> dict:
    """One training step of the llama-like litgpt model under TP on cuda:0, checked against the full model there."""
    device = _gpu()
    torch.manual_seed(0)
    reference = GPTWithLoss(make_config("llama")).to(device, dtype)
    model = GPTWithLoss(make_config("llama")).to(device, dtype)
    model.load_state_dict(reference.state_dict())
    transform = TensorParallel(thunder_tp.plans.litgpt(model, **GPU_MODES[mode]))
    jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors(backend))
    idx, targets = (t.to(device) for t in batch(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _same_step(reference, jm, transform, lambda m: m(idx, targets), dtype)
    traces = {"forward": thunder.last_traces(jm)[-1], "backward": thunder.last_backward_traces(jm)[-1]}
    return {
        "fallbacks": [str(w.message) for w in caught if w.category is RegionFallbackWarning],
        "counts": _step_counts(jm),
        "regions": {b.sym.executor.name for t in traces.values() for b in t.bound_symbols if b.sym.is_fusion},
        "backend": {ex.name for ex in fusion_executor(backend).backends},
        "fused_communication": [b.sym.name for t in traces.values() for b in t.bound_symbols
                                if b.sym.is_fusion and is_communication(b)],
        "attention": {getattr(b.sym.executor, "name", None) for b in traces["forward"].bound_symbols}
        & {"sdpa", "cudnn"},
    }


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", ["nvfuser", "inductor"])
@pytest.mark.parametrize("mode", list(GPU_MODES))
def test_litgpt_tp_on_one_gpu_matches_single_device(mode, backend, dtype):
    """One step, loss and grads as on one device; the minimum of collectives (loss parallel's stats gather replaces
    the logits' under SP too); the chosen backend's regions, no collective in them, no region fallen back."""
    _skip_without_nvfuser(backend)
    counted_as = "tp_sp" if GPU_MODES[mode].get("sequence_parallel") else mode
    for rank, r in enumerate(run_ranks(_tp_on_shared_gpu, 2, mode, backend, DTYPES[dtype])):
        assert not r["fallbacks"], f"rank {rank}: {r['fallbacks']}"
        assert r["counts"] == expected_counts(make_config("llama"), counted_as, 2), f"rank {rank}: {r['counts']}"
        assert r["regions"] & r["backend"], f"rank {rank}: no region of {r['backend']} in {r['regions']}"
        assert r["regions"] <= r["backend"] | BESIDE[backend], f"rank {rank}: regions of {r['regions']}"
        assert not r["fused_communication"], f"rank {rank}: collectives inside {r['fused_communication']}"
        assert r["attention"], f"rank {rank}: attention not on Thunder's sdpa/cudnn executors"


def _generate_on_shared_gpu(arch: str, backend: str, dtype: torch.dtype = torch.float32) -> dict:
    """Greedy generation with the KV cache sharded, on cuda:0, against the full model there (sdpa)."""
    rank, size = rank_and_size()
    config = gen_config(arch)
    device = _gpu()
    reference, model = models_with_cache(config, 2, dtype, device)
    jm = thunder.jit(model, transforms=[TensorParallel(thunder_tp.plans.litgpt(model))],
                     executors=thunder_tp.executors(backend))
    prompt = torch.randint(0, config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
    expected_tokens, expected_logits = greedy(reference, prompt, NEW_TOKENS)
    decode_counts = []
    tokens, logits = greedy(jm, prompt, NEW_TOKENS,
                            lambda _: decode_counts.append(collective_counts(thunder.last_traces(jm)[-1])))
    shapes = {n: tuple(b.shape) for n, b in jm.named_buffers() if ".kv_cache." in n}
    return {"same_tokens": _same_tokens(tokens, expected_tokens, logits, expected_logits, dtype),
            "decode_counts": decode_counts,
            "minimum": expected_counts(config, "tp", size)[0],
            "cache_shapes_sharded": shapes == local_cache_shapes(config, 2, size, rank),
            "cache_misses": thunder.cache_misses(jm)}


def _same_tokens(tokens, expected_tokens, logits, expected_logits, dtype: torch.dtype) -> bool:
    """Each step's logits close to the full model's while the tokens so far agree; the tokens equal, except (bf16)
    from a step where the full model's two best logits are within the tolerance of each other (a near tie that
    rounding may decide either way)."""
    rtol, atol = TOLERANCES[dtype]
    for step, (got, want) in enumerate(zip(logits, expected_logits, strict=True)):
        assert_close_scaled(got, want, rtol=rtol, atol=atol, what=f"logits of step {step}")
        differ = tokens[:, step] != expected_tokens[:, step]
        if differ.any():
            best = want.float().topk(2, -1).values
            near_tie = (best[:, 0] - best[:, 1] <= atol * want.float().abs().max()) | ~differ
            return dtype != torch.float32 and bool(near_tie.all())
    return True


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", ["nvfuser", "inductor"])
@pytest.mark.parametrize("arch", ["gqa", "mqa"])
def test_generation_on_one_gpu_matches_single_device(arch, backend, dtype):
    _skip_without_nvfuser(backend)
    for rank, r in enumerate(run_ranks(_generate_on_shared_gpu, 2, arch, backend, DTYPES[dtype])):
        assert r["same_tokens"], f"rank {rank}"
        assert all(c == r["minimum"] for c in r["decode_counts"]), f"rank {rank}: {r['decode_counts']}"
        assert r["cache_shapes_sharded"], f"rank {rank}"
        assert r["cache_misses"] == 2, f"rank {rank}: {r['cache_misses']}"


def _graph_steps_on_shared_gpu(arch: str) -> dict:
    """Greedy generation through decode steps replayed as CUDA graphs (over gloo: a graph per stretch between
    collectives; one per batch and bucket of 16 / 32 positions), against the steps without graphs and the full
    model, on cuda:0."""
    config = gen_config(arch)
    device = _gpu()
    reference, model = models_with_cache(config, 2, torch.float32, device)
    jm = thunder.jit(model, transforms=[TensorParallel(thunder_tp.plans.litgpt(model))],
                     executors=thunder_tp.executors())
    prompt = torch.randint(0, config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
    expected_tokens, _ = greedy(reference, prompt, NEW_TOKENS)
    bound_tokens, bound_logits = greedy(jm, prompt, NEW_TOKENS, decode=Decoder(jm, "bound", MAX_SEQ))
    for block in model.transformer.h:
        block.attn.kv_cache.reset_parameters()
    graphs = Decoder(jm, "graph", MAX_SEQ, min_bucket=16)
    tokens, logits = greedy(jm, prompt, NEW_TOKENS, decode=graphs)
    for step, (got, want) in enumerate(zip(logits, bound_logits, strict=True)):
        assert_close_scaled(got, want, rtol=RTOL, atol=ATOL, what=f"logits of step {step}")
    return {"same_tokens": torch.equal(tokens, bound_tokens) and torch.equal(tokens, expected_tokens),
            "steps": sorted(graphs.steps)}


@pytest.mark.parametrize("arch", ["gqa", "sliding_window"])
def test_graph_decode_steps_give_the_tokens_of_steps_without_graphs(arch):
    for rank, r in enumerate(run_ranks(_graph_steps_on_shared_gpu, 2, arch)):
        assert r["same_tokens"], f"rank {rank}"
        assert r["steps"] == [(2, 16), (2, MAX_SEQ)], f"rank {rank}: {r['steps']}"  # prompt 8 + 15 decode steps


def test_whole_step_graph_under_a_capturable_group():
    """Under a group whose collectives a CUDA graph holds (the fake group here, NCCL in a real run) the whole step is
    one graph: each rank's replayed logits are the bound step's, bit for bit, step after step."""
    from thunder_tp.runtimes.cuda_graphs import CapturedCall

    config = gen_config("gqa")
    device = _gpu()
    for rank in range(2):
        _, model = models_with_cache(config, 1, torch.float32, device)
        with thunder_tp.one_rank(2, rank, device), torch.inference_mode():
            jm = thunder.jit(model, transforms=[TensorParallel(thunder_tp.plans.litgpt(model))],
                             executors=thunder_tp.executors())
            graph, bound = thunder_tp.DecodeStep(jm, "graph"), thunder_tp.DecodeStep(jm, "bound")
            for position in range(PROMPT, PROMPT + 4):
                token = torch.tensor([[position]], device=device)
                where = torch.tensor([position], device=device)
                assert torch.equal(graph(token, where), bound(token, where)), (rank, position)
            assert isinstance(graph._program, CapturedCall), type(graph._program)


def _hf_on_shared_gpu(name: str, mode: str) -> tuple[dict, dict]:
    """One training step of a tiny HF model under plans.hf on cuda:0 (fp32), against the full model there."""
    from tests import hf_models

    device = _gpu()
    reference = hf_models.make_model(name).float().to(device)
    model = hf_models.make_model(name).float().to(device)
    model.load_state_dict(reference.state_dict())
    transform = TensorParallel(thunder_tp.plans.hf(model, **MODES[mode]))
    jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors("inductor"))
    idx = hf_models.batch().to(device)
    _same_step(reference, jm, transform, lambda m: m(input_ids=idx, labels=idx, use_cache=False).loss)
    return _step_counts(jm)


@pytest.mark.parametrize("name,mode", [("llama", "tp_lp"), ("gemma", "tp_sp")])
def test_hf_model_on_one_gpu_matches_single_device(name, mode):
    pytest.importorskip("transformers")
    from tests import hf_models

    for rank, counts in enumerate(run_ranks(_hf_on_shared_gpu, 2, name, mode)):
        assert counts == hf_models.expected_counts(name, mode, 2), f"rank {rank}: {counts}"


def _auto_on_shared_gpu() -> dict:
    """One training step of the litgpt model under TensorParallel("auto") on cuda:0, against the full model there."""
    device = _gpu()
    torch.manual_seed(0)
    reference = GPTWithLoss(make_config("llama")).to(device)
    model = GPTWithLoss(make_config("llama")).to(device)
    model.load_state_dict(reference.state_dict())
    idx, targets = (t.to(device) for t in batch(0))
    transform = TensorParallel("auto", example_inputs=((idx, targets), {}))
    jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors("inductor"))
    _same_step(reference, jm, transform, lambda m: m(idx, targets))
    plan = transform.plan
    return {"ran": _step_counts(jm), "priced": (dict(plan.communication.forward), dict(plan.communication.backward)),
            "reused": plan.trace_reused}


def test_auto_plan_on_one_gpu_matches_single_device():
    for rank, r in enumerate(run_ranks(_auto_on_shared_gpu, 2)):
        assert r["ran"] == r["priced"] and r["reused"], f"rank {rank}: {r}"
