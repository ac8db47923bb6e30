"""Where a thunder step's time goes: every fusion region and collective call of a jitted module, timed.

``step_breakdown(jm, step, steps, distributed)`` wraps the callables that Thunder's compiled forward and backward
call (the cache entry of the last call): fusion regions, collective issues (the torch.distributed calls) and waits,
told apart by the final traces' bound symbols. It runs ``steps`` steps, puts the callables back and reports per step:

- medians of the wall time, of the process's CPU time and of its main thread's (the difference is other threads':
  gloo's workers, which run on the rank's own core when ranks are pinned); idle = wall - process CPU (no thread of
  the process ran: waiting for a peer, or for the host to run this virtual CPU again);
- per phase (forward, backward) and kind (region, issue, wait): mean wall and main-thread CPU time, and calls;
  and, inside the regions, the matmul kernels they call out to (kind matmul: Inductor's extern ``mm``/``addmm``/
  ``bmm``; none for nvFuser's regions, which run their matmuls themselves);
- with ``distributed``: when each rank issued each collective and when its wait returned, lined up across the ranks
  of this host (one clock, CLOCK_MONOTONIC): medians of how far apart the ranks issued it and of how long after the
  last issue every rank was past its wait. In the forward, where each wait follows its issue, that is what the
  collective took, whatever the ranks' skew; in the backward it also spans the compute scheduled in between.

On CUDA every wrapped call synchronizes the device before and after, so region times are kernel times and
communication no longer overlaps compute: use it to see where time goes, not to time the step.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.lib.harness import sync

KINDS = ("region", "matmul", "issue", "wait")
MATMUL_KERNELS = ("mm", "addmm", "bmm", "baddbmm")


def _call_kinds(trace) -> dict[str, str]:
    """Name of each callable ``trace`` calls that is a fusion region, a collective's issue or a wait -> that kind
    (thunder_tp's naming of a work handle, a few microseconds, is left out)."""
    from thunder_tp.collectives import is_communication, is_wait
    from thunder_tp.collectives.symbols import tp_name_work

    kinds = {}
    for bsym in trace.bound_symbols:
        if bsym.sym.is_fusion:
            kinds[bsym.sym.name] = "region"
        elif is_wait(bsym):
            kinds[bsym.sym.name] = "wait"
        elif is_communication(bsym) and bsym.sym.id != tp_name_work.id:
            kinds[bsym.sym.name] = "issue"
    return kinds


def _compiled(jm) -> list[tuple[str, Callable, Any]]:
    """(phase, compiled function, its final trace) of the cache entry Thunder ran last."""
    import thunder

    last = thunder.last_traces(jm)[-1]
    entry = next(e for e in thunder.compile_stats(jm).interpreter_cache if e.computation_traces[-1] is last)
    phases = [("forward", entry.computation_fn, last)]
    if entry.backward_fn is not None:
        phases.append(("backward", entry.backward_fn, entry.backward_traces[-1]))
    return phases


def _handle(future) -> int | None:
    """Identity of the torch.distributed work behind a (work, tensor) future, named by thunder_tp or not; None for
    anything else (a synchronous collective's result, DDP's bucket packing)."""
    if not isinstance(future, tuple):
        return None
    return id(getattr(future[0], "work", future[0]))


class _Recorder:
    """Sums of wall / main-thread CPU time and calls per (phase, kind); each collective's issue start and wait end."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.wall: dict[tuple[str, str], float] = defaultdict(float)
        self.cpu: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.collectives: list[list] = []  # [phase, issued, done] in the order issued
        self._pending: dict[int, int] = {}  # work identity -> its index in collectives
        self.region_phase: str | None = None  # the phase of the region running now

    def wrap(self, phase: str, kind: str, fn: Callable) -> Callable:
        """``fn`` (a callable of the compiled ``phase``) timed as ``kind``; a region's matmul kernels are timed too."""
        def timed(*args, **kwargs):
            self.region_phase = phase if kind == "region" else None
            try:
                return self._timed(phase, kind, fn, args, kwargs)
            finally:
                self.region_phase = None

        return timed

    def wrap_matmul(self, fn: Callable) -> Callable:
        """``fn`` (a matmul kernel) timed as kind matmul of the region that calls it; untimed outside regions."""
        def timed(*args, **kwargs):
            if self.region_phase is None:
                return fn(*args, **kwargs)
            return self._timed(self.region_phase, "matmul", fn, args, kwargs)

        return timed

    def _timed(self, phase: str, kind: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self.sync()
        start, cpu = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        self.sync()
        end = time.perf_counter()
        self.wall[phase, kind] += end - start
        self.cpu[phase, kind] += time.thread_time() - cpu
        self.calls[phase, kind] += 1
        if kind == "issue" and (issued := _handle(out)) is not None:
            self._pending[issued] = len(self.collectives)
            self.collectives.append([phase, start, None])
        elif kind == "wait" and (waited := _handle(args[0])) in self._pending:
            self.collectives[self._pending.pop(waited)][2] = end
        return out


@contextlib.contextmanager
def _recording(jm, recorder: _Recorder) -> Iterator[None]:
    """The compiled functions of ``jm`` call ``recorder``'s wrappers of their regions, the regions' matmul kernels and
    the collectives while inside."""
    from torch._inductor.select_algorithm import extern_kernels

    with contextlib.ExitStack() as restore:
        for name in MATMUL_KERNELS:
            if hasattr(extern_kernels, name):
                original = getattr(extern_kernels, name)
                restore.callback(setattr, extern_kernels, name, original)
                setattr(extern_kernels, name, recorder.wrap_matmul(original))
        for phase, fn, trace in _compiled(jm):
            namespace = _unwrapped(fn).__globals__
            for name, kind in _call_kinds(trace).items():
                if name in namespace:
                    original = namespace[name]
                    restore.callback(namespace.__setitem__, name, original)
                    namespace[name] = recorder.wrap(phase, kind, original)
        yield


def _unwrapped(fn: Callable) -> Callable:
    """The function Thunder generated from a trace, under its decorators (``functools.wraps`` chains)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def step_breakdown(jm, step: Callable[[], Any], steps: int, distributed: bool) -> dict:
    """``steps`` calls of ``step`` (a training step of ``jm``), per step, split as the module docstring says: this
    rank's figures, and with ``distributed`` every rank's (``per_rank``) and the collectives lined up over them."""
    device = next((p.device for p in jm.parameters()), torch.device("cpu"))
    recorder = _Recorder(partial(sync, device))
    walls, process_cpu, main_cpu = [], [], []
    with _recording(jm, recorder):
        for _ in range(steps):
            if distributed:
                dist.barrier()
            wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
            step()
            walls.append(time.perf_counter() - wall)
            process_cpu.append(time.process_time() - cpu)
            main_cpu.append(time.thread_time() - thread)
    wall, process, main = (statistics.median(x) for x in (walls, process_cpu, main_cpu))
    out: dict = {"steps": steps, "wall_s": wall, "process_cpu_s": process, "main_thread_cpu_s": main,
                 "other_threads_cpu_s": max(process - main, 0.0), "idle_s": max(wall - process, 0.0), "calls": {}}
    for (phase, kind), total in sorted(recorder.wall.items()):
        out["calls"][f"{phase} {kind}"] = {"wall_s": total / steps, "cpu_s": recorder.cpu[phase, kind] / steps,
                                           "count": recorder.calls[phase, kind] // steps}
    if distributed:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (socket.gethostname(), recorder.collectives, out))
        out = {**out, "per_rank": [summary for _, _, summary in everyone],
               "collectives": _line_up([(host, calls) for host, calls, _ in everyone])}
    return out


def _line_up(everyone: list[tuple[str, list]]) -> dict | None:
    """Per phase, over every collective of every step (the k-th issued on each rank is the same one): medians of how
    far apart the ranks issued it and of how long after the last rank issued it every rank's wait had returned.
    ``everyone``: each rank's (host, collectives); None if the ranks are on several hosts (no common clock)."""
    if len({host for host, _ in everyone}) != 1:
        return None
    out = {}
    for phase in ("forward", "backward"):
        per_rank = [[(issued, done) for p, issued, done in calls if p == phase and done is not None]
                    for _, calls in everyone]
        lined = [(min(i for i, _ in same), max(i for i, _ in same), max(d for _, d in same))
                 for same in zip(*per_rank, strict=False)]  # a rank's unfinished calls are left out
        if lined:
            out[phase] = {"issue_spread_s": statistics.median(b - a for a, b, _ in lined),
                          "last_issue_to_done_s": statistics.median(d - b for _, b, d in lined)}
    return out


def breakdown_rows(name: str, b: dict) -> list[str]:
    """The markdown table rows of one mode's breakdown (ms per step), one per rank."""
    def ms(s):
        return f"{s * 1e3:.1f}"
    lined = b.get("collectives") or {}
    rows = []
    for rank, r in enumerate(b.get("per_rank", [b])):
        cells = [name if "per_rank" not in b else f"{name}, rank {rank}", ms(r["wall_s"]), ms(r["main_thread_cpu_s"]),
                 ms(r["other_threads_cpu_s"]), ms(r["idle_s"])]
        for phase in ("forward", "backward"):
            for kind in KINDS:
                c = r["calls"].get(f"{phase} {kind}")
                cells.append("–" if c is None else f"{ms(c['wall_s'])} ({c['count']})")
        for phase in ("forward", "backward"):
            c = lined.get(phase)
            cells.append("–" if c is None else f"{ms(c['issue_spread_s'])} / {ms(c['last_issue_to_done_s'])}")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


BREAKDOWN_HEADER = (
    "| mode | step wall | main thread CPU | other threads CPU | idle | fwd regions (calls) | in them: matmuls "
    "| fwd issues | fwd waits | bwd regions | in them: matmuls | bwd issues | bwd waits "
    "| fwd collective: issue spread / last issue -> done | bwd: same |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)
