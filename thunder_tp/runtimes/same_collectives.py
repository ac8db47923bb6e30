"""Every rank of a TP group issues the same collectives: checked when a program is compiled, before it first runs.

torch.distributed pairs the i-th collective of every rank of a group. A program whose ranks issue different ones
(one all_reduce more, other chunk counts, other byte counts) waits forever in a collective that a peer never issues,
or sums data that does not belong together. thunder_tp takes every decision that changes the communication from
facts every rank knows alike (the full tensor, the largest piece over the ranks: ``execution/overlap.py``); this
check catches a decision that still diverges, whatever took it.

What is compared: the collectives over the TP group of the compile's final forward and backward traces, in program
order: kind and bytes (an all_to_all only by kind: its sizes differ among the ranks by design, as expert
parallelism's do). Collectives over other groups are not: Thunder's DDP / FSDP run over a data-parallel group, each
rank of a TP group its own. A hash of that sequence rides on the compile agreement's all_gather
(``runtimes/agreement.py``); where the hashes differ, the ranks gather their sequences (on that error path only) and
every rank raises, naming the first collective where its sequence leaves a peer's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch.distributed as dist
from thunder.core.trace import TraceCtx

from thunder_tp.collectives.calls import collective_calls
from thunder_tp.runtimes.agreement import ranks_alike

__all__ = ["Issued", "SameCollectives", "issued_collectives"]

#: the trace names of a compile's final traces, in the order they are handed over
_TRACES = ("forward", "backward")


@dataclass(frozen=True)
class Issued:
    """One collective over the TP group: where it is (which trace, its place among that trace's collectives over the
    group), what every rank must issue alike (kind and bytes; None: sizes that differ by design) and what issued it."""

    trace: str
    index: int
    kind: str
    nbytes: int | None
    issued_by: str

    @property
    def key(self) -> tuple[str, str, int | None]:
        """What must be equal on every rank."""
        return self.trace, self.kind, self.nbytes

    def __str__(self) -> str:
        size = "" if self.nbytes is None else f" of {self.nbytes} bytes"
        return f"collective {self.index} of the {self.trace} (from 0): {self.kind}{size}, {self.issued_by}"


def issued_collectives(traces: Sequence[TraceCtx], group: dist.ProcessGroup) -> list[Issued]:
    """The collectives over `group` that a compile's final traces (the forward, then the backward) issue, in order."""
    members = dist.get_process_group_ranks(group)
    issued = []
    for name, trace in zip(_TRACES, traces, strict=False):
        calls = [c for c in collective_calls(trace) if _ranks(c["group"]) == members]
        issued += [Issued(name, i, c["kind"], None if c["kind"] == "all_to_all" else c["bytes"], c["issued_by"])
                   for i, c in enumerate(calls)]
    return issued


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of a collective's group (None: the default group)."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


class SameCollectives:
    """The compile agreement's check (`runtimes.agreement.Agreed`) that every rank issues the same collectives."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def fingerprint(self, traces: Sequence[TraceCtx]) -> int:
        """A 63-bit hash of what every rank must issue alike, in order."""
        keys = repr([c.key for c in issued_collectives(traces, self.group)]).encode()
        return int.from_bytes(hashlib.blake2b(keys, digest_size=8).digest(), "little") >> 1

    def raise_differences(self, traces: Sequence[TraceCtx], group: dist.ProcessGroup) -> NoReturn:
        """Gather every rank's collectives (all_gather_object) and raise, naming where this rank's leave a peer's."""
        mine = issued_collectives(traces, group)
        every: list[list[Issued]] = [[] for _ in range(group.size())]
        dist.all_gather_object(every, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        keys = [tuple(c.key for c in issued) for issued in every]
        mine_keys = keys[dist.get_rank(group)]
        peer = next(i for i, k in enumerate(keys) if k != mine_keys)
        raise RuntimeError(
            f"thunder_tp: the ranks of a TP group (global ranks {ranks}) compiled programs that issue different "
            f"collectives (ranks alike: {ranks_alike(ranks, keys)}); run, they would wait forever in a collective "
            "that a peer never issues, or sum data that does not belong together. Nothing ran. The first difference "
            f"from global rank {ranks[peer]}: {_first_difference(mine, every[peer], ranks[peer])}. The ranks were "
            "given different models, plans or options, or thunder_tp decided something from one rank's own shapes "
            "(a bug: please report it with this message from every rank). TensorParallel(..., "
            "check_collectives=False) turns this check off."
        )


def _first_difference(mine: list[Issued], theirs: list[Issued], peer: int) -> str:
    """The first collective where `mine` leaves `theirs` (global rank `peer`'s), on both sides."""
    pairs = enumerate(zip(mine, theirs, strict=False))
    at = next((i for i, (a, b) in pairs if a.key != b.key), min(len(mine), len(theirs)))
    here = str(mine[at]) if at < len(mine) else f"no collective after its {len(mine)}"
    there = str(theirs[at]) if at < len(theirs) else f"no collective after its {len(theirs)}"
    return f"this rank (global rank {dist.get_rank()}) issues {here}; global rank {peer} issues {there}"
