"""Smoke test of benchmarks/benchmark_litgpt.py: 2 ranks under torchrun, a 1-layer pythia-14m, a few iterations.

The runs use ``--compile thunder_default`` (no Inductor compile, so they stay short on a small CPU machine); the
default ``--compile thunder`` (thunder_tp's fusion executor) runs in the main-job smoke of ``.ci/run``.
"""

from __future__ import annotations

import json
import math
import os
import re
import runpy
import sys
from pathlib import Path

import pytest

from benchmarks import benchmark_litgpt as bench
from benchmarks.lib import harness, modes
from benchmarks.lib import litgpt_setup as setup
from tests.dist import REPO_ROOT, start_forked, torchrun

TINY = ["--model_name", "pythia-14m", "--n_layers", "1", "--block_size", "32", "--micro_batch_size", "1",
        "--max_iters", "3", "--warmup_iters", "1", "--compile", "thunder_default"]
TIMEOUT_S = 300
TOKENS = 32  # one micro-batch of 1 x block_size 32 per iteration
ACTIVATION = TOKENS * 128 * 4  # (1, 32, n_embd) fp32: what each activation all_reduce carries

pytest.importorskip("litgpt")


def _env() -> dict[str, str]:
    """This checkout's thunder_tp first (not an installed copy), one thread per process."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def _torchrun(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """Run the benchmark on 2 ranks; return its JSON results and its output."""
    json_path = tmp_path / "results.json"
    stdout, stderr = torchrun(["-m", "benchmarks.benchmark_litgpt", *TINY, "--json_path", str(json_path), *args],
                              timeout=TIMEOUT_S,
                              cwd=str(tmp_path))
    return json.loads(json_path.read_text()), stdout + stderr


def _pythia_param_bytes(tp_size: int) -> tuple[int, int]:
    """fp32 parameter bytes of the 1-layer pythia-14m: (full model, one TP rank's), by hand from its config.

    plans.litgpt shards the embedding and lm_head (vocab), q|k|v and fc (weights and biases) and the two row-parallel
    weights; the LayerNorms (norm_1, norm_2, ln_f: weight and bias) and the row-parallel biases stay replicated.
    """
    from litgpt import Config

    c = Config.from_name("pythia-14m", n_layer=1)
    assert not c.lm_head_bias and c.bias and c.n_query_groups == c.n_head, c  # what the count below assumes
    e, v, f, qkv = c.n_embd, c.padded_vocab_size, c.intermediate_size, (c.n_head + 2 * c.n_query_groups) * c.head_size
    sharded = 2 * v * e + (qkv * e + qkv) + e * e + (f * e + f) + e * f
    replicated = 3 * 2 * e + 2 * e
    return 4 * (sharded + replicated), 4 * (sharded // tp_size + replicated)


def _check_common(res: dict, output: str, bytes_slack: float = 0.0) -> None:
    """Losses, timings and memory figures of a run; its parameter bytes per rank the hand plan's (+ `bytes_slack`)."""
    assert len(res["losses"]) == 3 and all(math.isfinite(x) for x in res["losses"]), res["losses"]
    assert res["world_size"] == 2 and res["tp_size"] == 2
    # the figures are those of the timed iterations (all but the warm-up one)
    assert len(res["iter_times_ms"]) == 3 and res["tokens_per_iter"] == TOKENS, res
    assert math.isclose(res["average_iter_time_ms"], sum(res["iter_times_ms"][1:]) / 2, rel_tol=1e-9), res
    assert math.isclose(res["tokens_per_sec"], TOKENS * 1000 / res["average_iter_time_ms"], rel_tol=1e-9), res
    full, per_rank = _pythia_param_bytes(2)
    assert res["param_bytes_full_model"] == full, res
    assert per_rank <= res["param_bytes_per_rank"] <= (1 + bytes_slack) * per_rank, res
    # max RSS of a process that holds its parameters; rank 0's figure is the first of the per-rank ones
    assert res["peak_memory_bytes_per_rank"][0] == res["peak_memory_bytes"] > per_rank, res
    assert len(res["peak_memory_bytes_per_rank"]) == 2 and min(res["peak_memory_bytes_per_rank"]) > per_rank, res
    # saved for backward: activations plus forward inputs (parameters and batch), never more inputs than those
    saved = res["saved_for_backward"]
    slack = per_rank + 2 * TOKENS * 8
    assert 0 < saved["activation_bytes"] <= saved["bytes"] <= saved["activation_bytes"] + slack, saved
    for line in ("Average iter time:", "Tokens/s:", "Collectives per iteration, forward:", "iter 2: loss"):
        assert line in output, output[-4000:]


def test_tp(tmp_path):
    res, output = _torchrun(tmp_path, "--distributed_mode", "tp", "--dump_thunder_traces", "true",
                            "--trace_dir", str(tmp_path / "traces"))
    _check_common(res, output)
    per_iter = res["collectives"]["per_iteration"]
    logits = TOKENS * 50304 * 4  # lm_head's vocab-sharded output gathered (padded vocab, fp32)
    # forward: the embedding's all_reduce, the block's (pythia's parallel residual: attn.proj's and mlp.proj's
    # outputs summed, then reduced once), the logits' all_gather
    assert per_iter["forward"]["by_kind"] == {"all_reduce": {"count": 2, "bytes": 2 * ACTIVATION},
                                              "all_gather": {"count": 1, "bytes": logits}}, per_iter
    # backward: the input grads of qkv, fc and lm_head (column-parallel: one all_reduce each)
    assert per_iter["backward"]["by_kind"] == {"all_reduce": {"count": 3, "bytes": 3 * ACTIVATION}}, per_iter
    for name, count in (("forward", 2), ("backward", 3)):
        rows = [r for r in res["collectives"]["tables"][name] if r["kind"] == "all_reduce"]
        assert sum(r["count"] for r in rows) == count, rows
        assert all(r["group_size"] == 2 and r["bytes_per_call"] == ACTIVATION and r["padding_per_call"] == 0
                   for r in rows), rows
        assert all(".transformer." in r["issued_by"] or "lm_head" in r["issued_by"] for r in rows), rows  # modules
    # --dump_thunder_traces: every rank wrote its files, one line says where, the summary ends the output
    assert "traces of every rank written to" in output and "def backward_fn" not in output, output[-4000:]
    assert output.index("traces of every rank written to") < output.index("Model name:"), output[-4000:]
    for r in (0, 1):
        for name in ("forward.py", "backward.py", "collectives.md"):
            assert (tmp_path / "traces" / f"rank{r}_{name}").is_file(), name


def _run(argv: list[str], json_path: str) -> str:
    """The benchmark's run on this gloo rank of tests/dist.py (as under torchrun, minus the process-group set-up):
    what it printed."""
    import contextlib
    import io

    import torch
    import torch.distributed as dist

    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert bench.run(bench.parse_args([*TINY, *argv, "--json_path", json_path]), dist.get_rank(),
                         dist.get_world_size(), torch.device("cpu")) == 0
    return output.getvalue()


def test_tp_sp_loss_parallel(tmp_path):
    """On the warm gloo ranks of tests/dist.py (no torchrun start-up; test_tp covers the command line)."""
    from tests.dist import run_ranks

    json_path = tmp_path / "results.json"
    output = run_ranks(_run, 2, ["--distributed_mode", "tp_sp", "--loss_parallel", "true"], str(json_path))[0]
    res = json.loads(json_path.read_text())
    _check_common(res, output)
    assert res["loss_parallel"] is True
    # SP: into each TP region (qkv, fc after their sequence-sharded norms; lm_head after ln_f) an all_gather of the
    # (1, 32, 128) activations. The parallel-residual stream stays Partial from the embedding on (attention, MLP and
    # their row biases added in): a reduce_scatter where a norm reads it (the block's two norms, then ln_f); the
    # backward swaps them. Loss parallel: the logits stay vocab-sharded; one all_gather of each rank's log-sum-exp and
    # target logit per token (fp32, 2 x 32 numbers from each of the 2 ranks).
    # Backward: the grads of the replicated parameters used on sequence-sharded activations (the three LayerNorms'
    # weight and bias: 6 of n_embd fp32) are summed over the ranks in one all_reduce; the row biases, added to the
    # Partial stream by the first rank, get whole grads.
    per_iter = res["collectives"]["per_iteration"]
    gathers = {"count": 3, "bytes": 3 * ACTIVATION}
    scatters = {"count": 2, "bytes": 2 * ACTIVATION}
    stats = {"count": 4, "bytes": 3 * ACTIVATION + 2 * 2 * TOKENS * 4}
    assert per_iter["forward"]["by_kind"] == {"reduce_scatter": scatters, "all_gather": stats}, per_iter
    assert per_iter["backward"]["by_kind"] == {"reduce_scatter": gathers, "all_gather": scatters,
                                               "all_reduce": {"count": 1, "bytes": 6 * 128 * 4}}, per_iter


def test_tp_sp_float8(tmp_path):
    """Thunder's float8 flags at TP=2 + SP on the warm gloo ranks: torchao's Float8Linear for the block's 4 linears
    (emulated on the CPU; lm_head stays high precision), each tensorwise amax all-reduced over the group (forward: the
    4 weights, the inputs of the 2 row-parallel linears and of the 2 gathered ones; backward: the output grads of the
    2 column-parallel ones), and the inputs of qkv and fc gathered in float8: a quarter of the fp32 bytes."""
    pytest.importorskip("torchao", reason="torchao is the optional extra thunder_tp[float8]")
    from tests.dist import run_ranks

    json_path = tmp_path / "results.json"
    flags = ["--distributed_mode", "tp_sp", "--use_torchao_fp8_linear", "true", "--use_torchao_fp8_allgather", "true"]
    output = run_ranks(_run, 2, flags, str(json_path))[0]
    res = json.loads(json_path.read_text())
    _check_common(res, output)
    assert (res["use_torchao_fp8_linear"], res["use_torchao_fp8_allgather"], res["torchao_fp8_recipe"],
            res["float8_linears"], res["tp_overlap"]) == (True, True, "tensorwise", 4, "auto"), res
    assert "[torchao float8] linear, all-gather are enabled: recipe tensorwise, 4 Float8Linear" in output, output

    def rows(name: str, text: str) -> dict[str, tuple[str, int, int]]:
        return {r["issued_by"]: (r["kind"], r["count"], r["bytes_per_call"])
                for r in res["collectives"]["tables"][name] if r["issued_by"].startswith(text)}

    assert rows("forward", "float8") == {"float8: amax of the weight (max)": ("all_reduce", 4, 4),
                                         "float8: amax of the input (max)": ("all_reduce", 4, 4),
                                         "float8: the input gathered (cast first)": ("all_gather", 2, ACTIVATION // 4)}
    assert rows("backward", "float8: amax") == {"float8: amax of the output grad (max)": ("all_reduce", 2, 4)}


def _one_device_first_loss(argv: list[str]) -> float:
    """The benchmark's first loss on one device, eager: its model and first batch built as the run builds them."""
    import torch

    args = bench.parse_args([*TINY, *argv])
    config = setup.make_config(args)
    model = setup.make_model(args, config, torch.device("cpu"))
    idx, targets = setup.make_batch(args, config.padded_vocab_size, 0, 0, torch.device("cpu"))
    with torch.no_grad():
        return model(idx, targets).item()


def test_context_and_tensor_parallel(tmp_path):
    """--context_parallel_size 2 --tp_size 2 on 4 warm gloo ranks (a (cp x tp) mesh), keys and values passed around
    the ring: one device's first loss, the CP options and every rank's step memory reported."""
    from tests.dist import run_ranks

    json_path = tmp_path / "results.json"
    flags = ["--distributed_mode", "tp", "--tp_size", "2", "--context_parallel_size", "2", "--cp_rotate", "ring",
             "--measure_step_memory", "true"]
    output = run_ranks(_run, 4, flags, str(json_path))[0]
    res = json.loads(json_path.read_text())
    assert (res["world_size"], res["tp_size"], res["context_parallel_size"], res["dp_size"]) == (4, 2, 2, 1), res
    assert (res["cp_rotate"], res["cp_load_balance"], res["tokens_per_iter"]) == ("ring", True, TOKENS), res
    assert math.isclose(res["losses"][0], _one_device_first_loss(flags), rel_tol=1e-5), res["losses"]
    step_bytes = res["peak_step_memory_bytes_per_rank"]
    assert len(step_bytes) == 4 and step_bytes[0] == res["peak_step_memory_bytes"] and min(step_bytes) > 0, res
    for line in ("Distributed Mode: tp (world 4, tp 2, cp 2, dp 1)",
                 "Context parallel: ContextParallel over 2 ranks, keys and values passed around the ring, sequence "
                 "chunks head-tail (load-balanced)", "Peak step memory (the last iteration", "iter 2: loss"):
        assert line in output, output[-4000:]


@pytest.mark.slow  # the flag of what test_auto_plan checks (plans.auto's search, training with its plan)
def test_plan_auto_prints_the_plan_it_trains_with(tmp_path):
    """--plan auto: plans.auto searches the plan (printed by rank 0) and trains with it; the collectives that ran are
    the ones it priced. On this 1-layer pythia-14m at 32 tokens activations are tiny, so the default budget's slack
    (every weight matrix sharded, the rest whole, plus 1%: 1.005% over the hand plan's bytes here) goes to keeping
    matrices whole: the head stays loss parallel (no logits gathered), the embedding vocab-parallel."""
    import re

    from tests.dist import run_ranks

    json_path = tmp_path / "results.json"
    output = run_ranks(_run, 2, ["--distributed_mode", "tp", "--plan", "auto"], str(json_path), timeout=900)[0]
    res = json.loads(json_path.read_text())
    _check_common(res, output, bytes_slack=0.0101)
    assert "thunder_tp.plans.auto (TP=2)" in output and "'gpt.lm_head': ColwiseParallel" in output, output
    assert "'gpt.transformer.wte': RowwiseParallel" in output, output
    priced = re.search(r"per step forward (.*?); backward (.*?); cost", output)
    assert priced, output
    for (kinds, pass_) in zip(priced.groups(), ("forward", "backward"), strict=True):
        counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", kinds)}
        ran = {kind: v["count"] for kind, v in res["collectives"]["per_iteration"][pass_]["by_kind"].items()}
        assert ran == counts, (pass_, ran, counts)
    assert res["collectives"]["per_iteration"]["forward"]["bytes"] < 1 << 20, res  # gathered logits: 6 MiB


def test_simulate_dry_run(tmp_path, capsys):
    """--simulate 2: the TP plan on 2 ranks simulated in one plain process (pytest's: it holds no process group)."""
    argv = [*TINY, "--distributed_mode", "tp", "--loss_parallel", "true", "--simulate", "2",
            "--json_path", str(tmp_path / "results.json")]
    assert bench.main(argv) == 0
    output = capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    losses = list(res["losses"].values())
    assert len(losses) == 2 and losses[0] == losses[1] and math.isfinite(losses[0]), losses
    per_rank = list(res["param_bytes_per_rank"].values())
    full, tp_rank = _pythia_param_bytes(2)
    assert per_rank == [tp_rank, tp_rank] and res["param_bytes_full_model"] == full, res
    # loss parallel, one (parallel-residual) block: its all_reduce + the embedding's, and the loss's gather of 2
    # per-token statistics from each rank, no logits gather; backward: the input grads of qkv, fc and lm_head
    per_iter = res["collectives"]["per_iteration"]
    assert per_iter["forward"]["by_kind"] == {"all_reduce": {"count": 2, "bytes": 2 * ACTIVATION},
                                              "all_gather": {"count": 1, "bytes": 2 * 2 * TOKENS * 4}}, per_iter
    assert per_iter["backward"]["by_kind"] == {"all_reduce": {"count": 3, "bytes": 3 * ACTIVATION}}, per_iter
    assert "rank 1: loss" in output and "Collectives per rank and iteration, backward" in output


# --- Thunder benchmark_litgpt flags, on the gloo ranks of tests/dist.py (no torchrun start-up) ----------------


def _train(argv: list[str]) -> dict:
    """Build and train as the benchmark does; this rank's losses, saved bytes, collectives and a parameter checksum."""
    import thunder
    import torch
    import torch.distributed as dist

    args = bench.parse_args([*TINY, *argv])
    world = dist.get_world_size()
    groups = setup.make_groups(args.tp_size or world)
    config, model, jm = bench.build(args, groups, torch.device("cpu"))
    losses, _, _ = bench.train(args, groups, torch.device("cpu"), jm, config.padded_vocab_size)
    return {
        "losses": losses,
        "tp_rank": groups.tp_rank,
        "dtype": str(next(jm.parameters()).dtype),
        "saved": harness.saved_for_backward(thunder.last_traces(jm)[-1]),
        "collectives": harness.collectives_per_iteration(jm)["per_iteration"],
        "checksum": sum(p.double().sum().item() for p in jm.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in jm.parameters()),
        "full_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.slow  # accumulation: test_fabric's pretrain; checkpointed blocks: test_fabric_checkpointing, test_simulate
def test_accumulation_and_activation_checkpointing_are_exact():
    """TP=2: 2 micro-batches of 1 = one of 2; checkpointed blocks save less and give the same losses."""
    from tests.dist import run_ranks

    base = run_ranks(_train, 2, ["--distributed_mode", "tp", "--micro_batch_size", "2"])[0]
    accumulated = run_ranks(_train, 2,
                            ["--distributed_mode", "tp", "--micro_batch_size", "1", "--global_batch_size", "2"])[0]
    checkpointed = run_ranks(_train, 2, ["--distributed_mode", "tp", "--micro_batch_size", "2",
                                         "--checkpoint_activations", "true"])[0]
    assert _close(accumulated["losses"], base["losses"]), (accumulated["losses"], base["losses"])
    assert _close(checkpointed["losses"], base["losses"]), (checkpointed["losses"], base["losses"])
    # logits dominate
    assert checkpointed["saved"]["activation_bytes"] < base["saved"]["activation_bytes"], (checkpointed, base)
    # pythia's parallel residual needs no reduced activation in the backward, and the embedding's all_reduce
    # feeding the first block is computed outside it: nothing to re-issue here
    # (tests/test_simulate.py checks the re-issued all_reduce of a checkpointed llama block)
    assert checkpointed["collectives"]["backward"] == base["collectives"]["backward"], (checkpointed, base)


@pytest.mark.slow  # the flags of what test_2d (TP in Thunder's DDP / FSDP) and test_bench_generate (bf16) check
def test_bf16_and_2d_modes():
    """bf16 parameters; TP=2 inside Thunder's DDP (replicas stay in sync) and FSDP (a quarter of the bytes per rank)."""
    from tests.dist import run_ranks

    bf16 = run_ranks(_train, 2, ["--distributed_mode", "tp", "--dtype", "bfloat16"])
    assert bf16[0]["dtype"] == "torch.bfloat16" and all(math.isfinite(x) for x in bf16[0]["losses"]), bf16[0]
    for mode in ("tp_ddp", "tp_fsdp"):
        ranks = run_ranks(_train, 4, ["--distributed_mode", mode, "--tp_size", "2", "--dp_size", "2"])
        assert all(math.isfinite(x) for r in ranks for x in r["losses"]), ranks
        assert [r["tp_rank"] for r in ranks] == [0, 1, 0, 1]
        assert ranks[0]["losses"] == ranks[1]["losses"] != ranks[2]["losses"]  # dp ranks see different batches
        if mode == "tp_ddp":  # the same TP shard on both dp ranks after the steps: grads were averaged over dp
            assert math.isclose(ranks[0]["checksum"], ranks[2]["checksum"], rel_tol=1e-6), ranks
    full, tp_rank = _pythia_param_bytes(2)
    assert ranks[0]["full_param_bytes"] == full and ranks[0]["param_bytes"] == tp_rank // 2, ranks[0]  # FSDP halves it


@pytest.mark.slow  # the flags of what test_checkpoint checks (resuming at another TP size, lit_model.pth)
def test_save_resume_at_another_tp_size_and_pretrained_file(tmp_path):
    """--save_checkpoint at TP=2, --resume at TP=4, and --checkpoint from the exported lit_model.pth at TP=2 continue
    from the same weights (SGD has no state: both runs then see equal losses), not from a fresh initialization."""
    from tests.dist import run_ranks
    from thunder_tp.checkpoint import export

    saved_dir, pth = str(tmp_path / "ckpt"), str(tmp_path / "lit_model.pth")
    fresh = run_ranks(_train, 2, ["--distributed_mode", "tp", "--save_checkpoint", saved_dir])[0]
    export(saved_dir, pth)
    resumed = run_ranks(_train, 4, ["--distributed_mode", "tp", "--resume", saved_dir])[0]
    pretrained = run_ranks(_train, 2, ["--distributed_mode", "tp", "--checkpoint", pth])[0]
    assert _close(resumed["losses"], pretrained["losses"]), (resumed["losses"], pretrained["losses"])
    assert not _close(resumed["losses"][:1], fresh["losses"][:1]), (resumed["losses"], fresh["losses"])


# --- option parsing (no processes) ------------------------------------------------------------------------


def test_options():
    args = bench.parse_args(["--distributed_mode", "tp", "--dump_thunder_traces", "true", "--loss_parallel", "False"])
    assert args.dump_thunder_traces is True and args.loss_parallel is False and args.compile == "thunder"
    assert set(setup.TRAINER_MODES) >= {"none", "tp", "tp_sp"}
    with pytest.raises(SystemExit):
        bench.parse_args(["--dump_thunder_traces", "maybe"])
    with pytest.raises(SystemExit):  # eager has no TP
        bench.parse_args(["--compile", "eager", "--distributed_mode", "tp"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--max_iters", "2", "--warmup_iters", "2"])
    with pytest.raises(SystemExit):  # fp8 needs TransformerEngine
        bench.parse_args(["--low_precision_mode", "fp8-delayed-te"])
    with pytest.raises(SystemExit):  # --simulate simulates a TP plan
        bench.parse_args(["--simulate", "2"])
    args = bench.parse_args(["--micro_batch_size", "2", "--global_batch_size", "8"])
    assert setup.accumulation_steps(args, dp_size=2) == 2
    with pytest.raises(SystemExit, match="multiple"):
        setup.accumulation_steps(bench.parse_args(["--micro_batch_size", "2", "--global_batch_size", "6"]), dp_size=2)


@pytest.mark.parametrize(("argv", "fix"), [
    (["--context_parallel_size", "2", "--block_size", "30"],
     "--block_size 30 with --context_parallel_size 2: thunder_tp.ContextParallel: a sequence of 30 cannot be cut "
     "into 2 x CP = 4 chunks"),
    (["--context_parallel_size", "2", "--block_size", "30"], "(here: --block_size, or --cp_load_balance false)"),
    (["--context_parallel_size", "4", "--block_size", "30", "--cp_load_balance", "false"],
     "use a sequence length that is a multiple of 4 (here: --block_size)"),
    (["--context_parallel_size", "0"], "--context_parallel_size must be at least 1"),
    (["--context_parallel_size", "2", "--distributed_mode", "tp", "--simulate", "2"],
     "leave out --context_parallel_size"),
    (["--context_parallel_size", "2", "--compile", "eager"], "no context parallelism: use --compile thunder"),
])
def test_context_parallel_flags_refused_with_the_fix(argv, fix, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert fix in " ".join(capsys.readouterr().err.split()), fix


@pytest.mark.parametrize(("argv", "world", "fix"), [
    (["--context_parallel_size", "3", "--block_size", "48"], 4,
     "--context_parallel_size 3 must divide the world size 4"),
    (["--distributed_mode", "tp", "--tp_size", "3", "--context_parallel_size", "2"], 8,
     "--context_parallel_size 2 * --tp_size 3 must divide the world size 8: use --tp_size 4 or a divisor of it"),
    (["--distributed_mode", "tp", "--tp_size", "2", "--context_parallel_size", "2"], 8,
     "the replicas would train independently; use --tp_size 4"),
    (["--context_parallel_size", "2"], 4, "the replicas would train independently; use --context_parallel_size 4"),
    (["--distributed_mode", "tp_ddp", "--dp_size", "2", "--context_parallel_size", "2", "--tp_size", "2"], 4,
     "--dp_size 2 * --context_parallel_size 2 * --tp_size 2 must equal the world size 4"),
])
def test_context_parallel_sizes_that_do_not_fit_the_world_name_the_fix(argv, world, fix):
    """Checked before any process group is made (resolve_groups raises first)."""
    with pytest.raises(SystemExit, match=re.escape(fix)):
        setup.resolve_groups(bench.parse_args([*TINY, *argv]), 0, world)


_FP8 = ["--use_torchao_fp8_linear", "true"]
_FP8_GATHER = [*_FP8, "--use_torchao_fp8_allgather", "true"]


@pytest.mark.parametrize(("argv", "fix"), [
    (["--distributed_mode", "tp_sp", "--use_torchao_fp8_allgather", "true"], "add --use_torchao_fp8_linear true"),
    ([*_FP8_GATHER, "--distributed_mode", "tp_sp", "--torchao_fp8_recipe", "rowwise"],
     "Float8ColwiseParallel gathers in float8 only with tensorwise scaling"),
    ([*_FP8_GATHER, "--distributed_mode", "tp"], "use --distributed_mode tp_sp"),
    ([*_FP8, "--torchao_fp8_recipe", "colwise"], "not one of torchao's recipes: ['tensorwise', 'rowwise'"),
])
def test_float8_flags_refused_with_the_fix(argv, fix, capsys):
    pytest.importorskip("torchao", reason="torchao is the optional extra thunder_tp[float8]")
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert fix in " ".join(capsys.readouterr().err.split()), fix


def test_float8_flags_without_torchao_name_the_extra(monkeypatch, capsys):
    from benchmarks.lib import litgpt_options

    monkeypatch.setattr(litgpt_options, "torchao_installed", lambda: False)
    for flag in ("--use_torchao_fp8_linear", "--use_torchao_fp8_allgather"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--distributed_mode", "tp_sp", flag, "true"])
        assert "pip install thunder_tp[float8]" in capsys.readouterr().err


def test_tp_overlap_and_float8_all_gather_reach_tensor_parallel():
    """--tp_overlap and --use_torchao_fp8_allgather are TensorParallel's overlap= and float8_all_gather= (the
    latter off unless asked, as Thunder's flag); built on meta tensors, without ranks."""
    import torch

    import thunder_tp

    for argv, overlap, gather in (([], "auto", False), (["--tp_overlap", "never", *_FP8_GATHER], "never", True)):
        args = bench.parse_args(["--distributed_mode", "tp_sp", *TINY, *argv])
        with torch.device("meta"):
            model = setup.make_model(args, setup.make_config(args), torch.device("meta"))
        how = setup.how_of(args, setup.Groups(0, 2, 2, 0, None, 1, 0, None))
        tp = modes.tp_transform(model, how, sequence_parallel=True)
        assert isinstance(tp, thunder_tp.TensorParallel) and (tp.overlap, tp.float8_all_gather) == (overlap, gather)


@pytest.mark.parametrize("script", ["benchmark_litgpt", "bench_generate"])
def test_help_exits_zero(script, tmp_path):
    """``python -m benchmarks.<script> --help`` prints the usage and exits 0 (torchrun's ``@record`` returns None for a
    ``SystemExit(0)``); its ``__main__`` run in a process forked from the test pools' server (torch imported)."""
    out, err = tmp_path / "out", tmp_path / "err"
    process = start_forked(_run_as_main, f"benchmarks.{script}", ["--help"], name=f"{script}-help", stdout=str(out),
                           stderr=str(err))
    process.join(TIMEOUT_S)
    process.kill()
    assert process.exitcode == 0, (process.exitcode, err.read_text()[-3000:])
    assert out.read_text().startswith("usage:") and not err.read_text().strip()


def _run_as_main(module: str, argv: list[str]) -> None:
    """``python -m module *argv``."""
    sys.argv = [module, *argv]
    sys.modules.pop(module, None)  # imported with this test module: run afresh, as `python -m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)
