"""Bytes each rank reads when `ck.load`ing an HF `save_pretrained` directory into a meta-device TP model.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.bench_hf_load [--n_layers 4 --shard_size 50MB]

Rank 0 writes a seeded HF Llama (the sizes of `compare_hf.py`); every rank copies the directory to its own place
(so no rank finds the others' pages in the page cache), drops the copy's pages from the cache
(posix_fadvise DONTNEED), and reads /proc/self/io `read_bytes` (bytes fetched from storage, mmap faults included)
around the load. Reported per rank: bytes read, the rank's share (its slices of every tensor, what it requests),
and the directory's size. Reads come in pages and the kernel reads ahead around each fault, so a rank reads
somewhat more than its share.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import shutil
import tempfile

import torch
import torch.distributed as dist

from benchmarks.lib.harness import exit_without_teardown, init_distributed, log
from benchmarks.lib.litgpt_setup import HF_SIZES


def read_bytes() -> int:
    """Bytes this process has fetched from storage so far."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def evict(directory: str) -> None:
    """Drop the directory's files from the page cache."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n_layers", type=int, default=HF_SIZES["num_hidden_layers"])
    p.add_argument("--shard_size", default="", help="save_pretrained's max_shard_size (a sharded index), e.g. 50MB")
    args = p.parse_args(argv)
    rank, world, _ = init_distributed()
    import thunder
    from transformers import AutoModelForCausalLM, LlamaConfig

    import thunder_tp
    import thunder_tp.checkpoint as ck

    config = LlamaConfig(**(HF_SIZES | {"num_hidden_layers": args.n_layers}))
    root = [tempfile.mkdtemp(prefix="bench_hf_load_") if rank == 0 else None]
    dist.broadcast_object_list(root)
    saved = os.path.join(root[0], "saved")
    if rank == 0:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(saved, **({"max_shard_size": args.shard_size}
                                                                            if args.shard_size else {}))
    dist.barrier()
    mine = shutil.copytree(saved, os.path.join(root[0], f"rank{rank}"))
    evict(mine)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.hf(model))])
    dist.barrier()
    before = read_bytes()
    ck.load(mine, jm)
    read = read_bytes() - before
    share = sum(p.numel() * p.element_size() for p in jm.parameters())
    size = sum(os.path.getsize(os.path.join(mine, f)) for f in os.listdir(mine))
    log(rank, f"rank {rank}: read {read / 2**20:.1f} MiB of a {size / 2**20:.1f} MiB directory; its share "
              f"{share / 2**20:.1f} MiB (read / share {read / share:.2f}, read / directory {read / size:.2f})")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root[0])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
