"""A module built inside a jitted forward (litgpt's GPT.forward builds an nn.Identity) is tagged for torch.compile
natively: Thunder's interpreter never iterates dynamo's registry of every module in the process (a rank-local
"dictionary changed size during iteration" when the garbage collector frees a module during that loop)."""

import pytest
import thunder
import torch
from torch._dynamo import mutation_guard
from torch._dynamo.utils import ExactWeakKeyDictionary


class _Untraversable(dict):
    """A registry dict that counts insertions and refuses to be iterated (as the interpreter's `in` would)."""

    inserted = 0

    def __setitem__(self, key, value):
        type(self).inserted += 1
        super().__setitem__(key, value)

    def items(self):
        raise RuntimeError("dynamo's module registry iterated under thunder.jit")


@pytest.mark.usefixtures("speedups_applied")  # installs the lookaside
def test_module_built_in_jitted_forward_is_tagged_without_iterating_the_registry(monkeypatch):
    mutation_guard.install_generation_tagging_init()  # what torch.compile does on first entry
    registry = ExactWeakKeyDictionary()
    registry.refs, registry.values = _Untraversable(), _Untraversable()
    monkeypatch.setattr(mutation_guard.GenerationTracker, "generation_values", registry)

    def build_and_apply(x):
        return torch.nn.Identity()(x) + 1

    assert torch.equal(thunder.jit(build_and_apply)(torch.ones(2)), torch.full((2,), 2.0))
    assert _Untraversable.inserted == 2  # the Identity was tagged: one weak reference, one generation value
