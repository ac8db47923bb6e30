"""One rank of an N-rank TP group, alone in this process: its real program at its true shapes, nothing exchanged.

    with thunder_tp.one_rank(world_size=8, rank=3, device="cuda"):
        with torch.device("meta"):                      # nothing allocated at full size
            model = GPTWithLoss(Config.from_name("Llama-3-8B"))
        random_init = MaterializationTransform("cuda", init=MaterializationTransform.init_from_original_module_init())
        jm = thunder.jit(model, transforms=[TensorParallel(plan), random_init], executors=thunder_tp.executors())
        loss = jm(idx, targets); loss.backward()        # rank 3's forward and backward, its own shards only

Inside the context, torch.distributed's default group is a ``fake`` process group (PyTorch's
``FakeProcessGroup``) of ``world_size`` ranks in which this process is ``rank``: every collective returns at
once and moves nothing. So the traces, the local shapes, the collectives issued (kind, count, bytes) and the
memory are rank ``rank``'s of a real group, and the step time is its compute alone (communication is what
``benchmarks/lib/alpha_beta.py`` models). Values are not the real ranks': an all_reduce leaves this rank's
summand, an all_gather repeats this rank's piece. A reduce_scatter of the fake group would leave its output as allocated
(uninitialized memory, often NaN); inside the context it holds this rank's chunk of the input instead, both for
``torch.distributed.reduce_scatter_tensor`` (Thunder's and thunder_tp's collectives) and for the functional
collective DTensor and ``torch.compile`` use, so losses stay finite. all_to_all is left as the fake group does it.

A model built on the meta device gets random weights at its local shapes from Thunder's
``MaterializationTransform`` after ``TensorParallel`` (each module's ``reset_parameters`` at full size, one module
at a time, then this rank's shard); or load a checkpoint with ``thunder_tp.checkpoint.load``. The fake group's
tensors live on ``device`` (default: the current CUDA device where there is one, else the CPU), where
meta-device models are traced and materialized. No peer process exists, so thunder_tp does not hold the compile
agreement (``runtimes/agreement.py``) and ``thunder_tp.generate`` does not check that ranks sampled alike.
Leaving the context destroys the group and restores the collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from thunder_tp.collectives.run_mode import fake_group_on
from thunder_tp.thunder_internals.distributed import fake_store, reduce_scatter_keeps_own_chunk

__all__ = ["one_rank"]


def _default_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check(world_size: int, rank: int) -> None:
    for name, value in (("world_size", world_size), ("rank", rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"thunder_tp.one_rank: {name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"thunder_tp.one_rank: need world_size >= 1 and 0 <= rank < world_size, got world_size="
                         f"{world_size}, rank={rank}")
    if dist.is_initialized():
        raise RuntimeError(
            f"thunder_tp.one_rank: torch.distributed is already initialized (backend {dist.get_backend()}, world "
            f"size {dist.get_world_size()}); run one rank in a process without a process group (it creates its own "
            "fake one), or call torch.distributed.destroy_process_group() first"
        )


@contextlib.contextmanager
def one_rank(world_size: int, rank: int, device: torch.device | str | None = None) -> Iterator[None]:
    """Run as rank ``rank`` of a ``world_size``-rank fake process group on ``device``; see the module doc."""
    _check(world_size, rank)
    device = _default_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_store())
    try:
        with fake_group_on(device), reduce_scatter_keeps_own_chunk():
            yield
    finally:
        dist.destroy_process_group()
