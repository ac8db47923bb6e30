"""thunder_tp vs PyTorch DTensor TP vs single device, side by side in one run (CPU/gloo or CUDA/NCCL).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/compare.py --json_path out.json --png_path out.png

Every mode trains the same Llama (separate q/k/v, RMSNorm, RoPE, SwiGLU, GQA, causal SDPA, untied
embedding and lm_head) from the same weights on the same batch with the same step (forward,
cross-entropy, backward, SGD step):

- single device (rank 0 only, the other ranks wait at a barrier): eager, ``thunder.jit`` with
  ``thunder_tp.executors()`` and with Thunder's default executors;
- thunder_tp: TP (Megatron) and TP+SP (sequence parallel), ``thunder.jit(model, transforms=[TensorParallel(plan)],
  executors=thunder_tp.executors())``;
- DTensor: ``parallelize_module`` with the default Colwise/Rowwise plan, the best eager plan (one
  ``PrepareModuleInput`` per attention/MLP, so q/k/v and w1/w3 share one input and one backward all_reduce),
  the sequence-parallel plan, and the best plan under ``torch.compile`` (skipped, with the reason, if it fails);
- litgpt GPT of the same dims, single-device thunder and thunder_tp TP/SP with ``thunder_tp.plans.litgpt``.

Before any timing, each mode's first-step gradients (every parameter, gathered to full tensors) are compared
with the single-device eager run's, each within ``--grad_rtol`` of that tensor's largest entry: a mismatch raises
``GradientMismatch`` naming the mode and the parameter. Its first and second-step losses are compared too; a mode
whose losses disagree is reported and not timed.
Every rank uses one thread (``torch.set_num_threads(1)``). Outputs: a markdown table on stdout, ``--json_path``
and ``--png_path`` (step time and communication per mode, and transform time vs depth).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # ranks compile side by side on few cores

import argparse
import contextlib
import datetime
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# --- the model --------------------------------------------------------------------------------------


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
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

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
        norm_eps=cfg.norm_eps, parallel_residual=False, rotary_percentage=1.0,
    )


# --- plans ------------------------------------------------------------------------------------------


def thunder_tp_plan(sequence_parallel: bool, loss_parallel: bool = False) -> dict:
    """thunder_tp's plan for ``Llama`` (keys relative to ``WithLoss``); loss_parallel leaves the logits
    vocab-sharded, so the cross-entropy in the same trace runs on them without gathering them."""
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


def dtensor_plan(kind: str, loss_parallel: bool = False) -> dict:
    """DTensor plan for ``Llama``: 'default' (per-linear), 'best' (shared inputs) or 'sp' (torchtitan's);
    loss_parallel leaves the logits a vocab-sharded DTensor (for ``torch.distributed.tensor.parallel.loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    sp = kind == "sp"
    act = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel else ColwiseParallel(input_layouts=act, output_layouts=Replicate()),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    blk = "layers.*."
    for w in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[blk + w] = ColwiseParallel()
    plan[blk + "attention.wo"] = RowwiseParallel(output_layouts=act)
    plan[blk + "feed_forward.w2"] = RowwiseParallel(output_layouts=act)
    if kind != "default":
        # the module input becomes one Replicate DTensor shared by q/k/v (w1/w3): their Partial grads are summed
        # as DTensors and all-reduced once (the default plan all-reduces each linear's input grad separately)
        plan[blk + "attention"] = PrepareModuleInput(
            input_layouts=(act, None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=False)
        plan[blk + "feed_forward"] = PrepareModuleInput(
            input_layouts=(act,), desired_input_layouts=(Replicate(),), use_local_output=False)
    if sp:
        plan[blk + "attention_norm"] = SequenceParallel()
        plan[blk + "ffn_norm"] = SequenceParallel()
    return plan


# --- measuring --------------------------------------------------------------------------------------


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def proxy_bytes(p) -> int:
    from thunder.core import dtypes

    return math.prod(p.shape) * dtypes.to_torch_dtype(p.dtype).itemsize


_C10D_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "all_gather": "all_gather",
               "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all", "all_to_all": "all_to_all",
               "all_reduce": "all_reduce", "broadcast": "broadcast"}


def _kind(name: str) -> str:
    """Collective kind of an op schema name such as 'c10d::allreduce_' or '_c10d_functional::all_gather_into_tensor'."""
    short = name.split("::")[-1].lstrip("_")
    for key, kind in _C10D_KINDS.items():
        if short.startswith(key):
            return kind
    return short


def _payload(name: str, args, out) -> int:
    """Bytes of the full tensor a collective works on: all_reduce's tensor, all_gather's output, reduce_scatter's input."""
    tensors = [t for t in torch.utils._pytree.tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    kind, short = _kind(name), name.split("::")[-1]
    if "c10d_functional" in name:
        if kind == "all_gather":
            return sum(tensor_bytes(t) for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return tensor_bytes(tensors[0]) if tensors else 0
    if short in ("_allgather_base_", "_reduce_scatter_base_"):  # (output, input, ...)
        return tensor_bytes(tensors[0] if kind == "all_gather" else tensors[1])
    if short == "allgather_":  # (output lists, input list)
        return sum(tensor_bytes(t) for t in tensors[:-1])
    return sum(tensor_bytes(t) for t in tensors)


def comm_mode():
    """A CommDebugMode that also records (kind, bytes) of each collective it sees (DTensor's funcol ops and
    c10d ops, which thunder's torch.distributed calls go through)."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    class CommBytesMode(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.records: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = func._overloadpacket
            if out is not NotImplemented and (packet in self.comm_registry or packet in c10d_collective_ops):
                name = func._schema.name
                self.records.append((_kind(name), _payload(name, (args, kwargs), out)))
            return out

    return CommBytesMode()


def summarize_records(records: list[tuple[str, int]]) -> dict:
    counts: dict[str, int] = {}
    nbytes = 0
    for kind, b in records:
        counts[kind] = counts.get(kind, 0) + 1
        nbytes += b
    return {"counts": counts, "total": sum(counts.values()), "bytes": nbytes}


def trace_collectives(trace) -> list[tuple[str, int]]:
    """(kind, bytes) of each collective a final thunder trace issues (all_gather: the gathered output)."""
    from thunder_tp.debug import collective_calls

    return [(c["kind"], c["bytes"]) for c in collective_calls(trace)]


def thunder_saved_bytes(jm) -> int:
    """Bytes of the tensors the final forward trace saves for backward, parameters and inputs excluded."""
    import thunder
    from thunder.core.proxies import TensorProxy
    from thunder.core.pytree import tree_flatten

    fwd = thunder.last_traces(jm)[-1]
    ret = fwd.bound_symbols[-1]
    saved = ret.args[1] if len(ret.args) > 1 else ret.args[0][1]
    inputs = {p.name for p in tree_flatten((fwd.args, fwd.kwargs))[0] if isinstance(p, TensorProxy)}
    seen = {}
    for p in tree_flatten(saved)[0]:
        if isinstance(p, TensorProxy) and p.name not in inputs:
            seen[p.name] = proxy_bytes(p)
    return sum(seen.values())


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside ``t`` (DTensor's local shard, AsyncCollectiveTensor's result, ...)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [x for a in attrs for x in plain_tensors(getattr(t, a))]
    return [t]


def hooked_saved_bytes(fn: Callable[[], torch.Tensor], params) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves for backward while running ``fn``, parameters excluded."""
    param_ptrs = {x.untyped_storage().data_ptr() for p in params for x in plain_tensors(p)}
    seen: dict[int, int] = {}

    def pack(t):
        for x in plain_tensors(t):
            storage = x.untyped_storage()
            if storage.data_ptr() not in param_ptrs:
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return sum(seen.values()), loss


# --- modes ------------------------------------------------------------------------------------------


@dataclass
class Mode:
    name: str
    family: str  # "llama" or "litgpt"
    ranks: int  # 1: runs on rank 0 only
    runtime: str  # "eager", "thunder", "compile"
    build: Callable[[nn.Module], nn.Module]
    description: str


def _thunder_single(executors_fn):
    def build(model):
        import thunder

        return thunder.jit(model, executors=executors_fn())

    return build


def _thunder_tp(plan_fn):
    def build(model):
        import thunder
        import thunder_tp

        return thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan_fn(model))], executors=thunder_tp.executors())

    return build


def _dtensor(kind: str, compile: bool = False, loss_parallel: bool = False):
    def build(model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context
        from torch.distributed.tensor.parallel import parallelize_module

        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        parallelize_module(model.model, mesh, dtensor_plan(kind, loss_parallel))
        if loss_parallel:
            from torch.distributed.tensor import DTensor, Replicate

            def replicated_targets(_module, args):
                idx, targets = args
                return idx, DTensor.from_local(targets, mesh, [Replicate()])

            model.register_forward_pre_hook(replicated_targets)
            model.step_context = loss_parallel_context  # forward and backward of the loss run inside it
        return torch.compile(model) if compile else model

    return build


def all_modes() -> list[Mode]:
    import thunder
    import thunder_tp

    def litgpt_plan(sp):
        return lambda model: thunder_tp.plans.litgpt(model, sequence_parallel=sp)  # keys prefixed "model."

    return [
        Mode("single_eager", "llama", 1, "eager", lambda m: m, "1 rank, eager PyTorch"),
        Mode("single_thunder", "llama", 1, "thunder", _thunder_single(thunder_tp.executors),
             "1 rank, thunder.jit, executors=thunder_tp.executors()"),
        Mode("single_thunder_defaults", "llama", 1, "thunder", _thunder_single(thunder.get_default_executors),
             "1 rank, thunder.jit, Thunder's default executors"),
        Mode("thunder_tp_tp", "llama", 0, "thunder", _thunder_tp(lambda m: thunder_tp_plan(False)), "thunder_tp TP"),
        Mode("thunder_tp_sp", "llama", 0, "thunder", _thunder_tp(lambda m: thunder_tp_plan(True)), "thunder_tp TP+SP"),
        Mode("thunder_tp_tp_lp", "llama", 0, "thunder", _thunder_tp(lambda m: thunder_tp_plan(False, True)),
             "thunder_tp TP, loss parallel (logits stay vocab-sharded; compare with dtensor_tp_lp)"),
        Mode("dtensor_tp_lp", "llama", 0, "eager", _dtensor("best", loss_parallel=True),
             "DTensor TP, best eager plan, loss parallel (torch's loss_parallel(); compare with thunder_tp_tp_lp)"),
        Mode("dtensor_tp_default", "llama", 0, "eager", _dtensor("default"),
             "DTensor TP, default plan (Colwise/Rowwise per linear)"),
        Mode("dtensor_tp", "llama", 0, "eager", _dtensor("best"),
             "DTensor TP, best eager plan (+PrepareModuleInput per attention/MLP)"),
        Mode("dtensor_sp", "llama", 0, "eager", _dtensor("sp"), "DTensor TP+SP (torchtitan's plan)"),
        Mode("dtensor_tp_compile", "llama", 0, "compile", _dtensor("best", compile=True),
             "DTensor TP, best plan, torch.compile"),
        Mode("litgpt_single_thunder", "litgpt", 1, "thunder", _thunder_single(thunder_tp.executors),
             "litgpt GPT, 1 rank, thunder.jit, thunder_tp.executors()"),
        Mode("litgpt_thunder_tp_tp", "litgpt", 0, "thunder", _thunder_tp(litgpt_plan(False)),
             "litgpt GPT, thunder_tp TP (plans.litgpt)"),
        Mode("litgpt_thunder_tp_sp", "litgpt", 0, "thunder", _thunder_tp(litgpt_plan(True)),
             "litgpt GPT, thunder_tp TP+SP (plans.litgpt)"),
    ]


def make_model(family: str, cfg: LlamaConfig, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if family == "litgpt":
        from litgpt import GPT

        return WithLoss(GPT(litgpt_config(cfg)))
    return WithLoss(Llama(cfg))


def step_context(model):
    """What a mode's forward and backward must run inside (DTensor's loss_parallel), else nothing."""
    return getattr(model, "step_context", contextlib.nullcontext)()


def train_step(model, opt, idx, targets) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    with step_context(model):
        loss = model(idx, targets)
        loss.backward()
    opt.step()
    return loss.detach()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class GradientMismatch(AssertionError):
    """A mode's gradient differs from the single-device run's: the mode computes something else."""


def full_grads(jm: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (thunder_tp shards and DTensors gathered: collective in a distributed mode)."""
    from torch.distributed.tensor import DTensor

    from thunder_tp import TensorParallel
    from thunder_tp.collectives import gather_full
    from thunder_tp.layouts import Shard

    tp = next((t for t in getattr(jm, "_lc_transforms", []) if isinstance(t, TensorParallel)), None)
    layouts = tp.parameter_layouts if tp is not None else {}
    grads = {}
    for name, p in jm.named_parameters():
        name = name.removeprefix("_orig_mod.")  # torch.compile's wrapper
        grad = p.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        elif isinstance(layouts.get(name), Shard):
            grad = gather_full(grad, layouts[name], tp.tp.group)
        grads[name] = grad.detach()
    return grads


def check_gradients(mode_name: str, grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], rtol: float) -> float:
    """The largest gradient error relative to its reference's largest entry; GradientMismatch above rtol."""
    if set(grads) != set(reference):
        raise GradientMismatch(f"{mode_name}: parameters {sorted(set(grads) ^ set(reference))} are not in both "
                               "this mode and the single-device model")
    worst = 0.0
    for name, ref in reference.items():
        grad = grads[name].to(ref.device, torch.float64)
        error, largest = (grad - ref).abs().max().item(), ref.abs().max().item()
        bound = rtol * largest
        worst = max(worst, error / largest if largest else error)
        if not error <= bound:
            raise GradientMismatch(f"{mode_name}: gradient of {name!r} differs from the single-device run by {error:.3e} "
                                   f"(allowed {bound:.3e} = {rtol:g} x its largest entry); not timed")
    return worst


def prepare_mode(mode: Mode, model: nn.Module, idx, targets, args, reference: dict) -> tuple[dict, Any]:
    """Build, check every gradient and the first two losses, warm up; returns this rank's result and (jm, opt, params)."""
    distributed = mode.ranks != 1
    barrier = dist.barrier if distributed else (lambda: None)
    result: dict = {"description": mode.description, "ranks": dist.get_world_size() if distributed else 1,
                    "runtime": mode.runtime, "times_s": []}
    barrier()
    t0 = time.perf_counter()
    jm = mode.build(model)
    opt = torch.optim.SGD(list(jm.parameters()), lr=args.lr)
    loss1 = train_step(jm, opt, idx, targets)
    sync()
    result["first_iter_s"] = time.perf_counter() - t0
    result["grad_error"] = check_gradients(mode.name, full_grads(jm), reference[mode.family]["grads"], args.grad_rtol)
    loss2 = train_step(jm, opt, idx, targets)
    result["loss_step1"], result["loss_step2"] = loss1.item(), loss2.item()
    ref1, ref2 = reference[mode.family]["losses"]
    ok1 = math.isclose(loss1.item(), ref1, rel_tol=args.rtol)
    ok2 = math.isclose(loss2.item(), ref2, rel_tol=10 * args.rtol)
    result["loss_ok"] = ok1 and ok2
    result["reference_losses"] = [ref1, ref2]
    params = list(jm.parameters())
    result["param_bytes"] = sum(tensor_bytes(local(p)) for p in params)
    if distributed:
        ok = torch.tensor([float(result["loss_ok"])])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        result["loss_ok"] = bool(ok.item())
        first = torch.tensor([result["first_iter_s"]], dtype=torch.float64)
        dist.all_reduce(first, op=dist.ReduceOp.MAX)
        result["first_iter_s"] = first.item()
    if not result["loss_ok"]:
        result["error"] = (f"first/second-step loss {loss1.item():.7f}/{loss2.item():.7f} differs from single-device "
                           f"{ref1:.7f}/{ref2:.7f}; not timed")
        return result, None
    for _ in range(max(args.warmup - 2, 0)):  # the first two steps were warm-up too
        train_step(jm, opt, idx, targets)
    return result, (jm, opt, params)


def time_steps(mode: Mode, jm, opt, idx, targets, steps: int) -> list[float]:
    """Wall time of `steps` training steps; a distributed step lasts until its slowest rank is done."""
    distributed = mode.ranks != 1
    times = []
    for _ in range(steps):
        if distributed:
            dist.barrier()
        sync()
        start = time.perf_counter()
        train_step(jm, opt, idx, targets)
        sync()
        times.append(time.perf_counter() - start)
    if distributed:
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
    return times


def finish_mode(mode: Mode, state, idx, targets, args, result: dict) -> None:
    """Statistics of the timed steps, then peak memory, saved-for-backward bytes and collectives of one more step."""
    jm, opt, params = state
    times = result["times_s"]
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    result.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times), q1_s=q[0], q3_s=q[2])
    result["tokens_per_s"] = idx.numel() / result["median_s"]
    if args.profile_dir and mode.name in args.profile:  # every rank steps (collectives), rank 0 writes
        profile_steps(mode.name, jm, opt, idx, targets, args.profile_dir if dist.get_rank() == 0 else None)
    if args.dump_traces and mode.runtime == "thunder":
        import thunder_tp

        thunder_tp.dump_traces(jm, os.path.join(args.dump_traces, mode.name))
    result["peak_step_bytes"] = peak_step_bytes(lambda: train_step(jm, opt, idx, targets))
    measure_memory_and_comm(mode, jm, params, idx, targets, result)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_step_bytes(step: Callable[[], Any]) -> int | None:
    """Memory a step needs above what is live before it: CUDA's peak allocated, or on CPU the process's peak
    resident set (VmHWM, reset through /proc/self/clear_refs) after returning the heap's free pages (malloc_trim)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = _proc_status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        return None
    step()
    return (_proc_status_kib("VmHWM") - before) * 1024


def measure_memory_and_comm(mode: Mode, jm, params, idx, targets, result: dict) -> None:
    """Saved-for-backward bytes and collectives of one more forward/backward; after timing, since a dispatch mode
    (CommDebugMode) makes Dynamo give up on compiled code (Thunder's Inductor regions and torch.compile run eagerly
    from then on)."""
    jm.zero_grad(set_to_none=True)
    with step_context(jm):
        saved, loss = hooked_saved_bytes(lambda: jm(idx, targets), params)
        loss.backward()
    result["saved_bytes_hooks"] = saved
    if mode.runtime == "thunder":
        import thunder

        result["saved_bytes"] = thunder_saved_bytes(jm)
        fwd_t, bwd_t = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
        result["comm_forward_trace"] = summarize_records(trace_collectives(fwd_t))
        result["comm_backward_trace"] = summarize_records(trace_collectives(bwd_t))
        result["fusion_regions"] = [sum(b.sym.is_fusion for b in t.bound_symbols) for t in (fwd_t, bwd_t)]
    else:
        result["saved_bytes"] = saved
    fwd_mode, bwd_mode = comm_mode(), comm_mode()
    jm.zero_grad(set_to_none=True)
    try:
        with step_context(jm):
            with fwd_mode:
                loss = jm(idx, targets)
            with bwd_mode:
                loss.backward()
        result["comm_forward"] = summarize_records(fwd_mode.records)
        result["comm_backward"] = summarize_records(bwd_mode.records)
    except Exception as e:
        result["comm_note"] = f"runtime comm measurement failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    jm.zero_grad(set_to_none=True)


def profile_steps(name, jm, opt, idx, targets, directory):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            train_step(jm, opt, idx, targets)
    if directory is None:
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{name}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
    prof.export_chrome_trace(os.path.join(directory, f"{name}.json"))


def reference_run(family: str, cfg: LlamaConfig, state, idx, targets, lr) -> dict:
    """Eager single-device first and second-step losses and first-step gradients (float64 copies)."""
    model = make_model(family, cfg, 0)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss1 = train_step(model, opt, idx, targets).item()
    grads = {name: p.grad.detach().to(torch.float64) for name, p in model.named_parameters()}
    return {"losses": [loss1, train_step(model, opt, idx, targets).item()], "grads": grads}


# --- transform time vs depth ------------------------------------------------------------------------


def transform_scaling(cfg: LlamaConfig, depths: list[int], repeats: int) -> dict:
    """Time of TensorParallel.transform_traces_pre_prologue (the TP pass) for Llamas of each depth."""
    import thunder
    import thunder_tp
    from thunder_tp.collectives import comm_executor

    timings: list[float] = []
    original = thunder_tp.TensorParallel.transform_traces_pre_prologue

    def timed(self, prologue, computation, epilogue, **kwargs):
        start = time.perf_counter()
        out = original(self, prologue, computation, epilogue, **kwargs)
        timings.append(time.perf_counter() - start)
        timings_bsyms.append(len(computation.bound_symbols))
        return out

    timings_bsyms: list[int] = []
    thunder_tp.TensorParallel.transform_traces_pre_prologue = timed
    results = {}
    try:
        for n in depths:
            c = LlamaConfig(**{**asdict(cfg), "n_layers": n})
            samples = []
            for r in range(repeats):
                model = make_model("llama", c, 0)
                jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp_plan(False))],
                                 executors=[comm_executor, *thunder.get_default_executors()])
                idx = torch.zeros(1, min(16, c.max_seq), dtype=torch.long)
                with torch.no_grad():
                    jm(idx, idx)
                samples.append(timings[-1])
            t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results[n] = {"transform_s": t.item(), "samples_s": samples, "trace_bsyms": timings_bsyms[-1]}
    finally:
        thunder_tp.TensorParallel.transform_traces_pre_prologue = original
    return results


# --- report -----------------------------------------------------------------------------------------


def _mb(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _comm_cell(r: dict) -> str:
    f, b = r.get("comm_forward_trace") or r.get("comm_forward"), r.get("comm_backward_trace") or r.get("comm_backward")
    if f is None or b is None:
        return "-"

    def short(c):
        abbrev = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}
        return " ".join(f"{n}{abbrev.get(k, k)}" for k, n in sorted(c["counts"].items())) or "0"

    return f"{short(f)} / {short(b)}"


def comm_bytes(r: dict) -> int | None:
    f, b = r.get("comm_forward_trace") or r.get("comm_forward"), r.get("comm_backward_trace") or r.get("comm_backward")
    return None if f is None or b is None else f["bytes"] + b["bytes"]


def baseline_for(name: str) -> str:
    """The 1-rank run a mode's speed-up is measured against: same model family and runtime."""
    if name.startswith("litgpt"):
        return "litgpt_single_thunder"
    if name.startswith(("thunder_tp", "single_thunder")):
        return "single_thunder"
    return "single_eager"


def _saved_cell(r: dict) -> str:
    if r.get("runtime") == "thunder" and r.get("saved_bytes_hooks") is not None:
        return f"{_mb(r.get('saved_bytes'))} ({_mb(r['saved_bytes_hooks'])})"
    return _mb(r.get("saved_bytes"))


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown_table(results: dict) -> str:
    ref = results.get("dtensor_tp", {}).get("median_s")
    lines = [
        "| mode | ranks | step median (ms) | min–max (ms) | tokens/s | × DTensor TP | speed-up vs 1 rank "
        "| parallel eff. | first iter (s) | params/rank (MB) | saved for bwd (MB) | peak step mem (MB) "
        "| fusion regions fwd / bwd | collectives fwd / bwd | comm/step (MB) | loss ok |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for name, r in results.items():
        first = _fmt(r.get("first_iter_s"), ".1f")
        if "median_s" not in r:
            reason = r.get("error") or r.get("skipped") or "not run"
            lines.append(f"| {name} | {r.get('ranks', '–')} | – | – | – | – | – | – | {first} | – | – | – | – | – | – | {reason} |")
            continue
        base = results.get(baseline_for(name), {}).get("median_s")
        speedup = base / r["median_s"] if base else None
        cells = [
            name, str(r["ranks"]), f"{r['median_s'] * 1e3:.0f}", f"{r['min_s'] * 1e3:.0f}–{r['max_s'] * 1e3:.0f}",
            f"{r['tokens_per_s']:.0f}", _fmt(r["median_s"] / ref if ref else None, ".2f"), _fmt(speedup, ".2f"),
            _fmt(speedup / r["ranks"] if speedup else None, ".2f"), first, _mb(r.get("param_bytes")), _saved_cell(r),
            _mb(r.get("peak_step_bytes")), " / ".join(map(str, r["fusion_regions"])) if "fusion_regions" in r else "–",
            _comm_cell(r), _mb(comm_bytes(r)), "yes" if r.get("loss_ok") else "NO",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, scaling: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = {n: r for n, r in results.items() if "median_s" in r}
    names = list(timed)
    fig, axes = plt.subplots(1, 3 if scaling else 2, figsize=(18 if scaling else 13, 5.5))
    ax = axes[0]
    med = [timed[n]["median_s"] * 1e3 for n in names]
    err = [[m - timed[n]["min_s"] * 1e3 for n, m in zip(names, med)], [timed[n]["max_s"] * 1e3 - m for n, m in zip(names, med)]]
    colors = ["tab:gray" if timed[n]["ranks"] == 1 else "tab:blue" if "thunder_tp" in n else "tab:orange" for n in names]
    ax.barh(names, med, xerr=err, color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("step time, ms (median, min–max)")
    ax.set_title("Training step (fwd + CE + bwd + SGD)")
    ax = axes[1]
    comm = [(comm_bytes(timed[n]) or 0) / 2**20 for n in names]
    ax.barh(names, comm, color=colors)
    for i, n in enumerate(names):
        ax.text(comm[i], i, " " + _comm_cell(timed[n]), va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_yticklabels([])
    ax.set_xlabel("communication per step, MB (collectives fwd / bwd)")
    ax.set_title("Communication")
    if scaling:
        ax = axes[2]
        depths = sorted(int(k) for k in scaling)
        ax.plot(depths, [scaling[d]["transform_s"] * 1e3 for d in depths], "o-")
        ax.set_xlabel("n_layers")
        ax.set_ylabel("TensorParallel pass, ms")
        ax.set_title("TP transform time vs depth")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main -------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cfg = LlamaConfig()
    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "ffn_hidden"):
        p.add_argument(f"--{f}", type=int, default=getattr(cfg, f))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode (after warm-up)")
    p.add_argument("--rounds", type=int, default=5,
                   help="the timed steps are spread over this many rounds, modes alternating within each")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps, the first (compile) and second (checked) included")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-4, help="first-step loss tolerance (10x for the second step)")
    p.add_argument("--grad_rtol", type=float, default=1e-4,
                   help="first-step gradient tolerance, relative to each gradient's largest entry (fp32)")
    p.add_argument("--modes", default="all", help="comma-separated mode names, or 'all'")
    p.add_argument("--skip", default="", help="comma-separated mode names to leave out")
    p.add_argument("--scaling_layers", default="2,4,8", help="depths for the transform-time scaling ('' to skip)")
    p.add_argument("--scaling_repeats", type=int, default=3)
    p.add_argument("--fresh_inductor_cache", type=int, default=1,
                   help="1: compile into an empty Inductor cache (honest first-iteration times)")
    p.add_argument("--pin_cores", type=int, default=1, help="CPU runs: pin local rank r to core r (every mode)")
    p.add_argument("--timeout", type=float, default=600, help="process-group timeout in seconds (a hung peer fails after it)")
    p.add_argument("--json_path", default="")
    p.add_argument("--png_path", default="")
    p.add_argument("--profile", default="", help="comma-separated modes to profile (torch.profiler, rank 0)")
    p.add_argument("--profile_dir", default="")
    p.add_argument("--dump_traces", default="", help="directory for each thunder mode's final traces (every rank)")
    args = p.parse_args(argv)
    args.profile = [m for m in args.profile.split(",") if m]
    return args


def pin_to_core() -> None:
    """One core per rank (local rank r on core r), when there are cores enough: otherwise the scheduler lets
    ranks share a core for a while, and every collective waits for the rank that fell behind."""
    cores = sorted(os.sched_getaffinity(0))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if local_world <= len(cores):
        os.sched_setaffinity(0, {cores[local_rank]})


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cache_dir = None
    if args.fresh_inductor_cache:
        cache_dir = tempfile.mkdtemp(prefix=f"compare_inductor_{os.environ.get('RANK', '0')}_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    cuda = torch.cuda.is_available()
    if args.pin_cores and not cuda:
        pin_to_core()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.set_default_device(device)
    cfg = LlamaConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                      vocab=args.vocab, ffn_hidden=args.ffn_hidden, max_seq=args.seq)
    g = torch.Generator().manual_seed(1234)
    idx = torch.randint(0, cfg.vocab, (args.batch, args.seq), generator=g).to(device)
    targets = torch.randint(0, cfg.vocab, (args.batch, args.seq), generator=g).to(device)

    modes = all_modes()
    wanted = {m.name for m in modes} if args.modes == "all" else set(args.modes.split(","))
    wanted -= set(args.skip.split(","))
    unknown = wanted - {m.name for m in modes}
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; known: {[m.name for m in modes]}")
    modes = [m for m in modes if m.name in wanted]
    families = sorted({m.family for m in modes})
    states_dicts = {f: make_model(f, cfg, 0).state_dict() for f in families}

    # every rank runs the reference itself: each checks the full gradients it gathered
    reference = {f: reference_run(f, cfg, states_dicts[f], idx, targets, args.lr) for f in families}

    results: dict = {}
    states: dict = {}
    for mode in modes:  # build, check and warm up every mode first
        if rank == 0:
            print(f"[compare] {mode.name}: {mode.description}", file=sys.stderr, flush=True)
        if mode.ranks == 1 and rank != 0:
            dist.barrier()  # the other ranks wait while rank 0 runs the single-device mode
            results[mode.name] = {"description": mode.description}
            continue
        model = make_model(mode.family, cfg, 0)
        model.load_state_dict(states_dicts[mode.family])
        try:
            results[mode.name], state = prepare_mode(mode, model, idx, targets, args, reference)
            if state is not None:
                states[mode.name] = state
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            if mode.runtime != "compile" or isinstance(e, GradientMismatch):
                traceback.print_exc()
                raise
            results[mode.name] = {"description": mode.description, "skipped": f"torch.compile failed: {msg}"}
            print(f"[compare] {mode.name} skipped: {msg}", file=sys.stderr, flush=True)
        if mode.ranks == 1:
            dist.barrier()
    ready = torch.tensor([m.name in states for m in modes], dtype=torch.int32)
    dist.broadcast(ready, 0)  # rank 0 knows the single-device modes; a distributed mode's check is collective
    timed = [m for m, ok in zip(modes, ready.tolist()) if ok]
    rounds = max(1, min(args.rounds, args.steps))
    for r in range(rounds):  # alternate: every mode a few steps per round, order reversed every other round
        steps = args.steps // rounds + (r < args.steps % rounds)
        for mode in timed if r % 2 == 0 else timed[::-1]:
            if mode.ranks == 1 and rank != 0:
                dist.barrier()
                continue
            jm, opt, _ = states[mode.name]
            results[mode.name]["times_s"] += time_steps(mode, jm, opt, idx, targets, steps)
            if mode.ranks == 1:
                dist.barrier()
    for mode in timed:
        if mode.ranks == 1 and rank != 0:
            dist.barrier()
            continue
        finish_mode(mode, states.pop(mode.name), idx, targets, args, results[mode.name])
        if mode.ranks == 1:
            dist.barrier()
        if rank == 0:
            print(f"[compare] {mode.name}: {summary_line(results[mode.name])}", file=sys.stderr, flush=True)
        gc.collect()

    depths = [int(d) for d in args.scaling_layers.split(",") if d]
    scaling = transform_scaling(cfg, depths, args.scaling_repeats) if depths else {}

    if rank == 0:
        report(args, cfg, world, results, scaling)
    dist.barrier()
    dist.destroy_process_group()
    if cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return 0


def summary_line(r: dict) -> str:
    if "median_s" not in r:
        return r.get("error") or r.get("skipped") or "not run"
    return (f"median {r['median_s'] * 1e3:.0f} ms (min {r['min_s'] * 1e3:.0f}, max {r['max_s'] * 1e3:.0f}), "
            f"first iter {r['first_iter_s']:.1f} s, loss {r['loss_step1']:.6f}, comm {_comm_cell(r)}")


def targets_summary(results: dict, scaling: dict, world: int) -> dict:
    """The issue's targets, measured."""
    out: dict = {}
    tp, dt, single = (results.get(n, {}) for n in ("thunder_tp_tp", "dtensor_tp", "single_thunder"))
    if "median_s" in tp and "median_s" in dt:
        out["tp_vs_dtensor"] = {"ratio": tp["median_s"] / dt["median_s"], "target": 0.85}
    if "median_s" in tp and "median_s" in single:
        out["parallel_efficiency"] = {"value": single["median_s"] / (world * tp["median_s"]), "target": 0.9}
    lp, dt_lp = (results.get(n, {}) for n in ("thunder_tp_tp_lp", "dtensor_tp_lp"))
    if "median_s" in lp and "median_s" in dt_lp:
        out["tp_vs_dtensor_loss_parallel"] = {"ratio": lp["median_s"] / dt_lp["median_s"], "target": 0.85}
    if "median_s" in lp and "median_s" in single:
        out["parallel_efficiency_loss_parallel"] = {"value": single["median_s"] / (world * lp["median_s"]),
                                                    "target": 0.9}
    if "first_iter_s" in tp and "first_iter_s" in single:
        out["first_iter_vs_thunder_jit"] = {"ratio": tp["first_iter_s"] / single["first_iter_s"], "target": 1.3}
    if "comm_forward_trace" in tp:
        out["thunder_tp_tp_collectives"] = {"forward": tp["comm_forward_trace"]["counts"],
                                            "backward": tp["comm_backward_trace"]["counts"]}
    if len(scaling) >= 2:
        depths = sorted(scaling)
        out["transform_s_per_layer"] = {d: scaling[d]["transform_s"] / d for d in depths}
    return out


def report(args, cfg, world, results, scaling) -> None:
    table = markdown_table(results)
    print()
    print(f"Llama dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} ffn={cfg.ffn_hidden} "
          f"vocab={cfg.vocab}, batch={args.batch} seq={args.seq}; {world} ranks x {torch.get_num_threads()} thread, "
          f"{'NCCL' if torch.cuda.is_available() else 'gloo'}; median of {args.steps} steps after {args.warmup} warm-up")
    print()
    print(table)
    if scaling:
        print()
        print("| n_layers | TP transform (ms) | per layer (ms) | logical trace bsyms |")
        print("|---:|---:|---:|---:|")
        for d in sorted(scaling):
            s = scaling[d]
            print(f"| {d} | {s['transform_s'] * 1e3:.0f} | {s['transform_s'] * 1e3 / d:.1f} | {s['trace_bsyms']} |")
    summary = targets_summary(results, scaling, world)
    print()
    print(json.dumps(summary, indent=1))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"command": " ".join(sys.argv), "config": asdict(cfg), "batch": args.batch, "seq": args.seq,
                       "world_size": world, "steps": args.steps, "warmup": args.warmup, "modes": results,
                       "transform_scaling": scaling, "targets": summary, "table": table}, f, indent=1)
    if args.png_path:
        plot(results, scaling, args.png_path)


if __name__ == "__main__":
    sys.exit(main())
