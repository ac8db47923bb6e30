"""thunder_tp.clip_grad_norm_ (what ThunderTPStrategy's clip_gradients runs): the whole model's gradient norm equals one
device's, before and after clipping, and every rank scales by the same factor (float64, real gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tp_checks import FAST_EXECUTORS, assert_close_scaled

RTOL = 1e-9  # float64: the data-parallel average and the norm's summation order differ from one device's (~1e-10)


def _clip(config_name: str, tp: int, data_parallel: str | None) -> dict:
    import torch.distributed as dist

    import thunder_tp
    from tests.litgpt_models import GPTWithLoss, batch, make_config
    from thunder_tp.layouts import REPLICATE
    from thunder_tp.pieces import shard_tensor
    from thunder_tp.thunder_internals.private import applied_transforms
    from thunder_tp.tools.clipping import grad_norm

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    reference = GPTWithLoss(make_config(config_name))
    model = GPTWithLoss(reference.config)
    model.load_state_dict(reference.state_dict())
    mesh = thunder_tp.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    jm = thunder_tp.parallelize(model, thunder_tp.plans.litgpt(model), mesh, data_parallel, executors=FAST_EXECUTORS)
    idx, targets = batch(0, batch_size=2 * mesh.dp)
    rows = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)  # each data-parallel rank its share of the batch
    jm(idx[rows], targets[rows]).backward()
    reference(idx, targets).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    max_norm = 0.5 * expected.item()  # so that clipping scales
    total = thunder_tp.clip_grad_norm_(jm, max_norm)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    torch.testing.assert_close(total, expected, rtol=RTOL, atol=0)
    after = grad_norm(jm)
    torch.testing.assert_close(after, torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]),
                               rtol=RTOL, atol=0)
    if data_parallel is None:  # each shard's clipped grad is the chunk of one device's clipped grad
        tp_layouts = next(t for t in applied_transforms(jm)
                          if isinstance(t, thunder_tp.TensorParallel)).parameter_layouts
        for name, p in reference.named_parameters():
            want = shard_tensor(p.grad, tp_layouts.get(name, REPLICATE), mesh.tp_rank, mesh.tp)
            assert_close_scaled(jm.get_parameter(name).grad, want, rtol=1e-9, atol=1e-12, what=name)
    return {"total": total.item(), "after": after.item()}


# neox slow: a second compile for the same check (llama: GQA)
@pytest.mark.parametrize("config_name", [pytest.param("neox", marks=pytest.mark.slow), "llama"])
def test_clip_grad_norm_tp2(config_name):
    totals = run_ranks(_clip, 2, config_name, 2, None)
    assert totals[0] == totals[1]  # the same norm, bitwise, on every rank


@pytest.mark.slow  # reason: four ranks (TP=4 with replicated K/V heads; a 2 x 2 mesh under FSDP and DDP)
@pytest.mark.parametrize("tp,data_parallel", [(4, None), (2, "fsdp"), (2, "ddp")])
def test_clip_grad_norm_four_ranks(tp, data_parallel):
    totals = run_ranks(_clip, 4, "llama", tp, data_parallel)
    assert all(t == totals[0] for t in totals)
