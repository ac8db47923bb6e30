"""Generation with TP: a litgpt GPT whose KV cache was made before thunder.jit, against the single-device model.

Every case runs on real gloo ranks in float64: greedy tokens exactly the single-device ones, logits within 1e-6 of
their largest entry (litgpt's RMSNorm runs in float32), each decode step at Megatron's forward minimum of
collectives (asserted per step), each rank's cache 1/TP of the full one (or the replicated share), litgpt's own
`generate` unchanged on the jitted module, and sampling with temperature > 0 picking the same tokens on every rank.
"""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.distributed as dist
from litgpt import GPT
from litgpt.generate.base import batched_generate_fn, generate

import thunder_tp
from tests.dist import run_ranks
from tests.generation import (
    ARCHITECTURES,
    MAX_SEQ,
    NEW_TOKENS,
    PROMPT,
    gen_config,
    greedy,
    local_cache_shapes,
    models_with_cache,
)
from tests.litgpt_models import VOCAB, expected_counts
from tests.tp_checks import FAST_EXECUTORS, assert_close_scaled, collective_counts, rank_and_size


def _jit(model: GPT) -> torch.nn.Module:
    return thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))],
                       executors=FAST_EXECUTORS)


def _generate_and_compare(arch: str, batch: int) -> dict:
    """Greedy tokens and logits against one device, decode collectives per step, cache shapes."""
    rank, size = rank_and_size()
    config = gen_config(arch)
    reference, model = models_with_cache(config, batch)
    jm = _jit(model)
    prompt = torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    expected_tokens, expected_logits = greedy(reference, prompt, NEW_TOKENS)
    decode_counts = []
    def on_decode(_):
        decode_counts.append(collective_counts(thunder.last_traces(jm)[-1]))
    tokens, logits = greedy(jm, prompt, NEW_TOKENS, on_decode)
    assert torch.equal(tokens, expected_tokens), (tokens, expected_tokens)
    for step, (got, want) in enumerate(zip(logits, expected_logits, strict=True)):
        assert_close_scaled(got, want, rtol=1e-6, atol=1e-6, what=f"logits of step {step}")
    minimum = expected_counts(config, "tp", size)[0]
    assert all(counts == minimum for counts in decode_counts), (decode_counts, minimum)
    shapes = {n: tuple(b.shape) for n, b in jm.named_buffers() if ".kv_cache." in n}
    assert shapes == local_cache_shapes(config, batch, size, rank), shapes
    return {"cache_misses": thunder.cache_misses(jm)}


#: the default run's architectures; the others are slow-marked: GQA caches are compared in test_greedy_generation_at_tp3
#: (4 K/V groups over 3 ranks), sliding_window's mask in test_simulate's training, neox's parallel residual in training
#: (test_litgpt), moe's layer in test_moe
DEFAULT_ARCHITECTURES = ("mqa",)


@pytest.mark.parametrize("arch", [a if a in DEFAULT_ARCHITECTURES else pytest.param(a, marks=pytest.mark.slow)
                                  for a in ARCHITECTURES])
def test_greedy_generation_matches_single_device(arch):
    (info, _) = run_ranks(_generate_and_compare, 2, arch, 1)
    assert info["cache_misses"] == 2, info  # one prefill program, one decode program: decode never recompiles


@pytest.mark.slow  # TP=4: the cache is split by the TP=2 cases' rule; replicated K/V heads: mqa at TP=2
@pytest.mark.parametrize("arch", ["gqa", "mqa"])
def test_greedy_generation_at_tp4(arch):
    run_ranks(_generate_and_compare, 4, arch, 1)


def test_greedy_generation_at_tp3():
    """8 query heads in 4 K/V groups over 3 ranks: whole groups 2, 1, 1 with their query heads 4, 2, 2, and each
    rank's cache of its K/V heads; the MLP's 128 features and the vocabulary split unevenly too."""
    run_ranks(_generate_and_compare, 3, "gqa", 1)


@pytest.mark.slow
def test_batched_greedy_generation():
    run_ranks(_generate_and_compare, 2, "gqa", 4)


def _litgpt_loops(temperature: float) -> dict:
    """litgpt's generate (batch 1) and batched_generate_fn (batch 2) on the jitted module with litgpt's own sampler
    (``set_sampling("gather")``: the program returns the logits, gathered); seeded alike on every rank, sampling picks
    one device's tokens everywhere. Between the loops the caches are reset as litgpt's generate script does: every
    block's pieces were written, and are zero after. thunder_tp's sampler on shards: tests/test_sampling.py."""
    from thunder_tp.models.litgpt_sampling import sampling

    config = gen_config("gqa")
    reference, model = models_with_cache(config, 2)
    jm = _jit(model)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(2))
    args = dict(temperature=temperature, top_k=20, top_p=0.9)
    results = {}
    for name, m in (("reference", reference), ("tp", jm)):
        torch.manual_seed(1234)  # the same seed on every rank: the same draws from the same (gathered) logits
        with sampling("gather"):
            single = generate(m, prompt, PROMPT + NEW_TOKENS, **args)
        if m is jm:
            results["decode"] = collective_counts(thunder.last_traces(jm)[-1])
        caches = [block.attn.kv_cache for block in m.transformer.h]
        if m is jm:
            assert all(jm.get_buffer(f"transformer.h.{i}.attn.kv_cache.k").abs().sum() > 0 for i in range(len(caches)))
        for cache in caches:  # what litgpt's generate script does between prompts
            cache.reset_parameters()
        if m is jm:
            assert all((jm.get_buffer(f"transformer.h.{i}.attn.kv_cache.{kv}") == 0).all()
                       for i in range(len(caches)) for kv in "kv"), "a reset left a piece written"
        torch.manual_seed(1234)
        with sampling("gather"):
            batched = list(batched_generate_fn(m, torch.stack([prompt, prompt.flip(0)]), PROMPT + NEW_TOKENS,
                                               sample_args=args, include_prompt=False, include_eos=True))
        results[name] = (single, torch.stack([torch.cat(step) for step in batched]))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results["tp"])
    for other in gathered[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, gathered[0], strict=True)), "ranks sampled different tokens"
    return results


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 0.8])
def test_litgpt_generate_loops(temperature):
    results = run_ranks(_litgpt_loops, 2, temperature)[0]
    single, batched = results["tp"]
    want_single, want_batched = results["reference"]
    assert single.shape == (PROMPT + NEW_TOKENS,) and batched.shape == (NEW_TOKENS, 2)
    assert torch.equal(single, want_single) and torch.equal(batched, want_batched)
    assert results["decode"] == expected_counts(gen_config("gqa"), "tp", 2)[0], results["decode"]  # the logits gathered


def _cache_after_jit() -> str:
    config = gen_config("gqa")
    _, model = models_with_cache(config, 1)
    model.clear_kv_cache()
    jm = _jit(model)
    model.set_kv_cache(batch_size=1, dtype=torch.float64)
    try:
        greedy(jm, torch.randint(0, VOCAB, (1, PROMPT)), 1)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_cache_created_after_jit_is_a_clear_error():
    message = run_ranks(_cache_after_jit, 2)[0]
    assert "created after thunder.jit" in message and "set_kv_cache(...) before thunder.jit" in message, message


def _meta_model_from_lit_model_pth(path: str) -> bool:
    import thunder_tp.checkpoint as ck

    config = gen_config("gqa")
    reference, _ = models_with_cache(config, 1)
    if dist.get_rank() == 0:
        torch.save(reference.state_dict(), path)
    dist.barrier()
    with torch.device("meta"):
        model = GPT(config).double()
    model.max_seq_length = MAX_SEQ
    model.set_kv_cache(batch_size=1, dtype=torch.float64)
    jm = _jit(model)
    ck.load(path, jm)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    return torch.equal(greedy(jm, prompt, NEW_TOKENS)[0], greedy(reference, prompt, NEW_TOKENS)[0])


@pytest.mark.slow  # lit_model.pth into a meta TP model: test_checkpoint's test_lit_model_pth_loads_into_tp2
def test_meta_model_loaded_from_lit_model_pth_generates_the_same_tokens(tmp_path):
    assert run_ranks(_meta_model_from_lit_model_pth, 2, str(tmp_path / "lit_model.pth")) == [True, True]


def test_simulated_prefill_and_decode():
    config = gen_config("mqa")
    reference, model = models_with_cache(config, 1)
    prompt = torch.randint(0, VOCAB, (1, PROMPT))
    with torch.inference_mode():
        want = [reference(prompt, torch.arange(PROMPT)), reference(prompt[:, :1], torch.tensor([PROMPT]))]
    with thunder_tp.simulate(4):
        jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))],
                         executors=thunder_tp.executors())
        with torch.no_grad():  # LocalTensor cannot run under inference_mode
            got = [jm(prompt, torch.arange(PROMPT)), jm(prompt[:, :1], torch.tensor([PROMPT]))]
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            for rank, value in thunder_tp.per_rank(g).items():
                assert_close_scaled(value, w, rtol=1e-6, atol=1e-6, what=f"rank {rank}'s logits of step {step}")


def test_cache_of_another_dtype_is_a_clear_error():
    config = gen_config("gqa")
    _, model = models_with_cache(config, 1)
    model.set_kv_cache(batch_size=1, dtype=torch.float32)  # the model computes in float64
    with pytest.raises(TypeError, match=r"set_kv_cache\(batch_size, dtype=torch.float64\) before thunder.jit"):
        greedy(thunder.jit(model, executors=FAST_EXECUTORS), torch.randint(0, VOCAB, (1, PROMPT)), 1)


def test_batch_larger_than_the_cache_is_a_clear_error():
    _, model = models_with_cache(gen_config("gqa"), 1)
    with pytest.raises(ValueError,
                       match=r"a batch of 2 sequences, but the KV cache holds 1: model.set_kv_cache\(batch_size=2\)"):
        greedy(thunder.jit(model, executors=FAST_EXECUTORS), torch.randint(0, VOCAB, (2, PROMPT)), 1)


def _compiles_for_prompts(lengths: list[int]) -> list[int]:
    """thunder_tp.generate's chunked prefill, then a decode step, for prompts of several lengths: the programs
    compiled after each."""
    from thunder_tp.generate.generation import TokenPicker, prefill
    from thunder_tp.ops.sampling import Sampling

    _, model = models_with_cache(gen_config("gqa"), 1)
    jm = _jit(model)
    pick = TokenPicker(Sampling(temperature=0.0), "shards", in_program=True)
    misses = []
    for length in lengths:
        prompt = torch.randint(0, VOCAB, (length,))
        token = prefill(jm, prompt, pick)
        with torch.inference_mode():
            pick(jm, token, torch.tensor([length]))
        misses.append(thunder.cache_misses(jm))
    return misses


@pytest.mark.slow  # one prompt's chunked prefill compiles are counted by test_generate_cli's TP=2 run
def test_chunked_prefill_bounds_the_compiles():
    # chunks: 5 = 4 + 1, 7 = 4 + 2 + 1, 6 = 4 + 2, 3 = 2 + 1, 12 = 8 + 4: programs for 1, 2, 4, 8 tokens, 1 = decode
    assert run_ranks(_compiles_for_prompts, 2, [5, 7, 6, 3, 12])[0] == [2, 3, 3, 3, 4]
