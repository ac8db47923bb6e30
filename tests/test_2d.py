"""2-D parallelism on 4 gloo ranks: thunder_tp inside Thunder's DDP / FSDP on a (dp x tp) mesh, vs single device.

Each dp group trains on its slice of a global batch; the single-device reference trains on the whole batch.
The mean over dp of the per-rank losses, every grad and the parameters after 3 SGD steps must match.
"""

import pytest
import thunder
import thunder.distributed
import torch
import torch.distributed as dist
import torch.nn as nn
from litgpt import Config
from thunder.core.proxies import DistParallelType
from thunder.distributed.transforms.ddp_v2 import DDPTransform
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import CONFIGS, SEQ, VOCAB, GPTWithLoss, batch, expected_counts
from tests.tp_checks import FAST_EXECUTORS, assert_close_scaled, assert_grads_are_shards
from thunder_tp.execution.executor import is_communication
from thunder_tp.layouts import REPLICATE
from thunder_tp.pieces import shard_tensor, unshard_tensor
from thunder_tp.tools.debug import collective_kind

WORLD, STEPS, LR, RTOL, ATOL = 4, 3, 0.5, 1e-5, 1e-5
GLOBAL_BATCH = 4
_DP_TYPE = {"ddp": DistParallelType.REPLICATED, "fsdp": DistParallelType.FULLY_SHARDED}


def _llama(n_layer: int = 2) -> Config:
    return Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, **{**CONFIGS["llama"], "n_layer": n_layer})


def _dp_transform(kind: str, mesh: thunder_tp.Mesh):
    if kind == "ddp":
        return DDPTransform(process_group=mesh.dp_group, bucket_size_in_mb=25.0, broadcast_from=None)
    return FSDPTransform(device=torch.device("cpu"), process_group=mesh.dp_group)


# --- reading results back: full parameters and grads from (dp, tp) pieces ----------------------------


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return pieces


def _assert_gathered(reference, jm, tp: thunder_tp.TensorParallel, mesh, kind: str | None, *, parameters: bool = False,
                     what: str = "grad") -> None:
    """Every grad (parameters=True: every parameter) gathered from the ranks' pieces, FSDP over dp undone first (dim 0,
    padded), then TP over tp, equals the single-device one."""
    for n, p in reference.named_parameters():
        full, local = (p.detach(), jm.get_parameter(n).detach()) if parameters else (p.grad, jm.get_parameter(n).grad)
        assert local is not None, f"no {what} of {n}"
        layout = tp.parameter_layouts.get(n, REPLICATE)
        if kind == "fsdp":
            tp_rows = shard_tensor(full, layout, mesh.tp_rank, mesh.tp).shape[0]
            local = torch.cat(_gather(local, mesh.dp_group))[:tp_rows]
        gathered = unshard_tensor(_gather(local, mesh.tp_group), layout)
        assert_close_scaled(gathered, full, rtol=RTOL, atol=ATOL, what=f"gathered {what} of {n}")


# --- trace checks -------------------------------------------------------------------------------------


def _collectives(trace, mesh) -> dict[str, int]:
    """'{tp|dp} {kind}' -> count for every collective of a final trace; each must run on the tp or the dp group."""
    counts: dict[str, int] = {}
    for bsym in trace.bound_symbols:
        if bsym.sym.is_fusion:
            assert not is_communication(bsym), f"fusion region {bsym.sym.name} contains communication"
            continue
        groups = [a for a in bsym.flat_args if isinstance(a, dist.ProcessGroup)]
        if not groups:
            continue
        ranks = {tuple(dist.get_process_group_ranks(g)) for g in groups}
        assert len(ranks) == 1, f"{bsym.sym.name} uses several groups: {ranks}"
        (ranks,) = ranks
        which = {mesh.tp_ranks: "tp", mesh.dp_ranks: "dp"}.get(ranks)
        assert which is not None, f"{bsym.sym.name} runs on ranks {ranks}: neither the tp nor the dp group"
        if bsym.sym.name.startswith("tp_"):
            assert which == "tp" or mesh.tp_ranks == mesh.dp_ranks, f"TP op {bsym.sym.name} on the dp group {ranks}"
        size = {"tp": mesh.tp, "dp": mesh.dp}[which]
        assert all(g.size() == size for g in groups), \
            f"{bsym.sym.name}: group size {groups[0].size()} != {which}={size}"
        kind = collective_kind(bsym)
        if kind is not None:
            counts[f"{which} {kind}"] = counts.get(f"{which} {kind}", 0) + 1
    return counts


def _parameter_types(jm) -> dict[str, DistParallelType]:
    """distparallel_type of each parameter as the final prologue unpacks it."""
    prologue = thunder.last_prologue_traces(jm)[-1]
    return {b.args[1]: b.output.distparallel_type for b in prologue.bound_symbols if b.sym.name == "unpack_parameter"}


# --- the training comparison --------------------------------------------------------------------------


def _train(dp: int, tp_size: int, kind: str | None, fused: bool = False, n_layer: int = 2, helper: bool = False,
           overlap: str = "auto", sequence_parallel: bool = False):
    """TP (+ DDP/FSDP) on a (dp x tp) mesh vs single device on the whole batch; returns collective counts."""
    mesh = thunder_tp.init_mesh(dp=dp, tp=tp_size)
    config = _llama(n_layer)
    torch.manual_seed(0)
    reference = GPTWithLoss(config)
    model = GPTWithLoss(config)
    model.load_state_dict(reference.state_dict())
    plan = thunder_tp.plans.litgpt(model, sequence_parallel=sequence_parallel)
    executors = thunder_tp.executors() if fused else FAST_EXECUTORS
    if helper:
        jm = thunder_tp.parallelize(model, plan, mesh, data_parallel=kind, executors=executors)
        tp = jm._lc_transforms[0]
    else:
        tp = thunder_tp.TensorParallel(plan, process_group=mesh.tp_group, overlap=overlap)
        transforms = [tp] + ([_dp_transform(kind, mesh)] if kind else [])
        jm = thunder.jit(model, executors=executors, transforms=transforms)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=LR)
    opt = torch.optim.SGD(jm.parameters(), lr=LR)
    per_dp = GLOBAL_BATCH // dp
    mine = slice(mesh.dp_rank * per_dp, (mesh.dp_rank + 1) * per_dp)
    info = {}
    for step in range(STEPS):
        idx, targets = batch(step, GLOBAL_BATCH)
        expected, actual = reference(idx, targets), jm(idx[mine], targets[mine])
        mean_loss = actual.detach().clone()
        dist.all_reduce(mean_loss, group=mesh.dp_group)
        assert_close_scaled(mean_loss / dp, expected, rtol=RTOL, atol=ATOL, what=f"mean loss over dp at step {step}")
        expected.backward()
        actual.backward()
        if step == 0:
            if kind != "fsdp":  # DDP / TP only: each rank's grad is the TP shard of the full grad
                assert_grads_are_shards(reference, jm, tp.parameter_layouts, mesh.tp_rank, mesh.tp, rtol=RTOL,
                                        atol=ATOL)
            _assert_gathered(reference, jm, tp, mesh, kind)
            info["forward"] = _collectives(thunder.last_traces(jm)[-1], mesh)
            info["backward"] = _collectives(thunder.last_backward_traces(jm)[-1], mesh)
            info["fusions"] = sum(b.sym.is_fusion for b in thunder.last_traces(jm)[-1].bound_symbols)
            info["n_params"] = len(list(reference.parameters()))
            info["layouts"] = {n: repr(layout) for n, layout in tp.parameter_layouts.items()}
            types = _parameter_types(jm)
            want_type = _DP_TYPE.get(kind)
            if want_type is not None:
                wrong = {n: t for n, t in types.items() if t is not want_type}
                assert not wrong, f"parameters lost their {want_type.name}: {wrong}"
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    _assert_gathered(reference, jm, tp, mesh, kind, parameters=True, what=f"value after {STEPS} steps")
    if fused:  # skip a second Inductor compile
        return info
    with torch.no_grad():  # a second cache entry: both transforms' trace hooks run again
        idx, targets = batch(STEPS, GLOBAL_BATCH)
        expected, actual = reference(idx, targets), jm(idx[mine], targets[mine])
        dist.all_reduce(actual, group=mesh.dp_group)
        assert_close_scaled(actual / dp, expected, rtol=RTOL, atol=ATOL, what="mean loss over dp under no_grad")
    return info


def _expected_tp(n_layer: int = 2) -> tuple[dict, dict]:
    """TP's own collectives, as on TP ranks alone (tests/test_litgpt.py), named as _train counts them."""
    forward, backward = expected_counts(_llama(n_layer), "tp", 2)
    return tuple({f"tp {kind}": n for kind, n in counts.items()} for counts in (forward, backward))


def test_tp_inside_ddp_matches_single_device():
    info = run_ranks(_train, WORLD, 2, 2, "ddp", helper=True)[0]  # through thunder_tp.parallelize
    forward, backward = _expected_tp()
    assert info["forward"] == forward, info["forward"]  # DDP adds nothing to the forward
    dp_backward = {k: v for k, v in info["backward"].items() if k.startswith("dp")}
    assert set(dp_backward) == {"dp all_reduce"}, info["backward"]  # grads averaged over dp (maybe bucketed)
    assert {k: v for k, v in info["backward"].items() if k.startswith("tp")} == backward, info["backward"]


def test_tp_inside_fsdp_matches_single_device():
    info = run_ranks(_train, WORLD, 2, 2, "fsdp")[0]
    forward, backward = _expected_tp()
    n = info["n_params"]
    assert info["forward"] == {**forward, "dp all_gather": n}, info["forward"]  # one all_gather per parameter
    assert info["backward"] == {**backward, "dp reduce_scatter": n}, info["backward"]  # one reduce_scatter each


@pytest.mark.slow  # the decomposition itself: test_overlap; here its pieces on the TP subgroups of a 2-D mesh
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_collectives_decomposed_for_overlap_inside_data_parallelism(kind):
    info = run_ranks(_train, WORLD, 2, 2, kind, overlap="always", sequence_parallel=True)[0]
    assert info["forward"].get("tp send_recv", 0) > 0 and info["backward"].get("tp send_recv", 0) > 0, info


@pytest.mark.slow  # TP on 4 ranks: test_litgpt's TP=4 case; parallelize(): test_fsdp_only_on_a_tp1_mesh
def test_tp_only_on_a_dp1_mesh():
    info = run_ranks(_train, WORLD, 1, 4, None, helper=True)[0]
    forward, backward = _expected_tp()
    assert info["forward"] == forward and info["backward"] == backward, info


@pytest.mark.slow  # parallelize(): test_tp_inside_ddp; FSDP over dp: test_tp_inside_fsdp
def test_fsdp_only_on_a_tp1_mesh():
    info = run_ranks(_train, WORLD, 4, 1, "fsdp", helper=True)[0]
    n = info["n_params"]
    assert info["layouts"]["gpt.lm_head.weight"] == "Shard(0)", info["layouts"]  # TP ran, on a group of one
    dp_forward = {k: v for k, v in info["forward"].items() if k.startswith("dp")}
    tp_forward = {k: v for k, v in info["forward"].items() if k.startswith("tp")}
    assert dp_forward == {"dp all_gather": n}, info["forward"]
    assert tp_forward in ({}, _expected_tp()[0]), info["forward"]  # TP on one rank may skip its no-op collectives


@pytest.mark.slow  # TP inside FSDP: the test above; FSDP's collectives out of fusions: test_executor's FSDP case
def test_tp_inside_fsdp_with_the_fusion_executor():
    """thunder_tp.executors(): compute fused by Inductor, every TP / FSDP collective outside the regions."""
    info = run_ranks(_train, WORLD, 2, 2, "fsdp", True, 1, timeout=900)[0]
    assert info["fusions"] > 0, info
    forward, backward = _expected_tp(1)
    n = info["n_params"]
    assert info["forward"] == {**forward, "dp all_gather": n}, info["forward"]
    assert info["backward"] == {**backward, "dp reduce_scatter": n}, info["backward"]


# --- FSDP padding: TP shards whose dim 0 does not divide by dp -------------------------------------


class OddMLP(nn.Module):
    """fc1's TP shard has 3 rows, fc2's weight and bias 5: FSDP over dp=2 pads them."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).square().mean()


def _odd_mlp_fsdp():
    mesh = thunder_tp.init_mesh(dp=2, tp=2)
    torch.manual_seed(0)
    reference = OddMLP()
    model = OddMLP()
    model.load_state_dict(reference.state_dict())
    plan = {"fc1": thunder_tp.ColwiseParallel(), "fc2": thunder_tp.RowwiseParallel()}
    tp = thunder_tp.TensorParallel(plan, process_group=mesh.tp_group)
    fsdp = _dp_transform("fsdp", mesh)
    jm = thunder.jit(model, executors=FAST_EXECUTORS, transforms=[tp, fsdp])
    torch.manual_seed(1)
    x = torch.randn(8, 3, 5)
    mine = slice(mesh.dp_rank * 4, mesh.dp_rank * 4 + 4)
    expected, actual = reference(x), jm(x[mine])
    mean_loss = actual.detach().clone()
    dist.all_reduce(mean_loss, group=mesh.dp_group)
    assert_close_scaled(mean_loss / 2, expected, rtol=RTOL, atol=ATOL, what="mean loss")
    expected.backward()
    actual.backward()
    _assert_gathered(reference, jm, tp, mesh, "fsdp")
    return {n: (tuple(old), tuple(new)) for n, (old, new, _) in fsdp.sharded_params.items()}


def test_fsdp_pads_tp_shards():
    shapes = run_ranks(_odd_mlp_fsdp, WORLD)[0]
    assert shapes == {  # (TP shard, FSDP shard of the padded TP shard)
        "fc1.weight": ((3, 5), (2, 5)), "fc1.bias": ((3,), (2,)), "fc2.weight": ((5, 3), (3, 3)),
        "fc2.bias": ((5,), (3,)),
    }, shapes


# --- the mesh -------------------------------------------------------------------------------------


def _mesh_layouts():
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for dp, tp in ((2, 2), (1, 4), (4, 1)):
        m = thunder_tp.init_mesh(dp=dp, tp=tp)
        out[(dp, tp)] = (m.dp, m.tp, m.dp_rank, m.tp_rank, m.dp_ranks, m.tp_ranks,
                         tuple(dist.get_process_group_ranks(m.dp_group)),
                         tuple(dist.get_process_group_ranks(m.tp_group)))
    m = thunder_tp.init_mesh(tp=2)
    out["tp only"] = (m.dp, m.tp)
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = thunder_tp.init_mesh(device_mesh)
    out["device mesh"] = (m.dp, m.tp, m.dp_rank, m.tp_rank, m.dp_ranks, m.tp_ranks,
                          tuple(dist.get_process_group_ranks(m.dp_group)),
                          tuple(dist.get_process_group_ranks(m.tp_group)))
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))  # dims found by name
    m = thunder_tp.init_mesh(device_mesh=swapped)
    out["swapped"] = (m.dp_ranks, m.tp_ranks)
    return out


def test_init_mesh_is_tp_fastest():
    results = run_ranks(_mesh_layouts, WORLD)
    tp_groups, dp_groups = [(0, 1), (0, 1), (2, 3), (2, 3)], [(0, 2), (1, 3), (0, 2), (1, 3)]
    for rank, out in enumerate(results):
        want = (2, 2, rank // 2, rank % 2, dp_groups[rank], tp_groups[rank], dp_groups[rank], tp_groups[rank])
        assert out[(2, 2)] == want, (rank, out)
        assert out["device mesh"] == want, (rank, out)
        assert out[(1, 4)] == (1, 4, 0, rank, (rank,), (0, 1, 2, 3), (rank,), (0, 1, 2, 3)), (rank, out)
        assert out[(4, 1)] == (4, 1, rank, 0, (0, 1, 2, 3), (rank,), (0, 1, 2, 3), (rank,)), (rank, out)
        assert out["tp only"] == (2, 2), out
        assert out["swapped"] == (tp_groups[rank], dp_groups[rank]), out  # dims ("tp", "dp"): dp is the fast one


# --- bad input ------------------------------------------------------------------------------------


def _message(fn, exc=Exception) -> str:
    with pytest.raises(exc) as excinfo:
        fn()
    return str(excinfo.value)


def _bad_inputs():
    config = _llama(1)
    mesh = thunder_tp.init_mesh(dp=2, tp=2)

    def jit(transforms, model=None):
        torch.manual_seed(0)
        model = model or GPTWithLoss(config)
        plan = thunder_tp.plans.litgpt(model)
        tp = thunder_tp.TensorParallel(plan, process_group=mesh.tp_group)
        return thunder.jit(model, executors=FAST_EXECUTORS, transforms=[t if t != "tp" else tp for t in transforms])

    out = {
        "tp=3": _message(lambda: thunder_tp.init_mesh(tp=3), ValueError),
        "dp*tp": _message(lambda: thunder_tp.init_mesh(dp=3, tp=2), ValueError),
        "ddp first": _message(lambda: jit([_dp_transform("ddp", mesh), "tp"]), ValueError),
        "fsdp first": _message(lambda: jit([_dp_transform("fsdp", mesh), "tp"]), ValueError),
        "same group": _message(lambda: jit(["tp", DDPTransform(process_group=mesh.tp_group, bucket_size_in_mb=25.0,
                                                               broadcast_from=None)]), ValueError),
        "fsdp on world": _message(lambda: jit(["tp", FSDPTransform(device=torch.device("cpu"))]), ValueError),
        # thunder.distributed.ddp re-jits with DDPTransform on (a copy of) the default group: overlaps TP's
        "ddp() on world": _message(lambda: thunder.distributed.ddp(jit(["tp"])), ValueError),
    }
    # Thunder leaves use_ddp on the original module; jitting it again TP-first must still work
    model = GPTWithLoss(config)
    for _ in range(2):
        jit(["tp", _dp_transform("ddp", mesh)], model)
    out["mesh as group"] = _message(
        lambda: thunder.jit(nn.Sequential(nn.Linear(4, 4)),
                            transforms=[thunder_tp.TensorParallel({"0": thunder_tp.ColwiseParallel()},
                                                                  process_group=mesh)]),
        TypeError,
    )
    first_two = dist.new_group([0, 1])  # every rank creates it; ranks 2 and 3 are not members
    if dist.get_rank() >= 2:
        tp = thunder_tp.TensorParallel({"0": thunder_tp.ColwiseParallel()}, process_group=first_two)
        out["not a member"] = _message(lambda: thunder.jit(nn.Sequential(nn.Linear(4, 4)), transforms=[tp]), ValueError)
    return out


def test_bad_inputs_give_clear_errors():
    results = run_ranks(_bad_inputs, WORLD)
    for rank, out in enumerate(results):
        assert "world size 4 is not divisible by tp=3" in out["tp=3"], out["tp=3"]
        assert "dp * tp = 3 * 2 = 6 does not match the world size 4" in out["dp*tp"], out["dp*tp"]
        for key, name in (("ddp first", "DDPTransform"), ("fsdp first", "FSDPTransform")):
            assert f"TensorParallel must be applied before {name}" in out[key] and "list it first" in out[key], out[key]
        assert "overlap" in out["same group"] and "mesh.dp_group" in out["same group"], out["same group"]
        assert "overlap" in out["ddp() on world"] and "DDPTransform" in out["ddp() on world"], out["ddp() on world"]
        assert "overlap" in out["fsdp on "
                                "world"] and "(ranks [0, 1, 2, 3])" in out["fsdp on world"], out["fsdp on world"]
        assert "got Mesh" in out["mesh as group"] and "pass mesh.tp_group" in out["mesh as group"], out["mesh as group"]
        if rank >= 2:
            assert f"rank {rank} is not a member of the given TP process group" in out["not a member"], out
            assert "init_mesh" in out["not a member"], out
