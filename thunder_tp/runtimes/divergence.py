"""Nothing silent: the ranks of a TP group were handed the same inputs, shard the same weights, and hold the same
replicated tensors.

Inputs. A TP-jitted module computes one program over the ranks of its TP group, from inputs that every rank must
hold whole and alike. Handed a different batch on each rank (a data loader that shards by the world's rank, where
it should shard by the data-parallel group), it still runs: the vocab-parallel embedding looks each rank's own ids
up in its part of the vocabulary and sums, and every rank returns the same, wrong, logits. So before every training
call (autograd on) and the first call without autograd, by default, the ranks all-gather a fingerprint of the
call's inputs (the structure, each tensor's shape and dtype, a checksum of its bytes) and every rank raises if they
differ: two integers per rank in one all_gather, before anything else of the call runs, so no rank is left waiting
in a collective.

Weights. Each rank shards the full weights it holds; ranks that built their models from different seeds would
each compute with its piece of a different model, and nothing would say so. So each rank takes a checksum of every
full parameter where it sees it whole (at jit; a meta-device parameter where it is handed in full, by
MaterializationTransform or `load_original_state_dict`; a checkpoint loaded since replaces them all alike), and the
compile agreement (`runtimes/agreement.py`) compares their combination at the end of every compile, the first
call's included: `SameWeights`.

Replicated tensors. Replicated parameters stay equal across the TP group as long as every rank applies the same
update; a checkpoint save checks that they do (each replicated tensor's checksum, each chunk that several ranks hold
compared among its holders) and refuses to write one rank's copy for all when they differ. `check_same_tensors`
compares whole tensors (ThunderTPStrategy's setup: the full parameters every rank shards from).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from thunder.core.trace import TraceCtx

from thunder_tp.layouts import Layout, Shard, held_chunks
from thunder_tp.pieces import piece_parts
from thunder_tp.runtimes.agreement import gathered, ranks_alike
from thunder_tp.thunder_internals.private import wrap_module_call
from thunder_tp.thunder_internals.torch_pytree import tree_flatten

_MODULUS = (1 << 61) - 1  # a Mersenne prime: checksums stay exact int64s
_CHUNK = 1 << 16  # words per step of a checksum (a cache-sized temporary: 4x faster than 1 << 20 on a CPU)


def checksum(t: torch.Tensor) -> int:
    """A position-weighted sum of a tensor's bytes (as 32-bit words where they divide evenly), chunk by chunk: equal
    for equal tensors, and different for different ones but by a rare coincidence. One host sync per chunk."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    aligned = data.numel() % 4 == 0 and data.storage_offset() % 4 == 0
    words = data.view(torch.int32) if aligned else data
    weights = _position_weights(words.device)
    parts = (words[start : start + _CHUNK] for start in range(0, words.numel(), _CHUNK))
    return combined(int((part * weights[: part.numel()]).sum()) for part in parts)


def combined(values: Iterable[int]) -> int:
    """One checksum of several, in their order (each below 2^63)."""
    total = 0
    for value in values:
        total = (total * 1_000_003 + value) % _MODULUS
    return total


@functools.cache
def _position_weights(device: torch.device) -> torch.Tensor:
    """The int64 weight of each position of a chunk: a chunk's weighted sum is exact in int64 (2^16 products of a
    word below 2^31 by a weight below 2^16)."""
    return torch.arange(_CHUNK, device=device, dtype=torch.int64) % 65521 + 2


def fingerprint(args: tuple, kwargs: Mapping[str, Any]) -> list[int]:
    """[structure, data] of a call's inputs: a CRC of the pytree structure with every tensor's shape and dtype and
    every plain value, and a combination of the tensors' checksums."""
    leaves, spec = tree_flatten((args, dict(kwargs)))
    described = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            described.append(f"{tuple(x.shape)}:{x.dtype}")
        elif isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            described.append(repr(x))
        else:
            described.append(type(x).__qualname__)
    data = combined(checksum(x) for x in leaves if isinstance(x, torch.Tensor))
    return [zlib.crc32("|".join(described).encode()), data]


#: when the ranks of a TP group compare their inputs (TensorParallel's and ThunderTPStrategy's check_inputs)
CHECK_INPUTS = ("training", "every", "first", "never")


class InputAgreement:
    """The check that every rank of a TP group calls a jitted module with the same inputs.

    `when`: "training" (every call with autograd on, and the first call without: evaluation and generation are
    checked once), "every" call, or the "first" call only."""

    def __init__(self, group: dist.ProcessGroup, when: str = "training"):
        self.group = group
        self.when = when
        self.checked = False  # a call the first-call rule applies to was checked

    def install(self, model) -> None:
        """Check the inputs of `model`'s calls, as `when` says, before each runs."""
        wrap_module_call(model, self._checking)

    def _checking(self, forward: Callable) -> Callable:
        @functools.wraps(forward)
        def forward_checked(*args, **kwargs) -> Any:
            if self._due():
                self.check(args, kwargs)
            return forward(*args, **kwargs)

        return forward_checked

    def _due(self) -> bool:
        """Whether this call's inputs are compared."""
        if self.when == "every" or (self.when == "training" and torch.is_grad_enabled()):
            return True
        due, self.checked = not self.checked, True
        return due

    def check(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """Raise on every rank of the group if some rank's inputs differ from the others' (collective)."""
        every = gathered(fingerprint(args, kwargs), self.group, "the input check's all_gather")
        if all(f == every[0] for f in every):
            return
        ranks = dist.get_process_group_ranks(self.group)
        alike = ranks_alike(ranks, [tuple(v) for v in every])
        shapes = "their shapes or dtypes differ" if len({f[0] for f in every}) > 1 else "same shapes, different values"
        raise RuntimeError(
            f"thunder_tp: the ranks of a TP group (global ranks {ranks}) were handed different inputs ({shapes}; ranks "
            f"with equal inputs: {alike}). Every rank of a TP group computes one program over the same "
            "batch; a sampler or data loader that shards the data over the whole world (a DistributedSampler with the "
            "world's rank, litdata's StreamingDataset) hands each rank its own. Shard the data by the data-parallel "
            "group instead: DistributedSampler(dataset, num_replicas=mesh.dp, rank=mesh.dp_rank) with mesh = "
            "thunder_tp.init_mesh(...), or with Lightning Fabric the strategy thunder_tp.fabric.ThunderTPStrategy, "
            "whose setup_dataloaders does it."
        )


class SameWeights:
    """The compile agreement's check (`runtimes.agreement.Agreed`) that every rank of a TP group sharded the same full
    parameters (of those named `parameters`)."""

    def __init__(self, parameters: Iterable[str]):
        self.parameters = frozenset(parameters)
        self.checksums: dict[str, int] = {}

    def saw_whole(self, name: str, full: torch.Tensor) -> None:
        """Take the checksum of `full`, the whole value of `name` that this rank shards (a buffer's, or a meta
        tensor's, is not taken)."""
        if name in self.parameters and not full.is_meta:
            self.checksums[name] = checksum(full)

    def loaded(self, names: Iterable[str]) -> None:
        """Forget the values seen of parameters that a checkpoint (loaded by every rank) replaced."""
        for name in names:
            self.checksums.pop(name, None)

    def fingerprint(self, traces: Sequence[TraceCtx]) -> int:
        """The names and checksums, combined."""
        names = sorted(self.checksums)
        return combined([_crc(names), *(self.checksums[n] for n in names)])

    def raise_differences(self, traces: Sequence[TraceCtx], group: dist.ProcessGroup) -> None:
        """Raise on every rank, naming the parameters whose values differ among the ranks (collective)."""
        names = sorted(self.checksums)
        every = gathered([len(names), _crc(names)], group, "the weight check's all_gather")
        if any(values != every[0] for values in every):
            raise RuntimeError(
                f"thunder_tp: the ranks of a TP group (global ranks {dist.get_process_group_ranks(group)}) saw "
                f"different parameters whole ({len(names)} here): give every rank the same model, and load a "
                "checkpoint on every rank or on none"
            )
        check_same_tensors(self.checksums, group, "TensorParallel's weight check", _DIFFERENT_WEIGHTS)


_DIFFERENT_WEIGHTS = (
    "Each rank shards its own full weights, so the ranks would compute with pieces of different models. Seed every "
    "rank alike before building the model (e.g. torch.manual_seed(0)), or load the same checkpoint on every rank "
    "(thunder_tp.checkpoint.load); pass TensorParallel(..., check_weights=False) if the ranks shard from different "
    "sources on purpose. Nothing ran."
)


def _crc(names: list[str]) -> int:
    return zlib.crc32("|".join(names).encode())


def check_replicas(tensors: Mapping[str, tuple[torch.Tensor, Layout, tuple[int, ...]]], group: dist.ProcessGroup,
                   what: str) -> None:
    """Raise on every rank of the TP group if a replicated tensor, or a chunk that several ranks hold, differs among
    the ranks that hold it (collective). `tensors`: name -> (this rank's piece, its layout, the full shape)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return
    replicated = {name: x for name, x in sorted(tensors.items()) if _has_copies(x[1], size)}
    sums = [checksum(part) for t, layout, _ in replicated.values() for part in piece_parts(t, layout, rank, size)]
    every = gathered(sums, group) if sums else [[] for _ in range(size)]
    copies: dict[tuple[str, tuple[int, int] | None], set[int]] = {}
    for r, values in enumerate(every):
        keys = [(name, chunk) for name, (_, layout, shape) in replicated.items() for chunk in _chunks(shape, layout,
                                                                                                    r, size)]
        for key, value in zip(keys, values, strict=True):
            copies.setdefault(key, set()).add(value)
    differing = sorted({name for (name, _), values in copies.items() if len(values) > 1})
    if differing:
        ranks = dist.get_process_group_ranks(group)
        raise RuntimeError(
            f"thunder_tp: {what}: replicated tensors differ across the ranks of the TP group (global ranks {ranks}): "
            f"{differing[:6]}{'...' if len(differing) > 6 else ''}. Each rank would have its own copy of the model; "
            "the ranks updated them differently (a gradient clipped by each rank's own norm, as torch.nn.utils."
            "clip_grad_norm_ does on shards: use thunder_tp.clip_grad_norm_ or Fabric's clip_gradients with "
            "ThunderTPStrategy; or an optimizer step on some ranks only). Nothing was written."
        )


def check_same_tensors(checksums: Mapping[str, int], group: dist.ProcessGroup, what: str, cause: str) -> None:
    """Raise on every rank of `group` if a tensor's checksum (name -> checksum, the same names on every rank) differs
    among the ranks (collective: one all_gather of a checksum per tensor); the error names them and `cause`."""
    names = sorted(checksums)
    if dist.get_world_size(group) == 1 or not names:
        return
    every = gathered([checksums[n] for n in names], group, f"{what}'s all_gather")
    differing = [n for i, n in enumerate(names) if len({values[i] for values in every}) > 1]
    if differing:
        ranks = dist.get_process_group_ranks(group)
        alike = ranks_alike(ranks, [tuple(v) for v in every])
        raise RuntimeError(
            f"thunder_tp: {what}: {len(differing)} of {len(names)} tensors differ across the ranks (global ranks "
            f"with equal tensors: {alike}): {', '.join(differing[:6])}"
            f"{f' and {len(differing) - 6} more' if len(differing) > 6 else ''}. {cause}"
        )


def _has_copies(layout: Layout, size: int) -> bool:
    """Whether several of `size` ranks hold a copy of (some chunk of) a tensor of this layout."""
    if layout.owner(size) is not None:  # one rank holds it
        return False
    return not isinstance(layout, Shard) or layout.is_replicated


def _chunks(shape: tuple[int, ...], layout: Layout, rank: int, size: int) -> list[tuple[int, int] | None]:
    """The chunks of the full tensor (of `shape`) that `rank` holds (None: the whole tensor), in piece_parts'
    order."""
    if not isinstance(layout, Shard):
        return [None]
    return held_chunks(layout, shape[layout.dim], rank, size)
