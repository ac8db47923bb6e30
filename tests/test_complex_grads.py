"""Complex arithmetic's gradients (thunder_tp.execution.complex_grads): one device's, through thunder_tp's executors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import thunder
import torch
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import Symbol

import thunder_tp
from tests.torchtitan_llama import apply_rotary_emb, precompute_freqs_cis
from thunder_tp.execution.complex_grads import COVERED, EXACT_IN_THUNDER, complex_grads_executor

D = torch.float64
C64, C128 = torch.complex64, torch.complex128
#: the complex-grads executor before Thunder's own: the sweep needs no fusion (the rotary test runs with all of
#: thunder_tp's executors, which keep complex ops out of fusion regions)
SWEEP_EXECUTORS = [complex_grads_executor, *thunder.get_default_executors()]


def _c(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))


def _r(z: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(z).flatten(-2)


#: one program per op: real inputs (2, 4, 8) in, real out; each complex op applied to values that need grads
PROGRAMS = {
    # covered here (Thunder's own rules are wrong for these)
    "mul complex": lambda a, b: _r(_c(a) * _c(b)),
    "mul complex by real": lambda a, b: _r(_c(a) * b[..., :4]),
    "mul real by complex": lambda a, b: _r(b[..., :4] * _c(a)),
    "mul by number": lambda a, b: _r(_c(a) * (2 - 1j)),
    "mul broadcast": lambda a, b: _r(_c(a) * _c(b)[:1]),
    "div complex": lambda a, b: _r(_c(a) / (_c(b) + 3)),
    "div by real": lambda a, b: _r(_c(a) / (b[..., :4] + 3)),
    "true_divide by number": lambda a, b: _r(torch.true_divide(_c(a), 2 + 1j)),
    "real": lambda a, b: (_c(a) * _c(b)).real,
    "imag": lambda a, b: (_c(a) * _c(b)).imag,
    # torch's autograd of the torch function
    "exp": lambda a, b: _r(torch.exp(_c(a) * 0.1) * _c(b)),
    "abs": lambda a, b: (_c(a) * _c(b)).abs(),
    "getitem": lambda a, b: _r(_c(a)[:, 1:3] * _c(b)[:1, :2]),
    "split chunk": lambda a, b: _r(torch.split(_c(a), 2, 1)[1] * _c(b).chunk(2, 1)[0]),
    # right in Thunder (views, additions, conversions; torch's autograd for the ops it registers automatically)
    "polar": lambda a, b: _r(torch.polar(a[..., :4].abs() + 1, b[..., :4]) * _c(a)),
    "conj": lambda a, b: _r(_c(a).conj() * _c(b)),
    "add sub neg": lambda a, b: _r(-(_c(a) + _c(b)) - _c(b) * 2),
    "reshape view flatten": lambda a, b: _r(_c(a).reshape(2, 2, 2, 4).flatten(1, 2).view(2, 4, 4) * _c(b)),
    "unsqueeze squeeze expand": lambda a, b: _r((_c(a).unsqueeze(1).expand(2, 3, 4, 4) * _c(b).unsqueeze(1)).sum(1)),
    "transpose permute": lambda a, b: _r((_c(a).transpose(0, 1) * _c(b).permute(1, 0, 2)).transpose(0, 1)),
    "cat stack": lambda a, b: _r(torch.cat([_c(a), torch.stack([_c(b), _c(a)], 1).sum(1)], 1)),
    "to type_as clone": lambda a, b: _r(_c(a).to(torch.complex128).clone() * _c(b)).type_as(a),
}


def _assert_eagers_grads(program: Callable, *inputs: torch.Tensor, executors: list, traced: Callable | None = None):
    """``thunder.jit`` of ``traced`` (else ``program``) gives eager ``program``'s output and every input's grad, in
    its dtype (to 1e-12: float64 and complex128 make them exact)."""
    expected = program(*inputs)
    cotangent = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, inputs, cotangent, allow_unused=True)
    actual = thunder.jit(traced or program, executors=executors)(*inputs)
    grads = torch.autograd.grad(actual, inputs, cotangent, allow_unused=True)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_complex_op_gives_one_devices_grads(name):
    """Every op of the covered and the exact sets: output and both inputs' grads equal eager's (float64)."""
    torch.manual_seed(0)
    a, b = (torch.randn(2, 4, 8, dtype=D, requires_grad=True) for _ in range(2))
    _assert_eagers_grads(PROGRAMS[name], a, b, executors=SWEEP_EXECUTORS)


#: one program per case of mixed precisions, with the dtype and shape of each input: eager promotes, then gives each
#: input its grad in its own dtype and shape (both factors broadcast)
MIXED = {
    "complex64 * complex128": (lambda a, b: a * b, ((C64, (3, 4)), (C128, (2, 1, 4)))),
    "complex128 * complex64": (lambda a, b: a * b, ((C128, (2, 1, 4)), (C64, (3, 4)))),
    "complex64 / complex128": (lambda a, b: a / (b + 3), ((C64, (3, 4)), (C128, (2, 1, 4)))),
    "complex128 / complex64": (lambda a, b: a / (b + 3), ((C128, (2, 1, 4)), (C64, (3, 4)))),
    "complex64 * float64": (lambda a, b: a * b, ((C64, (3, 4)), (D, (2, 1, 4)))),
    "float32 / complex128": (lambda a, b: a / (b + 3), ((torch.float32, (3, 4)), (C128, (2, 1, 4)))),
    "pow by torch's autograd": (lambda a, b: torch.pow(a, b * 0.1), ((C64, (3, 4)), (C128, (2, 1, 4)))),
    "exp by torch's autograd": (lambda a, b: torch.exp(a * b), ((C64, (3, 4)), (D, (2, 1, 4)))),
}


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_precisions_give_eagers_grads_in_each_inputs_dtype(name):
    """complex64 with complex128 (or a real of another precision): eager's output and grads, each input's in its
    dtype (Thunder's accumulation refused a complex128 grad for a complex64 input)."""
    program, specs = MIXED[name]
    torch.manual_seed(0)
    inputs = [torch.randn(shape, dtype=dtype, requires_grad=True) for dtype, shape in specs]
    _assert_eagers_grads(program, *inputs, executors=thunder_tp.executors())


def _rotary_of_float64(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Meta's rotary embedding without its cast to float32: complex128 activations times complex64 rotations."""
    freqs_cis = torch.polar(torch.ones_like(angles), angles).view(1, x.shape[1], 1, -1)
    return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * freqs_cis).flatten(3)


def test_rotary_embedding_of_float32_frequencies_and_float64_activations_is_eagers():
    """Rotations from float32 angles applied to float64 activations: eager's grads of both, each in its dtype."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4, 16, dtype=D, requires_grad=True)
    angles = torch.randn(8, 8, dtype=torch.float32, requires_grad=True)
    _assert_eagers_grads(_rotary_of_float64, x, angles, executors=thunder_tp.executors())


def _lerp_meta(start: TensorProxy, *, weight: TensorProxy, end: TensorProxy) -> TensorProxy:
    return TensorProxy(like=start)


#: ``torch.lerp`` as a Thunder symbol taking its tensors ``weight`` and ``end`` by keyword, in that (not sorted) order:
#: Thunder binds a call's arguments to its symbol's signature, and no torch symbol of its own that reaches the opaque
#: backward keeps two tensors as keywords
LERP_BY_KEYWORDS = Symbol(name="lerp_by_keywords", meta=_lerp_meta, id="torch.lerp", is_prim=True)


def test_tensor_keywords_of_an_op_run_by_torchs_autograd_get_their_own_grads():
    """An op whose backward is torch's autograd, given two complex tensors by keyword out of key order: each input's
    grad is eager's (the opaque backward exchanged ``weight``'s and ``end``'s)."""
    torch.manual_seed(0)
    a, end, weight = (torch.randn(3, 4, dtype=C128, requires_grad=True) for _ in range(3))
    _assert_eagers_grads(
        lambda a, end, weight: torch.lerp(a, weight=weight, end=end), a, end, weight,
        executors=thunder_tp.executors(), traced=lambda a, end, weight: LERP_BY_KEYWORDS(a, weight=weight, end=end),
    )


def test_the_sets_name_thunder_symbols():
    """What the docs list as covered and as exact are ids of Thunder's symbols."""
    assert {"torch.mul", "torch.true_divide", "torch.real", "torch.imag"} <= set(COVERED)
    assert {"torch.reshape", "torch.add", "torch.cat"} <= set(EXACT_IN_THUNDER)


def _rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    q, k = apply_rotary_emb(x, x * 2, freqs_cis)
    return q + k


def test_complex_rotary_embedding_is_one_devices_and_thunders_own_rules_are_not():
    """torchtitan's rotary embedding: thunder_tp's executors give eager's grads; Thunder's defaults give grads off by
    more than their own size (the failure this module corrects: if this half fails, Thunder fixed it)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4, 16, dtype=torch.float32, requires_grad=True)
    freqs_cis = precompute_freqs_cis(16, 8, 10000.0)
    expected = _rotary(x, freqs_cis)
    cotangent = torch.randn_like(expected)
    (expected_grad,) = torch.autograd.grad((expected * cotangent).sum(), x)
    grads = {}
    for name, executors in (("thunder_tp", thunder_tp.executors()), ("thunder", thunder.get_default_executors())):
        actual = thunder.jit(_rotary, executors=executors)(x, freqs_cis)
        torch.testing.assert_close(actual, expected)
        (grads[name],) = torch.autograd.grad((actual * cotangent).sum(), x)
    torch.testing.assert_close(grads["thunder_tp"], expected_grad, rtol=1e-6, atol=1e-6)
    assert (grads["thunder"] - expected_grad).abs().max() > expected_grad.abs().max()


def test_a_complex_op_without_a_torch_function_raises_at_backward_naming_it():
    """An op thunder_tp neither covers nor can hand to torch's autograd (a Thunder prim on complex values): the
    forward runs, the backward raises naming it (instead of Thunder's wrong grad); without grads it runs."""
    from thunder.core import prims

    def program(a):
        z = _c(a)
        return _r(prims.exp(z))

    a = torch.randn(2, 4, 8, dtype=D, requires_grad=True)
    jf = thunder.jit(program, executors=SWEEP_EXECUTORS)
    out = jf(a)
    torch.testing.assert_close(out, _r(torch.exp(_c(a))))
    with pytest.raises(NotImplementedError, match=r"gradient of exp on complex tensors is not covered"):
        out.sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(jf(a), _r(torch.exp(_c(a))))


def test_tensor_parallel_without_thunder_tps_executors_refuses_complex_arithmetic():
    """A training program with complex arithmetic jitted with TensorParallel but Thunder's executors: a clear error
    at the first call, not Thunder's wrong grads."""
    a = torch.randn(2, 4, 8, dtype=D, requires_grad=True)
    jf = thunder.jit(PROGRAMS["mul complex"], transforms=[thunder_tp.TensorParallel()])
    with pytest.raises(ValueError, match=r"computes mul on complex tensors.*executors=thunder_tp.executors\(\)"):
        jf(a, a)
