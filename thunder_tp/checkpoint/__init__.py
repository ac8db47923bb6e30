"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save at any TP size, load at any other.

    import thunder_tp.checkpoint as ck
    ck.save(path, jm, optimizer)   # collective; a DCP directory, each rank writes only its shards
    ck.load(path, jm, optimizer)   # collective; a DCP directory or a full state-dict file (lit_model.pth)
    python -m thunder_tp.checkpoint export DIR OUT   # DCP directory -> one torch.save'd plain state dict

Representation: keys are the plain model's names ("model.<name>", "optim.state.<name>.<key>",
"optim.param_groups.<i>.<hyperparameter>", as torch.distributed.checkpoint.state_dict writes them). A TP-sharded
tensor is a ShardedTensor whose local shards are the slices of the global tensor this rank holds
(layouts.shard_chunks: one per block for a fused q|k|v), so DCP's own planner reshards on load by overlapping
saved and wanted chunks. Unsharded tensors are plain tensors, which DCP writes once however many ranks hold
them (so the dp replicas of 2-D TP x DDP write nothing twice).
"""

from thunder_tp.checkpoint.exporting import export, main
from thunder_tp.checkpoint.loading import load
from thunder_tp.checkpoint.state_dict import get_state_dict, save, set_state_dict

__all__ = ["save", "load", "get_state_dict", "set_state_dict", "export", "main"]
