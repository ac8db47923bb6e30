"""N ranks simulated in one process with PyTorch's LocalTensor: every tensor holds each simulated rank's value.

    with thunder_tp.simulate(world_size=8):
        jm = thunder.jit(model, transforms=[TensorParallel(plan)], executors=thunder_tp.executors())
        loss = jm(idx, targets)              # plain tensors in: the same on every simulated rank
        loss.backward()
        thunder_tp.per_rank(loss)            # {rank: tensor}

Inside the context, torch.distributed's default group is a ``fake`` process group of ``world_size`` ranks (this
process is its rank 0) and ``LocalTensorMode(world_size)`` is active: each op runs once per simulated rank, and
the collectives the traces issue (Thunder's torchex all_reduce / all_gather / reduce_scatter + wait, the same
symbols as on real ranks) do the equivalent math on the ranks' pieces. TensorParallel gives every parameter a
LocalTensor of each rank's shard (replicated parameters: a copy per rank). What depends on the rank inside the
program (the local slice of ``tp_scatter``, the vocabulary offset of vocab-parallel embedding and loss parallel)
is computed per simulated rank. Fusion executors cannot run on LocalTensor, so ``thunder_tp.executors()``
returns Thunder's torch executor (with thunder_tp's collectives and SDPA) while a simulation is active.
Leaving the context destroys the fake group and restores the RNG and executors; a real
``init_process_group`` works afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from thunder_tp.layouts import Layout, StackShard
from thunder_tp.pieces import shard_tensor
from thunder_tp.thunder_internals.private import fake_args_built_under

__all__ = [
    "check_transforms", "for_each_rank", "is_simulating", "joined_ranks", "local_piece", "outside_local_tensors",
    "per_rank", "rank_value", "simulate",
]


@dataclass(frozen=True)
class _Simulation:
    world_size: int
    mode: object  # torch.distributed._local_tensor.LocalTensorMode


_current: _Simulation | None = None


def is_simulating() -> bool:
    """True inside ``thunder_tp.simulate(...)``."""
    return _current is not None


def _require_active(what: str) -> _Simulation:
    if _current is None:
        raise RuntimeError(f"thunder_tp.{what} needs an active simulation: call it inside `with "
                           "thunder_tp.simulate(world_size=N):`")
    return _current


@contextlib.contextmanager
def simulate(world_size: int) -> Iterator[None]:
    """Simulate ``world_size`` ranks in this process (fake process group + LocalTensorMode); see the module doc."""
    global _current
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"thunder_tp.simulate: world_size must be a positive int, got {world_size!r}")
    if _current is not None:
        raise RuntimeError("thunder_tp.simulate: a simulation is already active; simulations do not nest")
    if dist.is_initialized():
        raise RuntimeError(
            f"thunder_tp.simulate: torch.distributed is already initialized (backend "
            f"{dist.get_backend()}, world size {dist.get_world_size()}); simulate in a process without a "
            "process group (it creates its own fake one), or call torch.distributed.destroy_process_group() first"
        )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        # Thunder's fake tensors for tracing a torch op it has no symbol for (e.g. Tensor.bool in litgpt's
        # sliding-window mask) must stay fake tensors, not become LocalTensors
        with LocalTensorMode(world_size) as mode, fake_args_built_under(mode.disable):
            _current = _Simulation(world_size, mode)
            try:
                yield
            finally:
                _current = None
    finally:
        dist.destroy_process_group()


# --- values of every simulated rank ---------------------------------------------------------------------


def per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{rank: that rank's value}`` of a simulated tensor; a plain tensor is the same on every rank."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(t, LocalTensor):
        return {r: t._local_tensors[r] for r in sorted(t._local_tensors)}
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"thunder_tp.per_rank expects a tensor, got {type(t).__name__}")
    return {r: t for r in range(_require_active("per_rank").world_size)}


def _group_ranks(group: dist.ProcessGroup | None) -> dict[int, int]:
    """Simulated global rank -> its rank in ``group`` (the group as the simulated ranks each see theirs)."""
    world = _current.world_size
    group = group if group is not None else dist.group.WORLD
    size = group.size()
    if size == world:
        return {r: r for r in range(world)}
    raise NotImplementedError(
        f"thunder_tp.simulate: a TP group of {size} ranks inside a simulated world of {world}; simulate "
        f"world_size={size} and pass process_group=None (2-D meshes are not simulated)"
    )


def for_each_rank(fn: Callable[..., torch.Tensor], group: dist.ProcessGroup | None,
                  *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(rank in group, *that rank's tensors)`` for every simulated rank, as one LocalTensor."""
    from torch.distributed._local_tensor import LocalTensor

    sim = _require_active("for_each_rank")
    pieces = {}
    with sim.mode.disable():
        for r, group_rank in _group_ranks(group).items():
            local = [t._local_tensors[r] if isinstance(t, LocalTensor) else t for t in tensors]
            pieces[r] = fn(group_rank, *local)
        return LocalTensor(pieces)


def rank_value(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Simulated rank `rank`'s value of `t` (a plain tensor is the same on every rank)."""
    from torch.distributed._local_tensor import LocalTensor

    return t._local_tensors[rank] if isinstance(t, LocalTensor) else t


def joined_ranks(values: dict[int, torch.Tensor]) -> torch.Tensor:
    """One LocalTensor of every simulated rank's value."""
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor(values)


@contextlib.contextmanager
def outside_local_tensors() -> Iterator[None]:
    """LocalTensorMode off: an op that computes every simulated rank's part itself works on their plain values."""
    with _require_active("outside_local_tensors").mode.disable():
        yield


def local_piece(t: torch.Tensor, layout: Layout, rank: int, size: int, group: dist.ProcessGroup | None = None, *,
                padded: bool = False) -> torch.Tensor:
    """This rank's piece of the full tensor ``t``; in a simulation, every simulated rank's piece (a LocalTensor), at
    its own size, or `padded` to the longest piece as the simulated program computes with it (a KV cache it writes).

    A StackShard tensor is held whole by one rank and by no other, but one simulated trace cannot give the ranks
    different shapes: in a simulation the others hold zeros of its full shape instead."""
    if not is_simulating():
        return shard_tensor(t, layout, rank, size)
    if isinstance(layout, StackShard):
        owner = layout.owner(size)
        return for_each_rank(lambda r, full: full.clone() if r == owner else torch.zeros_like(full), group, t.detach())
    return for_each_rank(lambda r, full: shard_tensor(full, layout, r, size, padded=padded).clone(), group, t.detach())


def check_transforms(model, tp_group: dist.ProcessGroup) -> None:
    """Raise if a jit in the simulation asks for what it cannot simulate: fusion, data parallelism, a TP subgroup."""
    import thunder
    from thunder.extend import FusionExecutor

    _group_ranks(tp_group)
    cd = thunder.compile_data(model)
    fusion = [ex.name for ex in cd.executors_list if isinstance(ex, FusionExecutor)]
    if fusion:
        raise NotImplementedError(
            f"thunder_tp.simulate: the fusion executor(s) {fusion} cannot compile LocalTensor programs; inside a "
            "simulation pass executors=thunder_tp.executors() (Thunder's torch executor runs every region there)"
        )
    transforms = getattr(cd, "transforms", None) or ()
    for t in transforms:
        if type(t).__name__ in ("DDPTransform", "FSDPTransform"):
            raise NotImplementedError(
                f"thunder_tp.simulate: {type(t).__name__} cannot run on simulated ranks (Thunder's data-parallel "
                "transforms shard and synchronize parameters by this process's rank, so every simulated rank would "
                "get rank 0's view); simulate TensorParallel alone over the whole simulated world, and run 2-D "
                "meshes (thunder_tp.init_mesh with DDP/FSDP) on real processes"
            )
