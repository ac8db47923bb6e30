"""Partial values (annotated K-split products) combined with replicated tensors: each operand counts once.

A replicated term added to a Partial one is added by the first rank alone, and the sum stays Partial until
something needs it whole: one all_reduce per case, as for a parallel-residual block's attention + residual + MLP.
Forward and every input grad vs single device, float64 (exact to ~1e-12).
"""

import thunder
import torch

from tests.dist import run_ranks
from tests.tp_checks import FAST_EXECUTORS, collective_counts
from thunder_tp import Shard, TensorParallel, annotate


def _product(a, b):
    return annotate(a, Shard(1)) @ annotate(b, Shard(0))  # each rank holds a Partial sum of the product


#: name -> function of (a, b, c) whose first product is Partial and c a replicated (4, 5) tensor
CASES = {
    "partial + replicate": lambda a, b, c: _product(a, b) + c,
    "replicate - partial": lambda a, b, c: c - _product(a, b),
    "partial * replicate": lambda a, b, c: _product(a, b) * c,
    "partial + partial": lambda a, b, c: _product(a, b) + _product(a * 2, b),
    "partial / replicate + replicate": lambda a, b, c: _product(a, b) / (c.abs() + 1) + c,
    "partial + replicate + partial": lambda a, b, c: _product(a, b) + c + _product(a, b * c[:1, :]),
    "sum(partial) + sum(replicate)": lambda a, b, c: _product(a, b).sum() + c.sum(),  # 0-dim, see test_symbolic
}


def _inputs() -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = [(4, 6), (6, 5), (4, 5)]
    return [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _check_cases() -> None:
    for name, fn in CASES.items():
        inputs, reference = _inputs(), _inputs()
        jf = thunder.jit(fn, transforms=[TensorParallel()], executors=FAST_EXECUTORS)
        actual, expected = jf(*inputs), fn(*reference)
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: output: {m}")
        assert collective_counts(thunder.last_traces(jf)[-1]) == {"all_reduce": 1}, name
        cotangent = torch.randn_like(expected)
        (actual * cotangent).sum().backward()
        (expected * cotangent).sum().backward()
        for i, (x, r) in enumerate(zip(inputs, reference, strict=True)):
            torch.testing.assert_close(x.grad, r.grad, rtol=1e-12, atol=1e-12,
                                       msg=lambda m, name=name, i=i: f"{name}: grad {i}: {m}")


def test_partial_combined_with_replicated_tensors_counts_each_once():
    run_ranks(_check_cases, 2)
