"""Nothing silent: different inputs on the ranks of a TP group raise on every rank at the first call (every call when
asked), before any collective; replicated parameters that differ across the TP group make a checkpoint save raise."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tp_checks import FAST_EXECUTORS
from thunder_tp.runtimes.divergence import InputAgreement


def _gpt(dtype=torch.float64):
    import thunder

    import thunder_tp
    from tests.litgpt_models import GPTWithLoss, make_config

    torch.manual_seed(0)
    model = GPTWithLoss(make_config("neox")).to(dtype)
    transform = thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))
    return thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)


def _first_call_with_rank_batches() -> str:
    """Each rank its own batch (a sampler over the world): the first call raises, on every rank."""
    import thunder
    import torch.distributed as dist

    from tests.litgpt_models import batch

    jm = _gpt()
    idx, targets = batch(seed=dist.get_rank())
    try:
        jm(idx, targets)
    except RuntimeError as e:
        assert thunder.compile_stats(jm).cache_misses == 0  # raised before compiling (and before any collective)
        return str(e)
    return "no error"


def test_different_batches_on_tp_ranks_raise_on_every_rank_at_the_first_call():
    messages = run_ranks(_first_call_with_rank_batches, 2, timeout=120)
    for m in messages:
        assert "were handed different inputs (same shapes, different values" in m, m
        assert "data-parallel group" in m and "DistributedSampler" in m, m


def _mlp(check_inputs: str):
    import thunder

    import thunder_tp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    plan = {"0": thunder_tp.ColwiseParallel(), "2": thunder_tp.RowwiseParallel()}
    transform = thunder_tp.TensorParallel(plan, check_inputs=check_inputs)
    return thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)


def _later_call_with_rank_shapes(check_inputs: str) -> str:
    """The same inputs first, then a different batch size on rank 1 (a training call: autograd on)."""
    import torch.distributed as dist

    jm = _mlp(check_inputs)
    jm(torch.ones(3, 8))
    try:
        jm(torch.ones(3 + dist.get_rank(), 8))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("check_inputs", ["training", "every"])
def test_check_inputs_at_a_later_training_call(check_inputs):
    for m in run_ranks(_later_call_with_rank_shapes, 2, check_inputs, timeout=120):
        assert "different inputs (their shapes or dtypes differ" in m, m


@pytest.mark.parametrize(("check_inputs", "compared"), [
    ("training", [True, True, False, False, True]),  # every call with autograd on, the first without
    ("every", [True, True, True, True, True]),
    ("first", [True, False, False, False, False]),
])
def test_which_calls_are_compared(check_inputs, compared):
    """Calls with autograd on, off, off, off, on (the group is not used to decide)."""
    agreement = InputAgreement(None, check_inputs)
    due = []
    for grad in (True, False, False, False, True):
        with torch.set_grad_enabled(grad):
            due.append(agreement._due())
    assert due == compared


def _first_call_with_rank_values() -> float:
    """check_inputs="never": each rank its own values at the first call (same shapes: the collectives match) run."""
    import torch.distributed as dist

    jm = _mlp("never")
    return jm(torch.full((3, 8), 1.0 + dist.get_rank())).sum().item()


def test_check_inputs_never_compares_nothing():
    run_ranks(_first_call_with_rank_values, 2, timeout=120)  # no error: what "never" asks for
    with pytest.raises(ValueError, match="check_inputs must be one of"):
        import thunder_tp

        thunder_tp.TensorParallel({}, check_inputs="sometimes")


def _save_with_diverged_replica(directory: str) -> str:
    import torch.distributed as dist

    import thunder_tp.checkpoint as ck

    jm = _mlp("first")
    with torch.no_grad():
        jm.get_parameter("2.bias").add_(float(dist.get_rank()) * 1e-7)  # replicated (Rowwise bias)
    try:
        ck.save(directory, jm)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_save_refuses_replicas_that_differ(tmp_path):
    for m in run_ranks(_save_with_diverged_replica, 2, str(tmp_path / "ckpt"), timeout=120):
        assert "replicated tensors differ across the ranks of the TP group" in m and "['2.bias']" in m, m
    assert not (tmp_path / "ckpt" / ".metadata").exists()
