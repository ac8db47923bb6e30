"""thunder_tp.execution.cpu_attention: SDPA on CPU runs torch's flash kernel, forward and backward, or decomposes."""

from __future__ import annotations

import math

import pytest
import thunder
import torch
import torch.nn.functional as F

from tests.dist import assert_close
from thunder_tp.execution.executor import executors

B, H, L, S, E = 2, 3, 16, 24, 8
FLASH = ("cpu_flash_attention_forward", "cpu_flash_attention_backward")


def _qkv(dtype=torch.float64, *, e_value: int = E) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q = torch.randn(B, L, H, E, dtype=dtype).transpose(1, 2)  # strided like a model's heads
    k, v = torch.randn(B, H, S, E, dtype=dtype), torch.randn(B, H, S, e_value, dtype=dtype)
    return tuple(t.requires_grad_() for t in (q, k, v))


def _run(fn, *args) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[str], list]:
    """``fn`` jitted with thunder_tp's executors: its output, the grads of ``args``, the names of the symbols its
    forward and backward run, and what the forward saves for the backward."""
    jfn = thunder.jit(fn, executors=executors())
    out = jfn(*args)
    grads = torch.autograd.grad(out, args, torch.ones_like(out))
    forward, backward = thunder.last_traces(jfn)[-1], thunder.last_backward_traces(jfn)[-1]
    names = [bsym.sym.name for trace in (forward, backward) for bsym in trace.bound_symbols]
    saved = forward.bound_symbols[-1].args[1][0]
    return out, grads, names, saved


def _check_against_eager(fn, *args) -> list[str]:
    expected = fn(*args)
    expected_grads = torch.autograd.grad(expected, args, torch.ones_like(expected))
    out, grads, names, _ = _run(fn, *args)
    assert_close(out, expected, rtol=1e-12, atol=1e-12, name="output")
    for i, (grad, want) in enumerate(zip(grads, expected_grads, strict=True)):
        assert_close(grad, want, rtol=1e-12, atol=1e-12, name=f"grad of argument {i}")
    return names


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [None, 0.25])
def test_flash_kernel_matches_eager(is_causal, scale):
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale) * 2

    names = _check_against_eager(attention, *_qkv())
    assert all(name in names for name in FLASH), names


@pytest.mark.parametrize("shape", [(L, S), (B, 1, L, S)], ids=["2d", "4d"])
def test_float_mask_takes_the_kernel(shape):
    mask = torch.randn(shape, dtype=torch.float64).tril()

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    assert all(name in _check_against_eager(attention, *_qkv()) for name in FLASH)


def test_saves_one_log_sum_exp_per_row_not_the_probabilities():
    q, k, v = _qkv(torch.float32)
    _, _, _, saved = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    shapes = [tuple(t.shape) for t in saved]
    assert (B, H, L, S) not in shapes and (B, H, L) in shapes, shapes


def _bool_mask(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(L, S, dtype=torch.bool).tril())


def _dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


def _grad_mask(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    "fn, args",
    [
        (_bool_mask, _qkv()),
        (_dropout, _qkv()),
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), _qkv(e_value=E + 4)),
        (_grad_mask, (*_qkv(), torch.zeros(L, S, dtype=torch.float64, requires_grad=True))),
    ],
    ids=["bool_mask", "dropout", "value_head_size", "mask_needs_grad"],
)
def test_what_the_kernel_does_not_take_decomposes(fn, args):
    _, grads, names, _ = _run(fn, *args)
    assert not any(name in names for name in FLASH), names
    assert all(torch.isfinite(g).all() for g in grads)


def test_decomposition_still_matches_eager_where_the_kernel_is_refused():
    q, k, v = _qkv(e_value=E + 4)
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(E))

    names = _check_against_eager(attention, q, k, v)
    assert not any(name in names for name in FLASH)


def test_inference_runs_the_forward_kernel_alone():
    q, k, v = (t.detach() for t in _qkv())
    jfn = thunder.jit(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), executors=executors())
    with torch.no_grad():
        out = jfn(q, k, v)
    assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12, name="output")
    names = [bsym.sym.name for bsym in thunder.last_traces(jfn)[-1].bound_symbols]
    assert FLASH[0] in names and FLASH[1] not in names, names
