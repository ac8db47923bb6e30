"""Thunder's interpreter reads globals and builtins through thunder_tp.thunder_internals.global_names: the same
wrapped values as Thunder's own lookup (a global's value still guarded by the prologue), without its cost."""

import sys

import pytest
import thunder
import torch
import torch.nn.functional as F

from thunder_tp.thunder_internals import global_names

pytestmark = pytest.mark.usefixtures("speedups_applied")  # Thunder's speed-ups in this module's jits

SCALE = 2.0


def _scaled(x):
    return F.relu(x * SCALE) + len(x.shape) + isinstance(x, torch.Tensor)


@pytest.fixture
def thunder_lookups(monkeypatch):
    """The names Thunder's own lookup answered."""
    calls = []
    thunders = global_names._thunder_globals_lookup

    def counted(globals_dict, name):
        calls.append(name.value)
        return thunders(globals_dict, name)

    monkeypatch.setattr(global_names, "_thunder_globals_lookup", counted)
    return calls


def test_globals_and_builtins_are_read_without_thunders_lookup(thunder_lookups):
    x = torch.randn(4, 3)
    torch.testing.assert_close(thunder.jit(_scaled)(x), _scaled(x), rtol=0, atol=0)
    assert thunder_lookups == [], thunder_lookups


def test_a_global_changed_after_the_first_call_is_seen(monkeypatch):
    """Thunder's guard of a global read (SCALE) still holds: a new value retraces and is used."""
    jitted, x = thunder.jit(_scaled), torch.randn(4, 3)
    torch.testing.assert_close(jitted(x), _scaled(x), rtol=0, atol=0)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", -3.0)
    torch.testing.assert_close(jitted(x), _scaled(x), rtol=0, atol=0)
    assert thunder.cache_misses(jitted) == 2


def test_the_wrapped_values_are_thunders(monkeypatch):
    """Each name of a litgpt-sized program: the object Thunder's lookup returns for it, the very same."""
    from litgpt import GPT

    from tests.litgpt_models import make_config

    checked = []
    thunders = global_names._thunder_globals_lookup

    def both(globals_dict, name):
        ours = global_names.globals_lookup(globals_dict, name)
        theirs = thunders(globals_dict, name)
        assert ours is theirs, name.value
        checked.append(name.value)
        return theirs

    monkeypatch.setattr(thunder.core.interpreter, "globals_lookup", both)
    config = make_config("llama")
    config.n_layer = 1
    torch.manual_seed(0)
    model, idx = GPT(config), torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(thunder.jit(model)(idx), model(idx))
    assert {"len", "torch", "F"} <= set(checked), sorted(set(checked))[:20]


def test_an_unknown_name_is_pythons_name_error():
    def missing(x):
        return x + not_defined_anywhere  # noqa: F821

    with pytest.raises(NameError, match="not_defined_anywhere"):
        thunder.jit(missing)(torch.ones(2))
