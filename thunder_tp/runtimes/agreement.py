"""Every rank of a TP group finishes compiling a jitted module, or every rank raises.

A compile error can be rank-local (the interpreter, a transform or an executor pass failing on one rank only);
the ranks that compiled would then wait in the module's first collective until the process group's timeout.
So each compile ends with one agreement: the ranks all-gather a flag (compiled / failed) after the last trace
pass; a rank whose compile raised contributes "failed" from its error path, and every rank raises.
A fake process group (``thunder_tp.one_rank``, ``thunder_tp.simulate``) has no peer process: TensorParallel holds
no agreement there.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import thunder
import torch
import torch.distributed as dist

from thunder_tp.collectives.distributed import NamedWork
from thunder_tp.run_mode import ranks_of
from thunder_tp.thunder_internals.private import wrap_module_call


class CompileAgreement:
    """The agreement of one jitted module's compiles over one process group."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._agreed_compile = 0  # the jitted module's cache-miss count at the last agreement

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
                    _tell_peers_of(error, self.group)
                raise

        return forward_agreeing

    def compiled(self, model) -> None:
        """Called after this rank's last trace pass of a compile: raise if a peer's compile failed."""
        stats = thunder.compile_stats(model)
        if self._agreed_compile == stats.cache_misses:
            return
        self._agreed_compile = stats.cache_misses
        failed = _failed_ranks(False, self.group)
        if failed:
            raise RuntimeError(
                f"thunder_tp: rank(s) {failed} of the TP group of global ranks "
                f"{dist.get_process_group_ranks(self.group)} failed to compile this module (their output has the "
                "error); every rank of the group stops here instead of waiting for them in a collective."
            )


def gathered(values: list[int], group: dist.ProcessGroup, what: str = "all_gather") -> list[list[int]]:
    """Every rank's `values` (int64s, as many on every rank), in the group's rank order (one all_gather; a failure
    names it as `what`)."""
    device = ranks_of(group).device
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = torch.zeros(group.size() * len(values), dtype=torch.int64, device=device)
    NamedWork(dist.all_gather_into_tensor(every, mine, group, async_op=True), what, mine, group).wait()
    return every.view(group.size(), len(values)).tolist()


def _failed_ranks(failed: bool, group: dist.ProcessGroup) -> list[int]:
    """The global ranks of `group` whose flag says failed (one all_gather of a flag per rank)."""
    ranks = dist.get_process_group_ranks(group)
    return [ranks[i] for i, (flag,) in enumerate(gathered([int(failed)], group)) if flag]


def _tell_peers_of(error: Exception, group: dist.ProcessGroup) -> None:
    """This rank's compile failed: take part in the agreement as failed (best effort: the error stays the error)."""
    try:
        _failed_ranks(True, group)
    except Exception as agreement_error:  # a peer died too: the original error is what the user needs
        error.add_note(f"thunder_tp could not tell the other ranks of the TP group: {agreement_error}")
    else:
        error.add_note("thunder_tp: the other ranks of the TP group were told that this rank's compile failed.")
