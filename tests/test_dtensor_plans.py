"""Plans written for DTensor (torch.distributed.tensor.parallel's styles and placements) run under TensorParallel:
the same loss and grads as one device (float64) and the same collectives as the equivalent thunder_tp plan; DTensor's
keyword names on thunder_tp's styles; plan keys matched segment by segment, as DTensor matches them."""

import re
from fnmatch import fnmatchcase

import pytest
import thunder
import torch
import torch.nn as nn
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor import parallel as dtensor

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import SEQ, GPTWithLoss, batch, make_config
from tests.tp_checks import compare_with_single_device
from thunder_tp import ColwiseParallel, Replicate, RowwiseParallel, SequenceParallel, Shard, TensorParallel
from thunder_tp.styles import ModuleLayouts
from thunder_tp.styles.dtensor import read_plan
from thunder_tp.styles.matching import match_plan
from thunder_tp.tools.debug import collective_calls

TOLERANCE = 1e-10  # float64 through Thunder's torch executor: ~1e-16 apart
#: litgpt's RMSNorm computes in float32 even on float64 inputs (gaps up to ~5e-7 of a grad's largest entry)
LITGPT_TOLERANCE = 1e-5


# --- DTensor's names and placements on thunder_tp's styles -------------------------------------------------------


def test_thunder_tp_styles_take_dtensor_keyword_names_and_placements():
    assert ColwiseParallel(input_layouts=DShard(1), output_layouts=DReplicate(), use_local_output=False) == \
        ColwiseParallel(output_layout=Replicate())
    assert ColwiseParallel(output_layouts=DShard(-1)) == ColwiseParallel()  # DTensor's default: the split's own
    assert RowwiseParallel(input_layouts=DReplicate(), output_layouts=DShard(1)) == \
        RowwiseParallel(output_layout=Shard(1))
    assert RowwiseParallel(output_layouts=DPartial()) == RowwiseParallel(output_layout=None)
    assert RowwiseParallel(output_layout=DShard(1)).output_layout == Shard(1)  # a placement under thunder_tp's name
    assert SequenceParallel(sequence_dim=2, use_local_output=True) == SequenceParallel(2)
    assert SequenceParallel(sequence_dim=1).input_layout == Shard(1)


def _annotated_with_placements() -> dict:
    from thunder_tp import annotate

    torch.manual_seed(0)
    a, b = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    jf = thunder.jit(lambda a, b: annotate(a, DShard(1)) @ annotate(b, DShard(0)), transforms=[TensorParallel()])
    torch.testing.assert_close(jf(a, b), a @ b, rtol=TOLERANCE, atol=TOLERANCE)
    return _collectives_of(thunder.last_traces(jf)[-1])


def test_annotate_takes_dtensor_placements():
    """Each rank multiplies its slices (a's columns, b's rows), one all_reduce sums them."""
    assert run_ranks(_annotated_with_placements, 2)[0] == [("all_reduce", 8 * 4 * 8)]


def test_two_names_for_one_layout_are_refused():
    with pytest.raises(ValueError, match="output_layout or DTensor's output_layouts, not both"):
        ColwiseParallel(output_layout=Replicate(), output_layouts=DReplicate())
    with pytest.raises(ValueError, match="seq_dim or DTensor's sequence_dim, not both"):
        SequenceParallel(2, sequence_dim=0)


def test_dtensor_styles_read_as_thunder_tp_styles():
    plan = read_plan({
        "emb": dtensor.RowwiseParallel(input_layouts=DReplicate(), output_layouts=DShard(1)),
        "head": dtensor.ColwiseParallel(input_layouts=DShard(1), output_layouts=DShard(-1), use_local_output=False),
        "norm": dtensor.SequenceParallel(),
        "attn": dtensor.PrepareModuleInput(input_layouts=(DShard(1), None), desired_input_layouts=(DReplicate(), None)),
        "mlp": dtensor.PrepareModuleInputOutput(
            input_layouts=(DShard(1),), desired_input_layouts=(None,), input_kwarg_layouts={"mask": DReplicate()},
            desired_input_kwarg_layouts={"mask": DShard(0)}, output_layouts=DPartial(),
            desired_output_layouts=DShard(1)),
        "out": dtensor.PrepareModuleOutput(output_layouts=(DReplicate(), None),
                                           desired_output_layouts=(DShard(0), None)),
        "blocks.*": {"fc": dtensor.ColwiseParallel(), "": dtensor.PrepareModuleOutput(
            output_layouts=DShard(1), desired_output_layouts=DReplicate())},
    })
    assert plan == {
        "emb": RowwiseParallel(output_layout=Shard(1)),
        "head": ColwiseParallel(),
        "norm": SequenceParallel(1),
        "attn": ModuleLayouts(inputs=(Replicate(), None)),
        "mlp": ModuleLayouts(inputs=(Shard(1),), kwarg_inputs={"mask": Shard(0)}, outputs=(Shard(1),)),
        "out": ModuleLayouts(outputs=(Shard(0), None)),
        "blocks.*.fc": ColwiseParallel(),
        "blocks.*": ModuleLayouts(outputs=(Replicate(),)),
    }, plan


def test_dtensor_loss_parallel_head_merged_into_a_ready_made_plan_is_its_loss_parallel():
    """plans.litgpt's SP plan with torchtitan's loss-parallel head is plans.litgpt's SP + loss-parallel plan."""
    with torch.device("meta"):
        model = GPTWithLoss(make_config("llama"))
    head = dtensor.ColwiseParallel(input_layouts=DShard(1), output_layouts=DShard(-1), use_local_output=False)
    merged = thunder_tp.plans.litgpt(model, sequence_parallel=True) | {"gpt.lm_head": head}
    assert read_plan(merged) == thunder_tp.plans.litgpt(model, sequence_parallel=True, loss_parallel=True)


class _Custom(dtensor.ParallelStyle):
    def _apply(self, module, device_mesh):
        return module


class _Float8Like(dtensor.ColwiseParallel):
    """A subclass, as torchao's Float8ColwiseParallel, which does more than ColwiseParallel."""


@pytest.mark.parametrize("style, match", [
    (_Custom(), "'blocks.0.fc' has .*_Custom.* neither a thunder_tp style nor one of DTensor's"),
    (_Float8Like(), "'blocks.0.fc' has _Float8Like.* a subclass of DTensor's ColwiseParallel"),
    ("colwise", "'blocks.0.fc' has 'colwise', neither"),
    (dtensor.RowwiseParallel(output_layouts=DPartial("max")),
     "'blocks.0.fc', RowwiseParallel.*only Partial\\('sum'\\)"),
])
def test_an_unsupported_style_is_an_error_naming_its_key(style, match):
    with pytest.raises((TypeError, ValueError), match=match):
        TensorParallel({"blocks.0.fc": style})


def test_a_placement_thunder_tp_cannot_split_by_is_an_error_naming_its_key():
    from torch.distributed.tensor.placement_types import _StridedShard

    with pytest.raises(TypeError, match="'head'.*_StridedShard.* is not a layout thunder_tp supports"):
        TensorParallel({"head": dtensor.ColwiseParallel(output_layouts=_StridedShard(0, split_factor=2))})


def test_the_automatic_plan_prices_a_dtensor_plan_as_its_thunder_tp_equivalent():
    from tests import custom_models

    model = custom_models.MLPStack().double()
    plan = thunder_tp.plans.auto(model, *custom_models.inputs("mlp"), tp_size=2)
    dtensor_plan = {"blocks.*": {"0": dtensor.ColwiseParallel(), "2": dtensor.RowwiseParallel()}}
    own = {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}
    assert plan.price(dtensor_plan) == plan.price(own)
    with pytest.raises(ValueError, match=r"\['blocks.0'\] have ModuleLayouts .* leave them out of the plan to price"):
        plan.price({"blocks.0": dtensor.PrepareModuleInput(input_layouts=DShard(0),
                                                           desired_input_layouts=DReplicate())})


# --- plan keys: one name segment per glob segment, as DTensor's parallelize_module ------------------------------


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_1, self.fc_2 = nn.Linear(4, 8), nn.Linear(8, 4)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _MLP()
        self.blocks = nn.ModuleList([_MLP(), _MLP()])


def test_glob_keys_match_one_name_segment_per_segment():
    """`*.fc_1` is `mlp.fc_1` only (DTensor walks one child per segment), where a glob over the whole dotted name
    would also take `blocks.0.fc_1` and `blocks.1.fc_1`."""
    model = _Model()
    names = [n for n, _ in model.named_modules()]
    assert [n for n in names if fnmatchcase(n, "*.fc_1")] == ["mlp.fc_1", "blocks.0.fc_1", "blocks.1.fc_1"]
    assert list(match_plan(model, {"*.fc_1": ColwiseParallel()})) == ["mlp.fc_1"]
    assert list(match_plan(model, {"blocks.*.fc_?": ColwiseParallel()})) == [
        "blocks.0.fc_1", "blocks.0.fc_2", "blocks.1.fc_1", "blocks.1.fc_2"]
    assert list(match_plan(model, read_plan({"blocks.*": {"fc_1": ColwiseParallel()}}))) == [
        "blocks.0.fc_1", "blocks.1.fc_1"]
    assert list(match_plan(model, {"": ModuleLayouts(inputs=(Replicate(),))})) == [""]  # "": the model itself
    with pytest.raises(ValueError, match="gives key 'blocks.0.fc_1' two styles"):
        read_plan({"blocks.0.fc_1": ColwiseParallel(), "blocks.0": {"fc_1": RowwiseParallel()}})
    with pytest.raises(ValueError, match="'blocks.fc_1' matches no module"):
        match_plan(model, {"blocks.fc_1": ColwiseParallel()})


# --- PrepareModuleInput / PrepareModuleOutput: constraints where a module is called ------------------------------


class _Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16, dtype=torch.float64), nn.Linear(16, 8, dtype=torch.float64)

    def forward(self, x, *, shift, scale=1.0):
        return self.down(torch.relu(self.up(x + shift))) * scale


class _Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Shifted()

    def forward(self, x, shift):
        return self.inner(x, shift=shift, scale=2.0)


def _module_layouts(boundary) -> dict:
    """The wrapper with `boundary` on `inner` against one device; the annotations the trace holds, or the error."""
    torch.manual_seed(0)
    reference, model = _Wrapper(), _Wrapper()
    model.load_state_dict(reference.state_dict())
    x, shift = torch.randn(4, 8, dtype=torch.float64, requires_grad=True), torch.randn(4, 8, dtype=torch.float64)
    plan = {"inner.up": dtensor.ColwiseParallel(), "inner.down": dtensor.RowwiseParallel(), "inner": boundary}
    jm = thunder.jit(model, transforms=[TensorParallel(plan)])
    try:
        out = jm(x, shift)
    except (TypeError, ValueError) as e:
        return {"error": str(e)}
    torch.testing.assert_close(out, reference(x, shift), rtol=TOLERANCE, atol=TOLERANCE)
    layouts = [b.args[1] for b in thunder.last_traces(jm)[0].bound_symbols if b.sym.name == "tp_annotate"]
    return {"annotations": layouts}


def test_module_inputs_kwargs_and_outputs_are_constrained_where_the_module_is_called():
    """Positional and keyword inputs and the output each get their layout (annotations in the traced program, besides
    the linears' own), and the result is one device's."""
    boundary = dtensor.PrepareModuleInputOutput(
        input_layouts=(DReplicate(),), desired_input_layouts=(DShard(0),), input_kwarg_layouts={"shift": DReplicate()},
        desired_input_kwarg_layouts={"shift": DShard(1)}, output_layouts=DShard(0), desired_output_layouts=DShard(1))
    out = run_ranks(_module_layouts, 2, boundary)[0]
    assert out["annotations"][:2] == [Shard(0), Shard(1)] and Shard(1) in out["annotations"][2:], out


@pytest.mark.parametrize("boundary, match", [
    (dtensor.PrepareModuleInput(input_layouts=(DShard(0), None), desired_input_layouts=(DReplicate(), None)),
     r"module 'inner' has 1 positional inputs but its ModuleLayouts .* gives 2 layouts"),
    (dtensor.PrepareModuleInput(input_kwarg_layouts={"scale": DReplicate()},
                                desired_input_kwarg_layouts={"scale": None}),
     r"module 'inner': keyword input 'scale' is a float, not a tensor, but its ModuleLayouts .* layout Replicate\(\)"),
], ids=["count", "not-a-tensor"])
def test_module_layouts_that_do_not_fit_the_call_are_an_error_on_every_rank(boundary, match):
    errors = [out["error"] for out in run_ranks(_module_layouts, 2, boundary)]
    assert len(errors) == 2 and all(re.search(match, e) for e in errors), errors


# --- DTensor plans run: the benchmark Llama (modes.dtensor_plan) and a litgpt llama ------------------------


def _collectives_of(trace) -> list[tuple[str, int]]:
    """Every collective of a trace, in order: (kind, bytes)."""
    return [(c["kind"], c["bytes"]) for c in collective_calls(trace)]


def _collectives(jm) -> dict:
    """Every collective of the last forward and backward."""
    traces = {"forward": thunder.last_traces(jm)[-1], "backward": thunder.last_backward_traces(jm)[-1]}
    return {name: _collectives_of(trace) for name, trace in traces.items()}


def _run_both(make_model, make_inputs, dtensor_plan, thunder_tp_plan, tolerance: float = TOLERANCE) -> dict:
    """Each plan against one device (loss, every grad, float64); each plan's collectives and parameter layouts. The
    DTensor plan runs on the group of a DeviceMesh, as DTensor's would."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh_group = init_device_mesh("cpu", (torch.distributed.get_world_size(),)).get_group()
    runs = {}
    for name, plan, group in (("dtensor", dtensor_plan, mesh_group), ("thunder_tp", thunder_tp_plan, None)):
        transform = TensorParallel(plan, process_group=group)
        info = compare_with_single_device(make_model, make_inputs, transform, rtol=tolerance, atol=tolerance,
                                          inspect=_collectives)
        runs[name] = {"collectives": info["inspected"], "layouts": transform.parameter_layouts}
    return runs


def _benchmark_llama(kind: str, loss_parallel: bool) -> dict:
    from benchmarks.lib import llama, modes

    cfg = llama.LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab=64, ffn_hidden=64, max_seq=SEQ)

    def make_model():
        return llama.WithLoss(llama.Llama(cfg)).double()

    def make_inputs():
        torch.manual_seed(5)
        return torch.randint(0, cfg.vocab, (2, SEQ)), torch.randint(0, cfg.vocab, (2, SEQ))

    # compare.py parallelizes the Llama (WithLoss's `model`) with this plan; thunder_tp jits it with its loss
    plan = {"model": modes.dtensor_plan(kind, loss_parallel)}
    return _run_both(make_model, make_inputs, plan, llama.thunder_tp_plan(kind == "sp", loss_parallel))


@pytest.mark.parametrize("kind, loss_parallel", [
    pytest.param("sp", True, id="torchtitan-sp-lp"),
    pytest.param("sp", False, id="torchtitan-sp", marks=pytest.mark.slow(reason="sp-lp runs the same SP plan")),
    pytest.param("default", False, id="tp", marks=pytest.mark.slow(reason="sp-lp runs the same styles")),
    pytest.param("best", True, id="tp-prepare-input-lp", marks=pytest.mark.slow(reason="sp-lp has the same styles")),
])
@pytest.mark.slow  # torchtitan's plan verbatim with SP and LP: test_torchtitan's tp_sp_lp on torchtitan's own Llama
def test_benchmark_llama_dtensor_plan_as_thunder_tp_plan(kind, loss_parallel):
    """modes.dtensor_plan (torchtitan's plan for `sp`), DTensor's styles only, gives one device's loss and grads
    and the collectives and parameter splits of thunder_tp's own plan for the Llama (llama.thunder_tp_plan)."""
    runs = run_ranks(_benchmark_llama, 2, kind, loss_parallel)[0]
    assert runs["dtensor"] == runs["thunder_tp"], runs


def _litgpt_dtensor_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    """A plan for GPTWithLoss in DTensor's styles, torchtitan's per-block plan applied to every block."""
    act = DShard(1) if sequence_parallel else DReplicate()
    block = {
        "attn.qkv": dtensor.ColwiseParallel(),  # DTensor has no fused-block split: q|k|v split as one dim
        "attn.proj": dtensor.RowwiseParallel(output_layouts=act),
        "mlp.fc_1": dtensor.ColwiseParallel(),
        "mlp.fc_2": dtensor.ColwiseParallel(),
        "mlp.proj": dtensor.RowwiseParallel(output_layouts=act),
    }
    plan = {
        "transformer.wte": dtensor.RowwiseParallel(input_layouts=DReplicate(), output_layouts=act),
        "transformer.h.*": block,
        "lm_head": dtensor.ColwiseParallel(input_layouts=act,
                                           output_layouts=DShard(-1) if loss_parallel else DReplicate(),
                                           use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        block |= {
            "norm_1": dtensor.SequenceParallel(), "norm_2": dtensor.SequenceParallel(),
            # CausalSelfAttention(x, cos, sin, mask, input_pos, input_pos_maxp1)
            "attn": dtensor.PrepareModuleInput(input_layouts=(DShard(1),) + (None,) * 5,
                                               desired_input_layouts=(DReplicate(),) + (None,) * 5),
            "mlp": dtensor.PrepareModuleInput(input_layouts=(DShard(1),), desired_input_layouts=(DReplicate(),)),
        }
        plan["transformer.ln_f"] = dtensor.SequenceParallel()
    return {"gpt": plan}


def _litgpt_thunder_tp_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    """The same plan in thunder_tp's styles (no PrepareModuleInput: each linear gathers its input itself)."""
    act = Shard(1) if sequence_parallel else Replicate()
    block = "gpt.transformer.h.*."
    plan = {
        "gpt.transformer.wte": RowwiseParallel(output_layout=act),
        **{f"{block}{name}": ColwiseParallel() for name in ("attn.qkv", "mlp.fc_1", "mlp.fc_2")},
        **{f"{block}{name}": RowwiseParallel(output_layout=act) for name in ("attn.proj", "mlp.proj")},
        "gpt.lm_head": ColwiseParallel(output_layout=None if loss_parallel else Replicate()),
    }
    if sequence_parallel:
        plan |= {f"{block}norm_1": SequenceParallel(), f"{block}norm_2": SequenceParallel(),
                 "gpt.transformer.ln_f": SequenceParallel()}
    return plan


def _litgpt_llama(sequence_parallel: bool, loss_parallel: bool) -> dict:
    config = make_config("llama")

    def make_model():
        return GPTWithLoss(config).double()

    return _run_both(make_model, batch, _litgpt_dtensor_plan(sequence_parallel, loss_parallel),
                     _litgpt_thunder_tp_plan(sequence_parallel, loss_parallel), LITGPT_TOLERANCE)


@pytest.mark.parametrize("sequence_parallel, loss_parallel", [
    pytest.param(True, True, id="sp-lp"),
    pytest.param(False, False, id="tp", marks=pytest.mark.slow(reason="sp-lp runs the same styles")),
    pytest.param(True, False, id="sp", marks=pytest.mark.slow(reason="sp-lp runs the same SP plan")),
    pytest.param(False, True, id="lp", marks=pytest.mark.slow(reason="sp-lp runs the same loss-parallel head")),
])
def test_litgpt_dtensor_plan_as_thunder_tp_plan(sequence_parallel, loss_parallel):
    """A DTensor-styles plan for a litgpt llama, per-block plan nested under `transformer.h.*`, gives one device's loss
    and grads and the collectives of the same plan in thunder_tp's styles."""
    runs = run_ranks(_litgpt_llama, 2, sequence_parallel, loss_parallel)[0]
    assert runs["dtensor"] == runs["thunder_tp"], runs


# --- one style for the whole module, as parallelize_module takes it ------------------------------------------------


def _one_style_on_a_linear() -> dict:
    def make_model():
        return nn.Linear(8, 6, dtype=torch.float64)

    def make_inputs():
        torch.manual_seed(2)
        return (torch.randn(4, 8, dtype=torch.float64, requires_grad=True),)

    layouts = {}
    for name, style in (("thunder_tp", ColwiseParallel()), ("dtensor", dtensor.ColwiseParallel())):
        transform = TensorParallel(style)
        compare_with_single_device(make_model, make_inputs, transform, rtol=TOLERANCE, atol=TOLERANCE)
        layouts[name] = dict(transform.parameter_layouts)
    return layouts


def test_one_style_is_the_plan_of_the_whole_module():
    """TensorParallel(ColwiseParallel()) on a Linear (thunder_tp's style or DTensor's): its weight and bias split by
    rows, output and grads one device's."""
    layouts = run_ranks(_one_style_on_a_linear, 2)[0]
    assert layouts["thunder_tp"] == layouts["dtensor"] == {"weight": Shard(0), "bias": Shard(0)}
    assert read_plan(dtensor.RowwiseParallel()) == {"": RowwiseParallel()}


def test_a_block_plan_given_at_the_top_level_says_how_to_nest_it():
    """torchtitan's per-block plan passed as the model's: the error names the blocks' glob and the nested plan."""
    from tests.torchtitan_llama import ModelArgs, Transformer

    with pytest.raises(ValueError, match=r"'attention\.wq' matches no module.*nest the plan under their glob, "
                                         r"\{'layers\.\*': \{'attention\.wq': \.\.\.\}\}"):
        match_plan(Transformer(ModelArgs()), read_plan({"attention.wq": dtensor.ColwiseParallel()}))
