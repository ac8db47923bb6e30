"""The benchmark Llama (separate q/k/v, RMSNorm, RoPE, SwiGLU, GQA, causal SDPA, untied embedding and lm_head), the
litgpt config of the same dims, thunder_tp's plan for it, and gpt-fast-style TP of a litgpt GPT written by hand
(``shard_by_hand``, the decode benchmarks' reference)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.lib.harness import tensor_bytes


@dataclass
class LlamaConfig:
    dim: int = 512
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab: int = 8192
    ffn_hidden: int = 1536
    max_seq: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq, head_dim) for the rotate-half form of RoPE."""
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under DTensor TP each rank sees only its heads
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.cfg = cfg
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the RoPE tables (buffers outside the state dict), e.g. once a meta-device model is materialized
        (Thunder's MaterializationTransform calls it)."""
        cos, sin = rope_tables(self.cfg)
        self.cos, self.sin = cos.to(self.cos), sin.to(self.sin)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


class WithLoss(nn.Module):
    """The model and its next-token cross-entropy: what every mode runs (under thunder, in one trace)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def litgpt_config(cfg: LlamaConfig):
    """A litgpt Config with the same dims as ``cfg``."""
    from litgpt import Config
    return Config(
        block_size=cfg.max_seq, vocab_size=cfg.vocab, padded_vocab_size=cfg.vocab, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_query_groups=cfg.n_kv_heads, n_embd=cfg.dim, head_size=cfg.head_dim,
        intermediate_size=cfg.ffn_hidden, bias=False, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm",
        norm_eps=cfg.norm_eps, parallel_residual=False, rotary_percentage=1.0, rope_base=int(cfg.rope_theta),
    )


def thunder_tp_plan(sequence_parallel: bool, loss_parallel: bool = False) -> dict:
    """thunder_tp's plan for ``Llama`` (keys relative to ``WithLoss``)."""
    from thunder_tp import ColwiseParallel, Replicate, RowwiseParallel, SequenceParallel, Shard
    reduced = Shard(1) if sequence_parallel else Replicate()
    blk = "model.layers.*."
    plan = {
        "model.tok_embeddings": RowwiseParallel(output_layout=reduced),
        **{f"{blk}attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
        f"{blk}attention.wo": RowwiseParallel(output_layout=reduced),
        **{f"{blk}feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")},
        f"{blk}feed_forward.w2": RowwiseParallel(output_layout=reduced),
        # loss parallel off (as for DTensor): the logits are gathered
        "model.output": ColwiseParallel(output_layout=None if loss_parallel else Replicate()),
    }
    if sequence_parallel:
        plan.update({f"{blk}attention_norm": SequenceParallel(1), f"{blk}ffn_norm": SequenceParallel(1),
                     "model.norm": SequenceParallel(1)})
    return plan


def _set_weight(linear: nn.Linear, weight: torch.Tensor) -> None:
    """Give ``linear`` its own copy of ``weight`` (a slice of the full weight, which is then freed)."""
    linear.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def shard_by_hand(model: nn.Module, rank: int, world: int) -> list[tuple[str, int]]:
    """gpt-fast-style TP of a litgpt llama in place, before ``set_kv_cache``: column/row shards, all_reduces and a
    logits all_gather; returns the list the last forward's collectives go to as (kind, bytes)."""
    c = model.config
    for name in ("n_head", "n_query_groups", "intermediate_size", "padded_vocab_size"):
        if getattr(c, name) % world:
            raise ValueError(f"manual_tp: {name} {getattr(c, name)} is not divisible by the {world} ranks")
    calls: list[tuple[str, int]] = []
    def all_reduce(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out)
        calls.append(("all_reduce", tensor_bytes(out)))
        return out
    def all_gather(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.contiguous())
        calls.append(("all_gather", world * tensor_bytes(out)))
        return torch.cat(parts, dim=-1)
    local = copy.copy(c)  # what each attention reads: its local heads
    local.n_head, local.n_query_groups = c.n_head // world, c.n_query_groups // world
    kv = c.n_query_groups * c.head_size
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        blocks = attn.qkv.weight.split((c.n_head * c.head_size, kv, kv))  # litgpt's fused layout: q | k | v
        _set_weight(attn.qkv, torch.cat([w.chunk(world)[rank] for w in blocks]))
        _set_weight(attn.proj, attn.proj.weight.chunk(world, dim=1)[rank])
        attn.config = local
        for fc in (mlp.fc_1, mlp.fc_2):
            _set_weight(fc, fc.weight.chunk(world)[rank])
        _set_weight(mlp.proj, mlp.proj.weight.chunk(world, dim=1)[rank])
        attn.register_forward_hook(all_reduce)
        mlp.register_forward_hook(all_reduce)
    _set_weight(model.lm_head, model.lm_head.weight.chunk(world)[rank])
    model.lm_head.register_forward_hook(all_gather)
    model.register_forward_pre_hook(lambda module, inputs: calls.clear())
    return calls
