"""Thunder's interpreter answers bool / len / [] / in / * / ** of builtin containers through
thunder_tp.thunder_internals.builtin_containers: the same programs and prologue guards as Thunder's own path."""

import collections
import re

import pytest
import thunder
import thunder.core.interpreter as interpreter
import torch
import torch.nn as nn

from thunder_tp.thunder_internals import builtin_containers

pytestmark = pytest.mark.usefixtures("speedups_applied")  # Thunder's speed-ups in this module's jits


@pytest.fixture
def thunders_own(monkeypatch):
    """Thunder's own lookasides, opcode handlers and interpreter functions back in place."""
    for fn, lookaside in builtin_containers._thunder_lookasides.items():
        monkeypatch.setitem(interpreter._default_lookaside_map, fn, lookaside)
    for name, handler in builtin_containers._thunder_handlers.items():
        monkeypatch.setitem(interpreter._default_opcode_handler_map, name, handler)
    for name, function in builtin_containers._thunder_functions.items():
        monkeypatch.setattr(interpreter, name, function)


class _Hooked(nn.Module):
    """Hooks, a kwargs call, containers of inputs and of attributes, a user class answering len / in / bool."""

    class Flags:
        def __init__(self, names):
            self.names = names

        def __len__(self):
            return len(self.names)

        def __contains__(self, name):
            return name in self.names

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.inner.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
        self.scales = collections.OrderedDict(a=1.5, b=-0.5)
        self.flags = self.Flags(["shift"])

    def forward(self, x, options, items):
        y = self.inner(x, **{}) if options else self.inner(x)
        if "shift" in options and "shift" in self.flags and len(self.flags):
            y = y + options["shift"]
        if "absent" not in options:
            n = len(items) * 3 - 1
            y = y * self.scales["a"] + n // 2 + 2**n % 7 + n / 4 + items[-1].sum()
        return torch.cat([*items, y]).view(-1, *y.shape[1:]).sum(0, keepdim=True)


def _inputs(shift: float | None, n_items: int):
    torch.manual_seed(0)
    options = {} if shift is None else {"shift": torch.tensor(shift)}
    return torch.randn(3, 4), options, [torch.randn(2, 4) for _ in range(n_items)]


def _programs(model: nn.Module, *inputs) -> list[str]:
    """The prologue and the computation trace as Thunder's interpretation gives them (timings left out)."""
    jitted = thunder.jit(model)
    torch.testing.assert_close(jitted(*inputs), model(*inputs), rtol=1e-6, atol=1e-6)
    traces = (thunder.last_prologue_traces(jitted)[0], thunder.last_traces(jitted)[0])
    return [re.sub(r"\(took \d+ milliseconds\)", "", str(trace)) for trace in traces]


def _litgpt():
    from litgpt import GPT

    from tests.litgpt_models import make_config

    config = make_config("llama")
    config.n_layer = 1
    torch.manual_seed(0)
    return GPT(config), torch.randint(0, 64, (1, 8))


@pytest.fixture
def counted(monkeypatch):
    """How often each shortcut found a builtin container (its wrapper method)."""
    found = collections.Counter()
    wrapper_method = builtin_containers._wrapper_method

    def counting(x, name, *types):
        method = wrapper_method(x, name, *types)
        found[name] += method is not None
        return method

    monkeypatch.setattr(builtin_containers, "_wrapper_method", counting)
    return found


@pytest.mark.parametrize("model", ["hooked", "litgpt"])
def test_programs_are_thunders(model, counted, request):
    """Prologue and computation trace with the shortcuts: character for character those of Thunder's own path."""
    module, *inputs = (_Hooked(), *_inputs(2.0, 2)) if model == "hooked" else _litgpt()
    ours = _programs(module, *inputs)
    assert {"__len__", "__getitem__", "__contains__"} <= {name for name, n in counted.items() if n}, counted
    request.getfixturevalue("thunders_own")
    assert _programs(module, *inputs) == ours


#: (shift or no key, list length): another value, the key gone; then the key back and the list one longer, which
#: Thunder 0.2.6 does not guard (no check of a dict's or a list's length: the entry of the empty dict answers, on
#: both paths)
CASES = [(2.0, 2), (-1.0, 2), (None, 2), (2.0, 3)]


def _results(model: nn.Module) -> tuple[list[torch.Tensor], int]:
    jitted = thunder.jit(model)
    return [jitted(*_inputs(*case)) for case in CASES], thunder.cache_misses(jitted)


def test_inputs_read_through_containers_are_guarded_as_thunder_guards_them(request):
    """The input dict changed (another value, a key gone) gives the eager result; every case, Thunder's own result
    and the same cache misses."""
    model = _Hooked()
    ours, misses = _results(model)
    for case, result in zip(CASES[:3], ours, strict=False):
        torch.testing.assert_close(result, model(*_inputs(*case)), rtol=1e-6, atol=1e-6)
    request.getfixturevalue("thunders_own")
    theirs, their_misses = _results(model)
    assert misses == their_misses == 2
    for result, their_result in zip(ours, theirs, strict=True):
        torch.testing.assert_close(result, their_result, rtol=0, atol=0)
