"""What an eager or DTensor step communicates and saves, seen at runtime: the collectives a ``CommDebugMode`` records
(kind and bytes) and the storages autograd saves for backward."""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.lib.harness import tensor_bytes

_C10D_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "all_gather": "all_gather",
               "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all", "all_to_all": "all_to_all",
               "all_reduce": "all_reduce", "broadcast": "broadcast"}


def _kind(name: str) -> str:
    """Collective kind of an op schema name such as 'c10d::allreduce_' or '_c10d_functional::all_gather_into_tensor'."""
    short = name.split("::")[-1].lstrip("_")
    for key, kind in _C10D_KINDS.items():
        if short.startswith(key):
            return kind
    return short


def _payload(name: str, args, out) -> int:
    """Bytes of the full tensor of a collective: all_reduce's tensor, all_gather's output, reduce_scatter's input."""
    tensors = [t for t in torch.utils._pytree.tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    kind, short = _kind(name), name.split("::")[-1]
    if "c10d_functional" in name:
        if kind == "all_gather":
            return sum(tensor_bytes(t) for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return tensor_bytes(tensors[0]) if tensors else 0
    if short in ("_allgather_base_", "_reduce_scatter_base_"):  # (output, input, ...)
        return tensor_bytes(tensors[0] if kind == "all_gather" else tensors[1])
    if short == "allgather_":  # (output lists, input list)
        return sum(tensor_bytes(t) for t in tensors[:-1])
    return sum(tensor_bytes(t) for t in tensors)


def comm_mode():
    """A CommDebugMode that also records (kind, bytes) of each collective it sees (DTensor's funcol ops and
    c10d ops, which thunder's torch.distributed calls go through)."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    class CommBytesMode(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.records: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = func._overloadpacket
            if out is not NotImplemented and (packet in self.comm_registry or packet in c10d_collective_ops):
                name = func._schema.name
                self.records.append((_kind(name), _payload(name, (args, kwargs), out)))
            return out

    return CommBytesMode()


def summarize_records(records: list[tuple[str, int]]) -> dict:
    """Counts per kind, the number of calls and the bytes of (kind, bytes) records."""
    counts: dict[str, int] = {}
    nbytes = 0
    for kind, b in records:
        counts[kind] = counts.get(kind, 0) + 1
        nbytes += b
    return {"counts": counts, "total": sum(counts.values()), "bytes": nbytes}


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside ``t`` (DTensor's local shard, AsyncCollectiveTensor's result, ...)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [x for a in attrs for x in plain_tensors(getattr(t, a))]
    return [t]


def hooked_saved_bytes(fn: Callable[[], torch.Tensor], params) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves for backward while running ``fn``, parameters excluded."""
    param_ptrs = {x.untyped_storage().data_ptr() for p in params for x in plain_tensors(p)}
    seen: dict[int, int] = {}

    def pack(t):
        for x in plain_tensors(t):
            storage = x.untyped_storage()
            if storage.data_ptr() not in param_ptrs:
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return sum(seen.values()), loss
