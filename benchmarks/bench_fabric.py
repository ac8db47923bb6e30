"""litgpt's pretrain loop on Lightning Fabric, side by side: (a) thunder_tp's ThunderTPStrategy against (b) Lightning's
ModelParallelStrategy with the Megatron TP plan as its parallelize_fn (DTensor, eager), alternating in one process
pair, same data, same seed, same initial weights.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.bench_fabric --rounds 3 --iters 12 --json_path out.json

Each round runs litgpt.pretrain.main (unmodified) once per mode in the same processes (a, b, a, b, ...); a mode's
step time is the median of `iter_time` that litgpt logs, its first `--warmup` iterations (compilation) left out, and
its peak memory the largest resident-set growth over the run (CUDA: max_memory_allocated). Every round checks that
both modes log the same losses (within --loss_rtol, float32). Prints a markdown table; `--json_path` keeps it all.

(b) in detail: litgpt's fused q|k|v projection cannot be split by DTensor's ColwiseParallel (a contiguous chunk of
its rows mixes query and key heads), so the parallelize_fn replaces it by three column-parallel projections holding
the same rows and gives each attention its per-rank head counts; every other parameter is replicated as a DTensor
(Lightning's clip_gradients, torch.nn.utils.clip_grad_norm_, cannot mix DTensors and plain tensors). It initializes
the weights as litgpt does on one device (reset_parameters in module order, from the same seed), so both modes start
from the same weights.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import json
import statistics
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
from litgpt import pretrain as litgpt_pretrain
from litgpt.args import EvalArgs, TrainArgs
from torch.utils.data import DataLoader, Dataset

from benchmarks.lib.harness import rss_bytes
from benchmarks.lib.llama import LlamaConfig, litgpt_config

# --- (b): Lightning's ModelParallelStrategy with the Megatron plan ------------------------------------------------


class SplitQKV(nn.Module):
    """litgpt's fused q|k|v projection as three linears with the same rows, whose outputs are concatenated."""

    def __init__(self, fused: nn.Linear, config):
        super().__init__()
        sizes = (config.n_head * config.head_size, config.n_query_groups * config.head_size,
                 config.n_query_groups * config.head_size)
        parts = zip(("q", "k", "v"), fused.weight.split(sizes),
                    fused.bias.split(sizes) if fused.bias is not None else (None,) * 3, strict=True)
        for name, weight, bias in parts:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                               dtype=weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(weight)
                if bias is not None:
                    linear.bias.copy_(bias)
            setattr(self, name, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def megatron_parallelize(model: nn.Module, device_mesh) -> nn.Module:
    """The Megatron plan for a litgpt Llama on the mesh's tensor-parallel dim (weights initialized here first)."""
    from litgpt.utils import reset_parameters
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = device_mesh["tensor_parallel"]
    tp = mesh.size()
    model.to_empty(device=device_mesh.device_type)
    reset_parameters(model)  # as litgpt on one device: module order, the seeded generator
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i, block in enumerate(model.transformer.h):
        config = copy.copy(block.attn.config)
        block.attn.qkv = SplitQKV(block.attn.qkv, config)
        config.n_head, config.n_query_groups = config.n_head // tp, config.n_query_groups // tp
        block.attn.config = config
        prefix = f"transformer.h.{i}."
        plan |= {prefix + n: ColwiseParallel() for n in ("attn.qkv.q", "attn.qkv.k", "attn.qkv.v", "mlp.fc_1",
                                                         "mlp.fc_2")}
        plan |= {prefix + n: RowwiseParallel() for n in ("attn.proj", "mlp.proj")}
    parallelize_module(model, mesh, plan)

    def replicate(name, module, mesh):
        for n, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(n, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))

    def as_dtensor(module, inputs, mesh):
        from torch.distributed.tensor import DTensor

        return tuple(DTensor.from_local(x, mesh, [Replicate()]) if isinstance(x, torch.Tensor) else x for x in inputs)

    for m in model.modules():  # the norms: replicated DTensors, computing on replicated DTensor inputs
        if any(not hasattr(p, "device_mesh") for p in m.parameters(recurse=False)):
            distribute_module(m, mesh, replicate, input_fn=as_dtensor, output_fn=lambda mod, out, mesh: out.to_local())
    return model


# --- data: the same token stream for both modes --------------------------------------------------------------------


class _Chunks(Dataset):
    def __init__(self, tokens: torch.Tensor, length: int):
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.length : (i + 1) * self.length + 1]


@dataclass
class SeededTokens:
    """A litgpt data module over seeded random token ids (the same on every rank and in both modes)."""

    vocab: int
    n_tokens: int
    batch_size: int = 1
    seq: int = 128

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None, **kwargs) -> None:
        self.batch_size, self.seq = batch_size, max_seq_length or self.seq

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str = "") -> None:
        self.tokens = torch.randint(0, self.vocab, (self.n_tokens,), generator=torch.Generator().manual_seed(0))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Chunks(self.tokens, self.seq), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Chunks(self.tokens[: 2 * self.seq + 1], self.seq), batch_size=self.batch_size)


class Metrics:
    """A Fabric logger keeping what litgpt logs."""

    name, version, root_dir, log_dir, group_separator = "bench", 0, None, None, "/"

    def __init__(self):
        self.rows: list[dict] = []

    def log_metrics(self, metrics: dict, step=None) -> None:
        self.rows.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))})

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def save(self) -> None:
        pass

    def finalize(self, status: str) -> None:
        pass


class PeakMemory:
    """The largest growth of this process's memory over a run: CUDA's max_memory_allocated, else the resident set
    sampled every few milliseconds."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self._stop = device, 0, threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            self.start = self.peak = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.start) / 2**20


# --- one run of litgpt's pretrain loop ------------------------------------------------------------------------------


def run(mode: str, args, config, out_dir: Path) -> dict:
    """litgpt.pretrain.main once with the mode's strategy: its logged losses, step times and peak memory."""
    from lightning.fabric.strategies import ModelParallelStrategy

    from thunder_tp.fabric import ThunderTPStrategy

    world = int(os.environ["WORLD_SIZE"])
    strategy = ThunderTPStrategy() if mode == "thunder_tp" else ModelParallelStrategy(megatron_parallelize, 1, world)
    metrics = Metrics()
    fabric = L.Fabric(accelerator=args.accelerator, devices=world, strategy=strategy, precision="32-true",
                      loggers=[metrics])
    fabric.launch()
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=args.micro_batch_size,
                      micro_batch_size=args.micro_batch_size,
                      max_tokens=args.iters * args.micro_batch_size * config.block_size * world, max_norm=1.0,
                      lr_warmup_steps=2, tie_embeddings=False)
    data = SeededTokens(config.padded_vocab_size, (args.iters + 4) * args.micro_batch_size * config.block_size + 1)
    sys.argv[1:] = [config.name]  # litgpt saves its CLI arguments next to its final checkpoint
    # litgpt's pretrain torch.compiles the model: (b) eager unless --compiled (thunder_tp: Thunder compiles it)
    stance = "default" if args.compiled or mode == "thunder_tp" else "force_eager"
    with PeakMemory(fabric.device) as memory, torch.compiler.set_stance(stance):
        litgpt_pretrain.main(fabric, devices=1, seed=42, initial_checkpoint_dir=None, resume=False, config=config,
                             data=data, out_dir=out_dir / mode, tokenizer_dir=None, tokenizer=None, train=train,
                             eval=EvalArgs(interval=10**6, max_iters=1, final_validation=False),
                             optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3}})
    rows = [r for r in metrics.rows if "loss" in r]
    return {"losses": [r["loss"] for r in rows], "iter_ms": [1000 * r["iter_time"] for r in rows[args.warmup:]],
            "peak_mib": memory.growth_mib}


def _memory(runs: list[dict]) -> dict:
    """Peak memory growth of a mode's first run (on CPU: compilation included, Thunder's and Inductor's) and the
    median of its later runs (the process's allocator already grown: what training adds once compiled)."""
    later = [r["peak_mib"] for r in runs[1:]]
    return {"first_peak_mib": runs[0]["peak_mib"], "later_peak_mib": statistics.median(later) if later else None}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["benchmark", "tiny"], default="benchmark",
                   help="benchmark: llama.py's Llama (the repo's comparison model); tiny: a smoke-test model")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (a run of each mode per round)")
    p.add_argument("--iters", type=int, default=12, help="iterations per run")
    p.add_argument("--warmup", type=int, default=3, help="first iterations of a run left out of its step times")
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--loss_rtol", type=float, default=2e-4,
                   help="float32: the two modes' logged losses agree this closely")
    p.add_argument("--compiled", action="store_true", help="(b) under the torch.compile that litgpt's pretrain applies")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--out_dir", type=Path, default=Path("out/bench_fabric"))
    p.add_argument("--json_path", type=Path)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    size = LlamaConfig() if args.size == "benchmark" else LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                                                      vocab=256, ffn_hidden=128, max_seq=32)
    config = litgpt_config(size)
    config.name = f"bench-llama-{args.size}"
    results: dict[str, list[dict]] = {"thunder_tp": [], "model_parallel": []}
    for _ in range(args.rounds):
        for mode in results:
            results[mode].append(run(mode, args, config, args.out_dir))
        a, b = (results[m][-1]["losses"] for m in results)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=args.loss_rtol, atol=0,
                                   msg=lambda m: f"the two modes' losses differ: {m}")
    summary = {mode: {"step_ms": statistics.median(t for r in runs for t in r["iter_ms"]), **_memory(runs)}
               for mode, runs in results.items()}
    ratio = summary["thunder_tp"]["step_ms"] / summary["model_parallel"]["step_ms"]
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"\nlitgpt pretrain, {args.size} Llama, 2 ranks, {args.rounds} alternating rounds x {args.iters} "
              f"iterations (median step of iterations after the first {args.warmup})\n")
        print("| strategy | step (ms) | peak memory growth, first run (MiB) | later runs, median (MiB) "
              "|\n|---|---:|---:|---:|")
        for mode, s in summary.items():
            later = "–" if s["later_peak_mib"] is None else f"{s['later_peak_mib']:.0f}"
            print(f"| {mode} | {s['step_ms']:.1f} | {s['first_peak_mib']:.0f} | {later} |")
        print(f"\nstep time ratio thunder_tp / ModelParallelStrategy: {ratio:.3f}; losses equal within "
              f"{args.loss_rtol}")
        if args.json_path:
            args.json_path.write_text(json.dumps({"args": vars(args) | {"out_dir": str(args.out_dir),
                                                                        "json_path": str(args.json_path)},
                                                  "summary": summary, "ratio": ratio, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
