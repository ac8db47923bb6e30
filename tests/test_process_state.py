"""State on objects, not in process globals: run modes nest, and no model or jit gets another's state, not even
through an object allocated at a dead one's id (docs/design.md, "Process-wide state")."""

from __future__ import annotations

import torch

from thunder_tp.execution.region_cache import CompiledRegions
from thunder_tp.run_mode import RankAlone, fake_group_on, simulated_ranks, simulated_world


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


def test_compiled_regions_clear():
    """A cleared cache makes each value again and counts from zero."""
    regions = CompiledRegions()
    assert regions.get("form", object) is regions.get("form", object) and regions.compiles == 1
    first = regions.get("form", object)
    regions.clear()
    assert len(regions) == 0 and regions.compiles == 0
    assert regions.get("form", object) is not first and regions.compiles == 1
