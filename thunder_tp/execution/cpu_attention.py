"""CPU attention: ``scaled_dot_product_attention`` on torch's flash kernel for CPU, forward and backward.

Thunder's SDPA executor claims CUDA tensors only; on CPU its math decomposition runs instead, which saves the
(batch, heads, query, key) probabilities for the backward. This executor claims SDPA on CPU tensors and runs
``aten._scaled_dot_product_flash_attention_for_cpu`` (what eager PyTorch and DTensor call) with its backward, saving
the output and one log-sum-exp per query row. Cases the kernel does not take keep the decomposition: dropout,
a mask that needs a grad or is not a 2-D / 4-D mask of the query's dtype, heads or head sizes that differ.
"""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.extend import OperatorExecutor, register_executor

from thunder_tp.thunder_internals.aten import cpu_flash_attention, cpu_flash_attention_backward

__all__ = ["cpu_attention_executor"]

cpu_attention_executor = OperatorExecutor("thunder_tp_cpu_attention", version="0.1")
register_executor(cpu_attention_executor)

_KERNEL_DTYPES = (dtypes.float32, dtypes.float64, dtypes.bfloat16, dtypes.float16)


def _forward_meta(query, key, value, attn_mask, is_causal: bool, scale: float | None):
    lse_dtype = dtypes.float64 if query.dtype == dtypes.float64 else dtypes.float32
    out = TensorProxy(like=query, shape=(*query.shape[:-1], value.shape[-1]))
    logsumexp = TensorProxy(like=query, shape=tuple(query.shape[:-1]), dtype=lse_dtype, requires_grad=False)
    return out, logsumexp


def _forward_impl(query, key, value, attn_mask, is_causal: bool, scale: float | None):
    return cpu_flash_attention(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


def _backward_meta(grad, query, key, value, attn_mask, out, logsumexp, is_causal: bool, scale: float | None):
    return TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value)


def _backward_impl(grad, query, key, value, attn_mask, out, logsumexp, is_causal: bool, scale: float | None):
    return cpu_flash_attention_backward(grad, query, key, value, out, logsumexp, 0.0, is_causal, attn_mask=attn_mask,
                                        scale=scale)


flash_attention_forward = cpu_attention_executor.register_operator(
    "cpu_flash_attention_forward",
    meta=_forward_meta,
    fn=_forward_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),
)
flash_attention_backward = cpu_attention_executor.register_operator(
    "cpu_flash_attention_backward", meta=_backward_meta, fn=_backward_impl
)


def _kernel_takes(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None) -> bool:
    """True when the CPU flash kernel computes this SDPA (and its grads) exactly as the decomposition would."""
    qkv = (query, key, value)
    if any(t.device.type != "cpu" or t.ndim != 4 or t.dtype != query.dtype for t in qkv):
        return False
    if query.dtype not in _KERNEL_DTYPES or dropout_p != 0.0:
        return False
    if len({t.shape[0] for t in qkv}) != 1 or len({t.shape[1] for t in qkv}) != 1:
        return False
    if len({t.shape[-1] for t in qkv}) != 1 or key.shape[2] != value.shape[2]:
        return False
    return attn_mask is None or (
        attn_mask.device.type == "cpu"
        and attn_mask.dtype == query.dtype
        and attn_mask.ndim in (2, 4)
        and not attn_mask.requires_grad
    )


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    out, _ = flash_attention_forward(query, key, value, attn_mask, is_causal, scale)
    return out


def _attention_grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    out, logsumexp = flash_attention_forward(query, key, value, attn_mask, is_causal, scale)
    grads = flash_attention_backward(get_grad(out), query, key, value, attn_mask, out, logsumexp, is_causal, scale)
    put_grads((query, key, value), grads)
    return out


cpu_attention_executor.register_implementation(
    ltorch.scaled_dot_product_attention,
    checker=_kernel_takes,
    execution_transform=_attention,
    grad_transform=_attention_grad,
)
