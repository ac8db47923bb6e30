"""A DCP checkpoint's model part as one plain state dict: ``python -m thunder_tp.checkpoint export DIR OUT``."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from thunder_tp.checkpoint.loading import read_metadata


def export(directory: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write the model part of a DCP checkpoint as one plain state dict (what litgpt loads as lit_model.pth)."""
    directory = os.fspath(directory)
    entries = read_metadata(directory).state_dict_metadata
    model = {
        k[len("model."):]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in entries.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    dcp.load({"model": model}, checkpoint_id=directory, no_dist=True)
    torch.save(model, os.fspath(out))


def main(argv: list[str]) -> int:
    """python -m thunder_tp.checkpoint export DIR OUT"""
    if len(argv) != 3 or argv[0] != "export":
        print("usage: python -m thunder_tp.checkpoint export DIR OUT", file=sys.stderr)
        return 2
    export(argv[1], argv[2])
    print(f"wrote {argv[2]}")
    return 0
