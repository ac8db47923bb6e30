"""Loss parallel: cross-entropy over vocabulary-sharded logits, against one device (float64), and the loss's symbols."""

import pytest
import thunder
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist import run_ranks
from tests.tp_checks import compare_with_single_device
from thunder_tp import ColwiseParallel, Replicate, TensorParallel

TOKENS, DIM, VOCAB, MASKED_ROWS = 6, 16, 64, 3


class Head(nn.Module):
    """lm_head and cross-entropy; the last half of the vocabulary is masked to -inf for the first rows, so at TP 2
    and 4 some ranks hold nothing but -inf for them."""

    def __init__(self, reduction: str):
        super().__init__()
        self.proj = nn.Linear(DIM, VOCAB, bias=False, dtype=torch.float64)
        mask = torch.zeros(TOKENS, VOCAB, dtype=torch.float64)
        mask[:MASKED_ROWS, VOCAB // 2:] = float("-inf")
        self.register_buffer("mask", mask)
        self.reduction = reduction

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.proj(x) + self.mask, targets, reduction=self.reduction)


def _inputs():
    torch.manual_seed(2)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    targets[:MASKED_ROWS] = torch.randint(0, VOCAB // 2, (MASKED_ROWS,))  # inside the unmasked half
    targets[-1] = -100  # ignored
    return torch.randn(TOKENS, DIM, dtype=torch.float64, requires_grad=True), targets


def _masked_head(reduction, grad=True, gathered=False):
    style = ColwiseParallel(output_layout=Replicate()) if gathered else ColwiseParallel()
    return compare_with_single_device(lambda: Head(reduction), _inputs, TensorParallel({"proj": style}),
                                      grad=grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_loss_matches_single_device_with_masked_shards(reduction, world):
    """Loss and grads exact in float64; the forward's one collective gathers 2 numbers per token from each rank (no
    logits gathered), the backward's only one sums the input's grad."""
    info = run_ranks(_masked_head, world, reduction)[0]
    assert info["forward"] == {"all_gather": 1} and info["backward"] == {"all_reduce": 1}, info


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_of_gathered_logits_matches_single_device_with_masked_rows(reduction):
    """Logits gathered by the plan (Replicate output): the loss runs as log-sum-exp minus target logit on every
    rank, exact in float64; the logits' grad is the rank's columns (no collective but the input grad's)."""
    info = run_ranks(_masked_head, 2, reduction, True, True)[0]
    assert info["forward"] == {"all_gather": 1} and info["backward"] == {"all_reduce": 1}, info


def test_vocab_parallel_loss_without_grad():
    """Under no_grad the log-sum-exp symbol runs through its decomposition."""
    info = run_ranks(_masked_head, 2, "mean", False)[0]
    assert info["forward"] == {"all_gather": 1}, info


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_cross_entropy_symbols_on_two_shards_value_and_grad(dtype):
    """The loss's two symbols on two vocabulary shards, the second all -inf on some rows: torch's cross_entropy in the
    loss's precision (float32 for bf16 logits, rounded to bf16 once at the end) and its grad, zero (not nan) over the
    -inf columns."""
    from thunder_tp.ops.cross_entropy import cross_entropy_of_stats, cross_entropy_stats

    torch.manual_seed(0)
    logits = torch.randn(5, 8, dtype=torch.float64) * 30
    logits[:2, 4:] = float("-inf")
    logits = logits.to(dtype).requires_grad_()
    target = torch.tensor([0, 3, 5, 7, -100])

    def loss(a, t):
        stats = torch.cat([cross_entropy_stats(a[:, :4], t), cross_entropy_stats(a[:, 4:], t - 4)])
        return cross_entropy_of_stats(stats, t, -100, "mean", a.dtype)

    actual = thunder.jit(loss)(logits, target)
    reference = logits.detach().double().requires_grad_()
    expected = F.cross_entropy(reference, target)
    exact = dtype == torch.float64
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected, rtol=1e-15 if exact else 2**-8, atol=0)
    (grad,) = torch.autograd.grad(actual, logits)
    (expected_grad,) = torch.autograd.grad(expected, reference)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-14 if exact else 2**-7,
                               atol=1e-15 if exact else 1e-3)
    assert torch.equal(grad[:2, 4:], torch.zeros(2, 4, dtype=dtype))
