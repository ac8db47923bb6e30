"""Communication hidden behind compute: a TP collective decomposed into pieces, each overlapped with the matmul of
another piece (Wang et al., ASPLOS 2023, "Overlap communication with dependent computation via decomposition";
JAX's collective matmul).

A pass on the local program, after the rewrite and before Thunder's autograd:

- all_gather -> matmuls (SP into column-parallel linears: ``tp_gather_to_tp`` read by linears only): this rank's
  chunk's matmuls at once; each peer's chunk by a shift (``collectives/shift.py``), its matmuls as it arrives; the
  outputs concatenated in rank order;
- matmul -> reduce_scatter (a row-parallel linear into SP): each peer's rows computed and shifted to it one after
  another, this rank's own rows last, the received partial sums added;
- matmul -> all_reduce (a row-parallel linear without SP): k chunks of tokens, chunk i all-reduced while chunk i + 1
  computes;
- copy into the TP region -> matmuls (column-parallel linears without SP: ``tp_copy_to_tp``): k chunks of tokens
  with a copy each, so the backward all-reduces each chunk's input grad after its matmuls.

Every piece is a symbol whose grad is its conjugate, so Thunder's autograd decomposes the backward as well: the
reduce_scatter of an input grad (the forward all_gather's conjugate) into a shift after each chunk's matmul, the
all_gather of an output grad (the forward reduce_scatter's conjugate) into a shift before each chunk's matmuls, the
input grad's all_reduce into chunks. The waits go as late as data allows (Thunder's wait sorting, then
``schedule.py``), so a piece is waited for just before its matmul.

``mode``: "auto" decomposes a site where ``overlap_cost`` says it pays, "always" wherever the shapes allow (tests),
"never" nowhere; an ``overlap_cost.Costs`` is "auto" priced with its link and matmul rate (another machine's).
Every rank must decompose alike (a rank that shifts pieces its peer all-reduces waits forever), so the decisions read
only what every rank knows alike: the bytes of the communicated tensor and the tokens are the same on every rank, and
each linear is priced at its weight's largest piece over the ranks, never at this rank's own (where the TP size
divides no head count, ranks hold weights of different widths); a weight that is not an input of the program (whose
pieces are not known) leaves its site undecomposed.
Never in a simulation (one trace runs for every rank there, and a shift's order is the rank's), nor under symbolic
values (shapes must be known), nor on fewer than ``MIN_CHUNK_ROWS`` rows a chunk, nor on one token a sequence (a
decode step).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import thunder.torch as ltorch
from thunder.core.compile_data import using_symbolic_values
from thunder.core.dtypes import to_torch_dtype
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from thunder_tp import collectives as C
from thunder_tp.collectives.labels import label_collectives, label_of
from thunder_tp.collectives.packing import is_plain
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.execution import overlap_cost as cost
from thunder_tp.layouts import Layout, TPGroup, largest_piece
from thunder_tp.thunder_internals.grad_mode import in_grad_mode_of

Mode = Literal["auto", "always", "never"] | cost.Costs
MODES: tuple[str, ...] = ("auto", "always", "never")

__all__ = ["MODES", "Mode", "decompose_for_overlap"]


@dataclass(frozen=True)
class _Site:
    """A collective and its matmuls, replaced by ``emit(*inputs)`` where ``anchor`` was; its results replace
    ``outputs``."""

    anchor: BoundSymbol
    replaced: tuple[BoundSymbol, ...]
    inputs: tuple
    outputs: tuple[TensorProxy, ...]
    emit: Callable[..., list[TensorProxy]]


def decompose_for_overlap(trace: TraceCtx, tp: TPGroup, mode: Mode,
                          inputs: Mapping[str, tuple[tuple[int, ...], Layout]]) -> TraceCtx:
    """``trace`` (the local program) with each collective that pays (``mode``) decomposed with its matmuls;
    ``inputs``: the full shape and layout of each of its inputs (proxy name), whence each weight's largest piece."""
    if mode == "never" or tp.size == 1 or ranks_of(tp.group).one_trace_for_all or using_symbolic_values():
        return trace
    sites = _Finder(trace, tp, mode, inputs).sites()
    if not sites:
        return trace
    at = {id(site.anchor): site for site in sites}
    dropped = {id(b) for site in sites for b in site.replaced}
    decomposed = from_trace(trace)
    swap: dict = {}
    with tracectx(decomposed):
        for bsym in trace.bound_symbols:
            site = at.get(id(bsym))
            if site is not None:
                start = len(decomposed.bound_symbols)
                with in_grad_mode_of(site.replaced):  # the pieces of a no-grad matmul are no-grad too
                    results = site.emit(*(swap.get(variableify(a), a) for a in site.inputs))
                _label_pieces(decomposed.bound_symbols[start:], site)
                swap.update((variableify(old), new) for old, new in zip(site.outputs, results, strict=True))
            if id(bsym) not in dropped:
                decomposed.bound_symbols.append(bsym.from_bsym_swap_proxies(swap) if swap else bsym)
    decomposed.set_provenance(TraceProvenance("thunder_tp: collectives decomposed for overlap"))
    return decomposed


def _label_pieces(pieces: list[BoundSymbol], site: _Site) -> None:
    """The collectives a decomposition emitted labelled as the collective they replace (its module and role)."""
    label = next(filter(None, map(label_of, site.replaced)), None)
    if label is not None:
        label_collectives(pieces, label)


# --- finding the sites ------------------------------------------------------------------------------------------


def _linear_operands(bsym: BoundSymbol) -> tuple[TensorProxy, TensorProxy, TensorProxy | None] | None:
    """(input, weight, bias) of a linear of a 2-D weight, None for any other bound symbol."""
    if bsym.sym.id != ltorch.linear.id or bsym.kwargs or len(bsym.args) != 3:
        return None
    a, w, b = bsym.args
    tensors = all(isinstance(t, TensorProxy) for t in (a, w)) and (b is None or isinstance(b, TensorProxy))
    return (a, w, b) if tensors and w.ndim == 2 else None


def _rows(t: TensorProxy) -> int:
    return math.prod(int(d) for d in t.shape[:-1])


def _too_few_rows(t: TensorProxy, pieces: int) -> bool:
    """Fewer than MIN_CHUNK_ROWS rows a piece, or one token a sequence (a decode step: never decomposed)."""
    return _rows(t) < pieces * cost.MIN_CHUNK_ROWS or (t.ndim >= 3 and int(t.shape[-2]) == 1)


def _nbytes(t: TensorProxy) -> int:
    return math.prod(int(d) for d in t.shape) * t.dtype.bytes


class _Finder:
    """The sites of a local program, priced alike on every rank."""

    def __init__(self, trace: TraceCtx, tp: TPGroup, mode: Mode, inputs: Mapping[str, tuple[tuple[int, ...], Layout]]):
        self.tp = tp
        self.inputs = inputs
        self.given = mode if isinstance(mode, cost.Costs) else None
        self.mode = "auto" if self.given is not None else mode
        self.bsyms = trace.bound_symbols
        self.position = {id(b): i for i, b in enumerate(self.bsyms)}
        self.produced_at = {o.name: i for i, b in enumerate(self.bsyms) for o in b.flat_proxy_outs}
        self.consumers: dict[str, list[BoundSymbol]] = {}
        for b in self.bsyms:
            for name in dict.fromkeys(a.name for a in b.flat_proxy_args):
                self.consumers.setdefault(name, []).append(b)

    def sites(self) -> list[_Site]:
        finders = {C.tp_gather_to_tp.id: self._gather, C.tp_copy_to_tp.id: self._copy,
                   C.tp_reduce_scatter.id: self._scatter, C.tp_reduce_from_tp.id: self._reduce}
        sites, taken = [], set()
        for site in (finders[b.sym.id](b) for b in self.bsyms if b.sym.id in finders):
            if site is not None and not taken & {id(b) for b in site.replaced}:
                sites.append(site)
                taken |= {id(b) for b in site.replaced}
        return sites

    def _matmuls(self, x: TensorProxy, linears: list[BoundSymbol]) -> cost.Linears | None:
        """The rows of ``x`` through each linear's weight at its largest piece over the ranks; None if a weight is not
        an input of the program (its pieces unknown)."""
        weights = [self.inputs.get(b.args[1].name) for b in linears]
        if None in weights:
            return None
        shapes = [largest_piece(shape, layout, self.tp.size) for shape, layout in weights]
        return cost.Linears(_rows(x), tuple((k, n) for n, k in shapes))

    def _costs(self, t: TensorProxy) -> cost.Costs:
        return self.given or cost.costs_for(self.tp.group, t.device.type, to_torch_dtype(t.dtype))

    def _sole_consumer(self, t: TensorProxy) -> BoundSymbol | None:
        readers = self.consumers.get(t.name, [])
        return readers[0] if len(readers) == 1 else None

    def _linears_reading(self, t: TensorProxy) -> list[BoundSymbol] | None:
        """The linears that read ``t`` as their input, if nothing else reads it and their weights and biases exist
        before the first of them."""
        readers = self.consumers.get(t.name, [])
        operands = [_linear_operands(b) for b in readers]
        if not readers or any(o is None or o[0].name != t.name for o in operands):
            return None
        first = self.position[id(readers[0])]
        others = [p for o in operands for p in o[1:] if p is not None]
        if any(p.name == t.name or self.produced_at.get(p.name, -1) >= first for p in others):
            return None
        return readers

    def _gather(self, g: BoundSymbol) -> _Site | None:
        x, dim, pieces, group = g.args
        out, n = g.output, self.tp.size
        dim %= out.ndim
        linears = self._linears_reading(out)
        if linears is None or not is_plain(pieces) or dim == out.ndim - 1 or _too_few_rows(out, n):
            return None
        matmuls = self._matmuls(out, linears)
        if matmuls is None:
            return None
        if self.mode == "auto" and not cost.gather_pays(self._costs(out), n, _nbytes(out), matmuls):
            return None
        emit = functools.partial(_gathered_matmuls, dim=dim, group=group, rank=self.tp.rank, size=n)
        inputs = (x, *(p for b in linears for p in b.args[1:]))
        return _Site(linears[0], (g, *linears), inputs, tuple(b.output for b in linears), emit)

    def _scatter(self, r: BoundSymbol) -> _Site | None:
        y, dim, pieces, group = r.args
        linear, n = self._producer(y), self.tp.size
        operands = None if linear is None else _linear_operands(linear)
        dim %= y.ndim
        if operands is None or operands[2] is not None or self._sole_consumer(y) is not r or not is_plain(pieces):
            return None
        if dim == y.ndim - 1 or int(y.shape[dim]) % n or _too_few_rows(y, n):
            return None
        h, w, _ = operands
        matmuls = self._matmuls(h, [linear])
        if matmuls is None:
            return None
        if self.mode == "auto" and not cost.scatter_pays(self._costs(y), n, _nbytes(y), matmuls):
            return None
        emit = functools.partial(_matmul_scattered, dim=dim, group=group, rank=self.tp.rank, size=n)
        return _Site(r, (linear, r), (h, w), (r.output,), emit)

    def _reduce(self, r: BoundSymbol) -> _Site | None:
        y, group = r.args
        linear = self._producer(y)
        operands = None if linear is None else _linear_operands(linear)
        if operands is None or operands[2] is not None or self._sole_consumer(y) is not r:
            return None
        h, w, _ = operands
        chunks = self._chunks(y, self._matmuls(h, [linear]), backward=False)
        if chunks == 1:
            return None
        emit = functools.partial(_matmul_reduced, group=group, chunks=chunks)
        return _Site(r, (linear, r), (h, w), (r.output,), emit)

    def _copy(self, copy: BoundSymbol) -> _Site | None:
        x, group = copy.args
        linears = self._linears_reading(copy.output)
        if linears is None:
            return None
        chunks = self._chunks(x, self._matmuls(x, linears), backward=True)
        if chunks == 1:
            return None
        emit = functools.partial(_copied_matmuls, group=group, chunks=chunks)
        inputs = (x, *(p for b in linears for p in b.args[1:]))
        return _Site(linears[0], (copy, *linears), inputs, tuple(b.output for b in linears), emit)

    def _producer(self, t: TensorProxy) -> BoundSymbol | None:
        at = self.produced_at.get(t.name)
        return None if at is None else self.bsyms[at]

    def _chunks(self, t: TensorProxy, linears: cost.Linears | None, *, backward: bool) -> int:
        if linears is None or _too_few_rows(t, 2):
            return 1
        return cost.reduce_chunks(self._costs(t), self.tp.size, _nbytes(t), linears, backward=backward,
                                  at_least_two=self.mode == "always")


# --- the decompositions (called inside the new trace's context) ---------------------------------------------------


def _pairs(operands: tuple) -> list[tuple]:
    """(weight, bias) of each linear from the flat operands."""
    return [tuple(operands[i : i + 2]) for i in range(0, len(operands), 2)]


def _gathered_matmuls(x: TensorProxy, *operands, dim: int, group, rank: int, size: int) -> list[TensorProxy]:
    """all_gather(x) -> each linear: this rank's chunk first, then rank - s's, s = 1, 2, ... as they arrive."""
    chunks = {rank: x} | {(rank - s) % size: C.tp_shift(x, s, group) for s in range(1, size)}
    arrival = [(rank - s) % size for s in range(size)]
    outs: list[dict] = [{} for _ in _pairs(operands)]
    for held in arrival:
        for out, (w, b) in zip(outs, _pairs(operands), strict=True):
            out[held] = ltorch.linear(chunks[held], w, b)
    return [ltorch.cat([out[r] for r in range(size)], dim) for out in outs]


def _matmul_scattered(h: TensorProxy, w: TensorProxy, *, dim: int, group, rank: int, size: int) -> list[TensorProxy]:
    """reduce_scatter(linear(h, w)): rank + s's rows computed and shifted to it, s = 1, 2, ..., this rank's last."""
    rows = ltorch.split(h, int(h.shape[dim]) // size, dim)
    received = [C.tp_shift(ltorch.linear(rows[(rank + s) % size], w, None), s, group) for s in range(1, size)]
    total = ltorch.linear(rows[rank], w, None)
    for partial in received:
        total = ltorch.add(total, partial)
    return [total]


def _token_chunks(x: TensorProxy, chunks: int) -> tuple[TensorProxy, ...]:
    rows = ltorch.reshape(x, (_rows(x), int(x.shape[-1])))
    return ltorch.split(rows, _rows(x) // chunks, 0)


def _joined(pieces: list[TensorProxy], like: tuple[int, ...]) -> TensorProxy:
    return ltorch.reshape(ltorch.cat(pieces, 0), like)


def _matmul_reduced(h: TensorProxy, w: TensorProxy, *, group, chunks: int) -> list[TensorProxy]:
    """all_reduce(linear(h, w)) in chunks of tokens, each reduced while the next computes."""
    shape = (*(int(d) for d in h.shape[:-1]), int(w.shape[0]))
    reduced = [C.tp_reduce_from_tp(ltorch.linear(piece, w, None), group) for piece in _token_chunks(h, chunks)]
    return [_joined(reduced, shape)]


def _copied_matmuls(x: TensorProxy, *operands, group, chunks: int) -> list[TensorProxy]:
    """copy_to_tp(x) -> each linear, in chunks of tokens: the backward all-reduces each chunk's input grad."""
    pairs = _pairs(operands)
    outs: list[list[TensorProxy]] = [[] for _ in pairs]
    for piece in _token_chunks(x, chunks):
        copy = C.tp_copy_to_tp(piece, group)
        for out, (w, b) in zip(outs, pairs, strict=True):
            out.append(ltorch.linear(copy, w, b))
    lead = tuple(int(d) for d in x.shape[:-1])
    return [_joined(out, (*lead, int(w.shape[0]))) for out, (w, _) in zip(outs, pairs, strict=True)]
