"""A model's repeated blocks traced once (thunder_tp.tracing.repeated_blocks) and its regions compiled once
(thunder_tp.tracing.region_cache): the same program as interpreting every block, bit for bit, under TP too; the
number of compiled regions does not grow with the depth."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import thunder
import torch
import torch.distributed as dist
import torch.nn as nn

import thunder_tp
from tests.generation import MAX_SEQ, greedy, models_with_cache
from tests.litgpt_models import CONFIGS, MODES, SEQ, VOCAB, GPTWithLoss, batch
from tests.tp_checks import FAST_EXECUTORS
from thunder_tp.tracing import block_keys, repeated_blocks
from thunder_tp.tracing.repeated_blocks import TraceStats, stats_of


@pytest.fixture(autouse=True)
def _no_process_group(monkeypatch):
    assert not dist.is_initialized(), "these tests simulate ranks in this process"
    monkeypatch.setattr(repeated_blocks, "VERIFIED_KINDS", set())  # each test's first trace checks its kinds
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _config(layers: int, **overrides):
    from litgpt import Config

    sizes = {"block_size": SEQ, "vocab_size": VOCAB, "padded_vocab_size": VOCAB, "n_layer": layers}
    return Config(**(CONFIGS["llama"] | sizes | overrides))


def _train_step(model: nn.Module, once: bool, transforms=(), executors=FAST_EXECUTORS) -> dict:
    jm = thunder.jit(model, transforms=list(transforms), executors=executors, compile_once=once)
    loss = jm(*batch(0))
    loss.backward()
    return {"jm": jm, "loss": loss.detach(), "grads": {n: p.grad for n, p in jm.named_parameters()},
            "stats": stats_of(model)}


def _both(make_model, **kwargs) -> tuple[dict, dict]:
    """One training step with every block interpreted, and with repeated blocks traced once; the same weights."""
    torch.manual_seed(0)
    reference = make_model()
    runs = []
    for once in (False, True):
        model = make_model()
        model.load_state_dict(reference.state_dict())
        runs.append(_train_step(model, once, **kwargs))
    return runs[0], runs[1]


def _assert_same(interpreted: dict, once: dict) -> None:
    assert torch.equal(once["loss"], interpreted["loss"])
    assert once["grads"].keys() == interpreted["grads"].keys()
    for name, grad in interpreted["grads"].items():
        assert torch.equal(once["grads"][name], grad), name


def test_the_first_two_blocks_are_interpreted_the_rest_replayed_bit_for_bit():
    """3 blocks: the first interpreted and recorded, the second interpreted and checked against it, the last
    appended from the recording; loss and every grad equal to interpreting each block (compile_once=False: the
    switch), bit for bit. A second model of the same blocks, their kind checked by the first's trace: one block
    interpreted, two replayed, bit for bit too."""
    interpreted, once = _both(lambda: GPTWithLoss(_config(3)))
    assert interpreted["stats"] == TraceStats(0, 0) and once["stats"] == TraceStats(interpreted=2, replayed=1)
    _assert_same(interpreted, once)
    torch.manual_seed(0)  # _both's weights
    again = _train_step(GPTWithLoss(_config(3)), True)
    assert again["stats"] == TraceStats(interpreted=1, replayed=2)
    _assert_same(interpreted, again)


def test_simulated_tp_sp_loss_parallel_gives_the_same_program():
    """TP + SP + loss parallel on 2 simulated ranks, 3 blocks: every rank's loss and grads, and the collectives
    (each labelled with its own block's module), those of interpreting every block."""
    runs = []
    for once in (False, True):
        torch.manual_seed(0)
        model = GPTWithLoss(_config(3))
        with thunder_tp.simulate(world_size=2):
            plan = thunder_tp.plans.litgpt(model, **MODES["tp_sp"], loss_parallel=True)
            run = _train_step(model, once, transforms=[thunder_tp.TensorParallel(plan)],
                              executors=thunder_tp.executors())
            run["tables"] = [thunder_tp.collectives_table(t[-1]) for t in
                             (thunder.last_traces(run["jm"]), thunder.last_backward_traces(run["jm"]))]
            run["labels"] = sorted({c["issued_by"] for c in thunder_tp.tools.debug.collective_calls(
                thunder.last_traces(run["jm"])[-1])})
        runs.append(run)
    interpreted, once = runs
    assert once["stats"].replayed == 1
    assert torch.equal(thunder_tp.per_rank(once["loss"])[1], thunder_tp.per_rank(interpreted["loss"])[1])
    for name, grad in interpreted["grads"].items():
        for rank, piece in thunder_tp.per_rank(grad).items():
            assert torch.equal(thunder_tp.per_rank(once["grads"][name])[rank], piece), (name, rank)
    assert once["tables"] == interpreted["tables"] and once["labels"] == interpreted["labels"]
    assert any("transformer.h.2." in label for label in once["labels"]), once["labels"]


def test_generation_with_a_kv_cache_gives_the_same_tokens():
    """A KV cache written in place by every block: prefill and greedy decode steps with blocks traced once give
    one device's tokens and logits (a replayed block's cache left unwritten would not)."""
    reference, model = models_with_cache(_config(3, block_size=MAX_SEQ), batch=1)
    jm = thunder.jit(model, executors=FAST_EXECUTORS, compile_once=True)
    prompt = torch.tensor([[1, 5, 9, 2]])
    (tokens, logits), (want_tokens, want_logits) = greedy(jm, prompt, steps=3), greedy(reference, prompt, steps=3)
    assert stats_of(model).replayed == 1
    assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
    for got, want in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # litgpt's RMSNorm computes in float32


def test_huggingface_decoder_layers_called_with_keywords_are_traced_once():
    """HF decoder layers (called with keywords): traced once, one device's loss and every grad."""
    from transformers import AutoModelForCausalLM

    from tests.hf_models import make_config

    config = make_config("llama")
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    reference, model = (thunder_tp.plans.hf.CausalLMLoss(
        AutoModelForCausalLM.from_config(config, torch_dtype=torch.float64)) for _ in range(2))
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, VOCAB, (2, SEQ))
    jm = thunder.jit(model, executors=FAST_EXECUTORS, compile_once=True)
    loss, want = jm(ids, ids), reference(ids, ids)
    loss.backward(), want.backward()
    assert stats_of(model).replayed == 1
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)  # HF's RMSNorm computes in float32
    for name, p in reference.named_parameters():
        torch.testing.assert_close(jm.get_parameter(name).grad, p.grad, rtol=1e-6, atol=1e-6, msg=name)


class _Scaled(nn.Module):
    """A block whose forward reads state no key sees (a list attribute): its likes are not one program."""

    def __init__(self, factor: float):
        super().__init__()
        self.linear, self.factor = nn.Linear(8, 8), [factor]

    def forward(self, x):
        return self.linear(x) * self.factor[0]


def test_blocks_that_differ_where_the_key_cannot_see_are_interpreted_each():
    """The second block's program differs from the first's: every block is interpreted, the result eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Scaled(float(i + 1)) for i in range(4)))
    x = torch.randn(2, 8)
    jm = thunder.jit(model, executors=FAST_EXECUTORS)
    torch.testing.assert_close(jm(x), model(x), rtol=0, atol=0)
    assert stats_of(model) == TraceStats(interpreted=4, replayed=0)


@dataclass
class _Settings:
    scale: float


class _Configured(nn.Module):
    """A block holding a config object, as litgpt's and HF's blocks do."""

    def __init__(self, settings: _Settings):
        super().__init__()
        self.linear, self.settings = nn.Linear(8, 8), settings

    def forward(self, x):
        return self.linear(x) * self.settings.scale


def test_blocks_holding_another_config_are_checked_again():
    """Blocks of a kind checked with one config: blocks holding another config (by its repr) are checked again,
    blocks holding an equal one are not; each result eager's."""
    x = torch.randn(2, 8)
    for scale, stats in ((1.0, TraceStats(2, 1)), (1.0, TraceStats(1, 2)), (3.0, TraceStats(2, 1))):
        model = nn.Sequential(*(_Configured(_Settings(scale)) for _ in range(3)))
        jm = thunder.jit(model, executors=FAST_EXECUTORS, compile_once=True)
        torch.testing.assert_close(jm(x), model(x), rtol=0, atol=0)
        assert stats_of(model) == stats, (scale, stats_of(model))


def test_blocks_constrained_to_other_layouts_are_another_kind():
    """Blocks whose submodule a plan constrains (ModuleLayouts: layout hooks) are one kind under one style whatever
    their names, another under another style (a replay would annotate the other plan's layouts)."""
    from thunder_tp.propagation.constraints import constrain_module_boundaries
    from thunder_tp.styles.dtensor_like import ModuleLayouts

    def structures(inputs) -> list[tuple]:
        model = nn.Sequential(*(_Configured(_Settings(1.0)) for _ in range(2)))
        constrain_module_boundaries(model, {f"{i}.linear": ModuleLayouts(inputs=inputs) for i in range(2)})
        return [block_keys._Keys(block).structure() for block in model]

    replicated, sharded = structures((thunder_tp.Replicate(),)), structures((thunder_tp.Shard(0),))
    assert replicated[0] == replicated[1] and sharded[0] == sharded[1]
    assert replicated[0] != sharded[0]


class _Dropout(nn.Module):
    """A block whose program depends on its `training` attribute."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return nn.functional.dropout(self.linear(x), 0.5, self.training)


def test_every_trace_checks_what_its_blocks_read():
    """A second model of a kind checked before: its first block is interpreted, so its prologue checks `training`
    and eval() after a training step traces again (every block replayed from another trace's recording would keep
    running the dropout)."""
    x = torch.randn(2, 8, dtype=torch.float64)
    for _ in range(2):
        model = nn.Sequential(*(_Dropout() for _ in range(3)))
        jm = thunder.jit(model, executors=FAST_EXECUTORS, compile_once=True)
        jm(x)
        jm.eval()
        torch.testing.assert_close(jm(x), model(x), rtol=0, atol=0)
    assert stats_of(model) == TraceStats(interpreted=1, replayed=2)


def test_compiled_regions_do_not_grow_with_depth(monkeypatch):
    """Inductor regions (thunder_tp.executors()): a 5-block model compiles as many regions as a 3-block one, each
    from an empty region cache (the blocks' regions compiled once for all blocks; from 3 blocks on, a model has every
    kind of region its depth can give: the first block's, a middle one's, the last's). The second's compilations
    are served by Inductor's on-disk cache, which the count does not see."""
    from thunder_tp.execution import executor
    from thunder_tp.tracing.region_cache import CompiledRegions

    compiled = []
    for layers in (3, 5):
        monkeypatch.setattr(executor, "COMPILED_REGIONS", CompiledRegions())
        torch.manual_seed(0)
        run = _train_step(GPTWithLoss(_config(layers)), True, executors=thunder_tp.executors())
        assert run["stats"].replayed == layers - 2
        compiled.append(executor.COMPILED_REGIONS.compiles)
    assert compiled[0] == compiled[1] > 0, compiled


@pytest.mark.usefixtures("speedups_applied")
def test_the_interpreter_decodes_each_code_object_once():
    """Thunder's interpreter reads a code object's instructions from thunder_tp's cache (dis's own, decoded once),
    and the frame of an exception raised at a line it made a frame for before from another; its tracebacks name
    the lines Python's do, and the call site it records is ``inspect.stack()``'s."""
    import dis
    import inspect
    import traceback

    import thunder.core.interpreter as interpreter

    from thunder_tp.thunder_internals import instructions

    def fails(x):
        raise ValueError("caught")

    def f(x):
        try:  # an exception leaving an interpreted frame: a frame made for its traceback
            fails(x)
        except ValueError:
            return (x * 2).sin()

    assert interpreter.dis.get_instructions(f.__code__) == tuple(dis.get_instructions(f.__code__))
    torch.testing.assert_close(thunder.jit(f)(torch.ones(3)), f(torch.ones(3)))
    caches = (instructions.instructions, instructions.python_frame)
    before = [cache.cache_info() for cache in caches]
    torch.testing.assert_close(thunder.jit(f)(torch.ones(3)), f(torch.ones(3)))  # again: nothing decoded or made
    after = [cache.cache_info() for cache in caches]
    for was, now in zip(before, after, strict=True):
        assert now.hits > was.hits and now.misses == was.misses, (before, after)

    def lines(call) -> list[tuple[str, int]]:
        with pytest.raises(ValueError) as raised:
            call(torch.ones(3))
        return [(entry.name, entry.lineno) for entry in traceback.extract_tb(raised.value.__traceback__)
                if entry.filename == __file__ and entry.name != "lines"]

    assert lines(thunder.jit(fails)) == lines(fails) == [("fails", fails.__code__.co_firstlineno + 1)]
    ours, python = interpreter.inspect.stack(), inspect.stack()
    assert [(e.frame, e.filename, e.lineno, e.function) for e in ours] == [
        (e.frame, e.filename, e.lineno, e.function) for e in python[:3]]
    assert ours[1:] == python[1:3]
