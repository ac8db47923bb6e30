"""Parallel styles: what a plan maps module names to.

A style says how a module's own tensors (parameters, and a cache's buffers) are split (`tensor_layouts`) and which
layouts the input and output of the op that consumes its weight are constrained to (`input_layout`,
`output_layout`), as DTensor's styles do at module boundaries. Every style implements `Style` (`base`); DTensor's
counterparts are in `dtensor_like`, the head-split norm and KV cache in `heads`, expert parallelism's in `expert`,
litgpt's LoRA pair's in `lora`. How plan keys are matched to modules and tensors checked: `matching`.
"""

from thunder_tp.styles.base import Style
from thunder_tp.styles.dtensor_like import ColwiseParallel, ModuleLayouts, RowwiseParallel, SequenceParallel
from thunder_tp.styles.expert import ExpertParallel, RouterParallel
from thunder_tp.styles.heads import FeatureShardedNorm, KVCacheParallel
from thunder_tp.styles.lora import LoRAPairParallel

__all__ = [
    "ColwiseParallel", "ExpertParallel", "FeatureShardedNorm", "KVCacheParallel", "LoRAPairParallel", "ModuleLayouts",
    "RouterParallel", "RowwiseParallel", "SequenceParallel", "Style",
]
