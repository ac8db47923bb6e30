"""Collectives decomposed for overlap (TensorParallel(overlap=...)): the loss and every grad of the undecomposed
program and of one device, the pieces' bytes adding up to the collectives they replace, decode steps untouched."""

import pytest
import thunder
import torch

import thunder_tp
from benchmarks.lib.llama import Llama, LlamaConfig, WithLoss, thunder_tp_plan
from tests.dist import run_ranks
from tests.generation import PROMPT, gen_config, greedy, models_with_cache
from tests.litgpt_models import VOCAB, GPTWithLoss, batch, expected_counts, make_config
from tests.tp_checks import (
    FAST_EXECUTORS,
    assert_close_scaled,
    assert_grads_are_shards,
    collective_counts,
    rank_and_size,
)
from thunder_tp import TensorParallel
from thunder_tp.execution import overlap_cost
from thunder_tp.tools.debug import UNLABELLED, collective_calls

#: the benchmark Llama scaled down (float64 all through: nn.RMSNorm keeps the dtype, unlike litgpt's)
SMALL_LLAMA = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab=128, ffn_hidden=64, max_seq=16)
#: tolerance (of a grad's largest entry) against the undecomposed program and against one device: float64 through
#: and through; litgpt's RMSNorm computes in float32 (a different rounding of its input shows up to ~5e-7)
TOLERANCES = {"benchmark": (1e-12, 1e-9), "litgpt": (1e-6, 1e-5), "fused": (1e-8, 1e-7)}  # fused: Inductor


def _models(name: str, sequence_parallel: bool):
    """(make a float64 model, its plan, its inputs) for the benchmark Llama or a litgpt llama."""
    if name == "benchmark":
        def make():
            return WithLoss(Llama(SMALL_LLAMA)).double()

        plan = thunder_tp_plan(sequence_parallel)
    else:
        def make():
            return GPTWithLoss(make_config("llama")).double()

        plan = thunder_tp.plans.litgpt(make(), sequence_parallel=sequence_parallel)
    idx, targets = batch(0)
    return make, plan, (idx % 128, targets % 128)


def _moved_bytes(trace) -> int:
    """The bytes that cross this rank's link in a pass: what each kind moves of its full tensor."""
    share = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
             "reduce_scatter": lambda n: (n - 1) / n, "send_recv": lambda n: 1}
    return sum(c["bytes"] * share[c["kind"]](c["group_size"]) for c in collective_calls(trace))


def _kinds(trace) -> dict:
    counts: dict = {}
    for c in collective_calls(trace):
        counts.setdefault(c["kind"], []).append(c["bytes"])
    return counts


def _decomposed_against_whole(name: str, sequence_parallel: bool, fused: bool = False) -> dict:
    """One training step of the model undecomposed and decomposed (overlap "never" / "always") and on one device:
    loss and every grad; each pass's collectives. ``fused``: thunder_tp's fusion executor (Inductor; its schedule)."""
    rank, size = rank_and_size()
    make, plan, (idx, targets) = _models(name, sequence_parallel)
    to_whole, to_one_device = TOLERANCES["fused" if fused else name]
    torch.manual_seed(0)
    reference = make()
    results, grads = {}, {}
    for overlap in ("never", "always"):
        model = make()
        model.load_state_dict(reference.state_dict())
        transform = TensorParallel(plan, overlap=overlap)
        jm = thunder.jit(model, transforms=[transform], executors=thunder_tp.executors() if fused else FAST_EXECUTORS)
        loss = jm(idx, targets)
        loss.backward()
        grads[overlap] = {n: p.grad for n, p in jm.named_parameters()}
        results[overlap] = {"loss": loss.item(), "layouts": transform.parameter_layouts,
                            "forward": thunder.last_traces(jm)[-1], "backward": thunder.last_backward_traces(jm)[-1]}
        for p in ("forward", "backward"):  # a decomposition's pieces keep the label of the collective they replace
            unlabelled = [c["kind"] for c in collective_calls(results[overlap][p]) if c["issued_by"] == UNLABELLED]
            assert not unlabelled, (overlap, p, unlabelled)
        if overlap == "always":
            reference(idx, targets).backward()
            assert_grads_are_shards(reference, jm, transform.parameter_layouts, rank, size, rtol=to_one_device,
                                    atol=to_one_device)
    assert abs(results["always"]["loss"] - results["never"]["loss"]) <= to_whole * abs(results["never"]["loss"])
    for n, g in grads["never"].items():
        assert_close_scaled(grads["always"][n], g, rtol=to_whole, atol=to_whole, what=f"decomposed grad of {n}")
    return {overlap: {p: {"kinds": _kinds(r[p]), "moved": _moved_bytes(r[p])} for p in ("forward", "backward")}
            for overlap, r in results.items()}


def _check_pieces(tables: dict, size: int, sequence_parallel: bool, layers: int) -> None:
    """Per pass the pieces move the bytes of what they replace; SP: each block's 2 all_gather and 2 reduce_scatter
    became size - 1 shifts each; TP: each block's all_reduce came in chunks."""
    for p in ("forward", "backward"):
        whole, pieces = tables["never"][p], tables["always"][p]
        assert pieces["moved"] == pytest.approx(whole["moved"], rel=1e-12), (p, whole, pieces)
        if sequence_parallel:
            assert len(pieces["kinds"].get("send_recv", [])) == 4 * layers * (size - 1) + (size - 1), (p, pieces)
        else:
            reduced = whole["kinds"]["all_reduce"]
            assert len(pieces["kinds"]["all_reduce"]) > len(reduced), (p, whole, pieces)
            assert sum(pieces["kinds"]["all_reduce"]) == sum(reduced), (p, whole, pieces)


@pytest.mark.parametrize("name, sequence_parallel", [
    pytest.param("benchmark", False, id="benchmark-tp"),
    pytest.param("benchmark", True, id="benchmark-tp_sp", marks=pytest.mark.slow),  # litgpt-tp_sp: the same shifts
    pytest.param("litgpt", True, id="litgpt-tp_sp"),
    pytest.param("litgpt", False, id="litgpt-tp", marks=pytest.mark.slow),  # benchmark-tp covers the same sites
])
def test_decomposed_program_matches_the_whole_and_one_device(name, sequence_parallel):
    tables = run_ranks(_decomposed_against_whole, 2, name, sequence_parallel)[0]
    _check_pieces(tables, 2, sequence_parallel, layers=2)


@pytest.mark.slow  # the same programs through Inductor's fusions and the fusion executor's schedule (compiles)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_decomposed_program_through_the_fusion_executor(sequence_parallel):
    tables = run_ranks(_decomposed_against_whole, 2, "benchmark", sequence_parallel, fused=True)[0]
    _check_pieces(tables, 2, sequence_parallel, layers=2)


@pytest.mark.slow  # the same decomposition at 4 ranks (3 shifts per all_gather / reduce_scatter)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_decomposed_program_at_four_ranks(sequence_parallel):
    tables = run_ranks(_decomposed_against_whole, 4, "benchmark", sequence_parallel)[0]
    _check_pieces(tables, 4, sequence_parallel, layers=2)


def _generation_with_everything_decomposed() -> dict:
    """Greedy generation with overlap="always": the prefill's all_reduces come in chunks, a decode step's one token
    is not cut (Megatron's decode minimum); the tokens and logits of one device."""
    _, size = rank_and_size()
    config = gen_config("gqa")
    reference, model = models_with_cache(config, 2)
    tp = TensorParallel(thunder_tp.plans.litgpt(model), overlap="always")
    jm = thunder.jit(model, transforms=[tp], executors=FAST_EXECUTORS)
    prompt = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        jm(prompt, torch.arange(PROMPT))
    prefill = collective_counts(thunder.last_traces(jm)[-1])
    for block in jm.transformer.h:  # a fresh cache for the generation
        block.attn.kv_cache.reset_parameters()
    want_tokens, want_logits = greedy(reference, prompt, 4)
    tokens, logits = greedy(jm, prompt, 4)
    assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
    for got, want in zip(logits, want_logits, strict=True):
        assert_close_scaled(got, want, rtol=1e-6, atol=1e-6, what="logits")
    return {"prefill": prefill, "decode": collective_counts(thunder.last_traces(jm)[-1]),
            "minimum": expected_counts(config, "tp", size)[0]}


def test_decode_steps_are_not_decomposed():
    counts = run_ranks(_generation_with_everything_decomposed, 2)[0]
    assert counts["decode"] == counts["minimum"], counts
    assert counts["prefill"]["all_reduce"] > counts["minimum"]["all_reduce"], counts


def test_cost_model_decomposes_only_where_it_pays():
    """Llama-3-8B's MLP at TP=2 on H100s: its all_gather pays; a 32-token all_reduce on gloo does not; a chunk count
    is never more than pays."""
    h100 = overlap_cost.Costs(22e-6, 370e9, 700e12, 2e-6, 128, 132)
    tokens, dim, ffn = 8192, 4096, 14336
    mlp = overlap_cost.Linears(tokens, ((dim, ffn // 2), (dim, ffn // 2)))
    assert overlap_cost.gather_pays(h100, 2, tokens * dim * 2, mlp)
    gloo = overlap_cost.Costs(1e-3, 0.8e9, 90e9, 30e-6)
    tiny = overlap_cost.Linears(32, ((32, 64),))
    assert overlap_cost.reduce_chunks(gloo, 2, 32 * 64 * 4, tiny, backward=False, at_least_two=False) == 1
    down = overlap_cost.Linears(tokens, ((ffn // 2, dim),))
    chunks = overlap_cost.reduce_chunks(h100, 2, tokens * dim * 2, down, backward=False, at_least_two=False)
    assert 1 < chunks < overlap_cost.MAX_CHUNKS, chunks
