"""aten's fused attention kernels for CPU, which eager ``scaled_dot_product_attention`` (and DTensor) call on CPU
tensors: torch 2.10 names them only privately (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its
``_backward``), and no public function returns the log-sum-exp their backward needs.
"""

from __future__ import annotations

import torch

__all__ = ["cpu_flash_attention", "cpu_flash_attention_backward"]


def cpu_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, is_causal: bool,
                        *, attn_mask: torch.Tensor | None = None,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output and one log-sum-exp per query row."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return kernel(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def cpu_flash_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float, is_causal: bool, *,
                                 attn_mask: torch.Tensor | None = None,
                                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grads of query, key and value, from the forward's output and log-sum-exp."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    return kernel(grad, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
