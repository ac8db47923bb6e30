"""litgpt's own pretraining loop (litgpt.pretrain.main, unmodified) on Lightning Fabric with thunder_tp's strategy.

    torchrun --nproc-per-node 2 examples/pretrain_fabric.py --out_dir out/pretrain-tp
    torchrun --nproc-per-node 4 examples/pretrain_fabric.py --tensor_parallel_size 2 --data_parallel fsdp

Every rank of a TP group trains on the same batches; the data is split by the data-parallel group. The model
is a small Llama (litgpt Config) built on the meta device; each rank materializes only its shards. The data is a
text file (--text; by default this script's own source), one token per byte, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from litgpt import Config
from litgpt import pretrain as litgpt_pretrain
from litgpt.args import EvalArgs, TrainArgs
from torch.utils.data import DataLoader, Dataset

from thunder_tp.fabric import ThunderTPStrategy


class _Chunks(Dataset):
    def __init__(self, tokens: torch.Tensor, length: int):
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.length : (i + 1) * self.length + 1]


@dataclass
class ByteText:
    """A litgpt data module over a local text file, one token per byte."""

    path: Path
    batch_size: int = 1
    seq: int = 128

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None, **kwargs) -> None:
        self.batch_size, self.seq = batch_size, max_seq_length or self.seq

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str = "") -> None:
        self.tokens = torch.tensor(list(self.path.read_bytes()), dtype=torch.long)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Chunks(self.tokens, self.seq), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Chunks(self.tokens[: 8 * self.seq + 1], self.seq), batch_size=self.batch_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", type=Path, default=Path(__file__), help="training text (default: this file)")
    p.add_argument("--out_dir", type=Path, default=Path("out/pretrain-fabric"))
    p.add_argument("--tensor_parallel_size", default="auto", help='"auto": all ranks of a node')
    p.add_argument("--data_parallel", default="fsdp", choices=["fsdp", "ddp"])
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true", "bf16-mixed"])
    p.add_argument("--iters", type=int, default=20, help="micro-batches per rank")
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--n_layer", type=int, default=2)
    args = p.parse_args()

    tp = args.tensor_parallel_size if args.tensor_parallel_size == "auto" else int(args.tensor_parallel_size)
    strategy = ThunderTPStrategy(tensor_parallel_size=tp, data_parallel=args.data_parallel)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    fabric = L.Fabric(devices=devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    config = Config(name="example-llama", block_size=128, vocab_size=256, padded_vocab_size=256, n_layer=args.n_layer,
                    n_head=8, n_query_groups=4, n_embd=256, intermediate_size=704, bias=False,
                    mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", parallel_residual=False,
                    rotary_percentage=1.0)
    dp = strategy.mesh.dp  # litgpt's batch arithmetic counts data-parallel ranks: TP ranks share a batch
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=args.micro_batch_size * dp,
                      micro_batch_size=args.micro_batch_size,
                      max_tokens=args.iters * args.micro_batch_size * config.block_size * fabric.world_size,
                      max_norm=1.0, lr_warmup_steps=2, tie_embeddings=False)
    sys.argv[1:] = [config.name, "--out_dir", str(args.out_dir)]  # litgpt saves its CLI arguments with a checkpoint
    litgpt_pretrain.main(
        fabric, devices=dp, seed=42, initial_checkpoint_dir=None, resume=False, config=config,
        data=ByteText(args.text), out_dir=args.out_dir, tokenizer_dir=None, tokenizer=None, train=train,
        eval=EvalArgs(interval=1000, max_iters=2, final_validation=False), optimizer="AdamW",
    )


if __name__ == "__main__":
    main()
