"""thunder_tp.DecodeStep: a TP-jitted litgpt GPT's decode step with its tensors bound once, against the module's own
call and one device, on real gloo ranks in float64: the same greedy tokens, the same logits (the bound computation:
exactly; the whole step compiled as one program: to 1e-6, litgpt's RMSNorm being float32), the KV cache written in
place, each step at Megatron's
decode minimum of collectives; the host's work per call the same at 2 and 4 layers; bad calls as clear errors. The
CUDA-graph strategy is tested in tests/test_cuda.py."""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys
from collections.abc import Callable

import pytest
import thunder
import torch

import thunder_tp
from tests.dist import run_ranks
from tests.generation import MAX_SEQ, NEW_TOKENS, PROMPT, gen_config, greedy, models_with_cache
from tests.litgpt_models import VOCAB, expected_counts
from tests.tp_checks import FAST_EXECUTORS, assert_close_scaled, collective_counts, rank_and_size
from thunder_tp.generate.generation import Decoder
from thunder_tp.runtimes.cuda_graphs import split_at_communication
from thunder_tp.runtimes.whole_step import compiled_whole, whole_program
from thunder_tp.thunder_internals.computation import computation_and_inputs


def _jit(model: torch.nn.Module, executors: list | None = None) -> torch.nn.Module:
    return thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))],
                       executors=executors or FAST_EXECUTORS)


def _reset(model: torch.nn.Module) -> None:
    for block in model.transformer.h:
        block.attn.kv_cache.reset_parameters()


def _caches(jm: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in jm.named_buffers() if ".kv_cache." in n}


def _steps_against_the_module(fused: bool) -> dict:
    """Greedy generation through the module's call, then (caches reset) through decode steps of each strategy: the
    tokens of one device, the module's logits and caches, the decode minimum per step."""
    _, size = rank_and_size()
    config = gen_config("gqa")
    reference, model = models_with_cache(config, 1)
    jm = _jit(model, thunder_tp.executors() if fused else None)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    want_tokens, _ = greedy(reference, prompt, NEW_TOKENS)
    module_tokens, module_logits = greedy(jm, prompt, NEW_TOKENS)
    module_caches = _caches(jm)
    assert torch.equal(module_tokens, want_tokens), (module_tokens, want_tokens)
    counts = {}
    # bound: the same program; compiled: Inductor's fusions of it, which sum litgpt's float32 RMSNorm in their order
    for strategy, tolerance in (("bound", 0.0), ("compiled", 1e-6)):
        _reset(model)
        decoder = Decoder(jm, strategy, MAX_SEQ)
        tokens, logits = greedy(jm, prompt, NEW_TOKENS, decode=decoder)
        assert torch.equal(tokens, want_tokens), (strategy, tokens, want_tokens)
        for step, (got, want) in enumerate(zip(logits, module_logits, strict=True)):
            assert_close_scaled(got, want, rtol=tolerance, atol=tolerance, what=f"{strategy}: logits of step {step}")
        for name, cache in _caches(jm).items():  # the steps wrote into the module's own caches
            assert_close_scaled(cache, module_caches[name], rtol=tolerance, atol=tolerance, what=f"{strategy}: {name}")
        (step,) = decoder.steps.values()
        counts[strategy] = collective_counts(step.trace)
    return {"counts": counts, "minimum": expected_counts(config, "tp", size)[0]}


@pytest.mark.parametrize("fused", [
    False,
    # fusion regions, which the compiled step inlines: test_whole_program_inlines_fusion_regions, on a smaller program
    pytest.param(True, marks=pytest.mark.slow),
])
def test_decode_steps_match_the_module(fused):
    for result in run_ranks(_steps_against_the_module, 2, fused, timeout=900):
        assert all(counts == result["minimum"] for counts in result["counts"].values()), result


def test_whole_program_inlines_fusion_regions():
    """thunder_tp's Inductor regions around the MLP's all_reduce, inlined with the collective into one program
    compiled whole: the module's output."""
    from tests.parallel_mlp import MLP, PLAN, mlp_input

    torch.manual_seed(0)
    model, (x,) = MLP(), mlp_input()
    with thunder_tp.one_rank(2, 1, "cpu"), torch.no_grad():
        jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(PLAN)], executors=thunder_tp.executors())
        want = jm(x.detach())
        entry, inputs, _ = computation_and_inputs(jm, (x.detach(),), {})
        trace = entry.computation_traces[-1]
        (got,) = compiled_whole(trace)(*inputs)
        program = whole_program(trace)
    assert sum(b.sym.is_fusion for b in trace.bound_symbols) >= 2, trace  # regions before and after the all_reduce
    assert [b.sym.name for b in program.bound_symbols if "all_reduce" in b.sym.name] == ["whole_step_all_reduce"]
    assert_close_scaled(got, want, rtol=1e-5, atol=1e-5, what="the whole program's output")


# --- host work per call: the same at any depth ------------------------------------------------------------------

#: Thunder's prologue: its generated function and the checks it calls for every parameter and buffer
_PROLOGUE_CHECKS = ("prologue", "_check_tensor_shape_and_metadata_impl", "_check_number_type_and_value_impl",
                    "_check_len_impl", "_check_literal_like_impl")


def _source(filename: str) -> str:
    """A file's name, Thunder's generated programs by kind (``thunder.epilogue_4``: ``thunder.epilogue``)."""
    return re.sub(r"^(thunder\.\w+?)_\d+$", r"\1", os.path.basename(filename))


def _python_calls(call: Callable[[], object]) -> tuple[collections.Counter, int]:
    """The Python functions ``call()`` runs outside the compiled computation (by file and name), and the number of
    prologue checks it runs anywhere."""
    outside: collections.Counter = collections.Counter()
    checks = 0
    inside: list = []  # the computation's frame while it runs

    def profile(frame, event, _arg):
        nonlocal checks
        code = frame.f_code
        if event == "call":
            checks += code.co_name in _PROLOGUE_CHECKS
            if inside:
                return
            if code.co_name == "computation":
                inside.append(frame)
            else:
                outside[(_source(code.co_filename), code.co_name)] += 1
        elif event == "return" and inside and frame is inside[0]:
            inside.clear()

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return outside, checks


def _host_work(depth: int) -> dict:
    """Rank 1's Python calls per decode step (of a fake group: the rank's own program, in this process)."""
    config = dataclasses.replace(gen_config("gqa"), n_layer=depth)
    _, model = models_with_cache(config, 1)
    token, where = torch.tensor([[3]]), torch.tensor([PROMPT])
    with thunder_tp.one_rank(2, 1, "cpu"), torch.inference_mode():
        jm = _jit(model)
        step = thunder_tp.DecodeStep(jm)
        step(token, where)  # binds
        step(token, where)
        module, module_checks = _python_calls(lambda: jm(token, where))
        bound, bound_checks = _python_calls(lambda: step(token, where))
    return {"module_checks": module_checks, "bound": bound, "bound_checks": bound_checks}


def test_host_work_per_call_does_not_grow_with_depth():
    """Outside the computation a decode step runs the same Python at 2 and 4 layers, and no prologue check; the
    module's own call checks every parameter and buffer (the measure sees growth where there is some)."""
    shallow, deep = _host_work(2), _host_work(4)
    assert shallow["bound_checks"] == deep["bound_checks"] == 0, (shallow["bound_checks"], deep["bound_checks"])
    assert shallow["bound"] == deep["bound"], set(shallow["bound"].items()) ^ set(deep["bound"].items())
    # 2 more blocks, each with 7 weights and 2 caches
    assert deep["module_checks"] >= shallow["module_checks"] + 2 * 9, (shallow["module_checks"], deep["module_checks"])


# --- the compute between collectives, split as for CUDA graphs over gloo ---------------------------------------


def test_split_program_computes_what_the_computation_does():
    """The computation split at its collectives (the CUDA-graph strategy over a group graphs cannot hold), each
    stretch run as a plain call here: the same logits as the computation itself."""
    config = gen_config("gqa")
    _, model = models_with_cache(config, 1)
    token, where = torch.tensor([[3]]), torch.tensor([PROMPT])
    with thunder_tp.one_rank(2, 1, "cpu"), torch.inference_mode():
        jm = _jit(model)
        want = jm(token, where)
        entry, inputs, _ = computation_and_inputs(jm, (token, where), {})
        refreshed = []

        def segment(fn, positions):
            refreshed.append(positions)
            return fn

        split = split_at_communication(entry.computation_traces[-1], segment)
        (got,) = split.python_callable()(*inputs)
    assert torch.equal(got, want)
    # a stretch between every two collectives (local TP symbols split some more), each collective's result refreshed
    collectives = sum(collective_counts(entry.computation_traces[-1]).values())
    assert len(refreshed) > collectives and sum(map(bool, refreshed)) == collectives and not refreshed[0], refreshed


# --- bad calls --------------------------------------------------------------------------------------------------


def test_bad_calls_are_clear_errors():
    _, model = models_with_cache(gen_config("gqa"), 1)
    jm = thunder.jit(model, executors=FAST_EXECUTORS)
    with pytest.raises(TypeError, match="expected a thunder.jit-ed module, got GPT"):
        thunder_tp.DecodeStep(model)
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        thunder_tp.DecodeStep(jm, "fast")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="strategy='graph' replays CUDA graphs, but CUDA is not available"):
            thunder_tp.DecodeStep(jm, "graph")
    step = thunder_tp.DecodeStep(jm)
    token, where = torch.tensor([[3]]), torch.tensor([PROMPT])
    with pytest.raises(RuntimeError, match=r"without autograd: call it under torch.no_grad\(\)"):
        step(token, where)
    with torch.no_grad():
        step(token, where, input_pos_maxp1=16)
        with pytest.raises(ValueError, match=r"argument 0 is a \(2, 1\) torch.int64 tensor on cpu, but this step runs "
                                             r"\(1, 1\) torch.int64 tensors on cpu: make a step per shape"):
            step(torch.tensor([[3], [4]]), where, input_pos_maxp1=16)
        with pytest.raises(ValueError, match="keyword 'input_pos_maxp1' is 32, but this step was compiled for 16"):
            step(token, where, input_pos_maxp1=32)
        with pytest.raises(ValueError, match=r"called with 2 positional arguments and keywords \[\], but bound to 2 "
                                             r"and \['input_pos_maxp1'\]"):
            step(token, where)


def test_decoder_buckets_are_powers_of_two_under_graphs():
    decoder = Decoder(None, "graph", 1000, min_bucket=16)
    assert [decoder.bucket(p) for p in (0, 15, 16, 31, 500, 511, 512, 999)] == [16, 16, 32, 32, 512, 512, 1000, 1000]
    assert Decoder(None, "bound", 1000).bucket(3) == 1000  # no graph: the whole cache, one program
