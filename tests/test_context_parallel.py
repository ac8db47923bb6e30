"""Context parallelism (thunder_tp.ContextParallel): the sequence split over the ranks, attention over keys and values
gathered, the loss averaged over the global tokens, the replicated parameters' grads summed: one device's loss and
every grad (float64), with and without head-tail load balancing, for litgpt and HF models."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
import torch.distributed as dist
from thunder.core import dtypes

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import SEQ, batch, make_config
from tests.tp_checks import FAST_EXECUTORS, assert_grads_are_shards, assert_simulated_grads_are_shards, rank_and_size
from thunder_tp.collectives.calls import collective_calls
from thunder_tp.plans.litgpt import GPTWithLoss

TOL = dict(rtol=1e-6, atol=1e-6)  # litgpt's and HF's RMSNorm compute in float32


def _litgpt(name: str) -> torch.nn.Module:
    from tests.litgpt_models import zoo_config

    torch.manual_seed(0)
    return GPTWithLoss(zoo_config(name) if name.startswith("Gemma") else make_config(name))


def _hf_llama() -> torch.nn.Module:
    from tests.hf_models import make_model

    model = thunder_tp.plans.hf.CausalLMLoss(make_model("llama"))
    thunder_tp.plans.hf(model)  # HF's lookasides registered, as a plan does
    return model


@pytest.mark.usefixtures("simulated_float64")
@pytest.mark.parametrize(("model", "world", "load_balance"), [
    ("llama", 2, False), ("llama", 2, True), ("neox", 4, True), ("hf_llama", 2, True), ("Gemma-2-2b", 2, True)])
def test_simulated_ranks_give_one_devices_loss_and_grads(model, world, load_balance):
    """A litgpt llama (GQA, RoPE), a gpt-neox (partial rotary, parallel residual), an HF Llama and Gemma-2 (a
    sliding window, soft-capped scores: attention as matmuls) on simulated ranks: the loss and every grad of one
    device; per block the keys and values gathered (their grads reduce-scattered), the loss's sum and count in one
    all_reduce, the replicated parameters' grads summed at the end."""
    reference = _hf_llama() if model == "hf_llama" else _litgpt(model)
    cp_model = copy.deepcopy(reference)
    idx, targets = batch(0)
    expected = reference(idx, targets)
    expected.backward()
    with thunder_tp.simulate(world_size=world):
        cp = thunder_tp.ContextParallel(load_balance=load_balance)
        jm = thunder.jit(cp_model, transforms=[cp], executors=thunder_tp.executors())
        loss = jm(idx, targets)
        loss.backward()
        for value in thunder_tp.per_rank(loss).values():
            torch.testing.assert_close(value, expected.detach(), **TOL)
        assert_simulated_grads_are_shards(reference, jm, {}, world, **TOL)
        forward = thunder_tp.collectives_table(thunder.last_traces(jm)[-1])
        backward = thunder_tp.collectives_table(thunder.last_backward_traces(jm)[-1])
    layers = 2
    gathers = [r for r in forward if r["kind"] == "all_gather" and r["bytes_per_call"] > 256]  # (not token ids)
    assert sum(r["count"] for r in gathers) == 2 * layers, forward
    scatters = [r for r in backward if r["kind"] == "reduce_scatter"]
    assert sum(r["count"] for r in scatters) == 2 * layers, backward


def _litgpt_steps(load_balance: bool, rotate: str) -> None:
    """2 gloo ranks, 3 SGD steps of a litgpt llama: every loss and grad one device's."""
    reference = _litgpt("llama").double()
    model = copy.deepcopy(reference)
    jm = thunder.jit(model, transforms=[thunder_tp.ContextParallel(load_balance=load_balance, rotate=rotate)],
                     executors=FAST_EXECUTORS)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, jm)]
    rank, size = rank_and_size()
    for step in range(3):
        expected, loss = reference(*batch(step)), jm(*batch(step))
        expected.backward()
        loss.backward()
        torch.testing.assert_close(loss, expected, **TOL, msg=f"loss of step {step}")
        assert_grads_are_shards(reference, jm, {}, rank, size, **TOL, what=f"step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("rotate", ["allgather", "ring"])
@pytest.mark.parametrize("load_balance", [False, True], ids=["in order", "head-tail"])
def test_training_steps_on_gloo_ranks_are_one_devices(load_balance, rotate):
    """Real ranks, keys and values gathered or passed around the ring: 3 SGD steps, the replicated weights updated
    alike on every rank from summed grads."""
    run_ranks(_litgpt_steps, 2, load_balance, rotate)


@pytest.mark.usefixtures("simulated_float64")
def test_a_sequence_the_ranks_cannot_split_is_a_clear_error():
    """A sequence length CP (or, load-balanced, 2 x CP) does not divide: an error naming the lengths that work."""
    model = _litgpt("llama")
    idx, targets = batch(0)
    with thunder_tp.simulate(world_size=4):
        jm = thunder.jit(model, transforms=[thunder_tp.ContextParallel()], executors=thunder_tp.executors())
        with pytest.raises(ValueError, match=f"a sequence of {SEQ - 4} cannot be cut into 2 x CP = 8 chunks .* "
                                             "multiple of 8 or ContextParallel\\(load_balance=False\\)"):
            jm(idx[:, 4:], targets[:, 4:])


def _cp_tp_steps(family: str, sequence_parallel: bool, rotate: str) -> None:
    """A (cp 2 x tp 2) mesh of 4 gloo ranks: ContextParallel over the CP group, then TensorParallel over the TP
    group; 3 SGD steps of a litgpt or HF llama, every loss and grad one device's (the grads TP's shards)."""
    mesh = thunder_tp.init_mesh(dp=2, tp=2)  # a (cp x tp) mesh is laid out as a (dp x tp) one: its dp groups
    reference = _litgpt("llama").double() if family == "litgpt" else _hf_llama()
    model = copy.deepcopy(reference)
    plans = thunder_tp.plans.litgpt if family == "litgpt" else thunder_tp.plans.hf
    plan = plans(model, sequence_parallel=sequence_parallel, loss_parallel=sequence_parallel)
    tp = thunder_tp.TensorParallel(plan, process_group=mesh.tp_group)
    cp = thunder_tp.ContextParallel(mesh.dp_group, rotate=rotate)
    jm = thunder.jit(model, transforms=[cp, tp], executors=FAST_EXECUTORS)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, jm)]
    for step in range(3):
        expected, loss = reference(*batch(step)), jm(*batch(step))
        expected.backward()
        loss.backward()
        torch.testing.assert_close(loss, expected, **TOL, msg=f"loss of step {step}")
        assert_grads_are_shards(reference, jm, tp.parameter_layouts, mesh.tp_rank, mesh.tp, **TOL,
                                what=f"step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    _assert_tp_collectives_as_without_cp(thunder.last_traces(jm)[-1], mesh, sequence_parallel, rotate)


def _assert_tp_collectives_as_without_cp(trace, mesh, sequence_parallel: bool, rotate: str) -> None:
    """Over the TP group nothing of attention is gathered (its heads stay split: CP's attention runs on each TP
    rank's heads), SP's all_gathers and reduce_scatters replace the all_reduces (the plan's styles reach the modules
    that read CP's copies of their weights), each labelled with its module; over the CP group the keys and values
    move, labelled with the rotation."""
    calls = collective_calls(trace)
    over_tp = [c["issued_by"] for c in calls if c["group"] is mesh.tp_group]
    assert over_tp and not [label for label in over_tp if "attention" in label], over_tp
    reduced = [c["issued_by"] for c in calls if c["group"] is mesh.tp_group and c["kind"] == "all_reduce"]
    assert not reduced if sequence_parallel else reduced, reduced
    assert [label for label in over_tp if label.startswith(("gpt.", "model."))], over_tp
    if sequence_parallel:  # and loss parallel: the logits' (log-sum-exp, target logit) pairs gathered, not the logits
        rows = batch(0)[0].numel() // 2
        loss = [c for c in calls if c["group"] is mesh.tp_group and "cross_entropy" in c["issued_by"]]
        assert [c["kind"] for c in loss] == ["all_gather"] and loss[0]["bytes"] <= 2 * rows * 8 * 2, loss
    over_cp = [c for c in calls if c["group"] is mesh.dp_group and c["kind"] != "all_reduce"]
    rotation = "gathered (all-gather)" if rotate == "allgather" else "passed (ring)"
    keys_and_values = {c["issued_by"] for c in over_cp if dtypes.is_float_dtype(c["bsym"].flat_args[0].dtype)}
    assert keys_and_values == {f"context parallel: keys and values {rotation}"}, keys_and_values
    # besides: HF's loss pads its labels by one token before shifting them, which gathers the (integer) labels'
    assert {c["issued_by"].split(":")[0] for c in over_cp} <= {"context parallel", "pad"}, over_cp


@pytest.mark.parametrize(("family", "sequence_parallel", "rotate"), [
    ("litgpt", False, "allgather"), ("litgpt", True, "ring"), ("hf", True, "allgather")],
    ids=["litgpt-tp-allgather", "litgpt-tp_sp-ring", "hf-tp_sp-allgather"])
def test_context_and_tensor_parallel_on_a_mesh(family, sequence_parallel, rotate):
    """CP x TP (and TP's SP with loss parallel), 4 ranks, keys and values gathered or passed around the ring: one
    device's losses and grads for 3 steps."""
    run_ranks(_cp_tp_steps, 4, family, sequence_parallel, rotate)


def _gather_over(t: torch.Tensor, group) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return torch.cat(pieces)


def _cp_inside_data_parallel_steps(kind: str) -> list[dict[str, int]]:
    """A (dp 2 x cp 2) mesh of 4 gloo ranks: ContextParallel over consecutive ranks (the mesh's tp groups), then
    Thunder's DDPTransform or FSDPTransform over the other dim; each DP pair fed its own half of the batch, 3 SGD
    steps: the mean loss over DP and every grad (DDP: averaged over DP; FSDP: its shards gathered over DP) those of
    one device on the whole batch. Returns the forward's and the backward's collectives (a program without CP gives
    the same numbers: only its collectives tell)."""
    from thunder.distributed.transforms.ddp_v2 import DDPTransform
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    mesh = thunder_tp.init_mesh(dp=2, tp=2)  # the tp groups (ranks 0, 1 and 2, 3) are the CP groups
    reference = _litgpt("llama").double()
    model = copy.deepcopy(reference)
    cp_group, dp_group = mesh.tp_group, mesh.dp_group
    data_parallel = (DDPTransform(process_group=dp_group, bucket_size_in_mb=25.0, broadcast_from=None) if kind == "ddp"
                     else FSDPTransform(device=torch.device("cpu"), process_group=dp_group))
    jm = thunder.jit(model, transforms=[thunder_tp.ContextParallel(cp_group), data_parallel], executors=FAST_EXECUTORS)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, jm)]
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    for step in range(3):
        idx, targets = batch(step, 2 * dp)  # the DP ranks' batches, concatenated
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)
        expected, loss = reference(idx, targets), jm(idx[mine], targets[mine])
        expected.backward()
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        torch.testing.assert_close(mean / dp, expected.detach(), **TOL, msg=f"mean loss over DP of step {step}")
        for name, p in reference.named_parameters():
            grad = jm.get_parameter(name).grad
            assert grad is not None, f"no grad of {name}"
            if kind == "fsdp":  # dim 0 sharded over DP (padded)
                assert grad.shape[0] == -(-p.shape[0] // dp), f"{name}'s grad {tuple(grad.shape)}: not FSDP's shard"
                grad = _gather_over(grad, dp_group)[: p.shape[0]]
            torch.testing.assert_close(grad, p.grad, **TOL, msg=f"grad of {name} at step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    groups = {tuple(dist.get_process_group_ranks(g)): name for g, name in ((cp_group, "cp"), (dp_group, "dp"))}
    return [_collectives_by_group(trace, groups) for trace in (thunder.last_traces(jm)[-1],
                                                              thunder.last_backward_traces(jm)[-1])]


def _collectives_by_group(trace, groups: dict[tuple[int, ...], str]) -> dict[str, int]:
    """'{cp|dp} {kind}: {label}' -> count, every collective's group the CP or the DP one."""
    counts: dict[str, int] = {}
    for c in collective_calls(trace):
        ranks = tuple(dist.get_process_group_ranks(c["group"] or dist.group.WORLD))
        assert ranks in groups, f"{c['kind']} ({c['issued_by']}) over ranks {ranks}: neither the CP nor the DP group"
        key = f"{groups[ranks]} {c['kind']}: {c['issued_by']}"
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_context_parallel_inside_data_parallel(kind):
    """CP over one dim of a (dp 2 x cp 2) mesh inside Thunder's DDP or FSDP over the other: one device's losses and
    grads on the DP ranks' batches for 3 steps; CP's collectives (keys and values, the loss, the grads summed) over
    the CP group, DDP's all_reduces or FSDP's all_gather and reduce_scatter per parameter over the DP group."""
    n, layers = len(list(_litgpt("llama").parameters())), 2
    keys_and_values = "context parallel: keys and values gathered (all-gather)"
    for forward, backward in run_ranks(_cp_inside_data_parallel_steps, 4, kind):
        fsdp_gathers = {"dp all_gather: (data parallelism)": n} if kind == "fsdp" else {}  # one per parameter
        assert forward == {f"cp all_gather: {keys_and_values}": 2 * layers, **fsdp_gathers,
                           "cp all_reduce: cross_entropy: cross_entropy computed on shards": 1}, forward
        summed = {k: v for k, v in backward.items() if k.startswith("cp all_reduce: replicated parameters")}
        assert sum(int(k.split()[-2]) * v for k, v in summed.items()) == n, backward  # every grad summed over CP
        rest = {k: v for k, v in backward.items() if k not in summed}
        if kind == "ddp":  # grads averaged over DP (maybe bucketed)
            assert rest.pop("dp all_reduce: (data parallelism)", 0) > 0, backward
        assert rest == {f"cp reduce_scatter: {keys_and_values}": 2 * layers,
                        **({"dp reduce_scatter: (data parallelism)": n} if kind == "fsdp" else {})}, backward


@pytest.mark.parametrize(("backend", "device", "dtype", "tokens", "heads", "head_size", "cp", "ring"), [
    ("nccl", "cuda", torch.bfloat16, 32768, 4, 128, 8, True),  # Llama-3-8B at TP 8: 4 heads a rank, 32k tokens
    ("nccl", "cuda", torch.bfloat16, 131072, 4, 128, 8, True),
    ("nccl", "cuda", torch.bfloat16, 4096, 4, 128, 8, False),  # 512 tokens a rank: the transfers' latency shows
    ("gloo", "cpu", torch.float32, 16384, 4, 32, 2, False),
], ids=["llama3-8b-32k", "llama3-8b-128k", "4k", "cpu-gloo-16k"])
def test_the_cost_model_chooses_the_ring_where_its_transfers_hide(backend, device, dtype, tokens, heads, head_size,
                                                                  cp, ring):
    """rotate="auto": the ring where each chunk's attention outlasts the next chunk's transfer, else the gather."""
    from thunder_tp.execution.overlap_cost import device_costs, ring_attention_pays

    local = tokens // cp
    chunk = 2 * heads * local * head_size * dtype.itemsize  # a rank's keys and values
    flops = 4 * heads * local * head_size * local  # its queries over one chunk: q k^T, then p v
    assert ring_attention_pays(device_costs(backend, device, dtype), chunk, flops, cp) is ring


def _auto_rotation_step() -> None:
    """ContextParallel's default rotate="auto" on 2 CPU ranks: causal attention blockwise, so keys and values are
    gathered (the ring has nothing to overlap there); one device's loss."""
    reference = _litgpt("llama").double()
    model = copy.deepcopy(reference)
    cp = thunder_tp.ContextParallel()
    assert cp.rotate == "auto"
    jm = thunder.jit(model, transforms=[cp], executors=FAST_EXECUTORS)
    torch.testing.assert_close(jm(*batch(0)), reference(*batch(0)), **TOL)
    labels = {c["issued_by"] for c in collective_calls(thunder.last_traces(jm)[-1])}
    assert "context parallel: keys and values gathered (all-gather)" in labels, labels


def test_auto_rotation_on_cpu_ranks_gathers():
    run_ranks(_auto_rotation_step, 2)
