"""Thunder's compile (interpretation, transforms) runs with the young generation's collection threshold raised, and
leaves the thresholds as they were, after a compile that raises too."""

import gc

import pytest
import thunder
import torch
from thunder.core.transform_common import Transform

from thunder_tp.thunder_internals.collections_during_compile import COMPILE_THRESHOLD

pytestmark = pytest.mark.usefixtures("speedups_applied")  # Thunder's speed-ups in this module's jits


class _Seen(Transform):
    """Records the collector's thresholds while Thunder transforms the trace."""

    def __init__(self, fail: bool = False):
        self.thresholds, self.fail = [], fail

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        self.thresholds.append(gc.get_threshold())
        if self.fail:
            raise RuntimeError("a transform failed")
        return prologue_trace, computation_trace, epilogue_trace


def test_the_compile_collects_less_and_the_thresholds_come_back():
    interpreted = []

    def f(x):
        interpreted.append(gc.get_threshold())  # runs while Thunder interprets f
        return x.sin() * 2

    seen, before = _Seen(), gc.get_threshold()
    jf = thunder.jit(f, transforms=[seen])
    torch.testing.assert_close(jf(torch.ones(3)), torch.ones(3).sin() * 2)
    raised = (COMPILE_THRESHOLD, *before[1:])
    assert interpreted == [raised] and seen.thresholds == [raised]
    assert gc.get_threshold() == before


def test_a_compile_that_raises_leaves_the_thresholds_as_they_were():
    seen, before = _Seen(fail=True), gc.get_threshold()
    with pytest.raises(RuntimeError, match="a transform failed"):
        thunder.jit(lambda x: x * 2, transforms=[seen])(torch.ones(3))
    assert seen.thresholds == [(COMPILE_THRESHOLD, *before[1:])]
    assert gc.get_threshold() == before
