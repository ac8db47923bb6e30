"""How the ranks of the TP group run, as the stages ask it: as processes (real ranks, or one rank of a fake group:
``has_peers``, ``group_device``), or simulated in this one process (``thunder_tp.simulate``: PyTorch's LocalTensor,
every tensor holding each simulated rank's value). Here: whether a simulation is active, and what the stages need to
compute every simulated rank's part (their values, a function per rank) and to refuse what cannot be simulated."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

_fake_group_device: torch.device | None = None  # set by thunder_tp.one_rank while its fake group is active


@contextlib.contextmanager
def fake_group_on(device: torch.device) -> Iterator[None]:
    """Within the context, a fake group's tensors live on ``device`` (``thunder_tp.one_rank``'s; else the CPU, as
    ``thunder_tp.simulate``'s)."""
    global _fake_group_device
    _fake_group_device = device
    try:
        yield
    finally:
        _fake_group_device = None


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a process group's tensors live: the current CUDA device for NCCL, ``thunder_tp.one_rank``'s device for
    a fake group, else the CPU."""
    backend = dist.get_backend(group) if dist.is_available() and dist.is_initialized() else None
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "fake" and _fake_group_device is not None:
        return _fake_group_device
    return torch.device("cpu")


def has_peers(group: dist.ProcessGroup | None = None) -> bool:
    """False where the group's other ranks are no other processes (torch's fake backend: ``one_rank``, or
    ``thunder_tp.simulate``), so nothing can be agreed on or compared with them."""
    return dist.get_backend(group) != "fake"



@dataclass(frozen=True)
class Simulation:
    """The simulated world: its size and the LocalTensorMode that runs every op once per simulated rank."""

    world_size: int
    mode: object  # torch.distributed._local_tensor.LocalTensorMode


_current: Simulation | None = None


def is_simulating() -> bool:
    """True inside ``thunder_tp.simulate(...)``."""
    return _current is not None


def active_simulation(what: str) -> Simulation:
    """The active simulation, or a clear error naming `what` needed one."""
    if _current is None:
        raise RuntimeError(f"thunder_tp.{what} needs an active simulation: call it inside `with "
                           "thunder_tp.simulate(world_size=N):`")
    return _current


@contextlib.contextmanager
def simulated_ranks(world_size: int, mode) -> Iterator[None]:
    """Within the context, the stages see `world_size` simulated ranks run by `mode` (set by thunder_tp.simulate)."""
    global _current
    _current = Simulation(world_size, mode)
    try:
        yield
    finally:
        _current = None


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

    sim = active_simulation("for_each_rank")
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
    with active_simulation("outside_local_tensors").mode.disable():
        yield


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
