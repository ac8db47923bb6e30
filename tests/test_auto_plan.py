"""plans.auto: a plan searched on a trace, exact against one device, no worse than the hand plans, and far cheaper
than gathering around every layer on models nobody wrote a plan for.

Each case plans on a meta-device copy of the model (shapes only), jits the real model with that plan on real gloo
ranks (float64), checks the loss and every grad against one device, and checks that the collectives the program
issues are the ones the search priced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import thunder
import torch

import thunder_tp
from tests import custom_models
from tests.dist import run_ranks
from tests.litgpt_models import batch, lora_config, zoo_config
from tests.tp_checks import (
    FAST_EXECUTORS,
    assert_close_scaled,
    assert_grads_are_shards,
    collective_counts,
    rank_and_size,
)
from tests.zoo_checks import simulated_at_tp8
from thunder_tp import TensorParallel
from thunder_tp.plans.litgpt import GPTWithLoss


@dataclass
class Case:
    """A model to plan: its factory, example inputs, its hand plan (or the naive one), how to read its loss."""

    make: Callable[[], torch.nn.Module]
    args: tuple
    kwargs: dict
    other_plan: Callable[[torch.nn.Module], dict]
    loss: Callable = lambda out: out
    tolerance: float = 2e-6  # litgpt's RMSNorm runs in float32; everything else is exact to ~1e-12


def _case(family: str, name: str) -> Case:
    if family == "litgpt":
        config = zoo_config(name)
        return Case(lambda: GPTWithLoss(config).double(), batch(0), {}, thunder_tp.plans.litgpt)
    if family == "hf":
        from tests import hf_models

        idx = hf_models.batch()
        return Case(lambda: hf_models.make_model(name), (), dict(input_ids=idx, labels=idx, use_cache=False),
                    thunder_tp.plans.hf, lambda out: out.loss, 1e-5)  # HF's loss and norms run in float32
    return Case(lambda: custom_models.MODELS[name]().double(), custom_models.inputs(name), {}, custom_models.naive_plan)


def _figures(comm, used: int) -> tuple[int, float, int]:
    """(collectives per step, cost-model communication, parameter bytes per rank) of a priced plan."""
    return comm.count, comm.cost, used


def _no_worse(auto: tuple[int, float, int], hand: tuple[int, float, int]) -> bool:
    """Against the hand plan: no more collectives, no higher cost, parameter bytes at most the hand plan's + 1%."""
    return auto[0] <= hand[0] and auto[1] <= hand[1] and auto[2] <= 1.01 * hand[2]


def _plan_compared_with_hand(plan, model, args: tuple, kwargs: dict, hand_plan: dict):
    """The plan the comparison with the hand plan is made on, and the hand plan's price: the default budget's plan,
    or where that one fails the comparison, the plan searched again with `memory=` the hand plan's bytes + 1%. The
    default budget keeps 1-D parameters whole, where the hand plan may split some (OLMo-2's q/k norms over all heads:
    bytes over), and splits every weight matrix, where the hand plan keeps MoE routers whole (at TP 8 at zoo size a
    router is more than the 1% slack: it gets sharded)."""
    hand = plan.price(hand_plan)
    if _no_worse(_figures(plan.communication, plan.bytes_per_rank), _figures(*hand)):
        return plan, hand
    return thunder_tp.plans.auto(model, *args, tp_size=plan.tp_size, memory=int(1.01 * hand[1]), **kwargs), hand


def _run_auto(family: str, name: str, shorthand: bool = False) -> dict:
    """Plan on the meta device, train one step with the plan against one device; counts priced and run."""
    rank, size = rank_and_size()
    case = _case(family, name)
    torch.manual_seed(0)
    reference = case.make()
    with torch.device("meta"):
        meta = case.make()
    plan = thunder_tp.plans.auto(meta, *case.args, tp_size=size, **case.kwargs)
    if family != "custom":
        plan, _ = _plan_compared_with_hand(plan, meta, case.args, case.kwargs, case.other_plan(meta))
    model = case.make()
    model.load_state_dict(reference.state_dict())
    example = (case.args, case.kwargs)
    transform = TensorParallel("auto", example_inputs=example) if shorthand else TensorParallel(plan)
    jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)
    expected, actual = case.loss(reference(*case.args, **case.kwargs)), case.loss(jm(*case.args, **case.kwargs))
    assert_close_scaled(actual, expected, rtol=0, atol=case.tolerance, what=f"{name} loss")
    expected.backward()
    actual.backward()
    assert_grads_are_shards(reference, jm, transform.parameter_layouts, rank, size, rtol=0, atol=case.tolerance,
                            what=name)
    return {
        "ran": (collective_counts(thunder.last_traces(jm)[-1]),
                collective_counts(thunder.last_backward_traces(jm)[-1])),
        "priced": (dict(plan.communication.forward), dict(plan.communication.backward)),
        "auto": _figures(plan.communication, plan.bytes_per_rank),
        "other": _figures(*plan.price(case.other_plan(meta))),
        "same_plan": dict(transform.plan) == dict(plan),
        "trace_reused": shorthand and transform.plan.trace_reused,  # the compile started from the search's trace
        "plan": str(plan),
    }


#: the MLP stack: test_tensor_parallel_auto_searches_at_jit; the ViT's transformer is in conv_vit; T5's
#: encoder-decoder slow-marked (conv_vit and the MLP stack search models without a plan by default)
CUSTOM = [pytest.param("vit", marks=pytest.mark.slow), pytest.param("t5", marks=pytest.mark.slow), "conv_vit"]


@pytest.mark.parametrize("name", CUSTOM)
def test_models_without_a_plan_get_one_cheaper_than_gathering_around_every_layer(name):
    info = run_ranks(_run_auto, 2, "custom", name, timeout=TIMEOUT_S)[0]
    assert info["ran"] == info["priced"], info
    count, cost, _ = info["auto"]
    naive_count, naive_cost, _ = info["other"]
    assert count < naive_count and cost < naive_cost, info


#: each rank traces the model twice (the search, then the compile): 4 ranks on 2 loaded cores need more than 300 s
TIMEOUT_S = 1200
LITGPT = [("Llama-3.2-1B", 2, ""), ("pythia-14m", 2, "slow"), ("Qwen2.5-1.5B", 4, "slow"),
          ("Mixtral-8x7B-v0.1", 2, "slow")]


def _params(cases):
    return [pytest.param(*case[:-1], marks=[pytest.mark.slow] if case[-1] else [], id="-tp".join(map(str, case[:2])))
            for case in cases]


@pytest.mark.parametrize("name,world", _params(LITGPT))
def test_litgpt_auto_plan_is_no_worse_than_the_hand_plan(name, world):
    info = run_ranks(_run_auto, world, "litgpt", name, timeout=TIMEOUT_S)[0]
    assert info["ran"] == info["priced"], info
    assert _no_worse(info["auto"], info["other"]), info


def _hf_sizes() -> list[tuple[str, int]]:
    from tests.hf_models import DENSE, tp_sizes

    return [(n, w) for n in DENSE for w in tp_sizes(n) if w <= 4]


def _hf_cases() -> list[tuple[str, int, str]]:
    """Every dense architecture at TP=2 and 4 where its heads allow, slow: the search is the same for every family
    and runs by default on litgpt (test_litgpt_auto_plan_*) and on models without a plan."""
    return [(n, w, "slow") for n, w in _hf_sizes()]


HF = _hf_cases()


@pytest.mark.parametrize("name,world", _params(HF))
def test_hf_auto_plan_is_no_worse_than_plans_hf(name, world):
    pytest.importorskip("transformers")
    info = run_ranks(_run_auto, world, "hf", name, timeout=TIMEOUT_S)[0]
    assert info["ran"] == info["priced"], info
    assert _no_worse(info["auto"], info["other"]), info


def test_tensor_parallel_auto_searches_at_jit():
    info = run_ranks(_run_auto, 2, "custom", "mlp", True, timeout=TIMEOUT_S)[0]
    assert info["same_plan"] and info["trace_reused"] and info["ran"] == info["priced"], info
    assert info["auto"][:2] < info["other"][:2], info  # fewer collectives than the naive plan


def _trace_reused_only_for_a_call_like_the_example() -> dict:
    """TensorParallel("auto") on the MLP stack searched on a batch of 1: a first call of batch 2 interprets the model
    itself; a second model searched on the batch of 2 starts its compile from the search's trace. Both exact."""
    torch.manual_seed(0)
    reference = custom_models.MLPStack().double()
    x, labels = custom_models.inputs("mlp")
    reused, errors = [], []
    for example in ((x[:1], labels[:1]), (x, labels)):
        model = custom_models.MLPStack().double()
        model.load_state_dict(reference.state_dict())
        transform = TensorParallel("auto", example_inputs=(example, {}))
        jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)
        errors.append((jm(x, labels) - reference(x, labels)).abs().item())
        reused.append(transform.plan.trace_reused)
    return {"reused": reused, "errors": errors}


def test_the_compile_starts_from_the_search_trace_only_for_a_call_like_the_example():
    info = run_ranks(_trace_reused_only_for_a_call_like_the_example, 2, timeout=TIMEOUT_S)[0]
    assert info["reused"] == [False, True] and max(info["errors"]) < 1e-12, info


def _check_priced_against_hand(case: str, model, args: tuple, kwargs: dict, world: int, hand_plan: dict):
    """Against the hand plan, priced on one trace (no ranks): no more collectives, no higher cost, parameter bytes
    at most the hand plan's + 1%; one PRICED line per case (-s) for the README's sweep. The plan compared."""
    searched = thunder_tp.plans.auto(model, *args, tp_size=world, **kwargs)
    plan, (hand, hand_used) = _plan_compared_with_hand(searched, model, args, kwargs, hand_plan)
    auto = plan.communication
    print(f"\nPRICED {case}: auto {auto.count} ({auto}) {plan.bytes_per_rank} B | hand {hand.count} ({hand}) "
          f"{hand_used} B | budget {plan.budget} B")
    assert _no_worse(_figures(auto, plan.bytes_per_rank), _figures(hand, hand_used)), str(plan)
    return plan


@pytest.mark.slow  # LoRA pairs under TP: test_fabric_lora; the search on a litgpt model: the Llama case above
@pytest.mark.parametrize("enable", ["qv", "qkv"])
def test_lora_auto_plan_prices_no_worse_than_plans_litgpt(enable):
    """litgpt.lora models: each LoRA pair is decided with its base layer (the litgpt family's wrapper rule), so the
    search follows the base's style into the pair, as plans.litgpt does; priced only."""
    from litgpt.lora import GPT, mark_only_lora_as_trainable

    with torch.device("meta"):
        model = GPT(lora_config(enable))
    mark_only_lora_as_trainable(model)
    idx = torch.randint(0, 256, (2, 16))
    plan = _check_priced_against_hand(f"lora {enable}", model, (idx,), {}, 2, thunder_tp.plans.litgpt(model))
    assert {type(s).__name__ for k, s in plan.items() if not k.endswith(".linear")} >= {"LoRAPairParallel"}, str(plan)


@pytest.mark.slow
@pytest.mark.parametrize("name,world", _hf_sizes(), ids=[f"{n}-tp{w}" for n, w in _hf_sizes()])
def test_hf_auto_plan_prices_no_worse_than_plans_hf(name, world):
    """Every dense HF architecture at TP 2 and 4 (where its heads allow), priced only: collectives, cost, bytes."""
    pytest.importorskip("transformers")
    from tests import hf_models

    idx = hf_models.batch()
    with torch.device("meta"):
        model = hf_models.make_model(name)
    _check_priced_against_hand(f"{name} tp{world}", model, (), dict(input_ids=idx, labels=idx, use_cache=False),
                               world, thunder_tp.plans.hf(model))


def _zoo_sizes() -> list[tuple[str, int]]:
    from tests.litgpt_models import zoo
    from thunder_tp.plans.litgpt import tp_sizes

    return [(n, w) for n in zoo() for w in (2, 4, 8) if w in tp_sizes(zoo_config(n))]


@pytest.mark.slow
@pytest.mark.parametrize("name,world", _zoo_sizes(), ids=[f"{n}-tp{w}" for n, w in _zoo_sizes()])
def test_zoo_auto_plan_prices_no_worse_than_the_hand_plan(name, world):
    """Every litgpt architecture at TP 2, 4, 8, priced only (no ranks): collectives, cost and parameter bytes."""
    with torch.device("meta"):
        model = GPTWithLoss(zoo_config(name))
    _check_priced_against_hand(f"{name} tp{world}", model, batch(0), {}, world, thunder_tp.plans.litgpt(model))


@pytest.mark.slow
@pytest.mark.parametrize("name,world", [c for c in _zoo_sizes() if c[1] < 8],
                         ids=[f"{n}-tp{w}" for n, w in _zoo_sizes() if w < 8])
def test_zoo_auto_plan_is_exact_and_no_worse_than_the_hand_plan(name, world):
    info = run_ranks(_run_auto, world, "litgpt", name, timeout=TIMEOUT_S)[0]
    assert info["ran"] == info["priced"], info
    assert _no_worse(info["auto"], info["other"]), info


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, w in _zoo_sizes() if w == 8])
def test_zoo_auto_plan_at_tp8_on_simulated_ranks_is_exact_and_no_worse(name):
    """The zoo's TP=8 leg without 8 processes: priced no worse than the hand plan, exact against one device, and the
    collectives that the simulated ranks issue are the ones priced."""
    with torch.device("meta"):
        meta = GPTWithLoss(zoo_config(name))
    plan = _check_priced_against_hand(f"{name} tp8", meta, batch(0), {}, 8, thunder_tp.plans.litgpt(meta))
    counts = simulated_at_tp8(name, lambda model: plan, "auto")
    assert counts == {"forward": dict(plan.communication.forward), "backward": dict(plan.communication.backward)}


def test_auto_plan_is_readable_and_a_plan_tensor_parallel_takes():
    model = custom_models.MLPStack().double()
    plan = thunder_tp.plans.auto(model, *custom_models.inputs("mlp"), tp_size=2)
    text = str(plan)
    assert "'blocks.*.0': ColwiseParallel" in text and "'blocks.*.2': RowwiseParallel" in text, text
    assert "per step forward 3 all_reduce; backward 2 all_reduce" in text and "search" in text, text
    assert dict(TensorParallel(plan).plan) == dict(plan)


def _priced(pricing, decisions, choice) -> tuple | None:
    priced = pricing.price(decisions, choice)
    return None if priced is None else (dict(priced[0].forward), dict(priced[0].backward), priced[0].cost, priced[1])


def test_a_search_prices_each_plan_as_a_pricing_of_it_alone():
    """The search reuses, from one plan's pricing to the next, the bound symbols the styles emitted and the strategies
    propagation chose (on one trace): every single move from the most sharded plan of a llama (and the plan itself)
    costs what a pricing of that plan alone finds: collectives each way, their cost, parameter bytes."""
    from tests.litgpt_models import make_config
    from thunder_tp.layouts import TPGroup
    from thunder_tp.plans.search.decisions import decisions_of
    from thunder_tp.plans.search.pricing import Pricing
    from thunder_tp.plans.search.search import _most_sharded
    from thunder_tp.plans.search.tracing import traced

    with torch.device("meta"):
        model = GPTWithLoss(make_config("llama"))
    trace = traced(model, batch(0), {})
    pricing = Pricing(model, trace, TPGroup(None, 2, 0), training=True)
    decisions = decisions_of(model, trace, 2)
    start = _most_sharded(decisions, pricing, budget=2**40)
    moves = [(*start[:i], j, *start[i + 1:]) for i, d in enumerate(decisions) for j in range(len(d.choices))]
    reused = [_priced(pricing, decisions, choice) for choice in moves]
    alone = [_priced(Pricing(model, trace, TPGroup(None, 2, 0), training=True), decisions, c) for c in moves]
    assert reused == alone
    assert len(set(map(str, reused))) > 5, reused  # the moves price differently


def test_auto_plan_for_inference_shards_the_kv_cache_like_the_hand_plan():
    from litgpt import GPT

    from tests.litgpt_models import make_config

    with torch.device("meta"):
        model = GPT(make_config("llama"))
    model.max_seq_length = 16
    model.set_kv_cache(batch_size=1, device=torch.device("meta"))
    token, position = torch.zeros(1, 1, dtype=torch.int64), torch.tensor([5])
    plan = thunder_tp.plans.auto(model, token, position, tp_size=2, for_inference=True)
    assert isinstance(plan["transformer.h.*.attn.kv_cache"], thunder_tp.KVCacheParallel), str(plan)
    hand, _ = plan.price(thunder_tp.plans.litgpt(model))
    assert plan.communication.forward == hand.forward == {"all_reduce": 5, "all_gather": 1}, str(plan)
    assert not plan.communication.backward, str(plan)


def test_a_budget_no_plan_fits_is_a_clear_error():
    model = custom_models.MLPStack().double()
    with pytest.raises(MemoryError, match=r"no plan fits 0.01 MiB .* blocks\.\d\.0\.weight"):
        thunder_tp.plans.auto(model, *custom_models.inputs("mlp"), tp_size=2, memory=10_000)


def test_auto_without_example_inputs_is_a_clear_error():
    with pytest.raises(ValueError, match=r"example_inputs=\(args, kwargs\)"):
        TensorParallel("auto")
    with pytest.raises(ValueError, match="mapping of module names to styles or \"auto\""):
        TensorParallel("automatic", example_inputs=((), {}))
