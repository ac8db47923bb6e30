"""The style of a litgpt LoRALinear's LoRA pair: split like its base layer (`thunder_tp.models.litgpt` tells the
automatic plan that the pair follows its `linear`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from thunder_tp.layouts import REPLICATE, Layout, Shard
from thunder_tp.styles.base import Style
from thunder_tp.styles.dtensor_like import ColwiseParallel, RowwiseParallel


@dataclass(frozen=True)
class LoRAPairParallel(Style):
    """The LoRA pair of a litgpt LoRALinear (`lora_A` r x in, `lora_B` out x r) split like its base layer: under a
    column-parallel base (outputs split) `lora_B`'s rows are split like the base's outputs (its q|k|v blocks: those
    LoRA is enabled for) and `lora_A` is whole; under a row-parallel base (inputs split) `lora_A`'s columns are split
    like the base's inputs and `lora_B` is whole. The LoRA path's ops are laid out by propagation; whole heads per rank
    are checked on the base layer."""

    base: ColwiseParallel | RowwiseParallel

    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Layouts of `lora_A` and `lora_B`."""
        if isinstance(self.base, RowwiseParallel):
            return {"lora_A": self.base.tensor_layouts(module.linear, size)["weight"], "lora_B": REPLICATE}
        rows = _enabled_blocks(module, self.base.tensor_layouts(module.linear, size)["weight"])
        # K/V heads replicated over ranks (fewer K/V groups than ranks): the LoRA path's product (a grouped conv1d)
        # would need lora_B whole, which a layout with copies cannot be gathered into; it stays whole
        return {"lora_A": REPLICATE, "lora_B": REPLICATE if rows.is_replicated else rows}


def _enabled_blocks(module: nn.Module, layout: Shard) -> Shard:
    """The base weight's layout restricted to the q|k|v blocks LoRA is enabled for (a LoRAQKVLinear's lora_B holds
    only those rows); a plain LoRALinear's lora_B is split like its base weight."""
    enabled = getattr(module, "enable_lora", None)
    if enabled is None or layout.blocks is None or all(enabled):
        return layout
    blocks = tuple(b for b, on in zip(layout.blocks, enabled, strict=True) if on)
    splits = tuple(s for s, on in zip(layout.block_splits(), enabled, strict=True) if on)
    return Shard(0, blocks if len(blocks) > 1 else None, None if all(s is None for s in splits) else splits)
