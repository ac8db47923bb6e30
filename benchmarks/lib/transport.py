"""What communication adds to a training step: steps whose collectives move nothing, alternating with real ones.

``without_transport()`` replaces the collectives the benchmark's modes call, torch.distributed's (thunder_tp, Thunder's
DDP and FSDP) and its functional collectives (DTensor's redistributions and ``loss_parallel``), by local stand-ins:
each writes its output from the rank's own input (the bytes any transport has to write on the rank) and returns done.
Results are wrong, so it serves timing only. Not replaced: DTensor's ``Shard(i) -> Shard(j)`` on CUDA (its
``shard_dim_alltoall`` op; on CPU it falls back to the functional all_gather). ``compare.py --without_transport 1`` runs
each multi-rank mode's steps of every round again without the transport, right before or after them
(``steps_without_transport``); the median over rounds of the difference is what communication costs the step
(``communication_cost``): the transport's work on the rank's CPU or device, waits on peers, and whatever the
schedule did not overlap. ``prioritize_transport_threads`` (``--transport_threads fifo``) lets gloo's threads run
ahead of the compute on CPU.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from benchmarks.lib.harness import set_other_threads_scheduling


class _Done:
    """The work handle of a collective that has already finished."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _all_reduce(tensor: torch.Tensor, *args, **kwargs) -> _Done:
    return _Done()  # in place: the tensor keeps the rank's own contribution


def _all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *args, **kwargs) -> _Done:
    output.view(-1, input.numel()).copy_(input.reshape(1, -1))
    return _Done()


def _reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, *args, **kwargs) -> _Done:
    output.copy_(input.reshape(-1, output.numel())[0].view_as(output))
    return _Done()


def _all_to_all_single(output: torch.Tensor, input: torch.Tensor, *args, **kwargs) -> _Done:
    output.copy_(input.view_as(output))
    return _Done()


def _mesh_dim_size(group: tuple) -> int:
    mesh, mesh_dim = group  # DTensor passes (mesh, mesh_dim)
    return mesh.size(mesh_dim)


def _functional_all_reduce(tensor: torch.Tensor, reduceOp: str, group, tag: str = "") -> torch.Tensor:
    return tensor.clone()


def _functional_all_gather(tensor: torch.Tensor, gather_dim: int, group, tag: str = "") -> torch.Tensor:
    return torch.cat([tensor] * _mesh_dim_size(group), dim=gather_dim)


def _functional_reduce_scatter(tensor: torch.Tensor, reduceOp: str, scatter_dim: int, group,
                               tag: str = "") -> torch.Tensor:
    return tensor.chunk(_mesh_dim_size(group), dim=scatter_dim)[0].clone()


_STAND_INS: list[tuple[Any, str, Callable]] = [
    (dist, "all_reduce", _all_reduce),
    (dist, "all_gather_into_tensor", _all_gather_into_tensor),
    (dist, "reduce_scatter_tensor", _reduce_scatter_tensor),
    (dist, "all_to_all_single", _all_to_all_single),
    (funcol, "all_reduce", _functional_all_reduce),
    (funcol, "all_gather_tensor", _functional_all_gather),
    (funcol, "reduce_scatter_tensor", _functional_reduce_scatter),
]


@contextlib.contextmanager
def without_transport() -> Iterator[None]:
    """Inside, every collective is a local stand-in that returns done (the module docstring says which)."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in _STAND_INS]
    try:
        for module, name, stand_in in _STAND_INS:
            setattr(module, name, stand_in)
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


@contextlib.contextmanager
def steps_without_transport(params: list[torch.Tensor]) -> Iterator[None]:
    """Inside, collectives are local stand-ins; the parameters (what steps without transport make wrong) are put
    back on leaving. The benchmark's SGD keeps no state that they could make wrong as well."""
    saved = [p.detach().clone() for p in params]
    try:
        with without_transport():
            yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)


def communication_cost(timed: dict, without: dict) -> dict:
    """What communication adds to a mode's step, from its timed steps and as many without transport run next to them
    in every round: the median of those without (seconds), the median over rounds of the round medians' difference,
    and the page faults of a step without transport."""
    differences = [a - b for a, b in zip(timed["round_medians_s"], without["round_medians_s"], strict=True)]
    return {"rounds": len(differences), "without_transport_s": statistics.median(without["times_s"]),
            "exposed_s": statistics.median(differences),
            "without_transport_minor_faults_per_step": statistics.median(without["minor_faults"])}


def prioritize_transport_threads(device: torch.device) -> int:
    """Give every thread of this process but the calling one the lowest real-time priority (SCHED_FIFO 1): on CPU,
    gloo's device loop and worker threads, which otherwise wait for the core behind the compute after each wake-up.
    The number of threads; a clear error on CUDA (NCCL's and CUDA's threads may busy-poll) and where the process may
    not (it needs CAP_SYS_NICE)."""
    if device.type == "cuda":
        raise SystemExit("--transport_threads fifo is for CPU runs (gloo's threads); drop it on CUDA")
    try:
        return set_other_threads_scheduling(os.SCHED_FIFO, 1)
    except PermissionError as e:
        raise SystemExit(f"--transport_threads fifo: this process may not give its threads real-time priority ({e}); "
                         "run it with CAP_SYS_NICE (e.g. as root) or drop the option") from e
