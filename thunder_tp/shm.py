"""Same-host shared-memory transport for the TP collectives of CPU tensors on gloo groups.

Gloo moves CPU tensors over TCP even between processes of one host, and each collective costs it several
round trips through the kernel: between two ranks of a 2-core VM an all_reduce of 2 MB takes 2-4 ms, of which
copying the bytes is ~0.2 ms. When every rank of a group runs on this host, each rank instead publishes its
contribution in shared memory and its peers read it in place; the signalling is shared memory too (readers
poll the sequence number of the message they expect), so nothing passes through the kernel.

Per rank and group there is
- a control block: a ring of message headers (sequence number, slot, generation, bytes) and a ring of
  acknowledgements (the sequence numbers of the collectives this rank has finished reading);
- data slots, files under /dev/shm; a slot grows (a new file, the next generation) when a message does not
  fit, and a file is unlinked once every peer has read from it (so has mapped it).
Publishing goes to any slot whose last message every peer has acknowledged (a new slot if none), so it never
waits for a peer; reading waits only for the peers' headers. Every rank issues the group's collectives in the
same order (as for any collective), so the n-th message of every rank belongs to the same collective.

Set ``THUNDER_TP_SHM=0`` (on every rank) to use gloo's transport.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import mmap
import os
import platform
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

HEADERS = 4096  # ring entries: more collectives than this in flight at once is an error
TIMEOUT_S = 600.0  # how long a reader waits for a peer's message before raising
_FIELDS = 4  # header: seq, slot, generation, nbytes
_SHM_DIR = "/dev/shm"
_LINKED: set[str] = set()


def _map(path: str, nbytes: int, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
            _LINKED.add(path)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    if path in _LINKED:
        _LINKED.discard(path)
        with contextlib.suppress(OSError):
            os.unlink(path)


@atexit.register
def _unlink_all() -> None:
    for path in list(_LINKED):
        _unlink(path)


def _poll(ready: Callable[[], bool], what: str) -> None:
    """Wait until `ready()`: spin briefly, then yield the core, then sleep; raise after TIMEOUT_S."""
    start = time.monotonic()
    polls = 0
    while not ready():
        polls += 1
        if polls < 2000:
            continue
        if polls % 64 == 0 and time.monotonic() - start > TIMEOUT_S:
            raise RuntimeError(
                f"thunder_tp shared-memory transport: {what} did not arrive within {TIMEOUT_S:.0f} s. Every rank "
                "of a TP group must run the same collectives in the same order; if one rank failed, see its "
                "error (set THUNDER_TP_SHM=0 on every rank to use gloo's transport instead)"
            )
        if polls < 20000:
            os.sched_yield()
        else:
            time.sleep(5e-5)


@dataclass(eq=False)
class _Slot:
    """One data file of this rank: its current generation and the last message placed in it."""

    index: int
    path: str
    gen: int
    data: torch.Tensor  # uint8 view of the mapping
    last: int = 0  # sequence number of the last message placed in it

    @property
    def capacity(self) -> int:
        return self.data.numel()


class Channel:
    """The shared-memory transport of one process group whose ranks all run on this host."""

    def __init__(self, group: dist.ProcessGroup, prefixes: list[str], control: mmap.mmap):
        self.rank, self.size = dist.get_rank(group), group.size()
        self.peers = [p for p in range(self.size) if p != self.rank]
        self.prefix = prefixes[self.rank]
        mappings = [control if r == self.rank else _map(f"{p}control", _control_bytes(), False)
                    for r, p in enumerate(prefixes)]
        self.control = [memoryview(m).cast("q") for m in mappings]  # int64 words; the views keep the maps alive
        self.prefixes = prefixes
        self.slots: list[_Slot] = []
        self.peer_slots: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self.seq = 0

    # --- this rank's messages ----------------------------------------------------------------------

    def publish(self, t: torch.Tensor) -> int:
        """Copy `t` into a free slot and announce it; returns the message's sequence number."""
        self.seq += 1
        seq, nbytes = self.seq, t.numel() * t.element_size()
        entry = seq % HEADERS
        _poll(lambda: all(self.control[p][HEADERS * _FIELDS + entry] >= seq - HEADERS for p in self.peers),
              f"the peers' reading of collective #{seq - HEADERS} (more than {HEADERS} in flight?)")
        slot = self._slot_for(nbytes)
        slot.data[:nbytes].view(t.dtype).view(t.shape).copy_(t)
        slot.last = seq
        header = self.control[self.rank]
        index = entry * _FIELDS
        header[index + 1], header[index + 2], header[index + 3] = slot.index, slot.gen, nbytes
        header[index] = seq  # last: readers poll it, and x86 keeps stores in order
        return seq

    def _read_by_all(self, seq: int) -> bool:
        return all(self.control[p][HEADERS * _FIELDS + seq % HEADERS] >= seq for p in self.peers)

    def _slot_for(self, nbytes: int) -> _Slot:
        free = [s for s in self.slots if s.last == 0 or self._read_by_all(s.last)]
        for s in free:
            if s.last:
                _unlink(s.path)  # every peer has read from (so mapped) it
        fitting = [s for s in free if s.capacity >= nbytes]
        if fitting:
            return fitting[0]
        old = max(free, key=lambda s: s.capacity, default=None)  # grown: a new file, the next generation
        index, gen = (old.index, old.gen + 1) if old else (len(self.slots), 0)
        path = f"{self.prefix}{index}_{gen}"
        slot = _Slot(index, path, gen, torch.frombuffer(_map(path, max(nbytes, 1 << 16), True), dtype=torch.uint8))
        self.slots[index:index + 1] = [slot]
        return slot

    # --- the peers' messages -----------------------------------------------------------------------

    def contributions(self, seq: int, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's contribution to collective `seq` (shaped like `mine`) in rank order; peers' are views."""
        parts = []
        for r in range(self.size):
            parts.append(mine if r == self.rank else self._peer_message(r, seq, mine))
        return parts

    def _peer_message(self, peer: int, seq: int, like: torch.Tensor) -> torch.Tensor:
        header, index = self.control[peer], (seq % HEADERS) * _FIELDS
        _poll(lambda: header[index] == seq, f"rank {peer}'s contribution to collective #{seq}")
        slot, gen, nbytes = header[index + 1], header[index + 2], header[index + 3]
        expected = like.numel() * like.element_size()
        if nbytes != expected:
            raise RuntimeError(
                f"thunder_tp shared-memory transport: rank {peer} sent {nbytes} bytes to collective #{seq}, this "
                f"rank expected {expected}; every rank must run the same collectives in the same order"
            )
        mapped_gen, data = self.peer_slots.get((peer, slot), (-1, None))
        if mapped_gen != gen:
            path = f"{self.prefixes[peer]}{slot}_{gen}"
            data = torch.frombuffer(_map(path, os.path.getsize(path), False), dtype=torch.uint8)
            self.peer_slots[(peer, slot)] = (gen, data)
        return data[:nbytes].view(like.dtype).view(like.shape)

    def done(self, seq: int) -> None:
        """Tell the peers this rank has finished reading their contributions to collective `seq`."""
        self.control[self.rank][HEADERS * _FIELDS + seq % HEADERS] = seq


def _control_bytes() -> int:
    return HEADERS * (_FIELDS + 1) * 8


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _unlink_stale() -> None:
    """Remove the files of thunder_tp processes that are gone (killed before they could)."""
    for path in glob.glob(os.path.join(_SHM_DIR, "thunder_tp_*")):
        pid = os.path.basename(path).split("_")[2]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except (ValueError, PermissionError):
            pass


_CHANNELS: dict[dist.ProcessGroup, Channel | None] = {}


def channel(group: dist.ProcessGroup) -> Channel | None:
    """The group's shared-memory channel, or None when its ranks are not all on this (x86-64) host or it is off.
    Collective on the group the first time it is called for it."""
    if group not in _CHANNELS:
        wanted = (os.environ.get("THUNDER_TP_SHM", "1") != "0" and os.path.isdir(_SHM_DIR)
                  and platform.machine() in ("x86_64", "AMD64"))  # the polling relies on x86's store order
        control = None
        prefix = os.path.join(_SHM_DIR, f"thunder_tp_{os.getpid()}_{uuid.uuid4().hex[:8]}_")
        if wanted:
            _unlink_stale()
            control = _map(f"{prefix}control", _control_bytes(), True)
        infos: list = [None] * group.size()
        dist.all_gather_object(infos, (wanted, _host_id(), prefix), group=group)
        usable = all(w for w, _, _ in infos) and len({h for _, h, _ in infos}) == 1
        _CHANNELS[group] = Channel(group, [p for _, _, p in infos], control) if usable else None
        dist.barrier(group=group)  # every rank has mapped every control block
        if control is not None:
            _unlink(f"{prefix}control")
    return _CHANNELS[group]
