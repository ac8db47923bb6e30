"""A DTensor parallelize function read, not run (``thunder_tp.styles.dtensor.read_parallelize_fn``): its calls of
DTensor's, FSDP2's and composable DDP's entry points go to stand-ins that note them. Such a function and its helpers
reach the entry points through whatever module-level names they imported them by, and torch has no hook on them, so
every such name in every loaded module is rebound for the duration. Composable ``replicate`` has no public path.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

__all__ = ["entry_points", "rebound_everywhere"]


def entry_points() -> dict[str, Callable]:
    """DTensor's ``parallelize_module``, ``distribute_module``, ``distribute_tensor``, FSDP2's ``fully_shard`` and
    composable ``replicate``, by name."""
    from torch.distributed._composable import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    return {"parallelize_module": parallelize_module, "fully_shard": fully_shard, "replicate": replicate,
            "distribute_module": distribute_module, "distribute_tensor": distribute_tensor}


@contextlib.contextmanager
def rebound_everywhere(stand_ins: list[tuple[Callable, Callable]], fn_globals: dict | None) -> Iterator[None]:
    """Every module-level name (of every loaded module, and in `fn_globals`) bound to an original of `stand_ins`
    (``(original, stand_in)`` pairs) points to its stand-in meanwhile."""
    by_id = {id(original): stand_in for original, stand_in in stand_ins}
    namespaces = [vars(m) for m in list(sys.modules.values()) if m is not None and hasattr(m, "__dict__")]
    if fn_globals is not None:
        namespaces.append(fn_globals)
    replaced = [(ns, name, value) for ns in namespaces for name, value in list(ns.items())
                if id(value) in by_id and isinstance(name, str)]
    for ns, name, value in replaced:
        ns[name] = by_id[id(value)]
    try:
        yield
    finally:
        for ns, name, value in replaced:
            ns[name] = value
