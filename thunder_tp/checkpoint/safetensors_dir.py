"""HuggingFace checkpoint directories (what `save_pretrained` writes): `model.safetensors`, or
`model.safetensors.index.json` and its shards. Read lazily through `safe_open(...).get_slice`, so each rank reads
only the slices it holds; written back as one `model.safetensors` plus the model's `config.json`."""

from __future__ import annotations

import json
import os

import torch

SINGLE, INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"


def is_hf_directory(path: str) -> bool:
    """A directory with HF safetensors weights and no DCP `.metadata`."""
    has_weights = os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX))
    return os.path.isdir(path) and has_weights and not os.path.exists(os.path.join(path, ".metadata"))


class SafetensorsSlice:
    """One tensor of a safetensors file: its shape, and any slice of it read on indexing (nothing read before)."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self._slice[index]


def read_hf_directory(path: str) -> dict[str, SafetensorsSlice]:
    """Every tensor of the directory by its saved name, unread."""
    from safetensors import safe_open

    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(path, SINGLE), framework="pt") as handle:
            files = dict.fromkeys(handle.keys(), SINGLE)
    handles = {file: safe_open(os.path.join(path, file), framework="pt") for file in set(files.values())}
    return {name: SafetensorsSlice(handles[file], name) for name, file in files.items()}


def write_hf_directory(state: dict[str, torch.Tensor], out: str, config: dict | None) -> None:
    """`state` as OUT/model.safetensors (a tied head's weight left out, as save_pretrained does) and `config` as
    config.json."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    if config is not None:
        if config.get("tie_word_embeddings", True):
            state = {k: v for k, v in state.items() if k not in _tied_keys(config)}
        with open(os.path.join(out, CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, SINGLE), metadata={"format": "pt"})


def _tied_keys(config: dict) -> set[str]:
    """The weights the model's class ties to another (its `_tied_weights_keys`, e.g. lm_head.weight)."""
    import transformers

    classes = [getattr(transformers, name, None) for name in config.get("architectures") or []]
    return {key for cls in classes if cls is not None for key in (getattr(cls, "_tied_weights_keys", None) or [])}


def save_config(model: torch.nn.Module, path: str) -> None:
    """The HF config of `model` (if it has one) as path/config.json, its class as `architectures` (for export)."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_json_string"):
        saved = json.loads(config.to_json_string(use_diff=False)) | {"architectures": [type(model).__name__]}
        with open(os.path.join(path, CONFIG), "w") as f:
            json.dump(saved, f, indent=2, sort_keys=True)


def load_config(path: str) -> dict | None:
    """path/config.json, or None."""
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)
