"""torchtitan's Llama 3 (complex rotary embedding) with torchtitan's own TP plan: one device's loss and every grad."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.torchtitan_llama import ModelArgs, Transformer, WithLoss, apply_tp, tp_plan
from tests.tp_checks import compare_with_single_device

ARGS = ModelArgs()
SEQ = 8


def _make_model() -> WithLoss:
    return WithLoss(Transformer(ARGS)).double()


def _make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    return torch.randint(0, ARGS.vocab_size, (2, SEQ)), torch.randint(0, ARGS.vocab_size, (2, SEQ))


def _plan(kind: str) -> dict:
    if kind == "tp":
        return {"model": tp_plan()}
    import thunder_tp

    # torchtitan's apply_tp, run with its parallelize_module calls read as the plan (no DTensor is made)
    return {"model": thunder_tp.plans.from_parallelize_fn(apply_tp, Transformer(ARGS), None, loss_parallel=True)}


def _compare(kind: str) -> dict:
    import thunder_tp

    torch.set_default_dtype(torch.float64)
    transform = thunder_tp.TensorParallel(_plan(kind))
    # the rotary embedding computes in float32 (as torchtitan's): one device and TP differ by its rounding
    return compare_with_single_device(_make_model, _make_inputs, transform, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, collectives", [
    # per block: 2 all_reduce each way; the embedding's all_reduce forward, the head's all_gather of the logits
    # forward and all_reduce of its input's grad backward
    pytest.param("tp", {"forward": {"all_reduce": 5, "all_gather": 1}, "backward": {"all_reduce": 5}}, id="tp"),
    # per block: 2 all_gather + 2 reduce_scatter each way; the embedding's reduce_scatter and the head's all_gather;
    # loss parallel's one all_gather of (log-sum-exp, target logit) per token; the norms' grads in one all_reduce
    pytest.param("tp_sp_lp", {"forward": {"all_gather": 6, "reduce_scatter": 5},
                              "backward": {"all_gather": 5, "reduce_scatter": 5, "all_reduce": 1}}, id="tp_sp_lp"),
])
def test_torchtitan_llama_with_its_plan_trains_as_one_device(kind, collectives):
    """Loss and every grad equal one device's (eager, float64 but the rotary's float32); Megatron's collectives."""
    info = run_ranks(_compare, 2, kind)[0]
    assert {k: info[k] for k in ("forward", "backward")} == collectives


def test_from_parallelize_fn_reads_torchtitans_calls_as_one_plan():
    """apply_tp's parallelize_module calls (the model's, then each block's) read as one plan, nothing applied."""
    import thunder_tp
    from thunder_tp.styles import ColwiseParallel, ModuleLayouts, RowwiseParallel, SequenceParallel

    model = Transformer(ARGS)
    plan = thunder_tp.plans.from_parallelize_fn(apply_tp, model, None, loss_parallel=False)
    assert isinstance(plan["layers.1.attention.wq"], ColwiseParallel)
    assert isinstance(plan["layers.0.feed_forward.w2"], RowwiseParallel)
    assert isinstance(plan["layers.0.attention"], ModuleLayouts)
    assert isinstance(plan["norm"], SequenceParallel)
    assert len(plan) == 3 + 11 * ARGS.n_layers
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # no DTensor made
