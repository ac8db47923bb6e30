"""A function run on N gloo ranks in new processes, for a benchmark that measures several group sizes in one run
(``torch.multiprocessing.spawn``; a rank that fails ends the others, a collective that waits past the timeout
fails)."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 1800.0) -> list[Any]:
    """``fn(*args)`` on each of ``world_size`` gloo ranks (one thread each); the results in rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="spawn_ranks_") as directory:
        mp.spawn(_rank, args=(world_size, port, directory, timeout_s, fn, args), nprocs=world_size)
        results = []
        for rank in range(world_size):
            with open(os.path.join(directory, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _rank(rank: int, world_size: int, port: int, directory: str, timeout_s: float, fn: Callable[..., Any],
          args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(directory, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
