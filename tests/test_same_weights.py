"""Every rank of a TP group shards the same full weights (plain thunder.jit, 2 gloo ranks): ranks that seeded their
models differently raise at the first call, on every rank, naming the parameters and the fix, before the program runs;
so do ranks whose replicated parameter alone differs, and meta-device models materialized by each rank's own init;
`check_weights=False` turns the check off; a checkpoint loaded by every rank after jit replaces what was seen."""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.distributed as dist
from thunder.transforms import MaterializationTransform

import thunder_tp
import thunder_tp.checkpoint as ck
from tests.dist import run_ranks
from tests.parallel_mlp import MLP, PLAN, mlp_input
from tests.tp_checks import FAST_EXECUTORS


def _first_call(model: torch.nn.Module, *, check: bool = True, materialize: bool = False, load: str = "") -> str:
    """Jit `model` under TP (materialized by each module's own init where asked; `load`: a checkpoint loaded after
    jit) and call it: its error, or "ran"."""
    transforms = [thunder_tp.TensorParallel(PLAN, check_weights=check)]
    if materialize:
        init = MaterializationTransform.init_from_original_module_init()
        transforms.append(MaterializationTransform("cpu", init=init))
    jm = thunder.jit(model, transforms=transforms, executors=FAST_EXECUTORS)
    if load:
        ck.load(load, jm)
    try:
        jm(*mlp_input()).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "ran"


def _seeded(seed: int, device: str = "cpu") -> MLP:
    torch.manual_seed(seed)
    with torch.device(device):
        return MLP()


def _every_case(checkpoint: str) -> dict[str, str]:
    """Each rank seeded with its rank (unless said otherwise): the outcome of each way of building the model."""
    rank = dist.get_rank()
    saved = thunder.jit(_seeded(0), transforms=[thunder_tp.TensorParallel(PLAN)], executors=FAST_EXECUTORS)
    ck.save(checkpoint, saved)
    replicated_differs = _seeded(0)
    with torch.no_grad():
        replicated_differs.fc2.bias[0] += rank  # RowwiseParallel: fc2's bias is replicated
    return {
        "seeded by rank": _first_call(_seeded(rank)),
        "unchecked": _first_call(_seeded(rank), check=False),
        "replicated bias": _first_call(replicated_differs),
        "materialized by rank": _first_call(_seeded(rank, "meta"), materialize=True),
        "materialized alike": _first_call(_seeded(0, "meta"), materialize=True),
        "loaded after jit": _first_call(_seeded(rank), load=checkpoint),
    }


def test_ranks_of_different_weights_raise_at_the_first_call(tmp_path):
    outcomes = run_ranks(_every_case, 2, str(tmp_path / "checkpoint"), timeout=180)
    for rank, outcome in enumerate(outcomes):
        for case in ("seeded by rank", "materialized by rank"):
            message = outcome[case]
            named = ("TensorParallel's weight check: 4 of 4 tensors differ across the ranks (global ranks with equal "
                     "tensors: [[0], [1]]): fc1.bias, fc1.weight, fc2.bias, fc2.weight.")
            assert named in message, (rank, case, message)
            assert "torch.manual_seed(0)" in message and "check_weights=False" in message, message
        assert "1 of 4 tensors differ across the ranks" in outcome["replicated bias"], outcome
        assert "): fc2.bias." in outcome["replicated bias"], outcome
        for case in ("unchecked", "materialized alike", "loaded after jit"):
            assert outcome[case] == "ran", (rank, case, outcome[case])


def test_check_weights_must_be_a_bool():
    with pytest.raises(TypeError, match="check_weights must be True or False"):
        thunder_tp.TensorParallel({}, check_weights=1)
