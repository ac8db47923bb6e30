"""Expert parallelism (plans.litgpt / plans.hf with expert_parallel=True): experts whole on their ranks, tokens moved
by all_to_all, against one device on real gloo ranks in float64 (loss parallel on): loss and every grad, each rank's
whole experts, the collectives of a step; routings that leave a rank without tokens; checkpoints across EP sizes;
simulated ranks; one rank alone; greedy generation."""

from __future__ import annotations

import re

import pytest
import thunder
import torch
import torch.distributed as dist

import thunder_tp
import thunder_tp.checkpoint as ck
from tests.dist import run_ranks
from tests.litgpt_models import MOE_BASE, batch, make_moe_model
from tests.tp_checks import (
    FAST_EXECUTORS,
    assert_close_scaled,
    assert_grads_are_shards,
    collective_counts,
    rank_and_size,
)
from thunder_tp import TensorParallel
from thunder_tp.layouts import StackShard
from thunder_tp.styles import ExpertParallel
from thunder_tp.styles.matching import match_plan, planned_tensors

# litgpt's RMSNorm (and the grouped router) compute in float32 even for float64 models
RTOL = ATOL = 1e-5
LAYERS = MOE_BASE["n_layer"]
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _reference_and_copy(name: str, **overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    reference = make_moe_model(name, **overrides)
    model = make_moe_model(name, **overrides)
    model.load_state_dict(reference.state_dict())
    return reference, model


def _jit_ep(model: torch.nn.Module, sequence_parallel: bool, executors=None) -> tuple[torch.nn.Module, TensorParallel]:
    plan = thunder_tp.plans.litgpt(model, sequence_parallel=sequence_parallel, loss_parallel=True, expert_parallel=True)
    transform = TensorParallel(plan)
    return thunder.jit(model, transforms=[transform], executors=executors or FAST_EXECUTORS), transform


def _held_experts(reference: torch.nn.Module, jm: torch.nn.Module) -> dict[str, set[int]]:
    """Per expert layer kind of each MoE layer (e.g. gpt.transformer.h.0.mlp.fc_1.weight): the experts this rank
    holds, each checked whole and equal to the single-device one; the others it holds nothing of."""
    held: dict[str, set[int]] = {}
    for name, full in reference.named_parameters():
        match = _EXPERT.search(name)
        if match is None:
            continue
        local = jm.get_parameter(name)
        if local.numel():
            assert local.shape == full.shape and torch.equal(local, full), name
            held.setdefault(_EXPERT.sub(".", name), set()).add(int(match[1]))
        else:
            assert local.shape == (0, *full.shape[1:]), (name, local.shape)
    return held


def _step(reference, jm, transform, idx, targets) -> dict:
    """One training step of both: the loss and every grad equal; this rank's experts and collectives."""
    rank, size = rank_and_size()
    held = _held_experts(reference, jm)
    expected, actual = reference(idx, targets), jm(idx, targets)
    assert_close_scaled(actual, expected, rtol=RTOL, atol=ATOL, what="loss")
    expected.backward()
    actual.backward()
    assert_grads_are_shards(reference, jm, transform.parameter_layouts, rank, size, rtol=RTOL, atol=ATOL)
    # the whole model's gradient norm (clipping): each expert's grad counted once, on its rank
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    assert_close_scaled(thunder_tp.tools.clipping.grad_norm(jm), norm, rtol=RTOL, atol=ATOL, what="gradient norm")
    forward, backward = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
    return {"held": held, "forward": collective_counts(forward), "backward": collective_counts(backward),
            "table": thunder_tp.collectives_table(forward)}


def _train(name: str, sequence_parallel: bool) -> dict:
    reference, model = _reference_and_copy(name)
    jm, transform = _jit_ep(model, sequence_parallel)
    return _step(reference, jm, transform, *batch(0))


def _expected_counts(name: str, sequence_parallel: bool, layers: int = LAYERS) -> tuple[dict, dict]:
    """Per MoE layer 3 all_to_alls forward (counts, dispatch, combine), 2 backward; without SP the layer's input is a
    local slice and its output all-gathered (backward: the input's grad all-gathered); with SP nothing else. The rest
    as a dense llama (tests/litgpt_models.py), loss parallel's one all_gather of (log-sum-exp, target logit); the
    replicated grads (routers, shared experts: float64; norms under SP and q/k norms: float32) summed per dtype."""
    dtypes = 1 + bool(sequence_parallel or name == "qwen3_moe")
    if sequence_parallel:
        forward = {"reduce_scatter": layers + 1, "all_gather": layers + 2, "all_to_all": 3 * layers}
        backward = {"reduce_scatter": layers + 1, "all_gather": layers + 1, "all_to_all": 2 * layers,
                    "all_reduce": dtypes}
    else:
        forward = {"all_reduce": layers + 1, "all_gather": layers + 1, "all_to_all": 3 * layers}
        backward = {"all_reduce": layers + 1 + dtypes, "all_gather": layers, "all_to_all": 2 * layers}
    return forward, backward


#: the default run: Mixtral-like at EP=2 without SP; DeepSeek-like (shared experts, grouped top-k) at EP=2 with SP and
#: the TP=4 and Qwen3-MoE cases slow (the same layer; at 4 ranks one expert each)
CASES = [(2, "mixtral", False, ""), (2, "grouped_shared", True, "slow"), (2, "qwen3_moe", False, "slow"),
         (4, "mixtral", True, "slow"), (4, "grouped_shared", False, "slow")]


@pytest.mark.parametrize("world, name, sequence_parallel", [
    pytest.param(w, n, sp, id=f"ep{w}-{n}{'-sp' * sp}", marks=[pytest.mark.slow] if slow else [])
    for w, n, sp, slow in CASES
])
def test_expert_parallel_matches_single_device(world, name, sequence_parallel):
    results = run_ranks(_train, world, name, sequence_parallel)
    n_expert, k, width = MOE_BASE["n_expert"], MOE_BASE["n_expert_per_token"], MOE_BASE["n_embd"]
    for rank, result in enumerate(results):
        per_rank = n_expert // world
        mine = set(range(rank * per_rank, (rank + 1) * per_rank))
        assert len(result["held"]) == 3 * LAYERS and all(e == mine for e in result["held"].values()), result["held"]
        assert (result["forward"], result["backward"]) == _expected_counts(name, sequence_parallel), result
    idx, _ = batch(0)
    pairs = idx.numel() // world * k * width * 8  # this rank's tokens x k rows of float64
    rows = {(r["kind"], r["bytes_per_call"]): r["count"] for r in results[0]["table"] if r["kind"] == "all_to_all"}
    assert rows == {("all_to_all", 8 * n_expert): LAYERS, ("all_to_all", pairs): 2 * LAYERS}, rows


def _skewed(k: int, favoured: tuple[int, ...], length: int) -> dict:
    """Grouped top-k routing whose score correction bias sends every token to the `favoured` experts (`length`
    tokens of one sequence: a length the ranks do not divide makes each rank dispatch its share of the rows); one
    layer."""
    reference, model = _reference_and_copy("grouped_shared", n_expert_per_token=k, n_layer=1)
    for m in (reference, model):
        for name, bias in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias[list(favoured)] = 10.0
    jm, transform = _jit_ep(model, sequence_parallel=False)
    idx, targets = (t[:1, :length] for t in batch(0))
    result = _step(reference, jm, transform, idx, targets)
    result["reached"] = sorted({int(_EXPERT.search(n)[1]) for n, p in reference.named_parameters()
                                if _EXPERT.search(n) and p.grad.abs().sum() > 0})
    return result


def test_routings_that_leave_a_rank_without_tokens():
    # every token to expert 3 (top-1): rank 0 receives no row, rank 1's expert 2 none; 15 tokens: 7 + 8 dispatched
    split = run_ranks(_skewed, 2, 1, (3,), 15)
    # every token to experts 0 and 1 (top-2), both rank 0's: rank 1 receives no row; 16 tokens: the sequence split
    held = run_ranks(_skewed, 2, 2, (0, 1), 16)
    assert split[0]["reached"] == [3] and held[0]["reached"] == [0, 1], (split[0]["reached"], held[0]["reached"])
    # a split's output is each rank's rows of an uneven split (8 + 7): all-gathered in the forward (an all_gather
    # where an all_reduce of a Partial sum would move twice the bytes)
    assert split[0]["forward"] == {"all_reduce": 2, "all_gather": 2, "all_to_all": 3}, split[0]["forward"]
    assert held[0]["forward"] == _expected_counts("grouped_shared", False, layers=1)[0], held[0]["forward"]


@pytest.mark.slow  # pricing serves plans.auto, which does not propose expert parallelism yet
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_priced_collectives_are_the_ones_a_step_issues(sequence_parallel):
    """communication.py prices the all_to_alls the layer issues inside it (at an even routing's bytes), both ways."""
    from thunder_tp.layouts import TPGroup
    from thunder_tp.plans.search.pricing import Pricing
    from thunder_tp.plans.search.tracing import traced

    with torch.device("meta"):
        model = make_moe_model("mixtral")
    pricing = Pricing(model, traced(model, batch(0), {}), TPGroup(None, 2, 0), training=True)
    plan = thunder_tp.plans.litgpt(model, sequence_parallel=sequence_parallel, loss_parallel=True, expert_parallel=True)
    comm, _ = pricing.price_plan(plan)
    assert (dict(comm.forward), dict(comm.backward)) == _expected_counts("mixtral", sequence_parallel), str(comm)


def test_indivisible_experts_are_a_clear_error():
    with torch.device("meta"):
        model = make_moe_model("mixtral")
    fc_1 = model.gpt.transformer.h[0].mlp.experts[1].fc_1
    with pytest.raises(ValueError, match="3 ranks cannot share 4 experts evenly; use a TP size that divides 4"):
        ExpertParallel(1, 4).tensor_layouts(fc_1, 3)
    styles = match_plan(model.gpt, thunder_tp.plans.litgpt(model.gpt, expert_parallel=True))
    experts = {name: style for name, style in styles.items() if isinstance(style, ExpertParallel)}
    with pytest.raises(ValueError, match="h.0.mlp.experts.0.fc_1: .* 3 ranks cannot share 4 experts evenly"):
        planned_tensors(model.gpt, experts, 3)
    assert planned_tensors(model.gpt, styles, 2).parameters[
        "transformer.h.1.mlp.experts.3.proj.weight"] == StackShard(3, 4)


# --- checkpoints across EP sizes -------------------------------------------------------------------------------


def _save_at_ep(path: str) -> None:
    _, model = _reference_and_copy("grouped_shared")
    jm, _ = _jit_ep(model, sequence_parallel=False)
    ck.save(path, jm)


def _load_at_ep(path: str) -> None:
    rank, size = rank_and_size()
    reference, model = _reference_and_copy("grouped_shared")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    jm, transform = _jit_ep(model, sequence_parallel=False)
    ck.load(path, jm)
    assert_grads_are_shards(reference, jm, transform.parameter_layouts, rank, size, rtol=0, atol=0, parameters=True)
    assert len(_held_experts(reference, jm)) == 3 * LAYERS


@pytest.mark.slow  # four ranks; the StackShard pieces are DCP shards as any other (tests/test_checkpoint.py)
def test_checkpoint_saved_at_ep2_loads_at_ep4_and_on_one_device(tmp_path):
    path = str(tmp_path / "ep2")
    run_ranks(_save_at_ep, 2, path)
    run_ranks(_load_at_ep, 4, path)
    reference = make_moe_model("grouped_shared")
    model = make_moe_model("grouped_shared")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ck.load(path, model)  # TP=1: a plain module, no process group
    for name, p in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name


def _original_state_dict_round_trip() -> None:
    reference, model = _reference_and_copy("grouped_shared")
    jm, _ = _jit_ep(model, sequence_parallel=False)
    full = reference.state_dict()
    gathered = jm.original_state_dict()  # each expert broadcast whole from the one rank that holds it
    assert gathered.keys() == full.keys()
    for name, value in gathered.items():
        assert torch.equal(value, full[name]), name
    _, fresh = _reference_and_copy("grouped_shared")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    loaded, _ = _jit_ep(fresh, sequence_parallel=False)
    loaded.load_original_state_dict(full)  # each rank keeps its own experts' pieces
    for name, p in jm.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p), name


@pytest.mark.slow  # original_state_dict's gather and scatter of experts (StackShard); DCP's path: test_checkpoint
def test_original_state_dict_round_trips_experts():
    run_ranks(_original_state_dict_round_trip, 2)


# --- simulated ranks, one rank alone, generation, HF -------------------------------------------------------------


@pytest.mark.slow  # every op of the step runs 8 times in this process
def test_simulated_ep8_matches_single_device():
    assert not dist.is_initialized()
    overrides = dict(n_expert=8, n_head=8, n_query_groups=8, head_size=4)
    reference, model = _reference_and_copy("mixtral", **overrides)
    idx, targets = batch(0)
    expected = reference(idx, targets)
    expected.backward()
    with thunder_tp.simulate(world_size=8):
        jm, transform = _jit_ep(model, sequence_parallel=True, executors=thunder_tp.executors())
        loss = jm(idx, targets)
        loss.backward()
        forward = collective_counts(thunder.last_traces(jm)[-1])
    for rank, value in thunder_tp.per_rank(loss).items():
        assert_close_scaled(value, expected, rtol=RTOL, atol=ATOL, what=f"loss of simulated rank {rank}")
    for name, full in reference.named_parameters():
        layout = transform.parameter_layouts.get(name)
        for rank, piece in thunder_tp.per_rank(jm.get_parameter(name).grad).items():
            if isinstance(layout, StackShard):  # simulated ranks hold every expert, zeros but the owner's
                want = full.grad if rank == layout.owner(8) else torch.zeros_like(full.grad)
            else:
                want = thunder_tp.pieces.shard_tensor(full.grad, layout or thunder_tp.Replicate(), rank, 8)
            assert_close_scaled(piece, want, rtol=RTOL, atol=ATOL, what=f"grad of {name} on simulated rank {rank}")
    assert forward["all_to_all"] == 3 * LAYERS, forward


@pytest.mark.slow  # one compile in this process; the fake group's exchange (every peer routes as this rank)
def test_one_rank_alone_runs_an_expert_parallel_step():
    from thunder.transforms import MaterializationTransform

    assert not dist.is_initialized()
    with thunder_tp.one_rank(2, 1, device="cpu"):
        with torch.device("meta"):
            model = make_moe_model("mixtral")
        plan = thunder_tp.plans.litgpt(model, loss_parallel=True, expert_parallel=True)
        init = MaterializationTransform("cpu", init=MaterializationTransform.init_from_original_module_init())
        jm = thunder.jit(model, transforms=[TensorParallel(plan), init], executors=FAST_EXECUTORS)
        loss = jm(*batch(0))
        loss.backward()
        forward = collective_counts(thunder.last_traces(jm)[-1])
        backward = collective_counts(thunder.last_backward_traces(jm)[-1])
        shapes = {n: tuple(p.shape) for n, p in jm.named_parameters() if _EXPERT.search(n)}
    assert torch.isfinite(loss), loss
    assert (forward, backward) == _expected_counts("mixtral", False), (forward, backward)
    for name, shape in shapes.items():  # rank 1 of 2 holds experts 2 and 3
        assert (shape[0] > 0) == (int(_EXPERT.search(name)[1]) >= 2), (name, shape)


def _generate() -> dict:
    from tests.generation import NEW_TOKENS, PROMPT, gen_config, greedy, models_with_cache
    from tests.litgpt_models import VOCAB

    config = gen_config("moe")
    reference, model = models_with_cache(config, 1)
    jm = thunder.jit(model, transforms=[TensorParallel(thunder_tp.plans.litgpt(model, expert_parallel=True))],
                     executors=FAST_EXECUTORS)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    expected, _ = greedy(reference, prompt, NEW_TOKENS)
    decode_counts = []
    def on_decode(_):
        decode_counts.append(collective_counts(thunder.last_traces(jm)[-1]))
    tokens, _ = greedy(jm, prompt, NEW_TOKENS, on_decode)
    assert torch.equal(tokens, expected), (tokens, expected)
    return {"layers": config.n_layer, "decode": decode_counts}


@pytest.mark.slow  # the decode step's layer is the routings test's split (a rank's share of the rows, Partial out)
def test_greedy_generation_with_expert_parallelism_matches_single_device():
    result = run_ranks(_generate, 2)[0]
    layers = result["layers"]
    # a decode step: one token, so one rank dispatches it and the MoE output is a Partial sum (one all_reduce); per
    # layer the counts exchange, the dispatch and the combine; attention and embedding as in dense TP, logits gathered
    step = {"all_reduce": 2 * layers + 1, "all_gather": 1, "all_to_all": 3 * layers}
    assert all(counts == step for counts in result["decode"]), result["decode"]


def _train_hf(name: str, sequence_parallel: bool) -> dict:
    from tests.hf_models import batch as hf_batch
    from tests.hf_models import make_model

    rank, size = rank_and_size()
    reference, model = make_model(name), make_model(name)
    model.load_state_dict(reference.state_dict())
    plan = thunder_tp.plans.hf(model, sequence_parallel=sequence_parallel, loss_parallel=True, expert_parallel=True)
    transform = TensorParallel(plan)
    jm = thunder.jit(model, transforms=[transform], executors=FAST_EXECUTORS)
    held = _held_experts(reference, jm)
    idx = hf_batch()
    expected = reference(input_ids=idx, labels=idx, use_cache=False)
    actual = jm(input_ids=idx, labels=idx, use_cache=False)
    # HF computes its loss (and most norms) in float32 even for float64 models
    assert_close_scaled(actual.loss, expected.loss, rtol=1e-6, atol=1e-6, what="loss")
    expected.loss.backward()
    actual.loss.backward()
    assert_grads_are_shards(reference, jm, transform.parameter_layouts, rank, size, rtol=1e-5, atol=1e-5)
    return {"held": held, "forward": collective_counts(thunder.last_traces(jm)[-1]),
            "backward": collective_counts(thunder.last_backward_traces(jm)[-1])}


def _expected_hf_counts(name: str, sequence_parallel: bool, world: int) -> tuple[dict, dict]:
    """Dense TP's counts (tests/hf_models.py) with each MoE block's reduction replaced: without SP its all_reduce each
    way by an all_gather, with SP its reduce_scatter and all_gather each way by nothing; plus the all_to_alls. Loss
    parallel adds its (log-sum-exp, target logit) all_gather under SP (the tp_lp mode has it)."""
    from tests.hf_models import LAYERS as HF_LAYERS
    from tests.hf_models import expected_counts

    forward, backward = expected_counts(name, "tp_sp" if sequence_parallel else "tp_lp", world)
    moved = ("reduce_scatter", "all_gather") if sequence_parallel else ("all_reduce",)
    for counts in (forward, backward):
        for kind in moved:
            counts[kind] -= HF_LAYERS
        if not sequence_parallel:
            counts["all_gather"] = counts.get("all_gather", 0) + HF_LAYERS
    forward["all_gather"] += sequence_parallel
    forward["all_to_all"], backward["all_to_all"] = 3 * HF_LAYERS, 2 * HF_LAYERS
    return {k: v for k, v in forward.items() if v}, {k: v for k, v in backward.items() if v}


@pytest.mark.slow  # the HF blocks run the litgpt cases' layer (the same moe_layer op)
@pytest.mark.parametrize("world, name, sequence_parallel", [(2, "mixtral", False), (2, "qwen3_moe", True),
                                                            (2, "qwen2_moe", False), (4, "qwen3_moe", False),
                                                            (4, "mixtral", True)])
def test_hf_expert_parallel_matches_single_device(world, name, sequence_parallel):
    from tests.hf_models import ARCHITECTURES

    results = run_ranks(_train_hf, world, name, sequence_parallel)
    n_expert = next(v for k, v in ARCHITECTURES[name][1].items() if k in ("num_local_experts", "num_experts"))
    for rank, result in enumerate(results):
        per_rank = n_expert // world
        assert result["held"] and all(e == set(range(rank * per_rank, (rank + 1) * per_rank))
                                      for e in result["held"].values()), result["held"]
        assert (result["forward"], result["backward"]) == _expected_hf_counts(name, sequence_parallel, world), result
