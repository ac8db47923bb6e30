"""Every rank of a TP group issues the same collectives.

Per rank, without running the ranks: each rank r of N, alone under ``thunder_tp.one_rank(N, r)``, compiles its
training step (traced, not run: its parameters are stand-ins of no memory), and the collectives over the TP group of
its final forward and backward (``runtimes.same_collectives``: kind and bytes, in order) are every other rank's.
Models whose head counts the TP size does not divide (ranks hold weights of different widths), under
``overlap="auto"`` with NCCL's constants at a model's real sizes and with a ``Costs`` under which chunks pay; the
decompositions happen (the program is not the undecomposed one). Every litgpt architecture at TP 3 and 8 in the slow
run.

On 2 gloo ranks: a planted divergence (rank 1 forced to other chunk counts) raises on every rank at the first call,
before the program runs, naming the collective; ``check_collectives=False`` turns the check off.
"""

from __future__ import annotations

import time

import pytest
import thunder
import torch
import torch.distributed as dist
from litgpt import Config

import thunder_tp
from tests.dist import run_ranks
from tests.litgpt_models import zoo
from tests.tp_checks import FAST_EXECUTORS
from thunder_tp.execution.overlap_cost import Costs, device_costs
from thunder_tp.plans.litgpt import GPTWithLoss, tp_sizes
from thunder_tp.runtimes.same_collectives import issued_collectives
from thunder_tp.thunder_internals.computation import computation_and_inputs
from thunder_tp.thunder_internals.private import set_parameter

#: a 10 us, 100 MB/s link and 1 GFLOP/s matmuls: at the small widths below, chunks pay at some sites by margins
#: that differ with a rank's width (so ranks that priced their own pieces decided differently)
CHUNKS_PAY = Costs(latency_s=1e-5, bus_bytes_per_s=1e8, flops_per_s=1e9, matmul_call_s=0.0)
NCCL = device_costs("nccl", "cuda", torch.bfloat16)
GQA6 = dict(n_layer=1, n_head=6, n_query_groups=3, n_embd=48, head_size=8, intermediate_size=96, bias=False,
            mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", parallel_residual=False, rotary_percentage=1.0,
            vocab_size=256, padded_vocab_size=256)
#: head counts the TP size does not divide, tiny widths, tokens: (config, TP size, tokens)
CASES = {
    "gqa6-tp2": (GQA6, 2, 64),  # 6 heads in 3 K/V groups (ranks issued 42 and 38 collectives a step, 2 layers)
    "gqa8-tp3": (GQA6 | dict(n_head=8, n_query_groups=4, n_embd=64, intermediate_size=128), 3, 64),
    "qwen28-tp8": (GQA6 | dict(n_head=28, n_query_groups=4, n_embd=32, head_size=4, intermediate_size=44), 8, 32),
}


def rank_program(config: Config, world: int, rank: int, overlap, tokens: int) -> list[tuple]:
    """Rank `rank` of `world`'s collectives over the TP group for a training step of `tokens` tokens, compiled alone
    (bf16 stand-in parameters of no memory): (trace, kind, bytes) each, in order."""
    with thunder_tp.one_rank(world, rank, device="cpu"):
        with torch.device("meta"):
            model = GPTWithLoss(config).to(torch.bfloat16)
        plan = {f"gpt.{k}": v for k, v in thunder_tp.plans.litgpt(model.gpt).items()}
        jm = thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan, overlap=overlap)],
                         executors=FAST_EXECUTORS)
        for name, p in list(jm.named_parameters()):  # the prologue checks their shapes only
            set_parameter(jm, name, torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), True))
        for name, b in list(jm.named_buffers()):
            jm.set_buffer(name, torch.zeros((), dtype=b.dtype).expand(b.shape))
        idx = torch.zeros(1, tokens, dtype=torch.long)
        computation_and_inputs(jm, (idx, idx), {})  # compiled, not run
        traces = (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
        return [c.key for c in issued_collectives(traces, dist.group.WORLD)]


def assert_ranks_alike(config: Config, world: int, overlap, tokens: int, *, decomposed: bool = True) -> None:
    """Every rank's collectives are rank 0's (and, where `decomposed`, some collective was decomposed)."""
    programs = [rank_program(config, world, rank, overlap, tokens) for rank in range(world)]
    for rank, program in enumerate(programs[1:], start=1):
        differ = next((i for i, (a, b) in enumerate(zip(program, programs[0], strict=False)) if a != b), None)
        assert program == programs[0], (world, rank, len(program), len(programs[0]), differ)
    if decomposed:
        assert programs[0] != rank_program(config, world, 0, "never", tokens), "nothing decomposed: the check is empty"


@pytest.mark.parametrize("case", CASES)
def test_ranks_of_different_widths_issue_the_same_collectives(case):
    config, world, tokens = CASES[case]
    assert_ranks_alike(Config(block_size=tokens, **config), world, CHUNKS_PAY, tokens)


def test_llama3_8b_at_tp3_on_nccl_constants_issues_the_same_collectives():
    """The measured case: 16k tokens, NCCL's H100 constants (chunk counts 4/4/2 when each rank priced its own)."""
    assert_ranks_alike(Config.from_name("Llama-3-8B", n_layer=1, block_size=16384), 3, NCCL, 16384)


# --- every litgpt architecture (slow) -------------------------------------------------------------------------

#: what the NCCL sweep takes from an architecture's real config (the zoo's scaled-down sizes otherwise)
REAL_SIZES = ("n_embd", "head_size", "intermediate_size", "moe_intermediate_size", "vocab_size", "padded_vocab_size")
SWEEP = [(name, world, costs) for name in zoo() for world in (3, 8) for costs in ("nccl", "chunks_pay")]


@pytest.mark.slow  # reason: a sweep; the default run covers GQA models at TP 2, 3 and 8, Llama-3-8B
@pytest.mark.parametrize("name,world,costs", SWEEP, ids=[f"{n}-tp{w}-{c}" for n, w, c in SWEEP])
def test_every_architecture_issues_the_same_collectives_on_every_rank(name, world, costs):
    scaled = zoo()[name]
    if world not in tp_sizes(Config(**scaled)):
        pytest.skip(f"{name} cannot be split over {world} ranks")
    if costs == "nccl":  # its real widths at 16k tokens, where NCCL's constants decompose (some sites)
        real, small = Config.from_name(name), Config(**scaled)
        windows = small.sliding_window_size is not None and any(small.sliding_window_indices)
        tokens = 512 if windows else 16384  # litgpt builds a sliding window's mask by a Python loop over the tokens
        config = Config(**(scaled | {f: getattr(real, f) for f in REAL_SIZES} | {"block_size": tokens}))
        assert_ranks_alike(config, world, NCCL, tokens, decomposed=False)
    else:
        assert_ranks_alike(Config(**(scaled | {"block_size": 64})), world, CHUNKS_PAY, 64, decomposed=False)


# --- the check on 2 gloo ranks ------------------------------------------------------------------------------------


def _rank1_chunked_otherwise() -> tuple[str, float]:
    """Rank 1 cuts every all_reduce into other chunk counts than rank 0: the first call's error and its time."""
    from unittest import mock

    from tests.parallel_mlp import MLP, PLAN, mlp_input
    from thunder_tp.execution import overlap_cost

    chosen = overlap_cost.reduce_chunks

    def other_count(*args, **kwargs) -> int:
        count = chosen(*args, **kwargs)
        return count if dist.get_rank() == 0 else (4 if count == 2 else 2)

    torch.manual_seed(0)
    with mock.patch.object(overlap_cost, "reduce_chunks", other_count):
        jm = thunder.jit(MLP(), transforms=[thunder_tp.TensorParallel(PLAN, overlap="always")],
                         executors=FAST_EXECUTORS)
        started = time.perf_counter()
        try:
            jm(*mlp_input())
        except RuntimeError as error:
            return str(error), time.perf_counter() - started
    return "no error", 0.0


def test_planted_divergence_raises_on_every_rank_at_the_first_call():
    results = run_ranks(_rank1_chunked_otherwise, 2, timeout=120)
    for rank, (message, seconds) in enumerate(results):
        assert "compiled programs that issue different collectives" in message, message
        assert "issues collective 0 of the forward (from 0): all_reduce of 32768 bytes, fc2: partial sums" in message
        assert "issues collective 0 of the forward (from 0): all_reduce of 16384 bytes, fc2: partial sums" in message
        assert f"this rank (global rank {rank}) issues" in message and "check_collectives=False" in message, message
        assert seconds < 30, seconds  # the compile and the agreement: no rank waited in the program's collectives


def _with_planted_difference(check: bool) -> str:
    """The MLP whose rank 1 reports one collective more than it issues: the first call's error, or "ran"."""
    from unittest import mock

    from tests.parallel_mlp import MLP, PLAN, mlp_input
    from thunder_tp.runtimes import same_collectives

    issued = same_collectives.issued_collectives

    def one_more(traces, group):
        planted = same_collectives.Issued("backward", 99, "all_reduce", 8, "planted")
        return issued(traces, group) + ([planted] if dist.get_rank() == 1 else [])

    torch.manual_seed(0)
    jm = thunder.jit(MLP(), transforms=[thunder_tp.TensorParallel(PLAN, check_collectives=check)],
                     executors=FAST_EXECUTORS)
    with mock.patch.object(same_collectives, "issued_collectives", one_more):
        try:
            jm(*mlp_input()).sum().backward()
        except RuntimeError as error:
            return str(error)
    return "ran"


def test_check_collectives_false_turns_the_check_off():
    checked = run_ranks(_with_planted_difference, 2, True, timeout=120)
    assert "global rank 1 issues collective 99 of the backward (from 0): all_reduce of 8 bytes" in checked[0], checked
    assert "(global rank 1) issues collective 99 of the backward" in checked[1], checked[1]
    assert "global rank 0 issues no collective after its" in checked[1], checked[1]
    assert run_ranks(_with_planted_difference, 2, False, timeout=120) == ["ran", "ran"]


def test_check_collectives_must_be_a_bool():
    with pytest.raises(TypeError, match="check_collectives must be True or False"):
        thunder_tp.TensorParallel({}, check_collectives="yes")
