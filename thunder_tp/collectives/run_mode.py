"""How the ranks of a process group run, asked of one object, `ranks_of(group)`: real ranks (processes that talk),
one rank alone in a fake group (``thunder_tp.one_rank``: no peer exists), or every rank simulated in this one process
(``thunder_tp.simulate``: PyTorch's LocalTensor, each tensor holding every simulated rank's value, one traced program
for all of them). The stages ask it how big the group is, which ranks this process computes, whether one trace runs
for all of them, whether there are peers to talk to, where the group's tensors live, and to compute a value per rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from thunder_tp.thunder_internals.distributed import is_local_tensor, local_tensor, local_tensors

__all__ = ["Ranks", "fake_group_on", "ranks_of", "simulated_ranks"]

_fake_group_device: torch.device | None = None  # set by thunder_tp.one_rank while its fake group is active


@dataclass(frozen=True)
class Simulation:
    """The simulated world: its size and the LocalTensorMode that runs every op once per simulated rank."""

    world_size: int
    mode: object  # torch.distributed._local_tensor.LocalTensorMode


_current: Simulation | None = None


class Ranks:
    """Real ranks: this process is one rank of ``group`` and its peers are other processes."""

    #: whether one traced program runs for every rank of the group (a simulation): the rank is no constant of the
    #: trace, and every rank's tensor of a value has one shape
    one_trace_for_all = False
    #: whether the group's other ranks are processes to talk to (not so for a fake group: nothing to agree on)
    has_peers = True

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group if group is not None else dist.group.WORLD

    @property
    def size(self) -> int:
        """How many ranks the group has."""
        return self.group.size()

    @property
    def computed(self) -> list[int]:
        """The ranks of the group whose values this process computes (a per-rank value lists them in this order)."""
        return [dist.get_rank(self.group)]

    @property
    def traced_rank(self) -> int | None:
        """This process's rank as a constant of a traced program; None where one trace runs for every rank."""
        return None if self.one_trace_for_all else dist.get_rank(self.group)

    @property
    def device(self) -> torch.device:
        """Where the group's tensors live: the current CUDA device for NCCL, else (or with no process group) the CPU."""
        if dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def for_each(self, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        """``fn(rank, *that rank's tensors)`` for every rank this process computes, as one tensor."""
        (rank,) = self.computed
        return fn(rank, *tensors)

    def value(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s value of ``t``."""
        return t

    def joined(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """One tensor of the computed ranks' values (in ``computed``'s order)."""
        (value,) = per_rank
        return value

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Where an op computes the ranks' values itself, on their plain tensors."""
        yield

    def check_jit(self, model) -> None:
        """Raise if a jit of ``model`` over this group asks for what these ranks cannot run."""


class RankAlone(Ranks):
    """``thunder_tp.one_rank``: this process is one rank of a fake group, with no peer to talk to."""

    has_peers = False

    @property
    def device(self) -> torch.device:
        """``thunder_tp.one_rank``'s device."""
        return _fake_group_device or torch.device("cpu")


class SimulatedRanks(Ranks):
    """``thunder_tp.simulate``: every rank of the group computed in this process, one LocalTensor per value."""

    one_trace_for_all = True
    has_peers = False

    def __init__(self, group: dist.ProcessGroup | None, simulation: Simulation):
        super().__init__(group)
        self.simulation = simulation
        if self.size != simulation.world_size:
            raise NotImplementedError(
                f"thunder_tp.simulate: a TP group of {self.size} ranks inside a simulated world of "
                f"{simulation.world_size}; simulate world_size={self.size} and pass process_group=None (2-D meshes "
                "are not simulated)"
            )

    @property
    def computed(self) -> list[int]:
        """Every rank of the group."""
        return list(range(self.size))

    @property
    def device(self) -> torch.device:
        """The CPU: LocalTensors live there."""
        return torch.device("cpu")

    def for_each(self, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        """``fn(rank, *that rank's tensors)`` for every simulated rank, as one LocalTensor."""
        with self.computing():
            return self.joined([fn(r, *(self.value(t, r) for t in tensors)) for r in self.computed])

    def value(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Simulated rank ``rank``'s value of ``t`` (a plain tensor is the same on every rank)."""
        return local_tensors(t)[rank] if is_local_tensor(t) else t

    def joined(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """One LocalTensor of every simulated rank's value."""
        return local_tensor(dict(zip(self.computed, per_rank, strict=True)))

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """LocalTensorMode off: the op works on the simulated ranks' plain values."""
        with self.simulation.mode.disable():
            yield

    def check_jit(self, model) -> None:
        """Raise if the jit asks for what a simulation cannot run: fusion, data parallelism."""
        _check_simulable(model)


def ranks_of(group: dist.ProcessGroup | None = None) -> Ranks:
    """How the ranks of ``group`` (None: the default group) run in this process."""
    if _current is not None:
        return SimulatedRanks(group, _current)
    if dist.is_initialized() and dist.get_backend(group) == "fake":
        return RankAlone(group)
    return Ranks(group)


def simulated_world() -> Simulation | None:
    """The active simulation (``thunder_tp.simulate``), if any."""
    return _current


@contextlib.contextmanager
def simulated_ranks(world_size: int, mode) -> Iterator[None]:
    """Within the context, the stages see `world_size` simulated ranks run by `mode` (set by thunder_tp.simulate);
    the enclosing simulation, if any, after it."""
    global _current
    previous, _current = _current, Simulation(world_size, mode)
    try:
        yield
    finally:
        _current = previous


@contextlib.contextmanager
def fake_group_on(device: torch.device) -> Iterator[None]:
    """Within the context, a fake group's tensors live on ``device`` (set by ``thunder_tp.one_rank``); the
    enclosing device after it."""
    global _fake_group_device
    previous, _fake_group_device = _fake_group_device, device
    try:
        yield
    finally:
        _fake_group_device = previous


def _check_simulable(model) -> None:
    """Raise if a jit in the simulation asks for what it cannot simulate: fusion, data parallelism."""
    import thunder
    from thunder.extend import FusionExecutor

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
