"""What a TP backward keeps: a SwiGLU MLP saves its two projections, not the activation and product between them.

What is saved is decided by the program and its regions, before any region compiles: the regions run uncompiled."""

import pytest
import thunder
import torch
import torch.nn as nn

import thunder_tp
from tests.dist import run_ranks
from tests.tp_checks import FAST_EXECUTORS, compare_with_single_device, regions_uncompiled
from thunder_tp.tools.debug import saved_for_backward

TOKENS, HIDDEN, FFN = 64, 64, 256


class SwiGLU(nn.Module):
    """litgpt's LLaMAMLP: proj(silu(fc_1(x)) * fc_2(x))."""

    def __init__(self):
        super().__init__()
        self.fc_1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.fc_2 = nn.Linear(HIDDEN, FFN, bias=False)
        self.proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.proj(torch.nn.functional.silu(self.fc_1(x)) * self.fc_2(x))


PLAN = {"fc_1": thunder_tp.ColwiseParallel(), "fc_2": thunder_tp.ColwiseParallel(),
        "proj": thunder_tp.RowwiseParallel()}


def _input():
    torch.manual_seed(3)
    return (torch.randn(2, TOKENS // 2, HIDDEN, requires_grad=True),)


def _saved_shapes(jm) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in saved_for_backward(thunder.last_traces(jm)[-1])]


def _swiglu_saved(fused: bool):
    executors = thunder_tp.executors() if fused else FAST_EXECUTORS
    # output, input grad and every weight grad vs one device; then what the forward saved
    with regions_uncompiled():
        info = compare_with_single_device(SwiGLU, _input, thunder_tp.TensorParallel(PLAN), executors=executors,
                                          inspect=_saved_shapes)
    return info["inspected"]


@pytest.mark.parametrize("fused", [True, False], ids=["thunder_tp.executors", "thunder defaults"])
def test_swiglu_saves_its_projections_not_what_is_computed_from_them(fused):
    shapes = run_ranks(_swiglu_saved, 2, fused)[0]
    # a = fc_1(x) and b = fc_2(x), which the backward of silu(a) * b needs; silu(a) and the product (proj's
    # input, for its weight grad) are recomputed from them (before: all four were saved)
    assert shapes.count((2, TOKENS // 2, FFN // 2)) == 2, shapes


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([SwiGLU(), SwiGLU()])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _recomputed_before_first_wait() -> list[str]:
    """The recomputed activations (Thunder names them bw_*) that the backward computes before its first wait."""
    plan = {f"blocks.*.{name}": style for name, style in PLAN.items()}
    torch.manual_seed(0)
    jm = thunder.jit(_Stack(), transforms=[thunder_tp.TensorParallel(plan)], executors=thunder_tp.executors())
    with regions_uncompiled():
        jm(*_input()).sum().backward()
    names = set()
    for bsym in thunder.last_backward_traces(jm)[-1].bound_symbols:
        if bsym.sym.name == "torch_wait_prim_impl":
            break
        names.update(s.output.name for s in bsym.subsymbols
                     if s.sym.name in ("silu", "mul") and s.output.name.startswith("bw_"))
    return sorted(names)


def test_backward_recomputes_a_block_activation_next_to_its_use():
    # up to the wait for the last block's input grad, only that block's silu(a) and product are recomputed; the
    # first block's, which read only saved values, are not pulled there (where they would live through the block)
    recomputed = run_ranks(_recomputed_before_first_wait, 2)[0]
    assert len(recomputed) == 2, recomputed


# --- values computed from parameters and buffers alone ------------------------------------------------------------


def _saved_from_parameters_alone(jm) -> list[str]:
    """The tensors the forward saves that it computed without reading the data (token ids, targets)."""
    trace = thunder.last_traces(jm)[-1]
    producer = {}

    def index(bsyms):
        for bsym in bsyms:
            if bsym.sym.is_fusion:
                index(bsym.subsymbols)
            else:
                producer.update((out.name, bsym) for out in bsym.flat_proxy_outs)

    index(trace.bound_symbols)
    data = {a.name for a in trace.args[:2]}  # idx, targets

    def reads_data(name: str, seen: set) -> bool:
        seen.add(name)
        bsym = producer.get(name)
        return name in data or (bsym is not None and any(
            reads_data(a.name, seen) for a in bsym.flat_proxy_args if a.name not in seen))

    arguments = {a.name for a in trace.args}
    return [p.name for p in saved_for_backward(trace) if p.name not in arguments and not reads_data(p.name, set())]


def _litgpt_saved_from_parameters_alone():
    from tests.litgpt_models import GPTWithLoss, batch, make_config

    config = make_config("llama")
    def make_model():
        return GPTWithLoss(config)
    transform = thunder_tp.TensorParallel(thunder_tp.plans.litgpt(make_model()))
    with regions_uncompiled():
        info = compare_with_single_device(make_model, batch, transform, executors=thunder_tp.executors(),
                                          inspect=_saved_from_parameters_alone)
    return info["inspected"]


def test_values_computed_from_parameters_alone_are_recomputed_not_saved():
    # norm weights broadcast to the activations' shape, RoPE tables, the causal mask: each was an activation-sized
    # tensor that a fusion region wrote out for the backward; the backward now computes them again where it uses
    # them (loss and every grad still match one device)
    assert run_ranks(_litgpt_saved_from_parameters_alone, 2)[0] == []
