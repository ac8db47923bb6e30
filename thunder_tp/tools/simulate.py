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
from collections.abc import Iterator

import torch
import torch.distributed as dist

from thunder_tp.collectives.run_mode import simulated_ranks, simulated_world
from thunder_tp.thunder_internals.distributed import fake_store, is_local_tensor, local_tensor_mode, local_tensors
from thunder_tp.thunder_internals.private import fake_args_built_under

__all__ = ["per_rank", "simulate"]


@contextlib.contextmanager
def simulate(world_size: int) -> Iterator[None]:
    """Simulate ``world_size`` ranks in this process (fake process group + LocalTensorMode); see the module doc."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"thunder_tp.simulate: world_size must be a positive int, got {world_size!r}")
    if simulated_world() is not None:
        raise RuntimeError("thunder_tp.simulate: a simulation is already active; simulations do not nest")
    if dist.is_initialized():
        raise RuntimeError(
            f"thunder_tp.simulate: torch.distributed is already initialized (backend "
            f"{dist.get_backend()}, world size {dist.get_world_size()}); simulate in a process without a "
            "process group (it creates its own fake one), or call torch.distributed.destroy_process_group() first"
        )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=fake_store())
    try:
        # Thunder's fake tensors for tracing a torch op it has no symbol for (e.g. Tensor.bool in litgpt's
        # sliding-window mask) must stay fake tensors, not become LocalTensors
        with local_tensor_mode(world_size) as mode, fake_args_built_under(mode.disable):
            with simulated_ranks(world_size, mode):
                yield
    finally:
        dist.destroy_process_group()


def per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{rank: that rank's value}`` of a simulated tensor; a plain tensor is the same on every rank."""
    if is_local_tensor(t):
        return dict(sorted(local_tensors(t).items()))
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"thunder_tp.per_rank expects a tensor, got {type(t).__name__}")
    simulation = simulated_world()
    if simulation is None:
        raise RuntimeError("thunder_tp.per_rank needs an active simulation: call it inside `with "
                           "thunder_tp.simulate(world_size=N):`")
    return {r: t for r in range(simulation.world_size)}
