"""torch.distributed's private objects that thunder_tp's run modes use: the ``fake`` process group's store
(``thunder_tp.one_rank``, ``thunder_tp.simulate``), LocalTensor (``simulate``), the functional collectives' op
namespace (the whole-step program), and a reduce_scatter that keeps this rank's chunk in the fake group
(``one_rank``). torch 2.10 has no public name for any of them. Imported lazily where torch's module is costly or
optional, as the callers did.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["FUNCTIONAL_COLLECTIVES", "fake_store", "is_local_tensor", "local_tensor", "local_tensor_mode",
           "local_tensors", "reduce_scatter_keeps_own_chunk"]

#: ``torch.ops._c10d_functional``: the functional collectives DTensor and torch.compile issue
FUNCTIONAL_COLLECTIVES = torch.ops._c10d_functional


def fake_store() -> dist.Store:
    """A store for ``init_process_group("fake", ...)`` (importing torch's test module registers the backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def local_tensor_mode(world_size: int) -> torch.utils._python_dispatch.TorchDispatchMode:
    """torch's ``LocalTensorMode(world_size)``: every op runs once per simulated rank."""
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(world_size)


def is_local_tensor(t: object) -> bool:
    """Whether `t` is a LocalTensor (every simulated rank's value)."""
    from torch.distributed._local_tensor import LocalTensor

    return isinstance(t, LocalTensor)


def local_tensors(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """A LocalTensor's value on each simulated rank (its ``_local_tensors``; no public getter)."""
    return t._local_tensors


def local_tensor(per_rank: dict[int, torch.Tensor]) -> torch.Tensor:
    """One LocalTensor of the simulated ranks' values."""
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor(per_rank)


# --- reduce_scatter: this rank's chunk of the input instead of uninitialized memory ---------------------------


def _own_chunk(input: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """The piece of ``input`` (the ranks' pieces concatenated along dim 0) that ``rank`` would receive."""
    return input.chunk(size)[rank]


@contextlib.contextmanager
def reduce_scatter_keeps_own_chunk() -> Iterator[None]:
    """Within the context, the fake group's reduce_scatter (c10d's and the functional collective's) outputs this
    rank's chunk of its input: ``dist.reduce_scatter_tensor`` replaced and the functional op's CPU and CUDA kernels
    overridden (the fake group has no hook for what a collective leaves)."""
    original = dist.reduce_scatter_tensor

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = original(output, input, op, group, async_op)
        group = group if group is not None else dist.group.WORLD
        output.copy_(_own_chunk(input, group.size(), group.rank()))
        return work

    def functional(input, reduce_op, group_size, group_name):
        group = dist.distributed_c10d._resolve_process_group(group_name)
        return _own_chunk(input, group_size, group.rank()).clone()

    def functional_out(input, reduce_op, group_size, group_name, *, out):
        return out.copy_(functional(input, reduce_op, group_size, group_name))

    library = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")  # replacing a kernel is the point here
        for key in ("CPU", "CUDA"):
            library.impl("reduce_scatter_tensor", functional, key)
            library.impl("reduce_scatter_tensor_out", functional_out, key)
    dist.reduce_scatter_tensor = reduce_scatter_tensor
    try:
        yield
    finally:
        dist.reduce_scatter_tensor = original
        library._destroy()
