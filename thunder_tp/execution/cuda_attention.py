"""CUDA attention with a mask shared by the batch: ``scaled_dot_product_attention`` on torch's own dispatch.

litgpt's KV-cache forward passes one (1, 1, query, key) mask for every sequence of a batch. Thunder 0.2.6's SDPA
executor claims that call (torch's kernel choice accepts a broadcast batch) and then fails in its own meta
function ("Expected all inputs to have same batch_size"), so batched generation on CUDA stopped at its first
compile. This executor, listed before Thunder's, claims exactly those calls and runs them as eager PyTorch does,
``torch.nn.functional.scaled_dot_product_attention``, which broadcasts the mask and picks the fused kernel
itself. It has no grad rule: a call that needs grads keeps Thunder's executors (training passes masks of the
batch's size, or none).
"""

from __future__ import annotations

import thunder.torch as ltorch
import torch
from thunder.core.proxies import TensorProxy
from thunder.extend import OperatorExecutor, register_executor

__all__ = ["cuda_attention_executor"]

cuda_attention_executor = OperatorExecutor("thunder_tp_cuda_attention", version="0.1")
register_executor(cuda_attention_executor)


def _meta(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale: float | None):
    return TensorProxy(like=query, shape=(*query.shape[:-1], value.shape[-1]))


def _impl(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale: float | None):
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


attention_with_batch_broadcast_mask = cuda_attention_executor.register_operator(
    "attention_with_batch_broadcast_mask", meta=_meta, fn=_impl
)


def _mask_broadcasts_over_batch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                scale=None) -> bool:
    """True for SDPA of CUDA tensors whose 4-D mask has one row of masks for a batch of several sequences."""
    return (
        query.device.type == "cuda"
        and attn_mask is not None
        and attn_mask.ndim == 4
        and attn_mask.shape[0] == 1 < query.shape[0]
    )


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    return attention_with_batch_broadcast_mask(query, key, value, attn_mask, dropout_p, is_causal, scale)


cuda_attention_executor.register_implementation(
    ltorch.scaled_dot_product_attention,
    checker=_mask_broadcasts_over_batch,
    execution_transform=_attention,
)
