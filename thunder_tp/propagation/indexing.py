"""Rules for indexed writes (index_copy, e.g. new keys and values written into a KV cache at their positions)."""

from __future__ import annotations

import thunder.torch as ltorch

from thunder_tp.layouts import REPLICATE, Shard
from thunder_tp.propagation.engine import Op, Strategy, register_rule


@register_rule(ltorch.index_copy, ltorch.index_copy_)
def index_copy(op: Op) -> list[Strategy]:
    """Target and source sharded alike on a dim other than the indexed one: each rank writes its own piece (the
    indices are replicated); a replicated split (heads held by several ranks) stays as it is."""
    target, source = op.tensors[0], op.tensors[2]
    dim = op.arg("dim") % target.ndim
    strategies = [op.replicated()]
    for layout in {x for x in (op.layouts[0], op.layouts[2]) if isinstance(x, Shard) and x.dim % target.ndim != dim}:
        layout = layout.moved(layout.dim % target.ndim)
        if source.ndim == target.ndim:
            strategies.insert(0, Strategy((layout, REPLICATE, layout), (layout,)))
    return strategies
