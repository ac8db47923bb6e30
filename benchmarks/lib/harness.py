"""What the benchmarks share: process group and device, alternating rounds, seeded models and batches, the training
step, timing (one rank's training and decode steps too), bytes and the JSON report."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import gc
import json
import math
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

import thunder_tp.thunder_internals.quiet  # noqa: F401  (before Thunder's first import: quiets what using thunder_tp causes)

#: a --dtype flag's name -> the dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

def options(doc: str, dtype: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser: ``doc``'s first line, defaults shown, ``--json_path`` and (given ``dtype``) ``--dtype``."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json_path", default="", help="write the results as JSON here")
    if dtype is not None:
        p.add_argument("--dtype", choices=sorted(DTYPES), default=dtype)
    return p


def init_distributed(timeout_s: float | None = None) -> tuple[int, int, torch.device]:
    """Join the default process group (NCCL + cuda:LOCAL_RANK on CUDA, gloo on CPU); a single process works too."""
    if "RANK" not in os.environ:  # plain `python -m benchmarks.<script>`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # one GPU per rank, or none at all: every rank decides the same way (NCCL can't share a GPU between ranks)
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        if torch.cuda.is_available() and local_rank == 0:
            print(f"note: {torch.cuda.device_count()} GPU(s) for {local_world} ranks per node: running on CPU (gloo)")
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_to_core() -> set[int]:
    """One core per rank (local rank r on core r), when there are cores enough: otherwise the scheduler lets ranks share
    a core for a while, and every collective waits for the rank that fell behind."""
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if local_world <= len(cores):
        os.sched_setaffinity(0, {cores[local_rank]})
    return before


def exit_without_teardown(code: int | None) -> NoReturn:
    """Exit with ``code`` after flushing output and running the exit handlers, skipping the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    atexit._run_exitfuncs()
    os._exit(code or 0)


def error_line(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, cut at ``limit`` characters."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:limit]


def agreed(ok: bool) -> bool:
    """True where ``ok`` holds on every rank."""
    flag = torch.tensor([float(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def log(rank: int, *msg: Any) -> None:
    """Print on rank 0 only."""
    if rank == 0:
        print(*msg, flush=True)


def thunder_tp_executors() -> list:
    """thunder_tp's executors (its fusion executor: nvFuser on CUDA when installed and able to run, else Inductor)."""
    import thunder_tp
    return thunder_tp.executors()


def thunder_default_executors() -> list:
    """Thunder's default executors behind thunder_tp's comm executor (no fusion executor of thunder_tp's)."""
    from thunder_tp.execution.executor import thunder_default_executors as executors
    return executors()


#: --compile -> the executors list for thunder.jit
EXECUTORS: dict[str, Callable[[], list]] = {"thunder": thunder_tp_executors,
                                            "thunder_default": thunder_default_executors}


T = TypeVar("T")


def alternating_rounds(runs: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """``(round, run)`` for every run in each of ``rounds`` rounds, the order reversed every other round: the runs
    compared share the host's drift over the rounds alike, and none always follows the same other."""
    for r in range(rounds):
        for run in runs if r % 2 == 0 else runs[::-1]:
            yield r, run


def on_ranks(ranks: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` on the ranks of a mode of ``ranks`` ranks (all, or 1: rank 0 while the others wait)."""
    if ranks != 1:
        return fn()
    out = fn() if dist.get_rank() == 0 else None
    dist.barrier()
    return out


def seeded_model(make: Callable[[], nn.Module], seed: int, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> nn.Module:
    """``make()`` after ``torch.manual_seed(seed)`` (the same weights on every rank), on ``device``, in ``dtype``."""
    torch.manual_seed(seed)
    with device if device is not None else contextlib.nullcontext():
        model = make()
    return model.to(dtype) if dtype is not None else model


def random_batch(rows: int, seq: int, vocab: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens in [0, vocab) as (idx, targets) of shape (rows, seq), targets the next token of idx."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    data = torch.randint(0, vocab, (rows, seq + 1), generator=g, device="cpu")
    return data[:, :-1].to(device), data[:, 1:].to(device)


def step_context(model: nn.Module):
    """What a model's forward and backward must run inside (its ``step_context``, e.g. DTensor's loss_parallel)."""
    return getattr(model, "step_context", contextlib.nullcontext)()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor,
               micro_batch_size: int | None = None) -> torch.Tensor:
    """Forward with the loss, backward and an optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    rows = micro_batch_size or idx.shape[0]
    pieces = list(zip(idx.split(rows), targets.split(rows), strict=True))
    loss = None
    with step_context(model):
        for micro_idx, micro_targets in pieces:
            micro_loss = model(micro_idx, micro_targets)
            if len(pieces) > 1:
                micro_loss = micro_loss / len(pieces)
            micro_loss.backward()
            loss = micro_loss.detach() if loss is None else loss + micro_loss.detach()
    optimizer.step()
    return loss


def sync(device: torch.device | None = None) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[Any, float]:
    """``fn()`` and its wall time in seconds, the device's work included."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def slowest_rank(times: list[float], device: torch.device | None = None) -> list[float]:
    """Each entry's maximum over the ranks (a distributed step lasts until its slowest rank is done)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(times)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_steps(step: Callable[[], Any], steps: int, *, distributed: bool, device: torch.device | None = None
               ) -> list[float]:
    """Wall seconds of each of ``steps`` calls of ``step()``, the device's work included (the slowest rank's)."""
    times = []
    for _ in range(steps):
        if distributed:
            dist.barrier()
        times.append(timed(step, device)[1])
    return slowest_rank(times, device) if distributed else times


def tensor_bytes(t) -> int:
    """Bytes of a tensor (a DTensor's local shard) or of a Thunder TensorProxy (its full logical shape)."""
    if isinstance(t, torch.Tensor):
        from torch.distributed.tensor import DTensor
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    from thunder_tp.collectives.reshard import nbytes
    return nbytes(t)


def param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards under TP)."""
    return sum(tensor_bytes(p) for p in module.parameters())


def kv_cache_bytes(module: nn.Module) -> int:
    """Bytes of the litgpt KV-cache buffers (``attn.kv_cache.k`` / ``.v``) this rank holds."""
    return sum(tensor_bytes(b) for name, b in module.named_buffers() if ".kv_cache." in name)


def saved_for_backward(forward_trace) -> dict | None:
    """Tensors a Thunder forward trace returns for the backward (``thunder_tp.tools.debug.saved_for_backward``)."""
    from thunder.core.proxies import TensorProxy
    from thunder.core.pytree import tree_flatten

    from thunder_tp.tools.debug import saved_for_backward as saved_tensors
    tensors = saved_tensors(forward_trace)
    if tensors is None:
        return None
    inputs = {p.name for p in tree_flatten((forward_trace.args, forward_trace.kwargs))[0] if isinstance(p, TensorProxy)}
    return {"count": len(tensors), "bytes": sum(tensor_bytes(p) for p in tensors),
            "activation_bytes": sum(tensor_bytes(p) for p in tensors if p.name not in inputs)}


def collectives_per_iteration(jm: nn.Module) -> dict:
    """The last traces' collectives: ``tables`` and ``per_iteration`` (count, bytes, ``by_kind`` per pass)."""
    import thunder

    import thunder_tp
    from thunder_tp.tools.debug import totals
    backward = thunder.last_backward_traces(jm)
    tables = {"forward": thunder_tp.collectives_table(thunder.last_traces(jm)[-1]),
              "backward": thunder_tp.collectives_table(backward[-1] if backward else None)}
    return {"tables": tables, "per_iteration": {name: pass_totals(totals(t)) for name, t in tables.items()}}


def pass_totals(by_kind: dict) -> dict:
    """A pass's calls and bytes over its ``{kind: {count, bytes}}``, and that by kind."""
    return {"count": sum(k["count"] for k in by_kind.values()), "bytes": sum(k["bytes"] for k in by_kind.values()),
            "by_kind": by_kind}


def collectives_lines(per_iteration: dict, label: str) -> list[str]:
    """One report line per pass: ``{label}, forward: 4 calls, 1.00 MiB: 3 all_reduce (...), ...``."""
    lines = []
    for name, c in per_iteration.items():
        kinds = ", ".join(f"{v['count']} {k} ({fmt_bytes(v['bytes'])})" for k, v in c["by_kind"].items()) or "none"
        lines.append(f"{label}, {name}: {c['count']} calls, {fmt_bytes(c['bytes'])}: {kinds}")
    return lines


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak memory so far: CUDA's max allocated, or on CPU the max resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak (``VmHWM``), in bytes, from /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def peak_step_bytes(step: Callable[[], Any]) -> int | None:
    """Memory ``step()`` needs above what is live before it: CUDA's peak allocated, or on CPU how far the resident set
    peaked above what it was (the heap's free pages returned first, malloc_trim, so that reusing them hides no rise)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = rss_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        step()
        return None
    step()
    return rss_bytes("VmHWM") - before


def fmt_bytes(n: float | None) -> str:
    """``n`` bytes in B / KiB / MiB / GiB."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def table(columns: str, rows: Iterable[Sequence[Any] | str]) -> list[str]:
    """A markdown table: ``columns`` "name | name> | ..." (">": right-aligned), then each row's cells (a str: as is)."""
    names = [c.strip() for c in columns.split(" | ")]
    return ["| " + " | ".join(n.removesuffix(">") for n in names) + " |",
            "|" + "|".join("---:" if n.endswith(">") else "---" for n in names) + "|",
            *(r if isinstance(r, str) else "| " + " | ".join(map(str, r)) + " |" for r in rows)]


def write_json(path: str | os.PathLike, results: dict) -> Path:
    """Write ``results`` as indented JSON (parent directories created); the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return path


def _medians(samples: list[dict]) -> dict:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def timed_training(model: nn.Module, batch: tuple, optimizer: torch.optim.Optimizer, steps: int, warmup: int,
                   device: torch.device) -> dict:
    """Warm-up and timed training steps: each part's median seconds, the losses finite, peak memory."""
    idx, targets = batch
    def step() -> dict:
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        with step_context(model):
            loss = model(idx, targets)
            sync(device)
            t1 = time.perf_counter()
            loss.backward()
        sync(device)
        t2 = time.perf_counter()
        optimizer.step()
        sync(device)
        t3 = time.perf_counter()
        return {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2, "step_s": t3 - t0,
                "loss": float(loss.detach().float())}
    warmups = [step() for _ in range(warmup)]
    samples = [step() for _ in range(steps)]
    result = _medians(samples) | {"loss_finite": all(math.isfinite(s["loss"]) for s in samples), "samples": samples,
                                  "first_step_s": (warmups or samples)[0]["step_s"]}  # the compiling step
    if device.type != "cuda":
        return result | {"peak_bytes": peak_step_bytes(step)}
    torch.cuda.reset_peak_memory_stats(device)  # CUDA's peak: everything live, parameters and optimizer state included
    step()
    return result | {"peak_bytes": torch.cuda.max_memory_allocated(device)}


def timed_decode(model: nn.Module, batch: int, position: int, steps: int, warmup: int, device: torch.device) -> dict:
    """One-token KV-cache forwards at ``position``: the synchronized step, the host's part of it (call to return, before
    synchronizing) and the step of back-to-back calls (medians, seconds)."""
    token = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    where = torch.tensor([position], device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # not the build's (materialization inits at full size)
    with torch.no_grad():
        warm = [timed(lambda: model(token, where), device)[1] for _ in range(warmup)]  # the first compiles
        samples = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            logits = model(token, where)
            t1 = time.perf_counter()
            sync(device)
            samples.append({"host_s": t1 - t0, "step_s": time.perf_counter() - t0})
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = model(token, where)
        sync(device)
        back_to_back = (time.perf_counter() - t0) / steps
    result = _medians(samples)
    result.update(back_to_back_s=back_to_back, first_step_s=warm[0] if warm else None,
                  loss_finite=bool(torch.isfinite(logits).all()), samples=samples,
                  peak_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
    return result


def thunder_structure(jm: nn.Module) -> dict:
    """The last traces with collectives and those as ``[kind, group size, bytes]`` per pass."""
    import thunder

    from thunder_tp.tools.debug import collective_calls
    def last_with_collectives(traces):
        return next((t for t in reversed(traces) if collective_calls(t)), traces[-1] if traces else None)
    traces = {"forward": last_with_collectives(thunder.last_traces(jm)),
              "backward": last_with_collectives(thunder.last_backward_traces(jm))}
    calls = {name: [[c["kind"], c["group_size"], c["bytes"]] for c in collective_calls(t)] if t is not None else []
             for name, t in traces.items()}
    return {"traces": traces, "collectives": calls}
