"""thunder_tp.checkpoint: save at TP=2, resume at TP=4 / 2 / 1 (plain module) / meta-device TP=2; lit_model.pth; bad
input.

The model is the neox-like config (LayerNorm: every op runs in float64), so resumed runs must reproduce the
original run's next losses to 1e-6 relative (they agree to ~1e-12); a single wrong shard or optimizer moment
moves them by far more.
"""

from __future__ import annotations

import os

import pytest
import thunder
import torch
import torch.distributed as dist
import torch.distributed.checkpoint
from litgpt import GPT

import thunder_tp
import thunder_tp.checkpoint as ck
from tests.dist import run_ranks
from tests.litgpt_models import GPTWithLoss, batch, make_config, training_losses
from tests.tp_checks import FAST_EXECUTORS

SAVED_AFTER, RESUMED = 3, 2
RTOL = 1e-6


def _config(**changes):
    """The neox-like test config with one block (tracing time grows with blocks) and 2 K/V groups for its 4 heads
    (so TP=4 replicates each K/V head on 2 ranks)."""
    config = make_config("neox")
    for key, value in {"n_layer": 1, "n_query_groups": 2, **changes}.items():
        setattr(config, key, value)
    return config


def _model(seed: int, device: str = "cpu") -> GPTWithLoss:
    torch.manual_seed(seed)
    with torch.device(device):
        return GPTWithLoss(_config()).double()


def _jit(model: torch.nn.Module) -> torch.nn.Module:
    plan = thunder_tp.plans.litgpt(model)
    return thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan)], executors=FAST_EXECUTORS)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_save_continue(path: str) -> list[float]:
    """3 AdamW steps at TP=2, save, 2 more steps: their losses."""
    jm = _jit(_model(0))
    optimizer = _optimizer(jm)
    training_losses(jm, optimizer, range(SAVED_AFTER))
    ck.save(path, jm, optimizer)
    return training_losses(jm, optimizer, range(SAVED_AFTER, SAVED_AFTER + RESUMED))


def _resume(path: str, meta: bool = False, own_dcp_calls: bool = False, resave: str = "") -> list[float]:
    """A differently seeded (or meta-device) TP model and a fresh optimizer load the checkpoint and continue.

    own_dcp_calls: then everything is scrambled and reloaded through get_state_dict / dcp.load / set_state_dict.
    resave: a directory the loaded state is saved to again (at this TP size) before continuing.
    """
    jm = _jit(_model(1, "meta" if meta else "cpu"))
    optimizer = _optimizer(jm)
    ck.load(path, jm, optimizer)
    if resave:
        ck.save(resave, jm, optimizer)
    if own_dcp_calls:
        with torch.no_grad():
            for t in (*jm.parameters(), *(v for s in optimizer.state.values() for v in s.values())):
                t.normal_()
        model_sd, optim_sd = ck.get_state_dict(jm, optimizer)
        torch.distributed.checkpoint.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        ck.set_state_dict(jm, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return training_losses(jm, optimizer, range(SAVED_AFTER, SAVED_AFTER + RESUMED))


def _resume_plain(path: str) -> list[float]:
    model = _model(1)
    optimizer = _optimizer(model)
    ck.load(path, model, optimizer)
    return training_losses(model, optimizer, range(SAVED_AFTER, SAVED_AFTER + RESUMED))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[float]]:
    path = str(tmp_path_factory.mktemp("ckpt") / "tp2")
    losses = run_ranks(_train_save_continue, 2, path)
    assert losses[0] == losses[1]
    return path, losses[0]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: test_saved_at_tp3_resumes_...
def test_resume_at_another_tp_size(saved, world, tmp_path):
    """At TP=4 the K/V heads are replicated: loaded into both holders, saved once, and loaded back by a plain module."""
    path, expected = saved
    resave = str(tmp_path / f"tp{world}")
    for losses in run_ranks(_resume, world, path, False, True, resave):
        torch.testing.assert_close(losses, expected, rtol=RTOL, atol=0)
    torch.testing.assert_close(_resume_plain(resave), expected, rtol=RTOL, atol=0)


# --- uneven shards: a TP size that divides neither the heads nor the features nor the vocabulary ------------------


@pytest.fixture(scope="module")
def saved_at_tp3(tmp_path_factory) -> tuple[str, list[float]]:
    """At TP 3: 4 query heads 2 / 1 / 1 (the first K/V head on rank 0 alone, the second on ranks 1 and 2), the MLP's 256
    features and the vocabulary 86 / 85 / 85."""
    path = str(tmp_path_factory.mktemp("ckpt") / "tp3")
    losses = run_ranks(_train_save_continue, 3, path)
    assert losses[0] == losses[1] == losses[2]
    return path, losses[0]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: another even size, as 2
def test_saved_at_tp3_resumes_at_another_tp_size(saved_at_tp3, world):
    """DCP describes each piece by its offsets in the full tensor, so pieces of any lengths load at any TP size."""
    path, expected = saved_at_tp3
    for losses in run_ranks(_resume, world, path):
        torch.testing.assert_close(losses, expected, rtol=RTOL, atol=0)
    torch.testing.assert_close(_resume_plain(path), expected, rtol=RTOL, atol=0)


@pytest.mark.slow  # test_saved_at_tp3_resumes_at_another_tp_size covers uneven pieces on either side of a load
def test_saved_at_tp4_resumes_at_tp3(saved, tmp_path):
    """The TP 2 checkpoint saved again at TP 4 (each K/V head on 2 ranks), resumed at TP 3 (uneven pieces)."""
    path, expected = saved
    at_tp4 = str(tmp_path / "tp4")
    run_ranks(_resume, 4, path, False, False, at_tp4)
    for losses in run_ranks(_resume, 3, at_tp4):
        torch.testing.assert_close(losses, expected, rtol=RTOL, atol=0)


def test_resume_meta_device_model(saved):
    path, expected = saved
    for losses in run_ranks(_resume, 2, path, True):
        torch.testing.assert_close(losses, expected, rtol=RTOL, atol=0)


def test_resume_plain_module_without_process_group(saved):
    path, expected = saved
    assert not dist.is_initialized()
    torch.testing.assert_close(_resume_plain(path), expected, rtol=RTOL, atol=0)


def test_export_to_a_plain_state_dict(saved, tmp_path):
    """`python -m thunder_tp.checkpoint export` gives what the plain model's state_dict() has, at the saved step."""
    path, _ = saved
    out = tmp_path / "lit_model.pth"
    assert ck.main(["export", path, str(out)]) == 0
    model, optimizer = _model(1), None
    ck.load(path, model, optimizer)
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)


# --- a full state-dict file (litgpt's lit_model.pth) -------------------------------------------------------------


def _loss_from_file(path: str, expected: float) -> float:
    """A meta-device litgpt GPT at TP=2 loads lit_model.pth; its loss is the single-device model's."""
    with torch.device("meta"):
        gpt = GPT(_config()).double()
    jm = _jit(gpt)
    ck.load(path, jm)
    idx, targets = batch(0)
    logits = jm(idx)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


def test_lit_model_pth_loads_into_tp2(tmp_path):
    torch.manual_seed(3)
    gpt = GPT(_config()).double()
    path = str(tmp_path / "lit_model.pth")
    torch.save(gpt.state_dict(), path)
    idx, targets = batch(0)
    expected = torch.nn.functional.cross_entropy(gpt(idx).reshape(-1, 256), targets.reshape(-1)).item()
    for loss in run_ranks(_loss_from_file, 2, path, expected):
        assert loss == pytest.approx(expected, rel=1e-9)


# --- bad input: every rank raises, naming what is wrong ----------------------------------------------------------


def _expect_error(path: str, case: str) -> str:
    """Load `path` into a model/optimizer that does not fit (`case`); the message of what every rank raised."""
    model = GPTWithLoss(_config(intermediate_size=512) if case == "config" else _config()).double()
    jm = _jit(model)
    optimizer = torch.optim.SGD(jm.parameters(), lr=0.1, momentum=0.9) if case == "optimizer" else _optimizer(jm)
    before = {n: p.detach().clone() for n, p in jm.named_parameters()}
    try:
        ck.load(path, jm, optimizer)
    except Exception as e:
        unchanged = all(torch.equal(p.detach(), before[n]) for n, p in jm.named_parameters())
        assert unchanged, "model changed by a failed load"
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"ck.load({path!r}) did not raise for {case}")


def test_bad_inputs_raise_on_every_rank(saved, tmp_path):
    path, _ = saved
    torch.save({"gpt.lm_head.weight": torch.zeros(256, 64), "extra": torch.zeros(1)}, tmp_path / "partial.pth")
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"")  # data files written, .metadata (written last) missing
    cases = {
        "config": (path, "has shape"),
        "optimizer": (path, "another optimizer type"),
        "keys": (str(tmp_path / "partial.pth"), "missing keys"),
        "interrupted": (str(interrupted), ".metadata does not exist"),
    }
    for case, (where, message) in cases.items():
        for error in run_ranks(_expect_error, 2, where, case):
            assert message in error and os.path.basename(where) in error, (case, error)


def _first_call_on_meta() -> str:
    with torch.device("meta"):
        model = GPTWithLoss(_config())
    try:
        _jit(model)(*batch(0))
    except RuntimeError as e:
        return str(e)
    raise AssertionError("a meta-device model ran without materialization")


def test_meta_model_without_checkpoint_names_the_ways_out():
    for message in run_ranks(_first_call_on_meta, 2):
        assert "meta device" in message and "checkpoint.load" in message and "MaterializationTransform" in message


# --- 2-D: TP inside Thunder's DDP (dp replicas write once), FSDP refused --------------------------------------


def _save_2d(path: str, kind: str) -> str:
    """Seed-0 model on a dp=2 x tp=2 mesh, saved without a step; FSDP: the error's text."""
    from thunder.distributed.transforms.ddp_v2 import DDPTransform
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    mesh = thunder_tp.init_mesh(dp=2, tp=2)
    model = _model(0)
    dp = (DDPTransform(process_group=mesh.dp_group, bucket_size_in_mb=25.0, broadcast_from=None) if kind == "ddp"
          else FSDPTransform(device=torch.device("cpu"), process_group=mesh.dp_group))
    tp = thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model), process_group=mesh.tp_group)
    jm = thunder.jit(model, transforms=[tp, dp], executors=FAST_EXECUTORS)
    try:
        ck.save(path, jm)
    except NotImplementedError as e:
        return str(e)
    return ""


def test_tp_inside_ddp_saves_each_shard_once_and_fsdp_is_refused(tmp_path):
    path = str(tmp_path / "2d")
    assert run_ranks(_save_2d, 4, path, "ddp") == [""] * 4
    model, expected = _model(1), _model(0).state_dict()
    ck.load(path, model)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    data = sum(f.stat().st_size for f in (tmp_path / "2d").glob("*.distcp"))
    model_bytes = sum(v.numel() * v.element_size() for v in expected.values())
    assert model_bytes <= data < 1.5 * model_bytes, (data, model_bytes)  # the dp replicas wrote nothing twice
    for message in run_ranks(_save_2d, 4, str(tmp_path / "fsdp"), "fsdp"):
        assert "FSDPTransform" in message and "DDPTransform" in message


def test_lit_model_pth_loads_into_a_module_wrapping_the_gpt(tmp_path):
    """litgpt's file holds GPT keys; a GPTWithLoss (keys "gpt.*", as in benchmark_litgpt --checkpoint) takes them."""
    source, target = _model(0), _model(1)
    torch.save(source.gpt.state_dict(), tmp_path / "lit_model.pth")
    ck.load(str(tmp_path / "lit_model.pth"), target)
    for name, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[name], value, rtol=0, atol=0, msg=name)
