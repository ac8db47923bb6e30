"""thunder_tp.one_rank: one rank of N alone in this process runs that rank's program of a real N-rank group.

For a litgpt llama under TP, TP + sequence parallel, TP + loss parallel (a training step) and a KV-cache decode
step: rank r in ``one_rank(N, r)`` (built on the meta device, random weights from Thunder's MaterializationTransform)
has the local parameter shapes and the forward and backward collectives (kind, group size, bytes, count, in order of
first appearance: ``thunder_tp.collectives_table`` of the final traces) of rank r of a real N-rank gloo group
(built on the CPU from seeded weights). The one-rank side runs in the pytest process (it holds no process group:
tests/dist.py's gloo groups live in pool workers).
"""

from __future__ import annotations

import math

import pytest
import thunder
import torch
import torch.distributed as dist
from litgpt import GPT
from litgpt.model import build_mask_cache
from thunder.transforms import MaterializationTransform

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import MODES, SEQ, GPTWithLoss, batch, make_config
from tests.tp_checks import FAST_EXECUTORS

PROMPT = 4


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not dist.is_initialized(), "one_rank tests need a process without a process group"
    yield
    assert not dist.is_initialized(), "one_rank left its fake process group behind"


def _model(case: str, meta: bool) -> torch.nn.Module:
    """The llama of the case (with its loss for training, with a KV cache for decode), on the meta device or
    seeded on the CPU."""
    config = make_config("llama")
    config.n_layer = 1  # one block shows every collective of a block; each program compiles on every rank
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        if case != "decode":
            return GPTWithLoss(config)
        model = GPT(config)
        model.max_seq_length = SEQ
        model.set_kv_cache(batch_size=1)
    model.mask_cache = build_mask_cache(SEQ, torch.device("cpu"))  # a plain attribute: not materialized
    return model.eval()


def _jit(model: torch.nn.Module, case: str, meta: bool) -> torch.nn.Module:
    plan_model = model.gpt if case != "decode" else model
    options = MODES.get(case, {})
    plan = thunder_tp.plans.litgpt(plan_model, **options)
    if case != "decode":
        plan = {f"gpt.{k}": v for k, v in plan.items()}
    transforms = [thunder_tp.TensorParallel(plan)]
    if meta:
        transforms.append(MaterializationTransform("cpu",
                                                   init=MaterializationTransform.init_from_original_module_init()))
    return thunder.jit(model, transforms=transforms, executors=FAST_EXECUTORS)


def _program(case: str, meta: bool) -> dict:
    """A case (a training mode of tests/litgpt_models.py, or "decode": a decode step of the plain TP plan): this
    rank's local parameter shapes, the collectives of its final traces and its loss (or logits) finite."""
    jm = _jit(_model(case, meta), case, meta)
    idx, targets = batch()
    if case == "decode":
        prompt = idx[:1, :PROMPT]
        with torch.no_grad():
            jm(prompt, torch.arange(PROMPT))
            out = jm(prompt[:, -1:], torch.tensor([PROMPT]))  # the decode step: its trace is the last one
        backward = None
    else:
        out = jm(idx, targets)
        out.backward()
        backward = thunder.last_backward_traces(jm)[-1]
    return {
        "params": {n: tuple(p.shape) for n, p in jm.named_parameters()},
        "forward": thunder_tp.collectives_table(thunder.last_traces(jm)[-1]),
        "backward": thunder_tp.collectives_table(backward),
        "finite": bool(torch.isfinite(out).all()),
    }


def _real_rank(cases: tuple[str, ...]) -> dict:
    """On a rank of a real gloo group: every case's program, from seeded CPU weights."""
    return {case: _program(case, meta=False) for case in cases}


def _check_same_program(world: int, cases: tuple[str, ...]) -> None:
    rank = world - 1  # not rank 0: the rank is the fake group's, not a default
    real = run_ranks(_real_rank, world, cases, timeout=600)[rank]
    with thunder_tp.one_rank(world, rank, device="cpu"):
        assert dist.get_rank() == rank and dist.get_world_size() == world
        alone = {case: _program(case, meta=True) for case in cases}
    for case in cases:
        for what in ("params", "forward", "backward"):
            assert alone[case][what] == real[case][what], (case, what, alone[case][what], real[case][what])
        assert alone[case]["finite"], f"{case}: one rank's loss or logits are not finite"
        assert real[case]["forward"], f"{case}: no collectives in the forward: the check would be empty"


def test_tp2_rank_alone_runs_the_real_rank_program():
    _check_same_program(2, ("tp_sp", "decode"))


@pytest.mark.slow  # reason: a real 4-rank group (on 2 cores) and the same cases as at TP 2
def test_tp4_rank_alone_runs_the_real_rank_program():
    _check_same_program(4, ("tp_sp", "decode"))


@pytest.mark.slow  # reason: every other case compiled on every rank of a real group
def test_rank_alone_without_sequence_parallel():
    _check_same_program(2, ("tp", "tp_lp"))
    _check_same_program(4, ("tp", "tp_lp"))


def test_reduce_scatter_gives_this_rank_chunk_and_is_restored():
    import torch.distributed._functional_collectives as funcol

    original = dist.reduce_scatter_tensor
    full = torch.arange(12.0)
    with thunder_tp.one_rank(4, 2, device="cpu"):
        out = torch.full((3,), math.nan)
        dist.reduce_scatter_tensor(out, full)
        assert out.tolist() == [6.0, 7.0, 8.0]
        functional = funcol.reduce_scatter_tensor(full, "sum", 0, dist.group.WORLD)
        assert functional.wait().tolist() == [6.0, 7.0, 8.0]
    assert dist.reduce_scatter_tensor is original and not dist.is_initialized()


def test_without_a_process_group_the_ranks_live_on_the_cpu():
    from thunder_tp.collectives.run_mode import ranks_of

    assert not torch.distributed.is_initialized()
    assert ranks_of().device == torch.device("cpu")  # ck.load of a meta model on one device (the CLI's TP=1 run)


def test_nothing_to_agree_with_under_one_rank():
    from thunder_tp.collectives.run_mode import ranks_of
    from thunder_tp.generate.generation import _check_ranks_agree

    with thunder_tp.one_rank(2, 1, device="cpu"):
        assert not ranks_of().has_peers
        _check_ranks_agree([1, 2, 3])  # no other rank's tokens: returns, no exchange


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        with thunder_tp.one_rank(4, 4):
            pass
    with pytest.raises(TypeError, match="world_size must be an int"):
        with thunder_tp.one_rank(2.0, 0):
            pass
    with thunder_tp.one_rank(2, 0, device="cpu"):
        with pytest.raises(RuntimeError, match="already initialized"):
            with thunder_tp.one_rank(2, 1):
                pass
