"""HuggingFace transformers models under plans.hf (TP / TP+SP / loss parallel) vs one device: loss, logits, every
grad and the collective counts; the plan's errors."""

import pytest
import thunder
import torch

import thunder_tp
from tests.dist import run_ranks
from tests.hf_models import DENSE, MODES, SEQ, assert_step_matches, batch, expected_counts, make_model, tp_sizes
from tests.hf_models import MOE as MOE_NAMES
from tests.tp_checks import (
    FAST_EXECUTORS,
    assert_close_scaled,
    assert_grads_are_shards,
    collective_counts,
)
from thunder_tp import TensorParallel
from thunder_tp.thunder_internals.overlapping_inputs import separate_overlapping_views

# HF computes its loss (and most norms) in float32 even for float64 models

pytest.importorskip("transformers")


def _train(name: str, mode: str, overlapping: bool = False) -> dict:
    """One step single-device and under TP on the same batch: loss, logits, every grad; the collectives.
    `overlapping`: input_ids and labels two overlapping views of one tensor, the models in eval mode (as
    `from_pretrained` leaves them: HF then builds its causal mask with an in-place op)."""
    reference = make_model(name)
    model = make_model(name)
    model.load_state_dict(reference.state_dict())
    if overlapping:
        reference.eval()
        model.eval()
    transform = TensorParallel(thunder_tp.plans.hf(model, **MODES[mode]))
    jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)
    if overlapping:
        data = batch(length=SEQ + 1)
        idx, labels = data[:, :-1], data[:, 1:]
    else:
        idx = labels = batch()
    assert_step_matches(reference, jm, transform.parameter_layouts, idx, labels)
    return {"forward": collective_counts(thunder.last_traces(jm)[-1]),
            "backward": collective_counts(thunder.last_backward_traces(jm)[-1])}


def _check(world: int, name: str, mode: str, overlapping: bool = False) -> None:
    counts = run_ranks(_train, world, name, mode, overlapping)[0]
    forward, backward = expected_counts(name, mode, world)
    assert counts["forward"] == forward, counts
    assert counts["backward"] == backward, counts


#: the default run: Llama under loss parallel, tied embeddings (Gemma) under SP, and Llama's TP in
#: test_overlapping_views_as_input_ids_and_labels; every other architecture, mode and TP=4 (K/V heads replicated:
#: Qwen2 with 2) in the slow sweep (K/V replication runs by default in test_litgpt_zoo's Qwen2.5 at TP=4)
FAST = [(2, "llama", "tp_lp"), (2, "gemma", "tp_sp")]


@pytest.mark.parametrize("world, name, mode", FAST, ids=[f"tp{w}-{n}-{m}" for w, n, m in FAST])
def test_hf_model_matches_single_device(world, name, mode):
    _check(world, name, mode)


#: Qwen2-MoE (shared experts and their gate) in TP; Mixtral in TP+SP (the router logits its block returns and its layer
#: drops); the other MoE architectures and modes in the slow sweep
MOE = [(2, "qwen2_moe", "tp"), (2, "mixtral", "tp_sp")]


@pytest.mark.parametrize("world, name, mode", MOE, ids=[f"tp{w}-{n}-{m}" for w, n, m in MOE])
def test_hf_moe_matches_single_device_with_one_reduction_per_moe_block(world, name, mode):
    _check(world, name, mode)


def test_overlapping_views_as_input_ids_and_labels():
    """idx = data[:, :-1], labels = data[:, 1:]: Thunder alone substitutes one for the other (same storage, same
    shape) once the program has an in-place op (HF's causal mask in eval mode); thunder_tp passes them apart."""
    _check(2, "llama", "tp", overlapping=True)


def test_only_overlapping_different_views_are_copied():
    data = torch.arange(12).reshape(2, 6)
    idx, labels, other = data[:, :-1], data[:, 1:], torch.zeros(3)
    (a, b, c), kwargs = separate_overlapping_views((idx, labels, other), {"same": idx, "flag": False})
    assert a is idx and c is other and kwargs["same"] is idx and kwargs["flag"] is False
    assert b is not labels and torch.equal(b, labels) and b.untyped_storage().data_ptr() != data.data_ptr()


@pytest.mark.slow  # the MoE lookasides against eager HF: every test_hf_moe_* case compares them under TP
def test_one_device_jit_of_an_hf_moe_model_matches_eager():
    reference, model = make_model("qwen2_moe"), make_model("qwen2_moe")
    thunder_tp.models.hf.moe.register_lookasides(model)
    jm = thunder.jit(model, executors=FAST_EXECUTORS)  # thunder_tp's compiles (the lookasides serve those only)
    idx = batch()
    expected = reference(input_ids=idx, labels=idx, use_cache=False).loss
    actual = jm(input_ids=idx, labels=idx, use_cache=False).loss
    assert_close_scaled(actual, expected, rtol=1e-12, atol=1e-12, what="loss")
    expected.backward()
    actual.backward()
    assert_grads_are_shards(reference, jm, {}, 0, 1, rtol=1e-10, atol=1e-10)  # no TP: one rank holding everything
    names = [b.sym.name for b in thunder.last_traces(jm)[-1].bound_symbols]
    assert names.count("moe_layer") == 2, names


SWEEP = [(w, n, m) for n in DENSE for w in (2, 4) if w in tp_sizes(n) for m in MODES if (w, n, m) not in FAST]
SWEEP += [(w, n, m) for n in MOE_NAMES for w in (2, 4) if w in tp_sizes(n) for m in MODES if (w, n, m) not in MOE]


@pytest.mark.slow
@pytest.mark.parametrize("world, name, mode", SWEEP, ids=[f"tp{w}-{n}-{m}" for w, n, m in SWEEP])
def test_every_architecture_matches_single_device(world, name, mode):
    _check(world, name, mode)


def test_unknown_style_string_is_a_clear_error(monkeypatch):
    model = make_model("llama")
    monkeypatch.setitem(model.config.base_model_tp_plan, "layers.*.mlp.down_proj", "local_packed_rowwise")
    with pytest.raises(NotImplementedError) as excinfo:
        thunder_tp.plans.hf(model)
    message = str(excinfo.value)
    assert "'model.layers.0.mlp.down_proj'" in message and "'local_packed_rowwise'" in message, message
    assert "pass a hand plan" in message, message


def test_model_without_a_plan_is_a_clear_error():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("stablelm", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=64)
    with pytest.raises(ValueError) as excinfo:
        thunder_tp.plans.hf(AutoModelForCausalLM.from_config(config))
    message = str(excinfo.value)
    assert "StableLmForCausalLM has no tp_plan" in message and "pass a hand plan" in message, message



def test_the_plan_checks_the_tp_size_it_is_made_for():
    """plans.hf(model, tp_size=N) raises at once where N ranks cannot split the model (hidden 64 over 128 ranks),
    naming the parameter; a size that works gives the plan."""
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj"):
        thunder_tp.plans.hf(model, tp_size=128)
    assert thunder_tp.plans.hf(model, tp_size=2) == thunder_tp.plans.hf(model)
