"""A replayed block is only ever an exact shortcut (thunder_tp.tracing.block_keys): blocks of one class whose
forward differs from the recorded call's (hooks and what they close over, attributes of any type, grad mode,
autocast, another model of the same class) give eager's loss and grads, and compile_once=False's bit for bit."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import thunder
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.tp_checks import FAST_EXECUTORS
from thunder_tp.tracing import repeated_blocks
from thunder_tp.tracing.repeated_blocks import stats_of

WIDTH, BLOCKS = 8, 4


@pytest.fixture(autouse=True)
def _float64_and_a_fresh_process_state(monkeypatch):
    assert not dist.is_initialized(), "these tests run in this process alone"
    monkeypatch.setattr(repeated_blocks, "VERIFIED_KINDS", set())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Mode(enum.Enum):
    PLAIN = 1
    SCALED = 2


@dataclass
class Window:
    left: float
    right: float


class Block(nn.Module):
    """A residual block with children; `extra` is what a variant's forward reads (None: nothing)."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)
        self.extra = None

    def forward(self, x):
        return x + self.fc(self.norm(x)) * _scale(self.extra)


def _scale(extra) -> float:
    """The factor each kind of `extra` gives (every kind read as a user's block would read it)."""
    if isinstance(extra, (tuple, list)):
        return extra[0] * extra[1]
    if isinstance(extra, dict):
        return extra["a"] * extra["b"] * extra["c"]
    if isinstance(extra, Mode):
        return 3.0 if extra is Mode.SCALED else 1.0
    if isinstance(extra, Window):
        return extra.left - extra.right
    return 1.0 if extra is None else float(extra)


class Stack(nn.Module):
    """Blocks in a ModuleList; those in `frozen` run under torch.no_grad(), those in `autocast` under bfloat16
    autocast; a frozen suffix's output is added to the input of its first block, so that the loss keeps a grad."""

    def __init__(self, blocks: int = BLOCKS, frozen: tuple[int, ...] = (), autocast: tuple[int, ...] = ()):
        super().__init__()
        self.h = nn.ModuleList(Block() for _ in range(blocks))
        self.frozen, self.autocast = frozen, autocast

    def forward(self, x):
        skip = None
        for i, block in enumerate(self.h):
            if i in self.frozen:
                skip = x if skip is None else skip
                with torch.no_grad():
                    x = block(x)
            elif i in self.autocast:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    x = block(x).to(torch.float64)
            else:
                x = block(x)
        return x if skip is None else x + skip


def _closure_hooks(model: Stack) -> None:
    def scaling(i: int):
        def hook(module, args, output):
            return output * (0.0 if i == 3 else 1.0)
        return hook

    for i, block in enumerate(model.h):
        block.register_forward_hook(scaling(i))


class _Scaler:
    def __init__(self, factor: float):
        self.factor = factor

    def scale(self, module, args, output):
        return output * self.factor


def _bound_method_hooks(model: Stack) -> None:
    for i, block in enumerate(model.h):
        block.register_forward_hook(_Scaler(0.25 if i == 3 else 1.0).scale)


def _pre_hooks_with_kwargs(model: Stack) -> None:
    for i, block in enumerate(model.h):
        block.register_forward_pre_hook(lambda m, args, kwargs, i=i: ((args[0] * (2.0 if i == 3 else 1.0),), kwargs),
                                        with_kwargs=True)


def _attributes(first, later) -> Callable[[Stack], None]:
    def set_extra(model: Stack) -> None:
        for i, block in enumerate(model.h):
            block.extra = first if i < 3 else later
    return set_extra


VARIANTS = {
    "hook closing over its layer": _closure_hooks,
    "hook bound to a per-layer object": _bound_method_hooks,
    "pre-hook with kwargs and a default": _pre_hooks_with_kwargs,
    "tuple attribute": _attributes((1.0, 2.0), (3.0, 1.0)),
    "list attribute": _attributes([1.0, 2.0], [1.0, 0.5]),
    # (keying a dict's items makes short-lived pairs: a key must not be taken from a dead pair's reused id)
    "dict attribute differing after its first item": _attributes({"a": 1.0, "b": 2.0, "c": 1.0},
                                                                 {"a": 1.0, "b": 0.5, "c": 3.0}),
    "enum attribute": _attributes(Mode.PLAIN, Mode.SCALED),
    "numpy scalar attribute": _attributes(np.float32(1.0), np.float32(-2.0)),  # (np.float64 is a Python float)
    "small object attribute": _attributes(Window(2.0, 1.0), Window(1.0, 3.0)),
}


def _step(model: nn.Module, x: torch.Tensor, once: bool | None) -> dict:
    """Loss and grads of one step: eager (`once` None) or jitted with compile_once=`once`."""
    run = model if once is None else thunder.jit(model, executors=FAST_EXECUTORS, compile_once=once)
    loss = run(x).square().sum()
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    if once is not None:
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in run.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"loss": loss.detach(), "grads": grads, "x": x.grad, "stats": None if once is None else stats_of(model)}


def _runs(make: Callable[[], Stack]) -> tuple[dict, dict, dict]:
    """Eager, every block interpreted, repeated blocks traced once: one step each on the same weights and input."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(2, 3, WIDTH)
    runs = []
    for once in (None, False, True):
        x.grad = None
        runs.append(_step(model, x.requires_grad_(), once))
    return tuple(runs)


def _assert_same(got: dict, want: dict, *, exact: bool) -> None:
    def check(a, b, what):
        assert (a is None) == (b is None), f"{what}: grad {a is not None} where the reference has {b is not None}"
        if a is not None:
            if exact:
                assert torch.equal(a, b), what
            else:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=what)

    check(got["loss"], want["loss"], "loss")
    check(got["x"], want["x"], "the input's grad")
    for name, grad in want["grads"].items():
        check(got["grads"][name], grad, name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_blocks_that_differ_from_the_third_on_give_eagers_result(variant):
    """The first three blocks alike, the fourth different where only its hooks or an attribute say: eager's loss and
    grads, and every block interpreted's bit for bit."""
    def make():
        model = Stack()
        VARIANTS[variant](model)
        return model

    eager, interpreted, once = _runs(make)
    _assert_same(interpreted, eager, exact=False)
    _assert_same(once, interpreted, exact=True)


@pytest.mark.parametrize(("blocks", "frozen", "autocast"), [(4, (0, 1), ()), (4, (2, 3), ()), (5, (), (4,))],
                         ids=["frozen prefix", "frozen suffix", "autocast on the last"])
def test_grad_mode_and_autocast_are_part_of_a_blocks_kind(blocks, frozen, autocast):
    """Blocks called under torch.no_grad() or autocast and blocks called without: the parameters eager leaves
    without a grad have none, the others eager's (autocast: Thunder's bfloat16 rules, so against every block
    interpreted alone), and replays of a kind only within one mode."""
    eager, interpreted, once = _runs(lambda: Stack(blocks, frozen, autocast))
    if not autocast:
        _assert_same(interpreted, eager, exact=False)
    _assert_same(once, interpreted, exact=True)
    assert once["stats"].replayed == blocks - 4, once["stats"]  # the first block (a leaf input) and two per kind


def test_a_second_model_whose_blocks_differ_from_the_third_on():
    """A kind checked in one model's trace, then a model of the same class whose blocks 3-5 hold another attribute:
    its blocks of the checked kind replayed right after the first (whose output feeds them), the others a kind of
    their own; eager's result and every block interpreted's."""
    eager, interpreted, once = _runs(Stack)
    _assert_same(once, interpreted, exact=True)

    def make():
        model = Stack(6)
        _attributes(None, (3.0, 1.0))(model)
        return model

    eager, interpreted, once = _runs(make)
    _assert_same(interpreted, eager, exact=False)
    _assert_same(once, interpreted, exact=True)
    assert once["stats"].replayed == 2, once["stats"]  # blocks 2 and 5; block 0 alone takes a leaf


def _gemma3_litgpt() -> nn.Module:
    from tests.litgpt_models import zoo_config
    from thunder_tp.plans.litgpt import GPTWithLoss

    config = zoo_config("Gemma-3-4b-it")
    config.n_layer, config.sliding_window_indices, config.rope_indices = 6, [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]
    return GPTWithLoss(config)


def _gemma3_hf() -> nn.Module:
    from transformers import AutoModelForCausalLM

    from tests.hf_models import make_config
    from thunder_tp.plans.hf import CausalLMLoss

    config = make_config("gemma3_text")
    config.num_hidden_layers = 6  # layers 0-4 local (sliding window), 5 global
    return CausalLMLoss(AutoModelForCausalLM.from_config(config, torch_dtype=torch.float64))


def _simulated_step_matches_one_device(make: Callable[[], nn.Module], plan: Callable) -> None:
    """One step of TP=2 + SP + loss parallel on 2 simulated ranks, blocks traced once: each rank's loss and grads
    those of one device (float32 RMSNorms: 1e-6; a replayed block of the other kind is off by far more)."""
    import thunder_tp
    from tests.litgpt_models import batch
    from tests.tp_checks import assert_simulated_grads_are_shards

    torch.manual_seed(0)
    model = make()
    idx, targets = batch(0)
    reference = make()
    reference.load_state_dict(model.state_dict())
    expected = reference(idx, targets)
    expected.backward()
    with thunder_tp.simulate(world_size=2):
        tp = thunder_tp.TensorParallel(plan(model, sequence_parallel=True, loss_parallel=True))
        jm = thunder.jit(model, transforms=[tp], executors=thunder_tp.executors(), compile_once=True)
        loss = jm(idx, targets)
        loss.backward()
        for value in thunder_tp.per_rank(loss).values():
            torch.testing.assert_close(value, expected.detach(), rtol=1e-6, atol=1e-6)
        assert_simulated_grads_are_shards(reference, jm, tp.parameter_layouts, 2, rtol=1e-6, atol=1e-6)
    assert stats_of(model).replayed == 3, stats_of(model)  # local blocks 2-4; the global one interpreted


@pytest.mark.parametrize("family", ["litgpt", "hf"])
def test_six_layers_of_local_and_global_attention_under_tp_sp_and_loss_parallel(family):
    """Gemma-3 (litgpt's and HF's): five sliding-window layers, then a global one with its own RoPE; 2 simulated
    ranks with SP and loss parallel, blocks traced once: one device's loss and grads on every rank."""
    import thunder_tp

    make, plan = (_gemma3_litgpt, thunder_tp.plans.litgpt) if family == "litgpt" else (_gemma3_hf, thunder_tp.plans.hf)
    _simulated_step_matches_one_device(make, plan)
