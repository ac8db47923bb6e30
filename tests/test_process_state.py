"""State on objects, not in process globals: run modes nest, and no model or jit gets another's state, not even
through an object allocated at a dead one's id (docs/design.md, "Process-wide state")."""

from __future__ import annotations

import gc
import weakref

import thunder
import torch
import torch.nn as nn

from thunder_tp.execution.region_cache import CompiledRegions
from thunder_tp.run_mode import RankAlone, fake_group_on, simulated_ranks, simulated_world
from thunder_tp.thunder_internals.private import interpretations_kept, reuse_interpretation


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
