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
from litgpt import GPT, Config
from litgpt.generate.base import batched_generate_fn, generate

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import CONFIGS, VOCAB, expected_counts
from tests.tp_checks import FAST_EXECUTORS, assert_close_scaled, collective_counts, rank_and_size

PROMPT, NEW_TOKENS, MAX_SEQ = 8, 16, 32
LLAMA = CONFIGS["llama"]  # 8 heads, 4 K/V groups
ARCHITECTURES = {
    "gqa": LLAMA,
    "mqa": LLAMA | dict(n_query_groups=1),  # one K/V head, held by every rank
    "neox": CONFIGS["neox"],  # parallel residual: one all_reduce per block
    # a ring cache of 8 slots in the first block: 8 prompt tokens + 16 decoded wrap it twice
    "sliding_window": LLAMA | dict(sliding_window_size=PROMPT, sliding_window_indices=[1, 0]),
    "moe": LLAMA | dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=32),
}


def gen_config(arch: str) -> Config:
    """A tiny litgpt config of one architecture, with room for the prompt and the new tokens."""
    return Config(block_size=MAX_SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, **ARCHITECTURES[arch])


def _models(config: Config, batch: int, dtype: torch.dtype = torch.float64,
            device: torch.device | None = None) -> tuple[GPT, GPT]:
    """The single-device model and an identical one for TP, both with a KV cache for `batch` sequences."""
    torch.manual_seed(0)
    reference = GPT(config).to(device=device, dtype=dtype)
    model = GPT(config).to(device=device, dtype=dtype)
    model.load_state_dict(reference.state_dict())
    for m in (reference, model):
        m.max_seq_length = MAX_SEQ
        m.set_kv_cache(batch_size=batch, dtype=dtype, device=device)
    return reference, model


def _jit(model: GPT) -> torch.nn.Module:
    return thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))],
                       executors=FAST_EXECUTORS)


@torch.inference_mode()
def greedy(model, prompt: torch.Tensor, steps: int, on_decode=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill, then `steps` - 1 decode steps: the greedy tokens and every step's last logits."""
    logits = model(prompt, torch.arange(prompt.shape[1], device=prompt.device))[:, -1]
    tokens, history = [logits.argmax(-1)], [logits]
    for i in range(steps - 1):
        logits = model(tokens[-1][:, None], torch.tensor([prompt.shape[1] + i], device=prompt.device))[:, -1]
        tokens.append(logits.argmax(-1))
        history.append(logits)
        if on_decode is not None:
            on_decode(i)
    return torch.stack(tokens, 1), history


def _local_cache_shapes(config: Config, batch: int, size: int) -> dict[str, tuple[int, ...]]:
    """Each rank's K/V cache: its K/V heads, or the one head its query heads share."""
    heads = config.n_query_groups // size if config.n_query_groups >= size else 1
    return {f"transformer.h.{i}.attn.kv_cache.{kv}": (batch, heads, _cache_length(config, i), config.head_size)
            for i in range(config.n_layer) for kv in "kv"}


def _cache_length(config: Config, block: int) -> int:
    windowed = config.sliding_window_indices is not None and config.sliding_window_indices[block]
    return config.sliding_window_size if windowed else MAX_SEQ


def _generate_and_compare(arch: str, batch: int) -> dict:
    """Greedy tokens and logits against one device, decode collectives per step, cache shapes."""
    _, size = rank_and_size()
    config = gen_config(arch)
    reference, model = _models(config, batch)
    jm = _jit(model)
    prompt = torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    expected_tokens, expected_logits = greedy(reference, prompt, NEW_TOKENS)
    decode_counts = []
    on_decode = lambda _: decode_counts.append(collective_counts(thunder.last_traces(jm)[-1]))  # noqa: E731
    tokens, logits = greedy(jm, prompt, NEW_TOKENS, on_decode)
    assert torch.equal(tokens, expected_tokens), (tokens, expected_tokens)
    for step, (got, want) in enumerate(zip(logits, expected_logits)):
        assert_close_scaled(got, want, rtol=1e-6, atol=1e-6, what=f"logits of step {step}")
    minimum = expected_counts(config, "tp", size)[0]
    assert all(counts == minimum for counts in decode_counts), (decode_counts, minimum)
    shapes = {n: tuple(b.shape) for n, b in jm.named_buffers() if ".kv_cache." in n}
    assert shapes == _local_cache_shapes(config, batch, size), shapes
    return {"cache_misses": thunder.cache_misses(jm)}


@pytest.mark.parametrize("arch", [a if a != "moe" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHITECTURES])
def test_greedy_generation_matches_single_device(arch):
    (info, _) = run_ranks(_generate_and_compare, 2, arch, 1)
    assert info["cache_misses"] == 2, info  # one prefill program, one decode program: decode never recompiles


@pytest.mark.parametrize("arch", [pytest.param("gqa", marks=pytest.mark.slow), "mqa"])
def test_greedy_generation_at_tp4(arch):
    run_ranks(_generate_and_compare, 4, arch, 1)


@pytest.mark.slow
def test_batched_greedy_generation():
    run_ranks(_generate_and_compare, 2, "gqa", 4)


def _litgpt_loops(temperature: float) -> dict:
    """litgpt's generate (batch 1) and batched_generate_fn (batch 2) on the jitted module; seeded alike on every
    rank, sampling picks the same tokens everywhere."""
    config = gen_config("gqa")
    reference, model = _models(config, 2)
    jm = _jit(model)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(2))
    sampling = dict(temperature=temperature, top_k=20, top_p=0.9)
    results = {}
    for name, m in (("reference", reference), ("tp", jm)):
        torch.manual_seed(1234)  # the same seed on every rank: the same draws from the same (gathered) logits
        single = generate(m, prompt, PROMPT + NEW_TOKENS, **sampling)
        for block in m.transformer.h:  # what litgpt's generate script does between prompts
            block.attn.kv_cache.reset_parameters()
        torch.manual_seed(1234)
        batched = list(batched_generate_fn(m, torch.stack([prompt, prompt.flip(0)]), PROMPT + NEW_TOKENS,
                                           sample_args=sampling, include_prompt=False, include_eos=True))
        results[name] = (single, torch.stack([torch.cat(step) for step in batched]))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results["tp"])
    for other in gathered[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, gathered[0])), "ranks sampled different tokens"
    return results


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 0.8])
def test_litgpt_generate_loops(temperature):
    results = run_ranks(_litgpt_loops, 2, temperature)[0]
    single, batched = results["tp"]
    want_single, want_batched = results["reference"]
    assert single.shape == (PROMPT + NEW_TOKENS,) and batched.shape == (NEW_TOKENS, 2)
    if temperature == 0.0:  # greedy: exactly the single-device tokens
        assert torch.equal(single, want_single) and torch.equal(batched, want_batched)


def _reset_zeroes_the_pieces() -> list[bool]:
    config = gen_config("gqa")
    _, model = _models(config, 1)
    jm = _jit(model)
    greedy(jm, torch.randint(0, VOCAB, (1, PROMPT)), 2)
    written = [bool(jm.get_buffer(f"transformer.h.{i}.attn.kv_cache.k").abs().sum() > 0) for i in range(config.n_layer)]
    for block in model.transformer.h:
        block.attn.kv_cache.reset_parameters()
    return written + [bool((jm.get_buffer(f"transformer.h.{i}.attn.kv_cache.v") == 0).all()) for i in range(config.n_layer)]


def test_cache_reset_acts_on_the_pieces():
    assert run_ranks(_reset_zeroes_the_pieces, 2) == [[True, True, True, True]] * 2


def _cache_after_jit() -> str:
    config = gen_config("gqa")
    _, model = _models(config, 1)
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
    reference, _ = _models(config, 1)
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


def test_meta_model_loaded_from_lit_model_pth_generates_the_same_tokens(tmp_path):
    assert run_ranks(_meta_model_from_lit_model_pth, 2, str(tmp_path / "lit_model.pth")) == [True, True]


def test_simulated_prefill_and_decode():
    config = gen_config("mqa")
    reference, model = _models(config, 1)
    prompt = torch.randint(0, VOCAB, (1, PROMPT))
    with torch.inference_mode():
        want = [reference(prompt, torch.arange(PROMPT)), reference(prompt[:, :1], torch.tensor([PROMPT]))]
    with thunder_tp.simulate(4):
        jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))],
                         executors=thunder_tp.executors())
        with torch.no_grad():  # LocalTensor cannot run under inference_mode
            got = [jm(prompt, torch.arange(PROMPT)), jm(prompt[:, :1], torch.tensor([PROMPT]))]
        for step, (g, w) in enumerate(zip(got, want)):
            for rank, value in thunder_tp.per_rank(g).items():
                assert_close_scaled(value, w, rtol=1e-6, atol=1e-6, what=f"rank {rank}'s logits of step {step}")


def test_cache_of_another_dtype_is_a_clear_error():
    config = gen_config("gqa")
    _, model = _models(config, 1)
    model.set_kv_cache(batch_size=1, dtype=torch.float32)  # the model computes in float64
    with pytest.raises(TypeError, match=r"set_kv_cache\(batch_size, dtype=torch.float64\) before thunder.jit"):
        greedy(thunder.jit(model), torch.randint(0, VOCAB, (1, PROMPT)), 1)


def test_batch_larger_than_the_cache_is_a_clear_error():
    _, model = _models(gen_config("gqa"), 1)
    with pytest.raises(ValueError, match=r"a batch of 2 sequences, but the KV cache holds 1: model.set_kv_cache\(batch_size=2\)"):
        greedy(thunder.jit(model), torch.randint(0, VOCAB, (2, PROMPT)), 1)


def _compiles_for_prompts(lengths: list[int]) -> list[int]:
    """thunder_tp.generate's chunked prefill, then a decode step, for prompts of several lengths: the programs
    compiled after each."""
    from thunder_tp.generate import prefill

    _, model = _models(gen_config("gqa"), 1)
    jm = _jit(model)
    misses = []
    for length in lengths:
        prompt = torch.randint(0, VOCAB, (length,))
        token = prefill(jm, prompt)[:, -1:].argmax(-1)
        with torch.inference_mode():
            jm(token, torch.tensor([length]))
        misses.append(thunder.cache_misses(jm))
    return misses


def test_chunked_prefill_bounds_the_compiles():
    # chunks: 5 = 4 + 1, 7 = 4 + 2 + 1, 6 = 4 + 2, 3 = 2 + 1, 12 = 8 + 4: programs for 1, 2, 4, 8 tokens, 1 = decode
    assert run_ranks(_compiles_for_prompts, 2, [5, 7, 6, 3, 12])[0] == [2, 3, 3, 3, 4]
