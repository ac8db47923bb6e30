"""Timing one rank's steps (training and decode) and reading what its final traces communicate: shared by
bench_rank.py and calibrate.py."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from benchmarks.lib.harness import peak_step_bytes, step_context, sync


def _medians(samples: list[dict]) -> dict:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def _peak_bytes(step: Callable[[], object], device: torch.device) -> int | None:
    """Peak memory of a step: CUDA's max allocated (everything live, parameters and optimizer state included);
    on the CPU the resident set's growth during the step (harness.peak_step_bytes)."""
    if device.type != "cuda":
        return peak_step_bytes(step)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    return torch.cuda.max_memory_allocated(device)


def timed_training(model: nn.Module, batch: tuple, optimizer: torch.optim.Optimizer, steps: int, warmup: int,
                   device: torch.device, before_step: Callable[[], None] = lambda: None) -> dict:
    """Warm-up and timed steps of forward (with the loss) + backward + ``optimizer``: medians in seconds of each
    part, the losses finite, peak memory; ``before_step`` runs before each step, untimed (e.g. a barrier)."""
    idx, targets = batch

    def step() -> dict:
        optimizer.zero_grad(set_to_none=True)
        before_step()
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
    result = _medians(samples)
    result["first_step_s"] = (warmups or samples)[0]["step_s"]  # the compiling step (the jit's time not in it)
    result["loss_finite"] = all(math.isfinite(s["loss"]) for s in samples)
    result["peak_bytes"] = _peak_bytes(step, device)
    result["samples"] = samples
    return result


def timed_decode(model: nn.Module, batch: int, position: int, steps: int, warmup: int, device: torch.device,
                 before_step: Callable[[], None] = lambda: None) -> dict:
    """One-token KV-cache forwards at ``position``: the synchronized step, the host's part of it (call to return,
    before synchronizing) and the step of back-to-back calls (medians, seconds)."""
    token = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    where = torch.tensor([position], device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # not the build's (materialization inits at full size)
    first_step_s = None
    with torch.no_grad():
        for _ in range(warmup):
            t0 = time.perf_counter()
            logits = model(token, where)
            sync(device)
            first_step_s = first_step_s or time.perf_counter() - t0  # the first: the compiling step
        samples = []
        for _ in range(steps):
            before_step()
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
    result.update(back_to_back_s=back_to_back, first_step_s=first_step_s,
                  loss_finite=bool(torch.isfinite(logits).all()), samples=samples,
                  peak_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
    return result


def thunder_structure(jm: nn.Module) -> dict:
    """The final traces (the last with collectives, so a CUDA-graph trace reads the trace before it) and their
    collectives as ``[kind, group size, bytes]`` per pass."""
    import thunder

    from thunder_tp.tools.debug import collective_calls

    def last_with_collectives(traces):
        return next((t for t in reversed(traces) if collective_calls(t)), traces[-1] if traces else None)

    traces = {"forward": last_with_collectives(thunder.last_traces(jm)),
              "backward": last_with_collectives(thunder.last_backward_traces(jm))}
    calls = {name: [[c["kind"], c["group_size"], c["bytes"]] for c in collective_calls(t)] if t is not None else []
             for name, t in traces.items()}
    return {"traces": traces, "collectives": calls}


