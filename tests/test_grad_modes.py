"""Grad mode as eager has it inside a TP program (thunder_tp.thunder_internals.grad_mode): what a model runs under
torch.no_grad(), or on detached tensors, gets no grad; everything else its one-device grad (float64)."""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.nn as nn

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import SEQ, VOCAB, batch, make_config
from tests.tp_checks import (
    FAST_EXECUTORS,
    assert_close_scaled,
    assert_grads_are_shards,
    assert_simulated_grads_are_shards,
    rank_and_size,
)
from thunder_tp import ColwiseParallel, RowwiseParallel, TensorParallel
from thunder_tp.plans.litgpt import GPTWithLoss

WIDTH, HIDDEN = 8, 16
MEGATRON = {"up1": ColwiseParallel(), "down1": RowwiseParallel(), "up2": ColwiseParallel(), "down2": RowwiseParallel()}
TOL = dict(rtol=1e-12, atol=1e-12)


class TwoMLPs(nn.Module):
    """Two Megatron MLPs; `frozen` says which runs without grad: "prefix" or "suffix" under torch.no_grad() (a
    frozen suffix's output added to its input, so that the loss keeps a grad), "inference" the first under
    torch.inference_mode(), "detached" the first's output detached."""

    def __init__(self, frozen: str):
        super().__init__()
        self.up1, self.down1 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.up2, self.down2 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.frozen = frozen

    def first(self, x):
        return self.down1(torch.relu(self.up1(x)))

    def second(self, x):
        return self.down2(torch.relu(self.up2(x)))

    def forward(self, x):
        if self.frozen == "prefix":
            with torch.no_grad():
                x = self.first(x)
            return self.second(x)
        if self.frozen == "inference":
            with torch.inference_mode():
                x = self.first(x)
            return self.second(x.clone())
        if self.frozen == "suffix":
            x = self.first(x)
            with torch.no_grad():
                y = self.second(x)
            return x + y
        return self.second(self.first(x).detach())


@pytest.mark.usefixtures("simulated_float64")
@pytest.mark.parametrize("plan", ["megatron", "empty"])
@pytest.mark.parametrize("frozen", ["prefix", "suffix", "inference", "detached"])
def test_simulated_ranks_leave_what_runs_without_grad_without_a_grad(frozen, plan):
    """2 simulated ranks: the loss, the input's grad (none where eager gives none) and every parameter's grad, none
    for the frozen MLP's (not zeros: an optimizer would decay them), each rank's shard of eager's for the others."""
    torch.manual_seed(0)
    model, x = TwoMLPs(frozen), torch.randn(4, WIDTH, requires_grad=True)
    expected = model(x).square().sum()
    expected.backward()
    want_x, x.grad = x.grad, None
    with thunder_tp.simulate(world_size=2):
        tp = TensorParallel(MEGATRON if plan == "megatron" else {})
        jm = thunder.jit(model, transforms=[tp], executors=thunder_tp.executors())
        loss = jm(x).square().sum()
        loss.backward()
        for rank, value in thunder_tp.per_rank(loss).items():
            assert_close_scaled(value, expected, **TOL, what=f"loss on rank {rank}")
        assert (x.grad is None) == (want_x is None), (x.grad, want_x)
        assert_simulated_grads_are_shards(model, jm, tp.parameter_layouts, 2, **TOL)


class FrozenPrefixLoss(GPTWithLoss):
    """A litgpt GPT whose embedding and first `frozen` blocks run under torch.no_grad() (partial fine-tuning), or
    whose last blocks do (`frozen` < 0), and its loss."""

    def __init__(self, config, frozen: int):
        super().__init__(config)
        self.frozen = frozen

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        gpt, blocks = self.gpt, list(self.gpt.transformer.h)
        cos, sin = gpt.cos[: idx.size(1)].unsqueeze(0), gpt.sin[: idx.size(1)].unsqueeze(0)
        cut = self.frozen if self.frozen >= 0 else len(blocks) + self.frozen
        with torch.set_grad_enabled(self.frozen < 0):
            x = gpt.transformer.wte(idx)
            for block in blocks[:cut]:
                x = block(x, cos, sin)
        with torch.set_grad_enabled(self.frozen >= 0):
            for block in blocks[cut:]:
                x = block(x, cos, sin)
        logits = gpt.lm_head(gpt.transformer.ln_f(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _litgpt_frozen(frozen: int, overlap: str) -> None:
    """TP=2 + SP + loss parallel, one step against one device: loss, and grads (none where one device has none)."""
    torch.manual_seed(0)
    config = make_config("llama")
    config.n_layer = 3
    reference = FrozenPrefixLoss(config, frozen).to(torch.float64)
    model = FrozenPrefixLoss(config, frozen).to(torch.float64)
    model.load_state_dict(reference.state_dict())
    tp = TensorParallel(thunder_tp.plans.litgpt(model, sequence_parallel=True, loss_parallel=True), overlap=overlap)
    jm = thunder.jit(model, transforms=[tp], executors=FAST_EXECUTORS)
    idx, targets = batch(0)
    expected, loss = reference(idx, targets), jm(idx, targets)
    expected.backward()
    loss.backward()
    assert_close_scaled(loss, expected, rtol=1e-6, atol=1e-6, what="loss")  # litgpt's RMSNorm runs in float32
    rank, size = rank_and_size()
    assert_grads_are_shards(reference, jm, tp.parameter_layouts, rank, size, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("frozen", "overlap"), [(2, "never"), (2, "always"), (-1, "never")],
                         ids=["frozen prefix", "frozen prefix, overlapped", "frozen suffix"])
def test_litgpt_with_a_frozen_prefix_or_suffix(frozen, overlap):
    """A litgpt llama whose embedding and first 2 of 3 blocks run under no_grad (or whose last block does), on 2
    gloo ranks (TP + SP + loss parallel; every collective decomposed for overlap too): one device's loss and
    grads, the frozen parameters without a grad."""
    run_ranks(_litgpt_frozen, 2, frozen, overlap)


class FrozenEmbeddingsLoss(thunder_tp.plans.hf.CausalLMLoss):
    """An HF CausalLM whose token embeddings are looked up under torch.no_grad() (passed as inputs_embeds)."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            embeds = self.model.get_input_embeddings()(input_ids)
        return self.model(inputs_embeds=embeds, labels=labels, use_cache=False).loss


def _hf_frozen_embeddings() -> None:
    from tests.hf_models import make_model

    reference, model = FrozenEmbeddingsLoss(make_model("llama")), FrozenEmbeddingsLoss(make_model("llama"))
    tp = TensorParallel(thunder_tp.plans.hf(model))
    jm = thunder.jit(model, transforms=[tp], executors=FAST_EXECUTORS)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    expected, loss = reference(ids, ids), jm(ids, ids)
    expected.backward()
    loss.backward()
    assert_close_scaled(loss, expected, rtol=1e-6, atol=1e-6, what="loss")  # HF's RMSNorm runs in float32
    rank, size = rank_and_size()
    assert_grads_are_shards(reference, jm, tp.parameter_layouts, rank, size, rtol=1e-6, atol=1e-6)


def test_hf_model_with_frozen_embeddings():
    """An HF Llama whose embeddings run under no_grad, TP=2 on gloo: one device's loss and grads, none for the
    embedding."""
    run_ranks(_hf_frozen_embeddings, 2)


def test_overlap_pieces_of_a_frozen_block_record_no_grad():
    """Rank 0 of a fake TP=2 group, every collective decomposed for overlap: the pieces that replace the frozen
    blocks' collectives and matmuls are recorded under no_grad as those were (nothing of them is differentiated or
    saved for a backward), the others with grad."""
    from thunder.core.proxies import ProxyTag

    torch.set_default_dtype(torch.float64)
    try:
        with thunder_tp.one_rank(2, 0, "cpu"):
            config = make_config("llama")
            config.n_layer = 3
            model = FrozenPrefixLoss(config, 2)
            plan = thunder_tp.plans.litgpt(model, sequence_parallel=True, loss_parallel=True)
            jm = thunder.jit(model, transforms=[TensorParallel(plan, overlap="always")], executors=FAST_EXECUTORS)
            jm(*batch(0)).backward()
    finally:
        torch.set_default_dtype(torch.float32)
    decomposed = next(t for t in thunder.last_traces(jm) if "overlap" in str(t._provenance))
    shifts = [b for b in decomposed.bound_symbols if b.sym.name.startswith("tp_shift")]
    frozen = [any(ProxyTag.DETACHED_AUTOGRAD_GRAPH in o.tags for o in b.flat_proxy_outs) for b in shifts]
    assert frozen.count(True) == 8 and frozen.count(False) == 5, frozen  # 4 sites a block; the head's gather
