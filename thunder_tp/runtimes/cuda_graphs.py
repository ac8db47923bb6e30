"""A program replayed as CUDA graphs: captured on its first call, then each call replays the kernels it recorded.

A process group whose collectives a graph can hold (NCCL; torch's fake group, whose collectives do nothing) lets the
whole program be one graph. Over any other group (gloo: it moves CUDA tensors through host memory) the program is
split at its communication: each stretch of compute between two collectives is a graph of its own, and the
collectives run in between as they do without graphs (``split_at_communication``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace

from thunder_tp.collectives import is_communication
from thunder_tp.thunder_internals.computation import sub_program

__all__ = ["CapturedCall", "capturable", "split_at_communication"]

#: backends whose collectives a CUDA graph can hold
CAPTURABLE_BACKENDS = ("nccl", "fake")


class CapturedCall:
    """``fn(*inputs)`` captured as a CUDA graph on its first call (after one run on a side stream, as capture needs)
    and replayed on later calls, which return the captured outputs (overwritten by the next replay). A replay reads
    the memory of the first call's inputs: the inputs at positions ``refreshed`` (values computed anew each call, at
    another address) are copied there first unless they are the captured tensors themselves; the others must be the
    same tensors on every call (bound parameters and caches, the outputs of an earlier graph)."""

    def __init__(self, fn: Callable[..., Any], refreshed: Sequence[int] = (), pool: Any = None):
        self.fn, self.refreshed, self.pool = fn, tuple(refreshed), pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple = ()
        self.outputs: Any = None

    def __call__(self, *inputs: Any) -> Any:
        """Capture (first call), or refresh the changing inputs and replay."""
        if self.graph is None:
            return self._capture(inputs)
        for i in self.refreshed:
            if inputs[i] is not self.inputs[i]:
                self.inputs[i].copy_(inputs[i])
        self.graph.replay()
        return self.outputs

    def _capture(self, inputs: tuple) -> Any:
        self.inputs = inputs  # held: the graph reads their memory on every replay
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the process group's watchdog thread may query CUDA events meanwhile
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs = self.fn(*inputs)
        self.graph.replay()
        return self.outputs


def capturable(trace: TraceCtx) -> bool:
    """Whether every collective of ``trace`` runs over a group whose collectives a CUDA graph can hold."""
    groups = {id(a): a for b in trace.bound_symbols if is_communication(b) for a in b.flat_args
              if isinstance(a, dist.ProcessGroup)}
    return all(dist.get_backend(g) in CAPTURABLE_BACKENDS for g in groups.values())


def split_at_communication(trace: TraceCtx, segment: Callable[[Callable, Sequence[int]], Callable]) -> TraceCtx:
    """``trace`` with each stretch of compute between two communication symbols replaced by one call of
    ``segment(fn, refreshed)``: ``fn`` runs the stretch (a function of the values it reads, returning those read
    later), ``refreshed`` are the positions of its inputs that communication computed."""
    items = _stretches(trace)
    read_later = _read_after(items)
    communicated = {o.name for item in items if not isinstance(item, list) and is_communication(item)
                    for o in item.flat_proxy_outs}
    bsyms, segments = [], 0
    for item, later in zip(items, read_later, strict=True):
        if isinstance(item, list):
            bsyms.append(_segment_call(item, later, communicated, segments, segment))
            segments += 1
        else:
            bsyms.append(item)
    split = from_trace(trace)
    split.bound_symbols = bsyms
    split.set_provenance(TraceProvenance("thunder_tp: compute between collectives as CUDA graphs"))
    return split


def _stretches(trace: TraceCtx) -> list[BoundSymbol | list[BoundSymbol]]:
    """The trace's symbols with each run of compute grouped into a list (deletions dropped: a graph's memory is its
    own, and the values a stretch returns live until the next call)."""
    items: list[BoundSymbol | list[BoundSymbol]] = []
    for bsym in trace.bound_symbols:
        if bsym.sym.id == prims.PrimIDs.DEL:
            continue
        if bsym.sym.id in (prims.PrimIDs.UNPACK_TRIVIAL, prims.PrimIDs.RETURN) or is_communication(bsym):
            items.append(bsym)
        elif items and isinstance(items[-1], list):
            items[-1].append(bsym)
        else:
            items.append([bsym])
    return items


def _read_after(items: list) -> list[set[str]]:
    """For each item, the names read by the items after it."""
    reads: set[str] = set()
    after = []
    for item in reversed(items):
        after.append(set(reads))
        for bsym in item if isinstance(item, list) else [item]:
            reads.update(p.name for p in bsym.flat_proxy_args)
    return after[::-1]


def _segment_call(stretch: list[BoundSymbol], read_later: set[str], communicated: set[str], index: int,
                  segment: Callable) -> BoundSymbol:
    """One call of ``segment`` running ``stretch``: its inputs are the values it reads that it does not compute, its
    outputs those it computes that are read later."""
    produced: dict[str, TensorProxy] = {}
    inputs: dict[str, Any] = {}
    for bsym in stretch:
        for p in bsym.flat_proxy_args:
            if p.name not in produced:
                inputs.setdefault(p.name, p)
        produced.update((o.name, o) for o in bsym.flat_proxy_outs)
    outputs = [p for name, p in produced.items() if name in read_later]
    fn = sub_program(stretch, list(inputs.values()), outputs, f"segment{index}")
    refreshed = [i for i, name in enumerate(inputs) if name in communicated]
    name = f"CUDAGraph{index}"
    symbol = Symbol(name, meta=None, is_fusion=True)
    return BoundSymbol(symbol, tuple(inputs.values()), {}, outputs, tuple(stretch),
                       _call_ctx={name: segment(fn, refreshed)})
