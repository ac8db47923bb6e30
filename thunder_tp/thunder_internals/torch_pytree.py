"""torch's pytree functions, which torch 2.10 exports only from the private ``torch.utils._pytree`` (Thunder's own
pytree, ``thunder.core.pytree``, is a different registry: see ``pytree.py`` here).
"""

from __future__ import annotations

from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

__all__ = ["tree_flatten", "tree_map", "tree_map_only"]
