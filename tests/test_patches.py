"""Thunder's speed-ups apply to thunder_tp's compiles only (thunder_internals/patches.py, issue 77): importing
thunder_tp changes nothing of Thunder's; once thunder_tp compiled, a plain ``thunder.jit`` still runs Thunder's code
and gives Thunder's traces; the registry installs, dispatches and uninstalls.

Thunder's own interpreter tests (``thunder/tests/test_interpreter.py``) are not in its wheel, and copying them is
not this project's to do, so `test_the_interpreter_runs_python_as_python` is a sample of our own modelled on what
that file covers (closures, globals and builtins, containers, unpacking, exceptions, generators, with-statements,
comprehensions, methods and partials), each run by a plain jit after thunder_tp compiled and by a jit with the
speed-ups, against plain Python.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import thunder
import thunder.core.interpreter as interpreter
import torch
from thunder.core.jit_ext import _general_jit_lookaside_map

import thunder_tp
from thunder_tp.collectives import comm_executor
from thunder_tp.execution.executor import thunder_default_executors
from thunder_tp.thunder_internals import patches, versions
from thunder_tp.thunder_internals.collections_during_compile import COMPILE_THRESHOLD

REPO = Path(__file__).resolve().parent.parent

#: run in a fresh process: plain jits before importing thunder_tp and after it compiled a TP program
_FRESH_PROCESS = r"""
import json, re, sys
import thunder, torch
import thunder.core.interpreter as interpreter
from thunder.core import jit_ext

def f(x, scale):
    d = {"a": x, "b": [x, x]}
    total = sum(t.sum() for t in d["b"]) if "a" in d and d else x
    return (x * scale + total).sin(), len(d["b"]) // 2

def untimed(trace):
    return re.sub(r"\(took \d+ milliseconds\)", "", str(trace))

def models():  # a litgpt GPT and an HF Llama (GQA): their families divert code of theirs to lookasides
    from litgpt import GPT, Config
    from tests.hf_models import make_model
    torch.manual_seed(0)
    gpt = GPT(Config(n_layer=1, n_embd=32, n_head=4, n_query_groups=2, block_size=16, padded_vocab_size=64))
    llama = make_model("llama")
    llama.config.use_cache = False
    return gpt, llama

def jitted_runs():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    options = {"debug_options": thunder.DebugOptions(record_interpreter_history=True)}
    runs, tokens = {}, torch.zeros(1, 8, dtype=torch.long)
    for name, fn, args in (("function", f, (torch.ones(2, 4), 3)), ("module", module, (torch.ones(3, 4),)),
                           ("litgpt", gpt, (tokens,)), ("hf", llama, (tokens,))):
        jf = thunder.jit(fn, **options)
        jf(*args)
        runs[name] = {"traces": [untimed(t) for t in thunder.last_traces(jf)],
                      "prologue": [untimed(t) for t in thunder.last_prologue_traces(jf)],
                      "instructions": len(thunder.last_interpreted_instructions(jf))}
    return runs

def executor_lists():
    from thunder import extend
    return {name: [ex.name for ex in getattr(extend, name)] for name in ("_default_executors", "_always_executors")}

def thunders_objects():
    modules = [m for name, m in sorted(sys.modules.items()) if name.split(".")[0] == "thunder"]
    objects = {f"{m.__name__}.{k}": id(v) for m in modules for k, v in vars(m).items()}
    objects.update({f"Symbol.{k}": id(v) for k, v in vars(thunder.core.symbol.Symbol).items()})
    objects.update({f"InterpreterFrame.{k}": id(v) for k, v in vars(interpreter.InterpreterFrame).items()})
    for name in ("_default_lookaside_map", "_default_opcode_handler_map"):
        objects.update({f"{name}[{k!r}]": id(v) for k, v in getattr(interpreter, name).items()})
    objects.update({f"_general_jit_lookaside_map[{k!r}]": id(v) for k, v in jit_ext._general_jit_lookaside_map.items()})
    return objects

# Dynamo wraps nn.Module.__init__ on its first use (torch's own patch, as thunder_tp's Inductor regions will): the
# plain jits of models that build modules interpret that wrapper before and after alike
torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
gpt, llama = models()
before, objects, executors = jitted_runs(), thunders_objects(), executor_lists()
import thunder_tp
from thunder_tp import ColwiseParallel, RowwiseParallel, TensorParallel
thunder_tp.TensorParallel  # the whole API loaded
after_import = thunders_objects()
changed = sorted(k for k, v in objects.items() if after_import.get(k, v) != v)
added = {name: names[:len(names) - len(executors[name])] for name, names in executor_lists().items()
         if names[len(names) - len(executors[name]):] == executors[name]}
with thunder_tp.simulate(world_size=2):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    thunder.jit(mlp, transforms=[TensorParallel(plan)], executors=thunder_tp.executors())(torch.ones(3, 4))
thunder_tp.models.hf.register_lookasides(llama)  # as plans.hf does: the HF family's lookasides registered
tp = thunder.jit(f, executors=thunder_tp.executors(),
                 debug_options=thunder.DebugOptions(record_interpreter_history=True))
tp(torch.ones(2, 4), 3)
print(json.dumps({"before": before, "changed_by_import": changed, "executors_added": added, "after": jitted_runs(),
                  "thunder_tp_instructions": len(thunder.last_interpreted_instructions(tp))}))
"""


@pytest.fixture(scope="module")
def fresh_process() -> dict:
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env={"OMP_NUM_THREADS": "1", **dict(__import__("os").environ)})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_thunder_tp_replaces_nothing_of_thunders(fresh_process):
    """No attribute of a loaded Thunder module, no interpreter map entry, no lookaside Thunder had is replaced; the
    one change is public registration: executors of thunder_tp's own symbols put in front of Thunder's default and
    always lists (``add_default_executor``: MoE, float8, blockwise attention; ``add_always_executor``: sampling),
    each claiming only thunder_tp's symbols, which a plain function never calls."""
    lists = ["thunder.extend._always_executors", "thunder.extend._default_executors"]
    assert set(fresh_process["changed_by_import"]) <= set(lists)
    added = fresh_process["executors_added"]
    assert sorted(added) == ["_always_executors", "_default_executors"]  # Thunder's lists kept as their tails
    assert all(name.startswith("thunder_tp_") for names in added.values() for name in names), added


@pytest.mark.parametrize("kind", ["function", "module", "litgpt", "hf"])
def test_a_plain_jit_after_thunder_tp_compiled_is_thunders(fresh_process, kind):
    """The traces (computation and prologue) are those before thunder_tp was imported, and the interpreter ran the
    instructions it ran then: Thunder's own path, not the speed-ups', nor the model families' lookasides (litgpt's
    GPT forward, HF's repeat_kv and causal-mask check), which serve thunder_tp's compiles only."""
    before, after = fresh_process["before"][kind], fresh_process["after"][kind]
    assert after["traces"] == before["traces"]
    assert after["prologue"] == before["prologue"]
    assert after["instructions"] == before["instructions"]


def test_thunder_tps_compile_of_the_same_function_has_the_speed_ups(fresh_process):
    assert fresh_process["thunder_tp_instructions"] < fresh_process["before"]["function"]["instructions"] / 2


SCALE = 3


def _closure(x):
    offset = 2

    def add(y):
        return y + offset * SCALE

    return add(x)


def _containers(x):
    d = collections.OrderedDict(a=x, b=x * 2)
    items = [v for k, v in d.items() if k in ("a", "b")]
    t = (*items, x)
    kwargs = {"alpha": 2}
    return torch.add(t[0], t[-1], **kwargs) if d and len(t) == 3 and "a" in d else x


def _exceptions(x):
    try:
        x.no_such_attribute  # noqa: B018  (an interpreted attribute lookup that raises)
    except AttributeError:
        x = x + 1
    try:
        raise ValueError("inner")
    except ValueError as e:
        x = x * len(str(e))
    finally:
        x = x - 1
    return x


def _generators(x):
    def halves(n):
        for i in range(n):
            yield x / (i + 1)

    return sum(halves(3)) + max(i * 2 for i in range(4))


def _with_statement(x):
    @contextlib.contextmanager
    def doubled():
        yield 2

    with doubled() as k, torch.no_grad():
        y = x * k
    return y


def _comprehensions(x):
    squares = {i: i * i for i in range(3)}
    kept = {i for i in squares.values() if i % 2 == 0}
    return x * sum(kept) + sum([squares[i] for i in squares])


def _methods_and_partials(x):
    class Scaler:
        def __init__(self, factor):
            self.factor = factor

        def __call__(self, y, *, bias=0):
            return self.scale(y) + bias

        def scale(self, y):
            return y * self.factor

    scaled = functools.partial(Scaler(3), bias=1)
    return scaled(x) + functools.partial(torch.mul, 2)(x) + divmod(7, 2)[1]


def _star_args(x, *args, **kwargs):
    def inner(a, b=0, *rest, c=1, **more):
        return a * c + b + len(rest) + len(more)

    return inner(x, *args, **kwargs) + inner(*[x], **{"c": 2})


SAMPLE = [(_closure, ()), (_containers, ()), (_exceptions, ()), (_generators, ()), (_with_statement, ()),
          (_comprehensions, ()), (_methods_and_partials, ()), (_star_args, (1, 2, 3))]


@pytest.mark.parametrize("speed_ups", [False, True], ids=["thunders", "speed_ups"])
@pytest.mark.parametrize("fn, extra", SAMPLE, ids=[fn.__name__.strip("_") for fn, _ in SAMPLE])
def test_the_interpreter_runs_python_as_python(fn, extra, speed_ups):
    """A plain jit after thunder_tp compiled (Thunder's path) and one with the speed-ups give Python's result."""
    thunder_tp.executors()  # installed, as after any use of thunder_tp
    x = torch.arange(4.0)
    with patches.applied() if speed_ups else contextlib.nullcontext():
        torch.testing.assert_close(thunder.jit(fn)(x, *extra), fn(x, *extra))


@pytest.fixture
def reinstalled():
    """The patches in place after the test, whatever it uninstalled."""
    yield
    patches.install()


def test_install_and_uninstall_swap_thunders_originals(reinstalled):
    patches.install()
    declared = patches.declared()
    assert {p.module for p in declared} <= set(versions.PATCHES)  # the version guard names each declaring module
    assert all(patches._get(p.owner, p.name) is p.replacement for p in declared)
    originals = [original for _, original in patches._installed]
    patches.uninstall()
    assert not patches.installed()
    assert [patches._get(p.owner, p.name) for p in declared] == originals
    patches.install()
    patches.install()  # once
    assert len(patches._installed) == len(declared)


def _inference_mode(x):
    with torch.inference_mode():
        y = x * 2
    return x * y


def test_a_lookaside_outside_thunder_tps_compiles_is_thunders_interpretation(reinstalled):
    """grad_mode's inference_mode lookasides: a plain jit's programs are those Thunder makes without them (it ignores
    the mode), a thunder_tp compile's record it as no_grad (the grad reaches x through one factor only)."""
    def compiled() -> tuple[list[str], torch.Tensor]:
        x = torch.full((2,), 3.0, requires_grad=True)
        jf = thunder.jit(_inference_mode)
        jf(x).sum().backward()
        return [re.sub(r"\(took \d+ milliseconds\)", "", str(t)) for t in thunder.last_traces(jf)], x.grad

    lookasides = [p.name for p in patches.declared() if p.owner is _general_jit_lookaside_map]
    assert torch.inference_mode.__enter__ in lookasides
    assert not any(fn in interpreter._default_lookaside_map for fn in lookasides)  # Thunder would interpret them
    patches.install()
    installed = compiled()
    patches.uninstall()
    thunders = compiled()
    assert installed[0] == thunders[0] and torch.equal(installed[1], thunders[1])
    torch.testing.assert_close(thunders[1], torch.full((2,), 12.0))
    with patches.applied():
        torch.testing.assert_close(compiled()[1], torch.full((2,), 6.0))


def test_the_speed_ups_are_active_in_thunder_tps_compiles_only():
    seen = []

    def f(x):
        seen.append(patches.active())
        return x * 2

    thunder.jit(f)(torch.ones(2))
    thunder.jit(f, executors=thunder_tp.executors())(torch.ones(2))
    with patches.applied():
        with patches.applied():
            thunder.jit(f)(torch.ones(2))
        thunder.jit(f)(torch.ones(2))
    assert seen == [False, True, True, True] and not patches.active()


def test_the_collection_threshold_is_raised_in_thunder_tps_compiles_only():
    """collections_during_compile finds a jit's CompileData in the closure of the function ``thunder.jit``
    decorates (``weakref_cd``): raised for a jit with thunder_tp's executors, not for a plain one."""
    executors = thunder_tp.executors()  # installed before the jits are made
    seen = []

    def f(x):
        seen.append(gc.get_threshold()[0])  # runs while Thunder interprets f
        return x * 2

    young = gc.get_threshold()[0]
    thunder.jit(f)(torch.ones(2))
    thunder.jit(f, executors=executors)(torch.ones(2))
    thunder.jit(f, executors=thunder_default_executors())(torch.ones(2))  # Thunder's fusion, thunder_tp's compiles
    assert seen == [young, *[max(young, COMPILE_THRESHOLD)] * 2] and gc.get_threshold()[0] == young


def test_the_marker_is_thunder_tps_collectives_executor():
    assert comm_executor.name == patches.MARKER and comm_executor in thunder_tp.executors()
