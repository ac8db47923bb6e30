"""A DCP checkpoint's model part as one plain state dict, or as an HF directory:
``python -m thunder_tp.checkpoint export DIR OUT [--hf]``."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from thunder_tp.checkpoint.loading import read_metadata
from thunder_tp.checkpoint.safetensors_dir import load_config, write_hf_directory

USAGE = "usage: python -m thunder_tp.checkpoint export DIR OUT [--hf]"


def export(directory: str | os.PathLike, out: str | os.PathLike, hf: bool = False) -> None:
    """Write the model part of a DCP checkpoint as one plain state dict (what litgpt loads as lit_model.pth), or
    with `hf` as a directory that HF's `from_pretrained` loads (model.safetensors and the saved model's config.json)."""
    directory = os.fspath(directory)
    entries = read_metadata(directory).state_dict_metadata
    model = {
        k[len("model."):]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in entries.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    dcp.load({"model": model}, checkpoint_id=directory, no_dist=True)
    if not hf:
        torch.save(model, os.fspath(out))
        return
    config = load_config(directory)
    if config is None:
        raise FileNotFoundError(
            f"thunder_tp.checkpoint export --hf: {directory!r} has no config.json; ck.save writes one for a model with "
            "an HF config: save from the HF model (or copy its config.json into the directory)"
        )
    write_hf_directory(model, os.fspath(out), config)


def main(argv: list[str]) -> int:
    """python -m thunder_tp.checkpoint export DIR OUT [--hf]"""
    hf = "--hf" in argv
    args = [a for a in argv if a != "--hf"]
    if len(args) != 3 or args[0] != "export":
        print(USAGE, file=sys.stderr)
        return 2
    export(args[1], args[2], hf=hf)
    print(f"wrote {args[2]}")
    return 0
