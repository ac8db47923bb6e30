"""A vocabulary no TP size divides: HF GPT-2 (Conv1D layers, tied embedding and head) with 257 entries, the
embedding and the head vocabulary-parallel (129 / 128 at TP 2, 65 / 64 / 64 / 64 at TP 4), under TP, TP+SP and loss
parallel, against one device (loss, logits, every grad, the collectives)."""

import pytest
import thunder

import thunder_tp
from tests.dist import run_ranks
from tests.hf_models import GPT2, MODES, assert_step_matches, batch, make_gpt2
from tests.tp_checks import (
    FAST_EXECUTORS,
    collective_counts,
)
from thunder_tp import TensorParallel

pytest.importorskip("transformers")

# HF computes its loss in float32 even for float64 models


def _train(mode: str) -> dict:
    reference, model = make_gpt2(), make_gpt2()
    transform = TensorParallel(thunder_tp.plans.hf(model, **MODES[mode]))
    jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)
    idx = batch()
    assert_step_matches(reference, jm, transform.parameter_layouts, idx, idx)
    vocab = jm.get_parameter("transformer.wte.weight").shape[0]
    return {"forward": collective_counts(thunder.last_traces(jm)[-1]),
            "backward": collective_counts(thunder.last_backward_traces(jm)[-1]), "vocab": vocab}


def _expected(mode: str) -> dict:
    """Megatron's minimum for 2 blocks: 2 reductions per block and the embedding's, the logits' gather (the model
    returns them) and under loss parallel the (log-sum-exp, target logit) pairs'; under SP GPT-2's learned positions
    add one all_gather backward (their grad, sliced to the sequence shards forward) and the replicated norms and
    biases one all_reduce."""
    if mode == "tp_sp":
        return {"forward": {"reduce_scatter": 5, "all_gather": 6},
                "backward": {"reduce_scatter": 5, "all_gather": 6, "all_reduce": 1}}
    return {"forward": {"all_reduce": 5, "all_gather": 1 + (mode == "tp_lp")}, "backward": {"all_reduce": 5}}


CASES = [(2, "tp_lp"), *(pytest.param(w, m, marks=pytest.mark.slow)  # the same vocabulary split: other modes, TP 4
                         for w, m in [(4, "tp_lp"), (2, "tp"), (2, "tp_sp"), (4, "tp"), (4, "tp_sp")])]


@pytest.mark.parametrize("world,mode", CASES)
def test_gpt2_with_a_vocabulary_no_size_divides(world, mode):
    results = run_ranks(_train, world, mode)
    pieces = [r.pop("vocab") for r in results]
    assert pieces == [GPT2["vocab_size"] // world + (r < GPT2["vocab_size"] % world) for r in range(world)], pieces
    assert results[0] == _expected(mode), results[0]
