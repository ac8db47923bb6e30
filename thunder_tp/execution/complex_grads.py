"""Gradients of complex arithmetic as PyTorch defines them, where Thunder 0.2.6's rules get them wrong.

Thunder's grad rules for products and quotients are written for real numbers: for ``out = a * b`` they give ``a``
the grad ``g * b``. For complex tensors PyTorch's convention (the conjugate Wirtinger derivative, what
``torch.autograd`` computes) is ``g * conj(b)``, and a real factor of a complex product gets the real part of
that. So ``thunder.jit`` of a rotary embedding written with complex numbers (torchtitan's and Meta's Llama:
``view_as_real(view_as_complex(x) * freqs_cis)``) returns the right values and wrong grads, silently::

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    freqs = torch.polar(torch.ones(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64))
    f = lambda x: torch.view_as_real(torch.view_as_complex(x.view(4, 4, 2)) * freqs).flatten(-2)
    thunder.jit(f)(x).sum().backward()   # x.grad differs from eager's by more than its own size

This operator executor comes first in ``thunder_tp.executors()``: Thunder's autograd takes the grad rule of the first
executor that can run an op, so it claims every op on complex tensors whose Thunder rule is not known to be right,
runs it as Thunder's torch executor does, and gives it

- a grad rule of its own for the ops of a complex rotary embedding and their kin: ``mul``, ``div`` /
  ``true_divide``, ``real``, ``imag`` (``COVERED``; fusible backward ops);
- for any other op with a torch function (``exp``, ``abs``, indexing, ...) torch's autograd of that function, in one
  opaque backward op that runs it again (``torch.autograd.functional.vjp``): eager's grads by construction;
- for an op without one (none among the torch functions Thunder traces), a backward that raises naming it, if the
  program's grads need it: the first ``backward()`` fails instead of training on a wrong grad.

Left to Thunder, whose rules are right for complex tensors (``tests/test_complex_grads.py`` checks each against
eager): the ops Thunder registers automatically from torch (``view_as_complex``, ``view_as_real``, ``polar``,
``conj``, ``complex``, ...: their grads are torch's own autograd), views and shape ops, additions, and conversions
(``EXACT_IN_THUNDER``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from numbers import Number

import thunder.clang as clang
import thunder.core.prims as prims
import thunder.torch as ltorch
import torch
from thunder.core import dtypes
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx
from thunder.core.transforms import get_grad, put_grad, sum_to
from thunder.executors.torchex import ex as pytorch_ex
from thunder.extend import OperatorExecutor, register_executor

__all__ = ["COVERED", "EXACT_IN_THUNDER", "check_complex_grads", "complex_grads_executor", "touches_complex"]

#: ops on complex tensors whose grads Thunder 0.2.6 computes as torch does (each checked against eager in the tests)
EXACT_IN_THUNDER = frozenset(s.id for s in (
    ltorch.reshape, ltorch.view, ltorch.flatten, ltorch.unsqueeze, ltorch.squeeze, ltorch.expand, ltorch.transpose,
    ltorch.permute, ltorch.cat, ltorch.stack, ltorch.add, ltorch.sub, ltorch.neg, ltorch.sum, ltorch.clone,
    ltorch.contiguous, ltorch.to, ltorch.type_as, prims.reshape, prims.broadcast_in_dim, prims.transpose,
    prims.squeeze, prims.cat, prims.add, prims.sub, prims.neg, prims.sum, prims.convert_element_type,
    prims.shallow_copy, prims.clone,
))


def touches_complex(bsym: BoundSymbol) -> bool:
    """Whether a tensor argument or output of ``bsym`` is complex."""
    tensors = (p for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs) if isinstance(p, TensorProxy))
    return any(dtypes.is_complex_dtype(t.dtype) for t in tensors)


def _conj(x):
    """The complex conjugate of a tensor or number (real ones are their own)."""
    if isinstance(x, TensorProxy):
        return ltorch.conj_physical(x) if dtypes.is_complex_dtype(x.dtype) else x
    return x.conjugate() if isinstance(x, Number) else x


def _put(x, grad: TensorProxy) -> None:
    """Accumulate ``grad`` into a tensor input ``x`` as eager does: its real part for a real ``x``, summed over
    broadcast dims, then cast to ``x``'s dtype (a complex64 factor of a complex128 product gets a complex64 grad)."""
    if not isinstance(x, TensorProxy):
        return
    if not dtypes.is_complex_dtype(x.dtype) and dtypes.is_complex_dtype(grad.dtype):
        grad = ltorch.real(grad)
    put_grad(x, clang.maybe_convert_to_dtype(sum_to(grad, x.shape), x.dtype))


def _product_grad(op: Symbol) -> Callable:
    def grad_transform(a, b):
        out = op(a, b)
        g = get_grad(out)
        _put(a, g * _conj(b))
        _put(b, g * _conj(a))
        return out

    return grad_transform


def _quotient_grad(op: Symbol) -> Callable:
    def grad_transform(a, b, **kwargs):
        out = op(a, b, **kwargs)
        g = get_grad(out)
        _put(a, g / _conj(b))
        _put(b, -g * _conj(out / b))
        return out

    return grad_transform


def _part_grad(op: Symbol, unit: complex) -> Callable:
    """``real`` (unit 1) and ``imag`` (unit 1j): the grad of the part goes back along that unit."""
    def grad_transform(a):
        out = op(a)
        _put(a, get_grad(out) * unit)
        return out

    return grad_transform


#: op id -> the grad rule this module gives it on complex tensors
COVERED: dict[object, Callable] = {
    ltorch.mul.id: _product_grad(ltorch.mul),
    prims.mul.id: _product_grad(prims.mul),
    ltorch.true_divide.id: _quotient_grad(ltorch.true_divide),
    ltorch.div.id: _quotient_grad(ltorch.div),
    prims.div.id: _quotient_grad(prims.div),
    ltorch.real.id: _part_grad(ltorch.real, 1 + 0j),
    ltorch.imag.id: _part_grad(ltorch.imag, 1j),
}


def _torch_function(op_id: object) -> Callable | None:
    """The torch function a Thunder symbol stands for, from its id (``torch.exp``, ``torch.Tensor.__getitem__``)."""
    if not isinstance(op_id, str) or not op_id.startswith("torch."):
        return None
    fn = torch
    for part in op_id.split(".")[1:]:
        fn = getattr(fn, part, None)
    return fn if callable(fn) else None


def _differentiable(x) -> bool:
    if isinstance(x, TensorProxy):
        return dtypes.is_inexact_dtype(x.dtype)
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _by_key(tree: dict) -> list[tuple]:
    """A dict's items in key order: the order of its tensors' grads, whatever order the keywords were given in."""
    return sorted(tree.items(), key=lambda item: str(item[0]))


def _leaves(tree) -> list:
    """The differentiable tensors of nested tuples, lists and dicts (values in key order), in order."""
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in _leaves(item)]
    if isinstance(tree, dict):
        return [leaf for _, value in _by_key(tree) for leaf in _leaves(value)]
    return [tree] if _differentiable(tree) else []


def _replaced(tree, leaves: Iterator):
    """`tree` with its differentiable tensors replaced by the next of `leaves`, in the order `_leaves` lists them."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(_replaced(item, leaves) for item in tree)
    if isinstance(tree, dict):
        return {key: _replaced(value, leaves) for key, value in _by_key(tree)}
    return next(leaves) if _differentiable(tree) else tree


def _torch_vjp(torch_fn: Callable, args: tuple, kwargs: dict, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The grads of the op's differentiable inputs, as torch's autograd computes them (running the op again)."""
    def op(*inputs):
        new_args, new_kwargs = _replaced((args, kwargs), iter(inputs))
        out = torch_fn(*new_args, **new_kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    _, input_grads = torch.autograd.functional.vjp(op, tuple(_leaves((args, kwargs))), v=grads)
    return input_grads


def _vjp_meta(args: tuple, kwargs: dict, *grads: TensorProxy) -> tuple[TensorProxy, ...]:
    return tuple(TensorProxy(like=x) for x in _leaves((args, kwargs)))


@functools.cache
def _vjp_operator(sym: Symbol, torch_fn: Callable) -> Symbol:
    return complex_grads_executor.register_operator(
        f"{sym.name.strip('_')}_complex_vjp", meta=_vjp_meta, fn=functools.partial(_torch_vjp, torch_fn)
    )


def _grad_by_torch_autograd(sym: Symbol, torch_fn: Callable) -> Callable:
    """The op as it is, and its input grads from torch's autograd (an opaque backward op): right by construction."""
    def grad_transform(*args, **kwargs):
        out = sym(*args, **kwargs)
        outputs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, TensorProxy)]
        input_grads = _vjp_operator(sym, torch_fn)(args, kwargs, *(get_grad(o) for o in outputs))
        for x, grad in zip(_leaves((args, kwargs)), input_grads, strict=True):
            put_grad(x, grad)
        return out

    return grad_transform


def _not_covered_message(name: str) -> str:
    return (f"thunder_tp: the gradient of {name} on complex tensors is not covered: Thunder 0.2.6 differentiates "
            "complex arithmetic wrongly (thunder_tp.execution.complex_grads), and this op has no torch function "
            "whose autograd thunder_tp could use instead. Write the complex part with torch functions, or in real "
            "arithmetic (a rotary embedding with cos and sin), or compute it without grads.")


def _raise_not_covered(grad, like, name: str):
    raise NotImplementedError(_not_covered_message(name))


def _uncovered_grad(sym: Symbol) -> Callable:
    """The op as it is, and a backward that raises when run: only a grad the program needs reaches it."""
    def grad_transform(*args, **kwargs):
        out = sym(*args, **kwargs)
        outputs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, TensorProxy)]
        grad = get_grad(outputs[0])
        for x in args:
            if isinstance(x, TensorProxy):
                put_grad(x, not_covered(grad, x, sym.name))
        return out

    return grad_transform


class ComplexGradsExecutor(OperatorExecutor):
    """Claims the ops on complex tensors whose Thunder grad rule is wrong or unknown; runs them as torchex does."""

    def can_execute(self, bsym: BoundSymbol) -> bool:
        """True for an op on complex tensors that Thunder's torch executor runs and whose grad Thunder gets wrong."""
        if bsym.sym.id in self.implmap:  # this executor's own operator
            return super().can_execute(bsym)
        if bsym.sym.id in EXACT_IN_THUNDER or OpTags.AUTO_REGISTERED in (bsym.sym.tags or ()):
            return False
        if bsym.sym.id == ltorch.div.id and bsym.kwargs.get("rounding_mode") is not None:
            return False
        return touches_complex(bsym) and pytorch_ex.can_execute(bsym)

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        """Never (Thunder's default would claim an op whose subsymbols it claims, e.g. `to` for its shallow copy)."""
        return False

    def get_execution_transform(self, bsym: BoundSymbol) -> Callable | None:
        """Torch's execution of the op, as Thunder's torch executor lowers it."""
        if bsym.sym.id in self.implmap:
            return super().get_execution_transform(bsym)
        impl = pytorch_ex.implmap[bsym.sym.id]
        return impl.execution_transform or impl.symbol

    def get_grad_transform(self, sym: Symbol) -> Callable | None:
        """The rule of a covered op; for any other, torch's autograd of its torch function, else a backward that
        raises naming it."""
        if sym.id in self.implmap:
            return None
        if sym.id in COVERED:
            return COVERED[sym.id]
        torch_fn = _torch_function(sym.id)
        return _uncovered_grad(sym) if torch_fn is None else _grad_by_torch_autograd(sym, torch_fn)


complex_grads_executor = register_executor(ComplexGradsExecutor("thunder_tp_complex_grads", version="0.1"))
not_covered = complex_grads_executor.register_operator(
    "complex_grad_not_covered", meta=lambda grad, like, name: TensorProxy(like=like), fn=_raise_not_covered
)


def check_complex_grads(trace: TraceCtx, executors_list) -> None:
    """A clear error where a program that needs grads computes on complex tensors without this executor first among
    its executors: Thunder's own rules would train it on wrong grads."""
    if complex_grads_executor in executors_list or not any(_needs_grad(a) for a in trace.args):
        return
    wrong = sorted({b.sym.name for b in trace.bound_symbols if complex_grads_executor.can_execute(b)})
    if wrong:
        raise ValueError(
            f"thunder_tp: this program computes {', '.join(wrong)} on complex tensors, whose gradients Thunder 0.2.6 "
            "gets wrong (thunder_tp.execution.complex_grads); pass executors=thunder_tp.executors(), or put "
            "thunder_tp.execution.complex_grads.complex_grads_executor first among your executors"
        )


def _needs_grad(arg) -> bool:
    return isinstance(arg, TensorProxy) and arg.requires_grad
