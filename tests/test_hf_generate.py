"""HuggingFace's ``generate`` through a TP program (``thunder_tp/models/hf/generation.py``): a static KV cache split by
heads, the next token sampled on the vocabulary shards.

Checked on 2 and 3 gloo ranks (3: a vocabulary of 256, which 3 does not divide) against one device (the same model,
``generate`` without jit, the same seed): top-k + temperature + top-p at batch 4 (TP 2) and greedy at batch 1 (TP 3)
give one device's tokens for 32 steps (slow: greedy, temperature, top-k, top-p and their combination at batch 1
and 4 on both), TP through HF's idiom ``jm.generate``; greedy is HF's own ``model.generate``'s tokens;
the decode step gathers each rank's candidates, never the logits; ``set_sampling("gather")`` gives the same tokens
from the gathered logits (HF sampling itself; slow). Settings the sampler on shards cannot see are a clear error.
"""

from __future__ import annotations

from functools import partial

import pytest
import thunder
import torch

import thunder_tp
from tests.dist import run_ranks
from tests.hf_models import VOCAB, make_config
from tests.tp_checks import FAST_EXECUTORS, rank_and_size
from thunder_tp.models import litgpt_sampling
from thunder_tp.models.hf import generation

PROMPT, NEW_TOKENS = 6, 32
MODES = {
    "greedy": dict(do_sample=False),
    "temperature": dict(do_sample=True, temperature=0.8, top_k=0),
    "top-k": dict(do_sample=True, temperature=1.0, top_k=5),
    "top-p": dict(do_sample=True, temperature=1.2, top_k=0, top_p=0.8),
    "top-k, temperature, top-p": dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9),
}
#: the candidates each rank gathers a row (top-p alone: the nucleus can be any size, the logits are gathered)
CANDIDATES = {"greedy": 1, "temperature": 1, "top-k": 5, "top-p": None, "top-k, temperature, top-p": 20}
#: (batch, mode) per TP size (slow: every mode at both batch sizes)
QUICK = {2: [(4, "top-k, temperature, top-p")], 3: [(1, "greedy")]}
EVERY = [(batch, mode) for batch in (1, 4) for mode in MODES]


def _model(ranks: int, batch: int) -> torch.nn.Module:
    """A float64 one-layer Llama (8 heads, 4 K/V heads; at 3 ranks 6 heads, 3 K/V heads), seeded, with a cache of
    ``batch`` rows."""
    from transformers import AutoModelForCausalLM

    config = make_config("llama")
    config.num_hidden_layers = 1
    if ranks % 2:
        config.num_attention_heads, config.num_key_value_heads, config.hidden_size = 6, 3, 48
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float64).eval()
    return generation.set_kv_cache(model, batch, PROMPT + NEW_TOKENS)


def _tokens(generate, prompts: torch.Tensor, mode: str) -> torch.Tensor:
    """The 32 new tokens of each row from ``generate(prompts, **settings)``, seeded alike everywhere."""
    torch.manual_seed(1234)
    with torch.no_grad():
        out = generate(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0, **MODES[mode])
    return out[:, PROMPT:]


def _generations(cases: list[tuple[int, str]], gather: bool) -> dict:
    """Per case the tokens of one device and of TP (and the TP decode step's collectives); greedy's HF eager tokens,
    and with ``gather`` greedy with ``set_sampling("gather")`` (two more compiles)."""
    from thunder_tp.tools.debug import totals

    ranks = rank_and_size()[1]
    results: dict = {}
    for batch in sorted({b for b, _ in cases}):
        reference, model = _model(ranks, batch), _model(ranks, batch)
        jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.hf(model))],
                         executors=FAST_EXECUTORS)
        prompts = torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(4))
        for mode in [m for b, m in cases if b == batch]:
            tp = _tokens(jm.generate, prompts, mode)  # routed by the transform to generation.generate(jm, ...)
            decode = totals(thunder_tp.collectives_table(thunder.last_traces(jm)[-1]))
            one_device = _tokens(partial(generation.generate, reference), prompts, mode)
            results[batch, mode] = dict(one_device=one_device, tp=tp, decode=decode)
        if (batch, "greedy") in cases:
            with torch.no_grad():
                eager = reference.generate(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)
            results[batch, "hf eager"] = dict(one_device=eager[:, PROMPT:], tp=results[batch, "greedy"]["tp"])
            if gather:
                with litgpt_sampling.sampling("gather"):
                    gathered = _tokens(jm.generate, prompts, "greedy")
                results[batch, "gather"] = dict(one_device=eager[:, PROMPT:], tp=gathered)
    return results


def _check(ranks: int, cases: list[tuple[int, str]], gather: bool = False) -> None:
    for result in run_ranks(_generations, ranks, cases, gather, timeout=300 * len(cases)):
        for (batch, mode), got in result.items():
            assert got["tp"].shape == (batch, NEW_TOKENS), (mode, got["tp"].shape)
            assert torch.equal(got["tp"], got["one_device"]), (batch, mode, got["tp"], got["one_device"])
            if CANDIDATES.get(mode):  # each rank's (value, index) float64 pairs, not the logits
                assert got["decode"]["all_gather"] == {"count": 1, "bytes": batch * CANDIDATES[mode] * 16 * ranks}, (
                    mode, got["decode"])


@pytest.mark.parametrize("ranks", [2, 3])
def test_hf_generate_samples_one_devices_tokens_on_shards(ranks):
    _check(ranks, QUICK[ranks])


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_hf_generate_every_mode_and_batch(ranks):
    _check(ranks, EVERY, gather=True)


@pytest.mark.parametrize("setting", [dict(repetition_penalty=1.2), dict(num_beams=2), dict(min_new_tokens=4),
                                     dict(output_logits=True, return_dict_in_generate=True)])
def test_settings_the_sampler_cannot_see_are_clear_errors(setting):
    model = _model(2, 1)
    with pytest.raises(ValueError, match="set_sampling\\('gather'\\)"):
        generation.generate(model, torch.zeros(1, PROMPT, dtype=torch.long), max_new_tokens=2, **setting)


def test_a_batch_the_cache_was_not_made_for_is_a_clear_error():
    with pytest.raises(ValueError, match="set_kv_cache\\(model, batch_size=2"):
        generation.generate(_model(2, 1), torch.zeros(2, PROMPT, dtype=torch.long), max_new_tokens=2)


def test_a_model_without_a_cache_is_a_clear_error():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(make_config("llama"))
    with pytest.raises(ValueError, match="set_kv_cache"):
        generation.generate(model, torch.zeros(1, PROMPT, dtype=torch.long), max_new_tokens=2)


def test_a_model_jitted_without_thunder_tp_is_a_clear_error():
    jm = thunder.jit(_model(2, 1))  # Thunder's executors: thunder_tp's lookasides do not serve its compiles
    with pytest.raises(ValueError, match="jitted without thunder_tp"):
        generation.generate(jm, torch.zeros(1, PROMPT, dtype=torch.long), max_new_tokens=2)
