"""A model's repeated blocks traced once: the first of each kind interpreted, the others appended again.

Interpreting a model is Thunder's largest cost per layer (about 5 s of CPU for a litgpt block on this project's
machine), and the blocks of a transformer are the same code on parameters of the same shapes. So, in a program
jitted with thunder_tp's executors, a call of a *repeated block* (a module with children, one of at least two of its
class in a ModuleList, ModuleDict or Sequential of the jitted model) is traced once per *kind*
(`block_keys.block_key`: everything its call can observe: its structure, every attribute of every submodule by value,
its hooks and what they close over, the code it runs and the globals that code names, grad mode and autocast, the
call's arguments). The first call of a kind is interpreted and its bound symbols recorded; the second is interpreted
too and must give the same program up to names (a block whose behaviour the key does not capture is then interpreted
every time); every later call is not interpreted: the recorded symbols are appended again with its own parameters,
buffers and arguments swapped in and fresh names. A kind checked so in one trace is not checked again in a later
trace of the process (a retrace under no_grad, another model of the same blocks: the same key): there the first call
alone is interpreted (`VERIFIED_KINDS`: a key equals no later one once an object it holds by identity is gone).

The trace that results is the one interpretation gives, so everything after it (TensorParallel, autodiff, fusion,
DDP/FSDP, checkpoints, generation, the trace dumps) is as before. What a replayed block's interpretation would
have added to the prologue is its tensors' unpacking and checks (kept: they are read by an interpreted function),
not checks of its Python attributes (a block's attribute changed after the first call goes unnoticed).

On by default with thunder_tp's executors (with the comm executor among them); `thunder.jit(...,
compile_once=False)` turns it off (and the sharing of compiled regions, `tracing/region_cache.py`), `=True` on
with any executors.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from thunder.core.compile_data import get_compile_data
from thunder.core.proxies import Proxy, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, get_tracectx

from thunder_tp.collectives import comm_executor
from thunder_tp.thunder_internals import replay
from thunder_tp.tracing.block_keys import block_key
from thunder_tp.tracing.region_cache import canonical_form, compile_once_option

__all__ = ["VERIFIED_KINDS", "TraceStats", "repeated_blocks", "stats_of"]

#: what a replayed block's output may hold besides proxies
_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass
class _Recording:
    """A kind's first call: its inputs (the call's tensors, then the block's tensors `names`), its bound symbols,
    its output (proxies and constants), and the program's form up to names."""

    inputs: tuple[Proxy, ...]
    names: tuple[tuple[str, str], ...]
    bsyms: tuple[BoundSymbol, ...]
    output: Any
    form: Hashable
    verified: bool = False


@dataclass
class TraceStats:
    """Per trace: the calls of repeated blocks interpreted, and replayed."""

    interpreted: int = 0
    replayed: int = 0


@dataclass
class _TraceState:
    recordings: dict[Hashable, _Recording | None]
    stats: TraceStats


_states: weakref.WeakKeyDictionary[TraceCtx, _TraceState] = weakref.WeakKeyDictionary()
_repeated: weakref.WeakKeyDictionary[nn.Module, frozenset[int]] = weakref.WeakKeyDictionary()
_latest: weakref.WeakKeyDictionary[nn.Module, TraceStats] = weakref.WeakKeyDictionary()
#: process-wide: the kinds (`block_keys.block_key`) whose second call gave the first's program, in any trace;
#: `VERIFIED_KINDS.clear()` has every kind checked again
VERIFIED_KINDS: set[Hashable] = set()


def stats_of(model: nn.Module) -> TraceStats:
    """How many calls of repeated blocks the latest interpretation of `model` (the module given to thunder.jit)
    interpreted and replayed."""
    return _latest.get(model, TraceStats())


def repeated_blocks(root: nn.Module) -> frozenset[int]:
    """The ids of `root`'s repeated blocks: modules with children, at least two of their class in one container."""
    if root not in _repeated:
        found: set[int] = set()
        for container in root.modules():
            if isinstance(container, _CONTAINERS):
                children = [m for m in container.children() if next(m.children(), None) is not None]
                classes = [type(m) for m in children]
                found.update(id(m) for m in children if classes.count(type(m)) > 1)
        _repeated[root] = frozenset(found)
    return _repeated[root]


def _tensors(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    return ([("_parameters", n, p) for n, p in module.named_parameters()]
            + [("_buffers", n, b) for n, b in module.named_buffers()])


def _enabled() -> bool:
    option = compile_once_option()
    if option is not None:
        return option
    cd = get_compile_data()
    return cd is not None and comm_executor in cd.executors_list


def _module_call(module, args: tuple, kwargs: dict):
    """A module call of a jitted program: a repeated block's traced once per kind, any other interpreted."""
    m, cd = replay.unwrap(module), get_compile_data()
    root = getattr(cd, "fn", None)
    if not (isinstance(root, nn.Module) and _enabled() and id(m) in repeated_blocks(root)):
        return replay.interpret_module_call(module, args, kwargs)
    key = block_key(m, *replay.unwrapped_call(args, kwargs))
    trace = get_tracectx()
    if trace not in _states:
        _states[trace] = _TraceState({}, TraceStats())
        _latest[root] = _states[trace].stats
    state = _states[trace]
    recording = state.recordings.get(key)
    if key is None or (key in state.recordings and recording is None):
        state.stats.interpreted += 1
        return replay.interpret_module_call(module, args, kwargs)
    if recording is not None and recording.verified:
        state.stats.replayed += 1
        return _replayed(recording, module, args, kwargs)
    state.stats.interpreted += 1
    result, new = _record(m, module, args, kwargs)
    state.recordings[key] = _checked(recording, new, key)
    return result


def _record(m: nn.Module, module, args: tuple, kwargs: dict) -> tuple[Any, _Recording | None]:
    """The call interpreted, and its recording (None if it reads a value that is neither an argument nor the
    block's own, or returns what a replay could not wrap)."""
    names = tuple((kind, name) for kind, name, _ in _tensors(m))
    owned = replay.module_tensors(module, names)
    result, bsyms = replay.recorded(lambda: replay.interpret_module_call(module, args, kwargs))
    arguments = [t for t in tree_flatten(replay.unwrapped_call(args, kwargs))[0] if isinstance(t, Proxy)]
    inputs = (*arguments, *owned)
    output = replay.unwrap(result)
    if not _replayable(bsyms, inputs, output):
        return result, None
    return result, _Recording(inputs, names, tuple(bsyms), output, canonical_form(bsyms, inputs, output))


def _replayable(bsyms: list[BoundSymbol], inputs: tuple, output: Any) -> bool:
    known, produced = {p.name for p in inputs}, set()
    for b in bsyms:
        if any(p.name not in known and p.name not in produced for p in b.flat_proxy_args):
            return False
        produced.update(p.name for p in b.flat_proxy_outs)
    items = output if isinstance(output, tuple) else (output,)
    return all(isinstance(x, Proxy) or isinstance(x, _CONSTANTS) for x in items)


def _checked(first: _Recording | None, new: _Recording | None, kind: Hashable) -> _Recording | None:
    """The kind's recording after a call interpreted: the first call's (verified at once if an earlier trace
    verified its kind), or the first verified by the second if they gave the same program; None (interpret every
    call) if not."""
    if first is None:
        if new is not None and kind in VERIFIED_KINDS:
            new.verified = True
        return new
    if new is None or new.form != first.form:
        return None
    first.verified = True
    VERIFIED_KINDS.add(kind)
    return first


def _replayed(recording: _Recording, module, args: tuple, kwargs: dict):
    """The recording's bound symbols appended with this call's tensors; its output, wrapped."""
    owned = replay.module_tensors(module, recording.names)
    arguments = [t for t in tree_flatten(replay.unwrapped_call(args, kwargs))[0] if isinstance(t, Proxy)]
    swap = {variableify(old): new for old, new in zip(recording.inputs, (*arguments, *owned), strict=True)}
    replay.append_replayed(recording.bsyms, swap)
    output = recording.output
    swapped = tuple(swap.get(variableify(x), x) if isinstance(x, Proxy) else x for x in output) \
        if isinstance(output, tuple) else swap[variableify(output)]
    return replay.opaque(swapped, module, (*args, *kwargs.values()))


replay.set_module_call_handler(_module_call)
