"""State on objects, not in process globals: run modes nest, and no model or jit gets another's state, not even
through an object allocated at a dead one's id (docs/design.md, "Process-wide state")."""

from __future__ import annotations

import gc
import weakref

import pytest
import thunder
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.tp_checks import FAST_EXECUTORS
from thunder_tp.collectives.run_mode import RankAlone, fake_group_on, simulated_ranks, simulated_world
from thunder_tp.thunder_internals.private import interpretations_kept, reuse_interpretation
from thunder_tp.tracing import block_keys, repeated_blocks
from thunder_tp.tracing.region_cache import CompiledRegions
from thunder_tp.tracing.repeated_blocks import TraceStats, stats_of


@pytest.fixture(autouse=True)
def _fresh_verified_kinds(monkeypatch):
    assert not dist.is_initialized(), "these tests run in this process alone"
    monkeypatch.setattr(repeated_blocks, "VERIFIED_KINDS", set())


class _Token:
    """An object a key holds by identity (no attributes to key by value)."""

    __slots__ = ("__weakref__",)


def _at_id(address: int, make):
    """An object `make()` allocates at `address` (a dead object's id); skips the test if none is."""
    made = [make() for _ in range(1000)]
    found = next((m for m in made if id(m) == address), None)
    if found is None:
        pytest.skip("no new object took the dead one's id")
    return found


def test_run_modes_nest():
    """An inner simulation or fake group's device ends with its context: the outer one is back, then none."""
    with simulated_ranks(4, "outer"):
        with simulated_ranks(2, "inner"):
            assert simulated_world().world_size == 2
        assert simulated_world().world_size == 4
    assert simulated_world() is None
    with fake_group_on(torch.device("meta")):
        with fake_group_on(torch.device("cpu", 1)):
            assert RankAlone().device == torch.device("cpu", 1)
        assert RankAlone().device == torch.device("meta")
    assert RankAlone().device == torch.device("cpu")


def test_a_key_by_identity_matches_no_object_allocated_at_a_dead_ones_id():
    """Two blocks holding one token are one kind; a token at a dead token's id is another kind."""
    block = nn.Linear(2, 2)
    token = _Token()
    address, key = id(token), block_keys._Keys(block).of(token)
    assert block_keys._Keys(block).of(token) == key
    del token
    gc.collect()
    assert block_keys._Keys(block).of(_at_id(address, _Token)) != key


class _Holding(nn.Module):
    """A block holding a token it does not read."""

    def __init__(self, token: _Token):
        super().__init__()
        self.linear, self.token = nn.Linear(8, 8), token

    def forward(self, x):
        return self.linear(x)


def _stats(token: _Token) -> TraceStats:
    model = nn.Sequential(*(_Holding(token) for _ in range(3)))
    x = torch.randn(2, 8)
    torch.testing.assert_close(thunder.jit(model, executors=FAST_EXECUTORS, compile_once=True)(x), model(x))
    return stats_of(model)


def test_a_second_model_does_not_inherit_a_dead_objects_checked_kind():
    """A kind checked in one model's trace: a second model's blocks holding the same token replay it at once; blocks
    holding a token allocated at the dead token's id are checked again."""
    token = _Token()
    assert _stats(token) == TraceStats(interpreted=2, replayed=1)
    assert _stats(token) == TraceStats(interpreted=1, replayed=2)
    address = id(token)
    del token
    gc.collect()
    assert _stats(_at_id(address, _Token)) == TraceStats(interpreted=2, replayed=1)


class _Relu(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x))


def _interpretation(model: nn.Module, x: torch.Tensor):
    with interpretations_kept() as kept:
        thunder.jit(model)(x)
    return kept[-1]


def test_an_interpretation_kept_for_one_jit_is_no_other_jits():
    """The interpretation a jit's next compile starts from: another jit of the module interprets its own, the jit
    it was kept for starts from it."""
    model, x = _Relu(), torch.randn(2, 8)
    kept = _interpretation(model, x)
    mine, other = thunder.jit(model), thunder.jit(model)
    reuse_interpretation(mine, kept)
    other(x)
    assert not kept.reused
    torch.testing.assert_close(mine(x), model(x))
    assert kept.reused


def test_an_interpretation_kept_for_a_jit_goes_with_it():
    """An interpretation kept for a jit that is dropped before compiling: nothing keeps it, nor the module its
    traces hold (so no module allocated at that id later can be given it)."""
    model, x = _Relu(), torch.randn(2, 8)
    reuse_interpretation(thunder.jit(model), _interpretation(model, x))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_compiled_regions_clear():
    """A cleared cache makes each value again and counts from zero."""
    regions = CompiledRegions()
    assert regions.get("form", object) is regions.get("form", object) and regions.compiles == 1
    first = regions.get("form", object)
    regions.clear()
    assert len(regions) == 0 and regions.compiles == 0
    assert regions.get("form", object) is not first and regions.compiles == 1
