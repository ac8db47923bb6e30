"""Every rank of a TP group finishes compiling a jitted module, alike, or every rank raises.

A compile error can be rank-local (the interpreter, a transform or an executor pass failing on one rank only);
the ranks that compiled would then wait in the module's first collective until the process group's timeout.
So each compile ends with one agreement, after the last trace pass (the backward's, where the compile has one): the
ranks all-gather a flag (compiled / failed) and a fingerprint of each check's facts (`Agreed`: the collectives the
program issues, `runtimes/same_collectives.py`; the full weights every rank sharded, `runtimes/divergence.py`). A
rank whose compile raised contributes "failed" from its error path, and every rank raises; where a check's
fingerprints differ, every rank takes that check's error path (a collective that names what differs) and raises.
All of it happens before the program first runs, so no rank is left waiting in a collective of the program.
A fake process group (``thunder_tp.one_rank``, ``thunder_tp.simulate``) has no peer process: TensorParallel holds
no agreement there.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import thunder
import torch
import torch.distributed as dist
from thunder.core.trace import TraceCtx

from thunder_tp.collectives.distributed import NamedWork
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.thunder_internals.computation import backward_follows
from thunder_tp.thunder_internals.private import wrap_module_call


class Agreed(Protocol):
    """What every rank of a group must hold alike, compared at the end of each compile."""

    def fingerprint(self, traces: Sequence[TraceCtx]) -> int:
        """This rank's fingerprint (an int64), from the compile's final traces (the forward, then the backward)."""

    def raise_differences(self, traces: Sequence[TraceCtx], group: dist.ProcessGroup) -> None:
        """Raise on every rank, naming what differs (collective: every rank of `group` calls it)."""


class CompileAgreement:
    """The agreement of one jitted module's compiles over one process group, with the `checks` it compares."""

    def __init__(self, group: dist.ProcessGroup, checks: Sequence[Agreed] = ()):
        self.group = group
        self.checks = tuple(checks)
        self._agreed_compile = 0  # the jitted module's cache-miss count at the last agreement
        self._forward: tuple[int, TraceCtx] | None = None  # (cache-miss count, forward) while its backward is due

    def install(self, model) -> None:
        """Make a compile error of `model` (a ThunderModule) tell the group before it propagates."""
        stats = weakref.ref(thunder.compile_stats(model))  # as Thunder's own call: no cycle through the module
        wrap_module_call(model, lambda forward: self._reporting_failures(forward, stats))

    def _reporting_failures(self, forward: Callable, stats: weakref.ref) -> Callable:
        @functools.wraps(forward)
        def forward_agreeing(*args, **kwargs) -> Any:
            compiles = stats().cache_misses
            try:
                return forward(*args, **kwargs)
            except Exception as error:
                misses = stats().cache_misses
                if misses != compiles and self._agreed_compile != misses:
                    self._agreed_compile = misses
                    _tell_peers_of(error, self.group, len(self.checks))
                raise

        return forward_agreeing

    def compiled(self, model, trace: TraceCtx) -> None:
        """Called with each final trace of a compile (its forward, then its backward if any): after the last, raise
        if a peer's compile failed, or if the ranks' fingerprints of a check differ."""
        misses = thunder.compile_stats(model).cache_misses
        if self._agreed_compile == misses:
            return
        pending = self._forward
        forward = (pending[1],) if pending is not None and pending[0] == misses else ()
        if backward_follows(trace):
            self._forward = (misses, trace)
            return
        self._forward = None
        traces = (*forward, trace)
        fingerprints = [check.fingerprint(traces) for check in self.checks]
        self._agreed_compile = misses
        every = gathered([0, *fingerprints], self.group, "the compile agreement's all_gather")
        failed = [rank for rank, (flag, *_) in zip(dist.get_process_group_ranks(self.group), every, strict=True)
                  if flag]
        if failed:
            raise RuntimeError(
                f"thunder_tp: rank(s) {failed} of the TP group of global ranks "
                f"{dist.get_process_group_ranks(self.group)} failed to compile this module (their output has the "
                "error); every rank of the group stops here instead of waiting for them in a collective."
            )
        for i, check in enumerate(self.checks, start=1):
            if len({values[i] for values in every}) > 1:
                check.raise_differences(traces, self.group)


def gathered(values: list[int], group: dist.ProcessGroup, what: str = "all_gather") -> list[list[int]]:
    """Every rank's `values` (int64s, as many on every rank), in the group's rank order (one all_gather; a failure
    names it as `what`)."""
    device = ranks_of(group).device
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = torch.zeros(group.size() * len(values), dtype=torch.int64, device=device)
    NamedWork(dist.all_gather_into_tensor(every, mine, group, async_op=True), what, mine, group).wait()
    return every.view(group.size(), len(values)).tolist()


def ranks_alike(ranks: list[int], values: list[Hashable]) -> list[list[int]]:
    """The ranks grouped by equal `values` (each rank's, in `ranks`' order)."""
    groups: dict[Hashable, list[int]] = {}
    for rank, v in zip(ranks, values, strict=True):
        groups.setdefault(v, []).append(rank)
    return sorted(groups.values())


def _tell_peers_of(error: Exception, group: dist.ProcessGroup, checks: int) -> None:
    """This rank's compile failed: take part in the agreement as failed (best effort: the error stays the error)."""
    try:
        gathered([1] + [0] * checks, group, "the compile agreement's all_gather")
    except Exception as agreement_error:  # a peer died too: the original error is what the user needs
        error.add_note(f"thunder_tp could not tell the other ranks of the TP group: {agreement_error}")
    else:
        error.add_note("thunder_tp: the other ranks of the TP group were told that this rank's compile failed.")
