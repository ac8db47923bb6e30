"""Core TP on single layers, meta-device models, distparallel_type, annotate(), rule-less ops and bf16."""

import pytest
import thunder
import torch
import torch.nn as nn
from thunder.core.proxies import DistParallelType

import thunder_tp
from tests.dist import run_ranks
from tests.parallel_mlp import HIDDEN, MLP, PLAN, mlp_input
from tests.tp_checks import FAST_EXECUTORS, compare_with_single_device, rank_and_size
from thunder_tp import ColwiseParallel, RowwiseParallel, Shard, TensorParallel, annotate


def _linear(style_name, bias):
    style = {"col": ColwiseParallel(), "row": RowwiseParallel()}[style_name]
    def make():
        return nn.Sequential(nn.Linear(64, 96, bias=bias))
    def inputs():
        return (torch.randn(4, 5, 64, requires_grad=True),)
    return compare_with_single_device(make, inputs, TensorParallel({"0": style}))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("style", ["col", "row"])
def test_linear(style, bias, world):
    info = run_ranks(_linear, world, style, bias)[0]
    if style == "col":  # output gathered for the caller; input grad all-reduced
        assert info["forward"] == {"all_gather": 1} and info["backward"] == {"all_reduce": 1}, info
    else:  # input sliced locally; partial sums reduced once, bias added after
        assert info["forward"] == {"all_reduce": 1} and info["backward"] == {"all_gather": 1}, info


def _embedding(style_name):
    style = {"col": ColwiseParallel(), "row": RowwiseParallel()}[style_name]
    def make():
        return nn.Sequential(nn.Embedding(64, 32))
    def inputs():
        return (torch.randint(0, 64, (3, 7)),)
    return compare_with_single_device(make, inputs, TensorParallel({"0": style}))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("style", ["col", "row"])
def test_embedding(style, world):
    info = run_ranks(_embedding, world, style)[0]
    kind = "all_gather" if style == "col" else "all_reduce"  # embedding dim gathered / vocabulary partials summed
    assert info["forward"] == {kind: 1}, info


def _meta_mlp():
    from thunder.transforms import MaterializationTransform

    with torch.device("meta"):
        model = MLP()
    init = MaterializationTransform.init_from_original_module_init()
    # materialization re-runs each module's init at full size (same seed on all ranks), then shards
    torch.manual_seed(0)
    transforms = [TensorParallel(PLAN), MaterializationTransform("cpu", init=init)]
    jm = thunder.jit(model, transforms=transforms, executors=FAST_EXECUTORS)
    torch.manual_seed(0)
    reference = MLP()
    (x,) = mlp_input()
    torch.testing.assert_close(jm(x), reference(x), rtol=1e-5, atol=1e-5)
    rank, size = rank_and_size()
    expected = torch.chunk(reference.fc1.weight, size, 0)[rank]
    torch.testing.assert_close(jm.get_parameter("fc1.weight"), expected)
    return tuple(jm.get_parameter("fc2.weight").shape)


def test_mlp_created_on_meta_device():
    assert run_ranks(_meta_mlp, 2) == [(HIDDEN, 256), (HIDDEN, 256)]


def _annotated_mlp():
    model = MLP()
    model.fc1.weight.distparallel_type = DistParallelType.COLUMN_WISE
    model.fc2.weight.distparallel_type = DistParallelType.ROW_WISE
    return model


def _distparallel_type():
    transform = TensorParallel()
    info = compare_with_single_device(_annotated_mlp, mlp_input, transform)
    info["layouts"] = {k: repr(v) for k, v in transform.parameter_layouts.items()}
    return info


def test_distparallel_type_annotations():
    info = run_ranks(_distparallel_type, 2)[0]
    assert info["layouts"] == {"fc1.weight": "Shard(0)", "fc1.bias": "Shard(0)", "fc2.weight": "Shard(1)",
                               "fc2.bias": "Replicate()"}
    assert info["forward"] == {"all_reduce": 1} and info["backward"] == {"all_reduce": 1}, info


def _matmul_fn(a, b):
    return annotate(a, Shard(0)) @ annotate(b, Shard(1))


def _annotated_matmul():
    torch.manual_seed(0)
    a = torch.randn(8, 6, requires_grad=True)
    b = torch.randn(6, 12, requires_grad=True)
    jf = thunder.jit(_matmul_fn, transforms=[TensorParallel()], executors=FAST_EXECUTORS)
    out = jf(a, b)
    torch.testing.assert_close(out, a @ b)
    out.sum().backward()
    a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (a_ref @ b_ref).sum().backward()
    torch.testing.assert_close(a.grad, a_ref.grad)
    torch.testing.assert_close(b.grad, b_ref.grad)
    return str(thunder.last_traces(jf)[-1])


@pytest.mark.parametrize("world", [2, 4])
def test_annotated_matmul_returns_full_product(world):
    trace = run_ranks(_annotated_matmul, world)[0]
    assert "all_gather" in trace


def _partial_plus_number_fn(a, b, c):
    return annotate(a, Shard(1)) @ annotate(b, Shard(0)) + c  # a Partial product plus a number


def _partial_plus_number(cache: str):
    torch.manual_seed(0)
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    jf = thunder.jit(_partial_plus_number_fn, transforms=[TensorParallel()], executors=FAST_EXECUTORS, cache=cache)
    torch.testing.assert_close(jf(a, b, 3.0), a @ b + 3.0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_partial_plus_number_adds_it_once(cache):
    """Under symbolic values the number is a NumberProxy, not a Number: it must still be added once, not per rank."""
    run_ranks(_partial_plus_number, 2, cache)


def _rows_to_columns_fn(x, weights):
    rows = annotate(x * 2, Shard(0))
    return (annotate(rows + 1, Shard(1)) * weights).sum(0)


def _rows_to_columns():
    """Shard(0) -> Shard(1): one all_to_all each way; values and grads exact (float64) vs eager."""
    from tests.tp_checks import collective_counts

    torch.manual_seed(0)
    x, weights = torch.randn(8, 12, dtype=torch.float64, requires_grad=True), torch.randn(8, 12, dtype=torch.float64)
    jf = thunder.jit(_rows_to_columns_fn, transforms=[TensorParallel()], executors=FAST_EXECUTORS)
    out = jf(x, weights)
    (out * torch.arange(12.0, dtype=torch.float64)).sum().backward()
    reference = x.detach().clone().requires_grad_()
    expected = _rows_to_columns_fn(reference, weights)
    (expected * torch.arange(12.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, reference.grad, rtol=1e-12, atol=1e-12)
    return {"forward": collective_counts(thunder.last_traces(jf)[-1]),
            "backward": collective_counts(thunder.last_backward_traces(jf)[-1])}


@pytest.mark.parametrize("world", [2, 4])
def test_shard_to_another_dim_is_one_all_to_all(world):
    counts = run_ranks(_rows_to_columns, world)[0]
    # forward: the all_to_all, then the (12,) column sums gathered for the caller; backward: the conjugates, and
    # the all_gather of x's row-sliced grad (x enters replicated)
    each = {"all_to_all": 1, "all_gather": 1}
    assert counts == {"forward": each, "backward": each}, counts


class MLPWithUnknownOp(MLP):
    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        return self.fc2(torch.roll(h, 1, -1))  # no rule: runs on the gathered value, then re-sliced


def _unknown_op():
    return compare_with_single_device(MLPWithUnknownOp, mlp_input, TensorParallel(PLAN))


def test_op_without_rule_falls_back_to_replicate():
    info = run_ranks(_unknown_op, 2)[0]
    assert info["forward"].get("all_gather") == 1, info


def _bf16():
    def make():
        return MLP().to(torch.bfloat16)
    def inputs():
        return tuple(x.detach().to(torch.bfloat16).requires_grad_() for x in mlp_input())
    return compare_with_single_device(make, inputs, TensorParallel(PLAN), rtol=2e-2, atol=2e-2)


def test_bf16_mlp():
    info = run_ranks(_bf16, 2)[0]
    assert info["forward"] == {"all_reduce": 1}, info


# --- bad input ------------------------------------------------------------------------------------


def _error(make_model, plan):
    with pytest.raises(Exception) as excinfo:
        thunder.jit(make_model(), transforms=[TensorParallel(plan)], executors=FAST_EXECUTORS)
    return f"{type(excinfo.value).__name__}: {excinfo.value}"


def _conflicting():
    model = MLP()
    model.fc1.weight.distparallel_type = DistParallelType.ROW_WISE
    return model


def _too_narrow():
    return MLP(ffn=3)  # 3 features over 4 ranks: one would hold none (510 would split 128, 128, 127, 127)


def _bad_inputs():
    return {
        "unmatched": _error(MLP, {"fc3": ColwiseParallel()}),
        "unmatched_glob": _error(MLP, {"layers.*.fc1": ColwiseParallel()}),
        "too_narrow": _error(_too_narrow, PLAN),
        "unsupported": _error(lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU()), {"1": ColwiseParallel()}),
        "conflict": _error(_conflicting, PLAN),
    }


def test_bad_inputs_give_clear_errors():
    errors = run_ranks(_bad_inputs, 4)[0]
    assert "'fc3' matches no module" in errors["unmatched"] and "fc1" in errors["unmatched"], errors
    assert "'layers.*.fc1' matches no module" in errors["unmatched_glob"], errors
    assert "'fc1.weight'" in errors["too_narrow"] and "dim 0 of size 3" in errors["too_narrow"], errors
    assert "cannot be split over 4 ranks" in errors["too_narrow"], errors
    assert "ReLU" in errors["unsupported"] and "nn.Linear" in errors["unsupported"], errors
    assert "ROW_WISE" in errors["conflict"] and "fc1.weight" in errors["conflict"], errors


def test_uninitialized_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="init_process_group"):
        thunder.jit(MLP(), transforms=[TensorParallel(PLAN)], executors=thunder_tp.executors())


def _proxy_types():
    jm = thunder.jit(MLP(), transforms=[TensorParallel(PLAN)], executors=FAST_EXECUTORS)
    jm(*mlp_input())
    names = {b.output.name: b.args[1] for b in thunder.last_prologue_traces(jm)[-1].bound_symbols
             if b.sym.name == "unpack_parameter"}
    computation = thunder.last_traces(jm)[0]
    return {names[a.name]: a.distparallel_type.name for a in computation.args if a.name in names}


def test_sharded_proxies_carry_distparallel_type():
    types = run_ranks(_proxy_types, 2)[0]
    assert types == {"fc1.weight": "COLUMN_WISE", "fc1.bias": "COLUMN_WISE", "fc2.weight": "ROW_WISE",
                     "fc2.bias": "NONE"}, types


def _state_dicts():
    torch.manual_seed(0)
    model = MLP(bias=True)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    jm = thunder.jit(model, transforms=[TensorParallel(PLAN)], executors=FAST_EXECUTORS)
    local = jm.state_dict()
    assert local["fc1.weight"].shape[0] == full["fc1.weight"].shape[0] // rank_and_size()[1]
    for k, v in jm.original_state_dict().items():
        torch.testing.assert_close(v, full[k], msg=lambda m, k=k: f"{k}: {m}")
    fresh = MLP(bias=True)
    jm2 = thunder.jit(fresh, transforms=[TensorParallel(PLAN)], executors=FAST_EXECUTORS)
    jm2.load_original_state_dict(full)
    torch.testing.assert_close(jm2.get_parameter("fc2.weight"), jm.get_parameter("fc2.weight"))
    return sorted(full)


def test_original_state_dict_round_trip():
    assert run_ranks(_state_dicts, 2)[0] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
