"""Float8 training (torchao's convert_to_float8_training, emulated on the CPU) under thunder.jit: one device equals
torchao eager; TP and TP+SP equal the one-device float8 run (scales from the whole tensors: amaxes reduced over the
group where an operand is sharded); TP inside DDP / FSDP equals one device accumulating the dp ranks' batches; a
checkpoint saved at TP=2 holds the float32 weights and resumes on one device."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import thunder
import torch
import torch.nn as nn

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import BATCH, batch, make_config, training_losses
from tests.tp_checks import FAST_EXECUTORS, rank_and_size

torchao = pytest.importorskip("torchao", reason="torchao is the optional extra thunder_tp[float8]")

RECIPES = ["tensorwise", "rowwise"]
STEPS, LR = 3, 0.5


def _config(recipe: str):
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def _converted(model: nn.Module, recipe: str) -> nn.Module:
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, config=_config(recipe),
                                      module_filter_fn=lambda m, name: "lm_head" not in name)


def _llama(recipe: str, seed: int = 0, n_layer: int = 2) -> nn.Module:
    """A litgpt llama (GQA, SwiGLU) of `n_layer` blocks, float32, its linears but the head converted to float8."""
    from thunder_tp.plans.litgpt import GPTWithLoss

    torch.manual_seed(seed)
    return _converted(GPTWithLoss(dataclasses.replace(make_config("llama"), n_layer=n_layer)), recipe)


def _steps(model: nn.Module, run, parameters) -> list[dict]:
    """STEPS SGD steps of `run` (the model eager or jitted): each step's loss and grads."""
    optimizer = torch.optim.SGD(parameters, lr=LR)
    history = []
    for step in range(STEPS):
        loss = run(*batch(step))
        loss.backward()
        history.append({"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in parameters_named(run)}})
        optimizer.step()
        optimizer.zero_grad()
    return history


def parameters_named(run) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in run.named_parameters()]


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_device_equals_torchao_eager(recipe):
    """thunder.jit of the converted model, 3 steps: torchao eager's losses and grads (its own casts and gemms)."""
    eager = _llama(recipe)
    jitted = thunder.jit(copy.deepcopy(eager), executors=FAST_EXECUTORS)
    want, got = _steps(eager, eager, eager.parameters()), _steps(jitted, jitted, jitted.parameters())
    for step, (w, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g["loss"], w["loss"], rtol=1e-6, atol=1e-6, msg=f"loss of step {step}")
        for name, grad in w["grads"].items():
            torch.testing.assert_close(g["grads"][name], grad, rtol=1e-5, atol=1e-5 * grad.norm().item(),
                                       msg=f"{name} at step {step}")


def _tp_steps(recipe: str, mode: str) -> None:
    """TP=2 (+SP) against one device, both float8 under thunder.jit: 3 SGD steps, every loss and grad shard."""
    from thunder_tp.pieces import shard_tensor

    reference = _llama(recipe)
    model = copy.deepcopy(reference)
    plan = thunder_tp.plans.litgpt(model, sequence_parallel=mode == "tp_sp")
    tp = thunder_tp.TensorParallel(plan)
    jm = thunder.jit(model, transforms=[tp], executors=FAST_EXECUTORS)
    one = thunder.jit(reference, executors=FAST_EXECUTORS)
    want, got = _steps(one, one, one.parameters()), _steps(jm, jm, jm.parameters())
    rank, size = rank_and_size()
    for step, (w, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g["loss"], w["loss"], rtol=1e-5, atol=0, msg=f"loss of step {step}")
        for name, grad in w["grads"].items():
            piece = shard_tensor(grad, tp.parameter_layouts.get(name, thunder_tp.Replicate()), rank, size)
            _assert_within_norm(g["grads"][name], piece, 1e-4, f"{name} at step {step}")


def _assert_within_norm(got: torch.Tensor, want: torch.Tensor, fraction: float, what: str) -> None:
    """Every entry of `got` within `fraction` of `want`'s norm: an fp32 rounding difference that moves a value across
    a float8 rounding boundary changes that entry by a float8 step, not the whole tensor."""
    error, norm = (got - want).abs().max().item(), want.norm().item()
    assert error <= fraction * norm, f"{what}: largest difference {error:.3g}, {error / norm:.3g} of the norm"


@pytest.mark.parametrize("mode", ["tp", "tp_sp"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_tp_equals_one_device_float8(recipe, mode):
    """2 gloo ranks, TP and TP+SP: the one-device float8 run's losses and grads for 3 steps (a rank's own amax for a
    sharded weight, input or output grad would be off by ~1e-2)."""
    run_ranks(_tp_steps, 2, recipe, mode)


def _tables(gather_in_float8: bool) -> tuple[list[dict], list[dict]]:
    """Rank 0 of 2 (thunder_tp.one_rank: nothing exchanged) of the bfloat16 llama, tensorwise, TP+SP: one step's
    forward and backward collectives tables."""
    with thunder_tp.one_rank(2, 0, "cpu"):
        model = _llama("tensorwise").to(torch.bfloat16)
        plan = thunder_tp.plans.litgpt(model, sequence_parallel=True)
        tp = thunder_tp.TensorParallel(plan, float8_all_gather=gather_in_float8)
        jm = thunder.jit(model, transforms=[tp], executors=FAST_EXECUTORS)
        jm(*batch(0)).backward()
        return [list(thunder_tp.collectives_table(t[-1])) for t in (thunder.last_traces(jm),
                                                                    thunder.last_backward_traces(jm))]


def test_collectives_table_shows_amax_reductions_and_float8_gathers():
    """The amaxes reduced over the group, each a bfloat16 number: per block forward, the weights of the 5 linears and
    the inputs of the 2 row-parallel ones and of the 2 gathered ones (the MLP's fc_1 and fc_2 share a gather);
    backward, the output grads of the 3 column-parallel ones. The inputs of the column-parallel linears gathered in
    float8: half the bytes of the bfloat16 gathers that float8_all_gather=False keeps."""
    (forward, backward), (hp_forward, _) = _tables(True), _tables(False)

    def rows(table, text):
        return [r for r in table if text in r["issued_by"]]

    layers = 2
    amaxes = {r["issued_by"]: (r["count"], r["bytes_per_call"]) for r in rows(forward, "float8: amax")}
    assert amaxes == {"float8: amax of the weight (max)": (5 * layers, 2),
                      "float8: amax of the input (max)": (4 * layers, 2)}, amaxes
    assert [(r["count"], r["bytes_per_call"]) for r in rows(backward, "float8: amax")] == [(3 * layers, 2)]
    float8, = rows(forward, "float8: the input gathered")
    bf16, = rows(hp_forward, "float8_matmul: sequence shards gathered")
    assert float8["count"] == bf16["count"] == 2 * layers and 2 * float8["bytes_per_call"] == bf16["bytes_per_call"]


def _torchtitan_float8(plan_kind: str) -> None:
    """torchtitan's Llama converted to float8 (tensorwise) with torchtitan's float8 TP plan (Float8ColwiseParallel,
    Float8RowwiseParallel, PrepareFloat8ModuleInput; TP + SP + loss parallel), read from its apply_tp: 3 steps of the
    one-device float8 run."""
    from tests.torchtitan_llama import ModelArgs, Transformer, WithLoss, apply_tp
    from thunder_tp.pieces import shard_tensor

    args = ModelArgs()
    torch.manual_seed(0)
    reference = _converted(WithLoss(Transformer(args)), "tensorwise")
    model = copy.deepcopy(reference)
    plan = {"model": thunder_tp.plans.from_parallelize_fn(apply_tp, Transformer(args), None, loss_parallel=True,
                                                           enable_float8_tensorwise_tp=plan_kind == "float8")}
    tp = thunder_tp.TensorParallel(plan)
    jm = thunder.jit(model, transforms=[tp], executors=FAST_EXECUTORS)
    one = thunder.jit(reference, executors=FAST_EXECUTORS)
    tokens = torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    want, got = one(tokens, tokens), jm(tokens, tokens)
    want.backward(), got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    rank, size = rank_and_size()
    for name, p in one.named_parameters():
        piece = shard_tensor(p.grad, tp.parameter_layouts.get(name, thunder_tp.Replicate()), rank, size)
        _assert_within_norm(jm.get_parameter(name).grad, piece, 1e-4, name)


def test_torchtitans_float8_plan_trains_as_one_device():
    """torchao's float8 styles in a DTensor plan, given verbatim: one device's float8 loss and grads on 2 ranks."""
    run_ranks(_torchtitan_float8, 2, "float8")


def test_torchaos_float8_styles_refuse_what_torchao_refuses():
    """Float8ColwiseParallel on a linear not converted, or on a rowwise recipe's (whose input is scaled per row, not
    gathered in float8): a clear error naming the module and the fix."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    from thunder_tp.styles.dtensor import read_plan
    from thunder_tp.styles.matching import planned_tensors

    plan = read_plan({"0": Float8ColwiseParallel()})
    with pytest.raises(TypeError, match="needs a Float8Linear, got a Linear: convert the model"):
        planned_tensors(nn.Sequential(nn.Linear(16, 16)), plan, 2)
    rowwise = _converted(nn.Sequential(nn.Linear(16, 16)), "rowwise")
    with pytest.raises(ValueError, match="scales its input per row .* give it ColwiseParallel"):
        planned_tensors(rowwise, plan, 2)


# --- 2-D: TP inside Thunder's DDP / FSDP --------------------------------------------------------------------------


def _gathered_over_dp(local: torch.Tensor, rows: int, group) -> torch.Tensor:
    """The TP shard (`rows` long) from this rank's FSDP chunk of it (dim 0, padded)."""
    import torch.distributed as dist

    chunks = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(chunks, local.contiguous(), group=group)
    return torch.cat(chunks)[:rows]


def _2d_steps(kind: str) -> dict:
    """dp=2 x tp=2, tensorwise: TP inside DDP or FSDP against one device, both float8 under thunder.jit, 3 SGD steps.
    Each dp rank trains on its own batch; float8 scales an activation (and its grad) by that rank's amax, as torchao
    under DDP / FSDP2 does, so the one device runs the dp ranks' batches one after the other and averages their
    grads (the whole batch at once would scale by the amax of both: off by a float8 rounding). Returns, at step 0,
    how far the concatenated batch's loss is from the dp mean, and which grads the other TP rank's shard also passed
    (none may: a wrong shard is caught)."""
    from thunder.distributed.transforms.ddp_v2 import DDPTransform
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_tp.pieces import shard_tensor

    mesh = thunder_tp.init_mesh(dp=2, tp=2)
    reference = _llama("tensorwise", n_layer=1)  # one block: 4 ranks share the CPUs
    model = copy.deepcopy(reference)
    tp = thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model), process_group=mesh.tp_group)
    dp = (DDPTransform(process_group=mesh.dp_group, bucket_size_in_mb=25.0, broadcast_from=None) if kind == "ddp"
          else FSDPTransform(device=torch.device("cpu"), process_group=mesh.dp_group))
    jm = thunder.jit(model, transforms=[tp, dp], executors=FAST_EXECUTORS)
    one = thunder.jit(reference, executors=FAST_EXECUTORS)
    opt_one, opt = torch.optim.SGD(one.parameters(), lr=LR), torch.optim.SGD(jm.parameters(), lr=LR)
    out = {}
    for step in range(STEPS):
        idx, targets = batch(step, 2 * BATCH)
        halves = [(idx[i * BATCH:(i + 1) * BATCH], targets[i * BATCH:(i + 1) * BATCH]) for i in range(mesh.dp)]
        losses = [one(*half) for half in halves]
        expected = sum(losses) / mesh.dp
        got = jm(*halves[mesh.dp_rank])
        torch.testing.assert_close(got, losses[mesh.dp_rank].detach(), rtol=1e-5, atol=0,
                                   msg=f"this dp rank's loss at step {step}")
        expected.backward(), got.backward()
        wrong_shard_passes = []
        for name, p in one.named_parameters():
            layout = tp.parameter_layouts.get(name, thunder_tp.Replicate())
            piece = shard_tensor(p.grad, layout, mesh.tp_rank, mesh.tp)
            grad = jm.get_parameter(name).grad
            if kind == "fsdp":
                grad = _gathered_over_dp(grad, piece.shape[0], mesh.dp_group)
            _assert_within_norm(grad, piece, 1e-4, f"{name} at step {step}")
            if step == 0 and layout != thunder_tp.Replicate():
                other = shard_tensor(p.grad, layout, 1 - mesh.tp_rank, mesh.tp)
                if (grad - other).abs().max() <= 1e-4 * other.norm():
                    wrong_shard_passes.append(name)
        if step == 0:
            with torch.no_grad():  # torchao eager (the same parameters): no second compile of `one`
                whole = reference(idx, targets)
            out = {"concatenated": abs((whole - expected) / expected).item(), "wrong shard passes": wrong_shard_passes,
                   "sharded": sum(layout != thunder_tp.Replicate() for layout in tp.parameter_layouts.values())}
        opt_one.step(), opt.step(), opt_one.zero_grad(), opt.zero_grad()
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_tp_inside_data_parallelism_equals_one_device_float8(kind):
    """4 gloo ranks, dp=2 x tp=2: each rank's loss and grad (FSDP: its dp chunk, gathered) is one device's, for 3
    steps; a grad compared with the other TP rank's shard fails, and so would the whole batch run at once."""
    for out in run_ranks(_2d_steps, 4, kind):
        assert out["sharded"] > 0 and out["wrong shard passes"] == [], out
        assert out["concatenated"] > 1e-5, out  # the dp ranks' own activation scales are what is compared


# --- checkpoints: the weights stay in high precision -----------------------------------------------------------------


def _momentum_sgd(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=LR, momentum=0.9)


def _train_save_continue(path: str) -> list[float]:
    """The float8 llama at TP=2: one SGD step (momentum: an optimizer state), ck.save, then 2 more steps' losses."""
    import thunder_tp.checkpoint as ck

    model = _llama("tensorwise")
    jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(thunder_tp.plans.litgpt(model))],
                     executors=FAST_EXECUTORS)
    optimizer = _momentum_sgd(jm.parameters())
    training_losses(jm, optimizer, range(1))
    ck.save(path, jm, optimizer)
    return training_losses(jm, optimizer, range(1, 3))


def test_checkpoint_saved_at_tp2_holds_float32_weights_and_resumes_on_one_device(tmp_path):
    """Saved at TP=2 after one step: every tensor float32, the plain model's names (a model not converted loads it
    too); torchao's eager float8 model on one device, differently seeded, loads it (weights and momentum) and its next
    2 losses are the TP run's. One weight's two TP shards swapped moves the next loss by far more than the tolerance."""
    import torch.distributed.checkpoint as dcp

    import thunder_tp.checkpoint as ck
    from thunder_tp.plans.litgpt import GPTWithLoss

    path = str(tmp_path / "float8_tp2")
    expected = run_ranks(_train_save_continue, 2, path)
    assert expected[0] == expected[1], expected
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    plain = GPTWithLoss(make_config("llama"))
    model_keys, names = {k for k in saved if k.startswith("model.")}, {f"model.{n}" for n in plain.state_dict()}
    assert model_keys == names, model_keys ^ names
    dtypes = {k: m.properties.dtype for k, m in saved.items() if hasattr(m, "properties")}
    assert dtypes and set(dtypes.values()) == {torch.float32}, dtypes

    one = _llama("tensorwise", seed=1)
    optimizer = _momentum_sgd(one.parameters())
    ck.load(path, one, optimizer)
    ck.load(path, plain)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(one.state_dict()[name], value, rtol=0, atol=0, msg=name)
    swapped = copy.deepcopy(one)
    weight = swapped.gpt.transformer.h[0].attn.proj.weight  # row-parallel: its two column halves swapped
    with torch.no_grad():
        weight.copy_(weight.roll(weight.shape[1] // 2, dims=1))
    torch.testing.assert_close(training_losses(one, optimizer, range(1, 3)), expected[0], rtol=1e-5, atol=0)
    with torch.no_grad():
        wrong = swapped(*batch(1)).item()
    assert abs(wrong - expected[0][0]) > 1e-3 * abs(expected[0][0]), (wrong, expected[0][0])
