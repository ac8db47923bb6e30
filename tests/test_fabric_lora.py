"""LoRA (litgpt.lora.GPT) under TP: each LoRA pair follows its base layer (plans.litgpt), base weights frozen, only
LoRA parameters get grads, exact against one device (float64, real gloo ranks), with LoRA on all of q/k/v and on a
subset."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.litgpt_models import lora_config
from tests.tp_checks import FAST_EXECUTORS

RTOL = 1e-9


def _lora_step(enable: str) -> dict:
    import thunder
    import torch.distributed as dist
    from litgpt.lora import GPT, mark_only_lora_as_trainable

    import thunder_tp
    from thunder_tp.layouts import REPLICATE
    from thunder_tp.pieces import shard_tensor

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    reference = GPT(lora_config(enable))
    for name, p in reference.named_parameters():
        if "lora_B" in name:  # litgpt starts lora_B at zero: nonzero, so that every LoRA grad is nonzero
            torch.nn.init.normal_(p, std=0.05)
    model = GPT(reference.config)
    model.load_state_dict(reference.state_dict())
    mark_only_lora_as_trainable(reference)
    mark_only_lora_as_trainable(model)
    transform = thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))
    jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    def loss(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    expected = loss(reference(idx))
    expected.backward()
    actual = loss(jm(idx))
    actual.backward()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=0)
    rank, size = dist.get_rank(), dist.get_world_size()
    with_grads = []
    for name, p in reference.named_parameters():
        grad = jm.get_parameter(name).grad
        if p.grad is None:
            assert grad is None, f"{name} is frozen but got a grad"
            continue
        with_grads.append(name)
        want = shard_tensor(p.grad, transform.parameter_layouts.get(name, REPLICATE), rank, size)
        torch.testing.assert_close(grad, want, rtol=RTOL, atol=RTOL * p.grad.abs().max().item(), msg=name)
    sharded = sorted(n for n, layout in transform.parameter_layouts.items() if "lora_" in n)
    return {"with_grads": with_grads, "sharded_lora": sharded}


# all of q/k/v slow: a second compile; the q,v subset is the harder case
@pytest.mark.parametrize("enable", [pytest.param("qkv", marks=pytest.mark.slow), "qv"])
def test_lora_pairs_follow_their_base_tp2(enable):
    info = run_ranks(_lora_step, 2, enable)[0]
    assert info["with_grads"] and all("lora_" in n for n in info["with_grads"])
    # every LoRA pair has one sharded member: lora_B of column-parallel bases, lora_A of row-parallel ones
    assert "transformer.h.0.attn.qkv.lora_B" in info["sharded_lora"]
    assert "transformer.h.0.attn.proj.lora_A" in info["sharded_lora"]
    assert "transformer.h.0.mlp.proj.lora_A" in info["sharded_lora"] and "lm_head.lora_B" in info["sharded_lora"]


@pytest.mark.slow  # reason: four ranks; K/V heads replicated (2 K/V groups on 4 ranks), LoRA on a subset with k
def test_lora_with_replicated_kv_heads_tp4_is_refused_on_every_rank():
    """Not supported yet: the LoRA path of a q|k|v projection whose K/V heads are replicated needs a redistribution of
    replicated chunks that thunder_tp does not do; every rank raises it at the first compile (nothing hangs)."""
    with pytest.raises(AssertionError, match="cannot redistribute Shard"):
        run_ranks(_lora_step, 4, "kv")
