"""thunder_tp keeps each Thunder symbol's meta signature (thunder_internals/signatures.py): the signatures are
``inspect.signature``'s, and the traces Thunder's."""

import inspect
import re

import pytest
import thunder
import thunder.core.prims as prims
import thunder.torch as ltorch
import torch
import torch.nn.functional as F
from thunder.core.symbol import Symbol

from thunder_tp.thunder_internals import signatures

pytestmark = pytest.mark.usefixtures("speedups_applied")  # Thunder's speed-ups in this module's jits


def _symbols() -> list[Symbol]:
    found = {id(s): s for module in (ltorch, prims) for s in vars(module).values()
             if isinstance(s, Symbol) and s.meta is not None}
    return list(found.values())


def test_every_kept_signature_is_inspects():
    symbols = _symbols()
    assert len(symbols) > 300, len(symbols)
    for symbol in symbols:
        kept = signatures.meta_signature(symbol.meta)
        assert kept == inspect.signature(symbol.meta), symbol.name
        assert signatures.meta_signature(symbol.meta) is kept, symbol.name  # computed once


def _program(x, w):
    y = F.linear(x, w).view(-1, 4).sum(dim=1, keepdim=True)
    z = torch.softmax(x, -1) + torch.where(x > 0, x, 0.5) * y
    return torch.cat([z, F.gelu(z, approximate="tanh")], 1).sum(0)


def _traces(jf) -> str:
    text = "\n".join(str(t) for t in (*thunder.last_traces(jf), *thunder.last_backward_traces(jf)))
    return re.sub(r"\(took \d+ milliseconds\)", "", text)


def test_the_traces_are_thunders(monkeypatch):
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    traces = []
    for normalize in (signatures.normalize, signatures._thunder_normalize):
        monkeypatch.setattr(Symbol, "normalize", normalize)
        jf = thunder.jit(_program)
        jf(x, w).sum().backward()
        traces.append(_traces(jf))
    assert traces[0] == traces[1]
