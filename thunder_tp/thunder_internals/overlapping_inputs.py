"""Inputs that share memory but are different views of it (e.g. ``idx = data[:, :-1]``, ``targets = data[:, 1:]``)
passed to a TP-jitted module as separate tensors.

Thunder 0.2.6 groups a call's tensor inputs by storage (``thunder/__init__.py``, ``_alias_tensor_of_args_kwargs``),
and when the traced program has any in-place op (HF's causal-mask construction has ``mul_`` in eval mode, which
``from_pretrained`` leaves a model in), ``thunder.core.update_aliases.replace_args_with_alias_map`` substitutes the
first input of each group for the others (reshaped where the shapes differ): it treats them as one tensor. Two
overlapping views of the same shape then read the same values: HF's loss compared ``input_ids`` with themselves
shifted instead of with ``labels`` (Llama dim 512: 9.108 instead of 9.092). Plain ``thunder.jit`` gives the same
wrong result; only an input that is the same view as the group's first (the same tensor passed twice) is what that
substitution assumes.

So a TP-jitted module passes each such input as a copy (``clone``: autograd still reaches the view), as separate
tensors whose values are what the caller passed; the same view passed twice stays aliased. The copies are of inputs
(token ids, usually b·s integers). A program that writes into such an input in place would write into the copy:
Thunder's substitution would have computed it from the wrong values anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from thunder.core.pytree import tree_flatten, tree_unflatten


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def separate_overlapping_views(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args`, `kwargs` with every tensor that shares storage with an earlier one, but is not the same view of it,
    replaced by a copy (the grouping is Thunder's: plain strided tensors by ``untyped_storage().data_ptr()``)."""
    flat, spec = tree_flatten((args, kwargs))
    first: dict[int, torch.Tensor] = {}
    copied = False
    for i, t in enumerate(flat):
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            continue
        storage = t.untyped_storage().data_ptr()
        if storage not in first:
            first[storage] = t
        elif not _same_view(t, first[storage]):
            flat[i] = t.clone()
            copied = True
    return tree_unflatten(flat, spec) if copied else (args, kwargs)


def separating_overlapping_views(call: Callable) -> Callable:
    """`call` (a jitted module's forward) given overlapping views as separate tensors."""

    @functools.wraps(call)
    def call_with_separate_views(*args, **kwargs) -> Any:
        args, kwargs = separate_overlapping_views(args, kwargs)
        return call(*args, **kwargs)

    return call_with_separate_views
