"""thunder_tp's sampler (``thunder_tp/ops/sampling.py``): litgpt's ``sample`` semantics as a Gumbel-max draw whose noise
depends on the vocabulary index only, so that each rank reduces its vocabulary shard to a few candidates.

Checked: on vocabulary shards (1, 2, 3 and 5 of a vocabulary none of them divides) the token of the whole vocabulary,
bit for bit, in every mode (greedy, temperature, top-k with k below and above a shard, top-k with top-p, ties to the
lower index); greedy is ``torch.argmax`` (litgpt's); the draws follow litgpt's distribution; bad arguments are clear
errors. On 2 and 3 gloo ranks, litgpt's ``generate`` (batch 1) and ``batched_generate_fn`` (batch 4, every row its
own mode) on a TP-jitted GPT draw one device's tokens for 32 steps, the decode step gathering each rank's
candidates, not the logits.
"""

from __future__ import annotations

import pytest
import thunder
import torch
from litgpt import Config

import thunder_tp
from tests.dist import run_ranks
from tests.generation import ARCHITECTURES, PROMPT, models_with_cache
from tests.tp_checks import FAST_EXECUTORS, rank_and_size
from thunder_tp.layouts import balanced
from thunder_tp.ops.sampling import Sampling, candidates, chosen, sample

#: a vocabulary neither 2 nor 3 (nor 5) divides
VOCAB = 251
MODES = {
    "greedy": (0.0, None, 1.0),
    "temperature": (0.8, None, 1.0),
    "top-k": (1.0, 5, 1.0),
    "top-k above a shard": (0.7, 100, 1.0),
    "top-k and top-p": (0.9, 40, 0.6),
    "greedy with top-k and top-p": (0.0, 3, 0.5),
    "top-p": (1.2, None, 0.8),
}


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1  # a tie for the largest, across shards
    logits[2, 90:100] = logits[2].max() + 1  # ten tied, inside and across shards
    return logits


@pytest.mark.parametrize("mode", MODES)
def test_shards_pick_the_token_of_the_whole_vocabulary(mode):
    args = MODES[mode]
    logits = _logits(4)
    key = torch.randint(0, 2**31, (4, 2), generator=torch.Generator().manual_seed(1))
    whole = sample(logits, *args, key=key)
    assert whole.shape == (4, 1) and whole.dtype == torch.int64
    if Sampling(*args).greedy:
        assert torch.equal(whole, logits.argmax(-1, keepdim=True))
    if not Sampling(*args).splits:
        return  # top-p alone runs on the whole vocabulary only
    for ranks in (2, 3, 5):
        found = [candidates(logits[:, start:start + n], key, start, *args) for start, n in balanced(VOCAB, ranks)]
        assert torch.equal(chosen(torch.cat(found, 1), key, VOCAB, *args), whole), (ranks, mode)


def test_top_k_candidates_keep_the_lower_of_tied_indices():
    values = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0]], dtype=torch.float64)
    pairs = candidates(values, None, 10, 1.0, 2, 1.0)
    assert pairs[0, :, 1].tolist() == [11.0, 13.0], pairs
    padded = candidates(values[:, :1], None, 10, 1.0, 3, 1.0)  # fewer logits than k: padded past every index
    assert padded[0, :, 0].tolist() == [1.0, -torch.inf, -torch.inf] and padded[0, 1:, 1].min() > VOCAB, padded


def test_draws_follow_litgpts_distribution():
    """20,000 draws of one row (a key each) against litgpt's probabilities: top-k, then temperature, then top-p."""
    from litgpt.generate.base import sample_top_p

    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(2)).expand(20000, 32)
    keys = torch.randint(0, 2**31, (20000, 2), generator=torch.Generator().manual_seed(3))
    for temperature, top_k, top_p in [(0.7, 8, 0.8), (1.5, None, 1.0), (1.0, None, 0.5)]:
        drawn = torch.bincount(sample(logits, temperature, top_k, top_p, key=keys).view(-1), minlength=32) / 20000
        row = logits[0]
        if top_k is not None:
            v, i = row.topk(top_k)
            row = torch.full_like(row, -torch.inf).scatter(0, i, v)
        expected = sample_top_p(row / temperature, top_p).softmax(-1)
        assert 0.5 * (drawn - expected).abs().sum() < 0.03, (temperature, top_k, top_p, drawn, expected)


@pytest.mark.parametrize("args, message", [
    ((1.0, None, 1.5), r"top_p must be in \[0, 1\], got 1.5"),
    ((1.0, 0, 1.0), "top_k must be a positive int or None, got 0"),
])
def test_bad_arguments_are_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        sample(torch.zeros(1, 4), *args)


def test_bad_logits_and_sampler_are_clear_errors():
    with pytest.raises(ValueError, match=r"expected \(batch, vocabulary\) logits, got shape \(1, 2, 4\)"):
        sample(torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=r"unknown sampler 'multinomial'; expected one of \('shards', 'gather'\)"):
        thunder_tp.set_sampling("multinomial")


NEW_TOKENS = 32
#: batch 4's rows, one mode each
ROWS = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_k=5), dict(temperature=1.2, top_p=0.8)]
#: batch 1: top-k, then temperature, then top-p (k candidates a rank: cheaper to gather than the logits while
#: k x 16 bytes x ranks < 251 x 8 bytes; the rule gathers whichever is smaller)
COMBINED = dict(temperature=0.8, top_k=20, top_p=0.9)


def _loops_on_shards() -> dict:
    """litgpt's generate (batch 1) and batched_generate_fn (batch 4) on one device and on a TP-jitted GPT, each seeded
    alike: the tokens of each, the collectives of the TP decode step (batch 1, its last trace)."""
    from litgpt.generate.base import batched_generate_fn, generate

    from thunder_tp.tools.debug import totals

    config = Config(block_size=PROMPT + NEW_TOKENS, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                    **ARCHITECTURES["gqa"] | dict(n_layer=1))
    reference, model = models_with_cache(config, len(ROWS), max_seq=PROMPT + NEW_TOKENS)
    jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))],
                     executors=FAST_EXECUTORS)
    prompts = torch.randint(0, VOCAB, (len(ROWS), PROMPT), generator=torch.Generator().manual_seed(4))
    tokens, decode = {}, None
    for name, m in (("one device", reference), ("tp", jm)):
        torch.manual_seed(1234)
        single = generate(m, prompts[0], PROMPT + NEW_TOKENS, **COMBINED)[PROMPT:]
        if m is jm:
            decode = totals(thunder_tp.collectives_table(thunder.last_traces(jm)[-1]))
        for block in m.transformer.h:
            block.attn.kv_cache.reset_parameters()
        batched = batched_generate_fn(m, prompts, PROMPT + NEW_TOKENS, sample_args=ROWS, include_prompt=False,
                                      include_eos=True)
        tokens[name] = (single, torch.stack([torch.cat(step) for step in batched], 1))
    return {"tokens": tokens, "decode": decode, "size": rank_and_size()[1]}


@pytest.mark.parametrize("ranks", [2, 3])
def test_litgpt_loops_sample_one_devices_tokens_on_shards(ranks):
    for result in run_ranks(_loops_on_shards, ranks, timeout=600):
        (single, batched), (want_single, want_batched) = result["tokens"]["tp"], result["tokens"]["one device"]
        assert single.shape == (NEW_TOKENS,) and batched.shape == (len(ROWS), NEW_TOKENS), (single, batched)
        assert torch.equal(single, want_single), (single, want_single)
        assert torch.equal(batched, want_batched), (batched, want_batched)
        # every rank's 20 (value, index) float64 pairs, not the logits (251 float64, 2,008 bytes)
        candidates_bytes = 20 * 2 * 8 * ranks
        assert result["decode"]["all_gather"] == {"count": 1, "bytes": candidates_bytes}, result["decode"]
