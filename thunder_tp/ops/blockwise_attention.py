"""Causal attention of a rank's query chunks over blocks of keys, without a mask tensor: context parallelism's.

A rank of a context-parallel group holds query chunks at known positions of the sequence, and attends them to key
blocks whose positions are known too: each (query chunk, key block) pair is either fully visible (the keys all come
before the queries), causal (the same positions: a square causal mask) or invisible. So each pair is one call of
torch's fused attention kernel for CPU (``_scaled_dot_product_flash_attention_for_cpu``: no (query, key) matrix
kept, one log-sum-exp per query row), and a query chunk's pairs are merged by their log-sum-exps. The backward is
the kernel's backward of each pair with the merged output and log-sum-exp (the softmax is over all keys: a pair's
share of it is its probabilities under the merged normalizer), its grads added up.

``pairs``: (query start, query length, key tensor index, key start, key length, causal) in the local tensors.
"""

from __future__ import annotations

import torch
from thunder.core import dtypes
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import register_grad
from thunder.extend import OperatorExecutor, add_default_executor, register_executor

from thunder_tp.thunder_internals.aten import cpu_flash_attention, cpu_flash_attention_backward

__all__ = ["Pair", "blockwise_attention", "blockwise_attention_executor"]

#: (query start, query length, key tensor index, key start, key length, causal)
Pair = tuple[int, int, int, int, int, bool]

#: Runs the symbols below (opaque: torch's CPU kernels inside). A Thunder default executor.
blockwise_attention_executor = OperatorExecutor("thunder_tp_blockwise_attention", version="0.1")
register_executor(blockwise_attention_executor)
add_default_executor(blockwise_attention_executor)


def _query_chunks(pairs: tuple[Pair, ...]) -> dict[tuple[int, int], list[Pair]]:
    chunks: dict[tuple[int, int], list[Pair]] = {}
    for pair in pairs:
        chunks.setdefault(pair[:2], []).append(pair)
    return chunks


def _forward(q, keys, values, pairs: tuple[Pair, ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = cpu_flash_attention
    outs, lses = [], []
    for (start, length), chunk in sorted(_query_chunks(pairs).items()):
        rows = q[..., start : start + length, :]
        parts = [kernel(rows, keys[i][..., k0 : k0 + n, :], values[i][..., k0 : k0 + n, :], 0.0, causal, scale=scale)
                 for _, _, i, k0, n, causal in chunk]
        total = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), 0)
        outs.append(sum(torch.exp(part_lse - total).unsqueeze(-1).to(q.dtype) * part for part, part_lse in parts))
        lses.append(total)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def _backward(grad, q, keys, values, out, lse, pairs: tuple[Pair, ...], scale: float):
    kernel = cpu_flash_attention_backward
    grad_q = torch.zeros_like(q)
    grad_keys, grad_values = [torch.zeros_like(k) for k in keys], [torch.zeros_like(v) for v in values]
    for start, length, i, k0, n, causal in pairs:
        rows = slice(start, start + length)
        dq, dk, dv = kernel(grad[..., rows, :].contiguous(), q[..., rows, :], keys[i][..., k0 : k0 + n, :],
                            values[i][..., k0 : k0 + n, :], out[..., rows, :].contiguous(),
                            lse[..., rows].contiguous(), 0.0, causal, scale=scale)
        grad_q[..., rows, :] += dq
        grad_keys[i][..., k0 : k0 + n, :] += dk
        grad_values[i][..., k0 : k0 + n, :] += dv
    return grad_q, tuple(grad_keys), tuple(grad_values)


def _forward_meta(q, keys, values, pairs, scale) -> tuple[TensorProxy, TensorProxy]:
    lse_dtype = dtypes.float64 if q.dtype == dtypes.float64 else dtypes.float32
    return TensorProxy(like=q), TensorProxy(like=q, shape=tuple(q.shape[:-1]), dtype=lse_dtype, requires_grad=False)


def _backward_meta(grad, q, keys, values, out, lse, pairs, scale) -> tuple:
    return TensorProxy(like=q), tuple(TensorProxy(like=k) for k in keys), tuple(TensorProxy(like=v) for v in values)


#: (output, log-sum-exp per query row) of the query chunks of `pairs` over their key blocks
blockwise_attention = blockwise_attention_executor.register_operator("blockwise_attention", meta=_forward_meta,
                                                                     fn=_forward)
blockwise_attention_backward = blockwise_attention_executor.register_operator(
    "blockwise_attention_backward", meta=_backward_meta, fn=_backward)


def _grad(q, keys, values, pairs, scale):
    out, lse = blockwise_attention(q, keys, values, pairs, scale)
    grad_q, grad_keys, grad_values = blockwise_attention_backward(get_grad(out), q, keys, values, out, lse, pairs,
                                                                  scale)
    put_grad(q, grad_q)
    for t, g in (*zip(keys, grad_keys, strict=True), *zip(values, grad_values, strict=True)):
        put_grad(t, g)
    return out, lse


register_grad(blockwise_attention, _grad)
