"""Whether decomposing a collective pays, and into how many chunks: an alpha-beta link and a matmul model.

Every rank must decide alike (a rank that decomposed where its peer did not would wait forever for the peer's
pieces), so the decision reads nothing measured at run time: only the shapes, the dtype, the device, the group's
size and backend, and the figures of the backend's link and the device's matmuls (``thunder_tp/costs.py``). Each
site is priced as a two-resource pipeline (this rank's compute and one link, one transfer at a time, as NCCL runs a
communicator's operations in order): the undecomposed schedule against the decomposed one. Chunks are not free: each
chunk's matmul is a call more, and on a GPU a smaller matmul fills its last wave of output tiles less (``Costs.tile``
x ``tile`` tiles over ``units`` SMs); the backward pays the same for its input grads (chunked like the forward) and a
call more per chunk for its weight grads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from thunder_tp import costs

#: the most chunks a collective is cut into, and the fewest rows (tokens) a chunk's matmul gets
MAX_CHUNKS = 8
MIN_CHUNK_ROWS = 4


@dataclass(frozen=True)
class Costs:
    """One transfer's latency and bus bandwidth on the group; the matmul rate, one call's fixed cost and, on a GPU,
    the output tile and the units (SMs) that run tiles at once (0: no wave quantization); ``concurrent``: the share
    of a transfer during which this rank computes on (1: NCCL on its own stream; 0: a transport whose threads need
    the rank's core)."""

    latency_s: float
    bus_bytes_per_s: float
    flops_per_s: float
    matmul_call_s: float
    tile: int = 0
    units: int = 0
    concurrent: float = 1.0

    def busy_s(self, comm_s: float) -> float:
        """What a transfer of ``comm_s`` takes from this rank's compute."""
        return (1.0 - self.concurrent) * comm_s

    def collective_s(self, kind: str, nbytes: float, size: int) -> float:
        """A ring collective of ``nbytes`` (the full tensor) over ``size`` ranks."""
        return self.latency_s + costs.ring_factor(kind, size) * nbytes / self.bus_bytes_per_s

    def send_s(self, nbytes: float) -> float:
        """One rank's ``nbytes`` to one peer (a shift)."""
        return self.latency_s + nbytes / self.bus_bytes_per_s

    def matmul_s(self, rows: int, k: int, n: int) -> float:
        """A (rows x k) @ (k x n) matmul: its FLOPs, on a GPU rounded up to whole waves of output tiles."""
        flops = 2.0 * rows * k * n
        if self.tile:
            tiles = math.ceil(rows / self.tile) * math.ceil(n / self.tile)
            flops = 2.0 * math.ceil(tiles / self.units) * self.units * self.tile * self.tile * k
        return flops / self.flops_per_s + self.matmul_call_s


@dataclass(frozen=True)
class Linears:
    """The matmuls of a site: ``rows`` tokens through each linear of ``shapes`` ((in, out) features)."""

    rows: int
    shapes: tuple[tuple[int, int], ...]

    def piece_s(self, c: Costs, pieces: int) -> float:
        """One piece's matmuls (``rows / pieces`` tokens through every linear)."""
        return sum(c.matmul_s(self.rows // pieces, k, n) for k, n in self.shapes)

    def weight_grads_s(self, c: Costs, pieces: int) -> float:
        """The weight grads' matmuls, contracted over the tokens in ``pieces`` calls."""
        return sum(c.matmul_s(n, self.rows, k) + (pieces - 1) * c.matmul_call_s for k, n in self.shapes)

    def backward_extra_s(self, c: Costs, pieces: int) -> float:
        """What ``pieces`` chunks add to the backward: the input grads' matmuls chunked, a weight grad call each."""
        inputs = sum(pieces * c.matmul_s(self.rows // pieces, n, k) - c.matmul_s(self.rows, n, k)
                     for k, n in self.shapes)
        return inputs + (pieces - 1) * len(self.shapes) * c.matmul_call_s


def costs_for(group: dist.ProcessGroup, device_type: str, dtype: torch.dtype) -> Costs:
    """The figures for a group's backend (a fake group: the device's usual one) and a matmul's device and dtype."""
    return device_costs(dist.get_backend(group), device_type, dtype)


def device_costs(backend: str, device_type: str, dtype: torch.dtype) -> Costs:
    """The figures for a backend ("nccl", "gloo"; another: the device's usual one), a device type and a dtype."""
    device_type = "cuda" if device_type == "cuda" else "cpu"
    if backend not in costs.BACKEND_LINKS:
        backend = "nccl" if device_type == "cuda" else "gloo"
    link = costs.LINKS[costs.BACKEND_LINKS[backend]]
    device = costs.DEVICES[costs.DEVICE_TYPE_DEVICES[device_type]]
    return Costs(link.latency_s, link.bus_bytes_per_s, device.matmul_rate(dtype), device.matmul_call_s, device.tile,
                 device.units, link.concurrent)


# --- the two pipelines --------------------------------------------------------------------------------------------


def send_after_compute(piece_s: float, comm_s: float, count: int, tail_s: float = 0.0) -> float:
    """``count`` pieces computed one after another, each sent when done (``comm_s``, one transfer at a time), then
    ``tail_s`` more compute that needs no transfer: the time until both are done."""
    link = 0.0
    for j in range(1, count + 1):
        link = max(link, j * piece_s) + comm_s
    return max(count * piece_s + tail_s, link)


def compute_after_receive(piece_s: float, comm_s: float, count: int, local: bool) -> float:
    """``count`` pieces received one after another (``comm_s`` each), each computed (``piece_s``) when there, after
    the ``local`` piece (no transfer) if any: the time until the last is computed."""
    t = piece_s if local else 0.0
    for j in range(1, count + 1):
        t = max(t, j * comm_s) + piece_s
    return t


def ring_attention_pays(c: Costs, kv_bytes: float, chunk_flops: float, size: int) -> bool:
    """Context parallelism's keys and values passed around a ring of ``size`` ranks, each rank's chunk attended to
    when it arrives (``kv_bytes`` a chunk's keys and values, ``chunk_flops`` the queries' attention over one chunk),
    against all of them gathered first, then attended to."""
    piece_s = chunk_flops / c.flops_per_s + c.matmul_call_s
    send = c.send_s(kv_bytes)
    ring = compute_after_receive(piece_s + c.busy_s(send), send, size - 1, True)
    gathered = c.collective_s("all_gather", kv_bytes * size, size) + size * piece_s
    return ring < gathered


# --- the sites: the pass of the collective priced, plus what the chunks add to the other pass -------------------


def gather_pays(c: Costs, size: int, nbytes: int, linears: Linears) -> bool:
    """all_gather -> matmuls: the local chunk's matmuls, then each peer's as it arrives."""
    whole = compute_after_receive(linears.piece_s(c, 1), c.collective_s("all_gather", nbytes, size), 1, False)
    send = c.send_s(nbytes / size)
    pieces = compute_after_receive(linears.piece_s(c, size) + c.busy_s(send), send, size - 1, True)
    return pieces + linears.backward_extra_s(c, size) < whole


def scatter_pays(c: Costs, size: int, nbytes: int, linears: Linears) -> bool:
    """matmul -> reduce_scatter: each peer's rows computed and sent, this rank's own last."""
    whole = send_after_compute(linears.piece_s(c, 1), c.collective_s("reduce_scatter", nbytes, size), 1)
    piece, send = linears.piece_s(c, size), c.send_s(nbytes / size)
    pieces = send_after_compute(piece + c.busy_s(send), send, size - 1, tail_s=piece)
    return pieces + linears.backward_extra_s(c, size) < whole


def reduce_chunks(c: Costs, size: int, nbytes: int, linears: Linears, *, backward: bool, at_least_two: bool) -> int:
    """Chunks of tokens for matmul -> all_reduce (1: not decomposed): the count that finishes first, or 1 where none
    beats the whole. ``backward``: the all_reduce of the linears' input grad, whose undecomposed form already hides
    behind their weight grads (computed after it); its forward pays the chunks' matmuls."""

    def total(k: int) -> float:
        comm = c.collective_s("all_reduce", nbytes / k, size)
        busy = c.busy_s(comm) if k > 1 else 0.0  # what the transfers overlapping a piece take from it
        if not backward:
            piece = linears.piece_s(c, k) + busy
            return send_after_compute(piece, comm, k) - busy + linears.backward_extra_s(c, k)
        transposed = Linears(linears.rows, tuple((n, k_in) for k_in, n in linears.shapes))
        forward_extra = k * linears.piece_s(c, k) - linears.piece_s(c, 1)
        piece = transposed.piece_s(c, k) + busy
        return send_after_compute(piece, comm, k, linears.weight_grads_s(c, k)) + forward_extra

    counts = [k for k in range(2, MAX_CHUNKS + 1) if linears.rows % k == 0 and linears.rows // k >= MIN_CHUNK_ROWS]
    if not counts:
        return 1
    best = min(counts, key=total)
    return best if at_least_two or total(best) < total(1) else 1
