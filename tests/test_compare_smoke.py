"""Smoke test of ``benchmark_litgpt --compare``: every mode runs under torchrun on a tiny config, its every gradient
gated against single device; the gate fails on one wrong shard."""

import contextlib
import json
import math
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

from benchmarks.lib import compare_report, harness, llama, side_by_side, transport
from benchmarks.lib.harness import thunder_default_executors
from benchmarks.lib.modes import How
from tests.dist import REPO_ROOT, run_ranks, torchrun

DIMS = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab": 64, "ffn_hidden": 64}
BATCH, SEQ = 2, 8
TINY = ["--llama_config", json.dumps(DIMS), "--micro_batch_size", str(BATCH), "--block_size", str(SEQ),
        "--max_iters", "3", "--warmup_iters", "1", "--fresh_inductor_cache", "false", "--learning_rate", "0.01"]
EVERY_MODE = {
    "eager", "thunder", "thunder_defaults", "thunder_inductor",
    "tp", "tp_auto", "tp_sp", "tp_lp",
    "dtensor_tp_lp", "dtensor_tp_default", "dtensor_tp", "dtensor_sp", "dtensor_tp_compile",
    "litgpt:thunder", "litgpt:tp", "litgpt:tp_sp",
    "hf:thunder", "hf_tp", "hf:tp", "hf:tp_lp",
}
HF_MODES = {"hf:thunder", "hf_tp", "hf:tp", "hf:tp_lp"}
#: modes that compile with Inductor by default (the slow-marked test)
INDUCTOR_MODES = ("tp", "dtensor_tp_compile", "thunder_inductor")
#: a bound for a run on a loaded machine (minutes on 2 shared cores); a hung rank fails earlier, after the
#: process-group --timeout
TIMEOUT_S = 1500

pytest.importorskip("litgpt")


def _compare(tmp_path, modes: str, *args: str) -> tuple[dict, str]:
    """Run ``benchmark_litgpt --compare modes`` on 2 ranks under torchrun; its JSON report and stdout."""
    json_path = tmp_path / "compare.json"
    stdout, _ = torchrun(["-m", "benchmarks.benchmark_litgpt", "--compare", modes, *TINY, "--timeout", "600",
                          "--json_path", str(json_path), *args],
                         timeout=TIMEOUT_S)
    return json.loads(json_path.read_text()), stdout


def _check_modes(modes: dict) -> None:
    """Every mode checked, matched single device on its every gradient and both losses, and was timed."""
    for name, r in modes.items():
        if "skipped" in r:  # only torch.compile may be skipped, with its reason
            assert name == "dtensor_tp_compile" and r["skipped"].startswith("torch.compile failed"), (name, r)
            continue
        assert r["loss_ok"], (name, r)
        assert 0 <= r["grad_error"] <= 1e-4, (name, r["grad_error"])  # every gradient gathered and checked
        reference = r["reference_losses"][0]
        assert math.isclose(r["loss_step1"], reference, rel_tol=1e-4), (name, r["loss_step1"], reference)
        assert len(r["times_s"]) == 2 and 0 < r["min_s"] <= r["median_s"] <= r["max_s"], (name, r)


def _llama_param_bytes(tp: int) -> int:
    """fp32 bytes of the Llama's parameters on one of ``tp`` ranks: every linear and the embedding sharded (q: all
    heads; k, v: the K/V heads), the three RMSNorm weights replicated."""
    d, f, v = DIMS["dim"], DIMS["ffn_hidden"], DIMS["vocab"]
    kv = DIMS["n_kv_heads"] * d // DIMS["n_heads"]
    sharded = 2 * v * d + 2 * d * d + 2 * kv * d + 3 * f * d
    return 4 * (sharded // tp + 3 * d)


def _may_use_real_time_priority() -> bool:
    """True if a process of this user may give a thread SCHED_FIFO (CAP_SYS_NICE)."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60).returncode == 0


def test_compare_runs_thunder_tp_against_dtensor(tmp_path):
    """The default side-by-side run: thunder_tp's TP and loss-parallel modes and DTensor's on Thunder's default
    executors (no Inductor compile), each gated against one device and timed; the broken-down step of one mode."""
    modes = ["eager", "tp", "tp_lp", "dtensor_tp", "dtensor_tp_lp"]
    report, stdout = _compare(tmp_path, ",".join(modes), "--compile", "thunder_default", "--breakdown", "1")
    assert set(report["modes"]) == set(modes), sorted(report["modes"])
    _check_modes(report["modes"])
    for name in ("tp", "dtensor_tp"):  # Megatron's minimum, the logits gathered
        r = report["modes"][name]
        forward, backward = (r.get(f"comm_{p}_trace") or r[f"comm_{p}"] for p in ("forward", "backward"))
        assert forward["counts"] == {"all_reduce": 3, "all_gather": 1}, (name, forward)
        assert backward["counts"] == {"all_reduce": 3}, (name, backward)
    assert "| tp |" in stdout and "| dtensor_tp_lp |" in stdout


# every mode, the transport runs: ~9 minutes on 2 cores
@pytest.mark.slow
def test_compare_runs_every_mode(tmp_path):
    """Every mode but the Inductor ones (in the slow test), the thunder modes on Thunder's default executors:
    no Inductor compile at all; the report; gloo's threads at SCHED_FIFO where the machine allows it."""
    fifo = _may_use_real_time_priority()
    report, stdout = _compare(tmp_path, "all", "--compile", "thunder_default",
                              "--skip", "dtensor_tp_compile,thunder_inductor",
                              "--breakdown", "2", "--without_transport", "true",
                              *(["--transport_threads", "fifo"] if fifo else []))
    assert ("(its threads at SCHED_FIFO 1)" in stdout) == fifo
    modes = report["modes"]
    assert set(modes) == EVERY_MODE - {"dtensor_tp_compile", "thunder_inductor"}, sorted(modes)
    _check_modes(modes)
    # the same model gives the same first-step loss in every Llama mode
    llama = {r["loss_step1"] for n, r in modes.items() if not n.startswith(("litgpt", "hf")) and "loss_step1" in r}
    assert max(llama) - min(llama) <= 1e-4 * max(llama), llama
    # Megatron's minimum: 2 all_reduce per block + the embedding's (forward) / lm_head's (backward), the logits gathered
    for name in ("tp", "dtensor_tp"):
        r = modes[name]
        forward, backward = (r.get(f"comm_{p}_trace") or r[f"comm_{p}"] for p in ("forward", "backward"))
        assert forward["counts"] == {"all_reduce": 3, "all_gather": 1}, (name, forward)
        assert backward["counts"] == {"all_reduce": 3}, (name, backward)
    # parameters: single device holds the whole model, a TP rank its shards (DTensor's and thunder_tp's alike)
    for name, r in modes.items():
        if "param_bytes" in r and not name.startswith(("litgpt", "hf")):
            assert r["param_bytes"] == _llama_param_bytes(r["ranks"]), (name, r["param_bytes"])
    assert "| tp |" in stdout and "| dtensor_sp |" in stdout
    _check_breakdowns(modes, stdout)
    # what communication adds: every multi-rank mode measured with and without its transport, one row each
    measured = {n for n, r in modes.items() if "transport" in r}
    assert measured == {n for n, r in modes.items() if r["ranks"] > 1}, sorted(measured)
    for name in measured:  # in every round, next to the mode's timed steps
        t = modes[name]["transport"]
        assert t["rounds"] == len(modes[name]["round_medians_s"]) > 0 and t["without_transport_s"] > 0, (name, t)
    transport_table = stdout.split("What communication adds to a step")[1]
    assert all(f"| {name} | " in transport_table for name in measured), transport_table


def _check_breakdowns(modes: dict, stdout: str) -> None:
    """Every thunder mode's step broken down: one timed call per collective issue and wait of its traces, the
    collectives lined up over the ranks; the single device's step has none."""
    thunder_modes = {n for n, r in modes.items() if r.get("runtime") == "thunder"}
    assert thunder_modes == {n for n, r in modes.items() if "breakdown" in r}, sorted(thunder_modes)
    table = stdout.split("Where a step goes")[1]
    for name in thunder_modes:
        b, ranks = modes[name]["breakdown"], modes[name]["ranks"]
        # medians of separate samples: the main thread's CPU time may exceed the process's by the clocks' resolution
        assert 0 < b["main_thread_cpu_s"] <= b["process_cpu_s"] + 1e-3 and b["idle_s"] >= 0, (name, b)
        for phase in ("forward", "backward"):
            expected = modes[name][f"comm_{phase}_trace"]["total"] if ranks > 1 else 0
            for kind in ("issue", "wait"):
                assert b["calls"].get(f"{phase} {kind}", {"count": 0})["count"] == expected, (name, phase, kind, b)
            if ranks > 1:
                lined = b["collectives"][phase]
                assert lined["issue_spread_s"] >= 0 and lined["last_issue_to_done_s"] > 0, (name, lined)
        assert ("collectives" in b) == (ranks > 1) == ("per_rank" in b), (name, b)
        assert len(b.get("per_rank", [b])) == ranks and b.get("per_rank", [b])[0]["calls"] == b["calls"], (name, b)
        labels = [f"| {name}, rank {r} | " for r in range(ranks)] if ranks > 1 else [f"| {name} | "]
        assert all(label in table for label in labels), name


@pytest.mark.slow
def test_compare_with_inductor(tmp_path):
    """The Inductor-compiled runs: the default executors (thunder_tp.executors(): Inductor fusions) on the headline TP
    mode, and DTensor under torch.compile. Slow-marked: Inductor compiles on 2 cores take minutes; the fusion executor
    under TP is tested in tests/test_tp_executor.py and run by the main-job smoke of .ci/run."""
    report, _ = _compare(tmp_path, ",".join(INDUCTOR_MODES))
    assert set(report["modes"]) == set(INDUCTOR_MODES)
    _check_modes(report["modes"])
    assert report["modes"]["tp"]["description"] == "thunder_tp TP"


# --- the gradient gate ----------------------------------------------------------------------------------------


def test_gradient_gate_fails_on_one_wrong_entry():
    """One entry of one gradient off by 1e-3 of the largest: the gate names the mode and the parameter."""
    torch.manual_seed(0)
    reference = {"model.w1.weight": torch.randn(8, 4, dtype=torch.float64),
                 "model.norm.weight": torch.randn(4, dtype=torch.float64)}
    grads = {name: g.float() for name, g in reference.items()}
    assert side_by_side.check_gradients("tp", grads, reference, rtol=1e-4) < 1e-6  # fp32 rounding passes
    wrong = grads["model.w1.weight"].clone()
    wrong[5, 2] += 1e-3 * reference["model.w1.weight"].abs().max().item()
    with pytest.raises(side_by_side.GradientMismatch, match=r"tp: gradient of 'model.w1.weight'"):
        side_by_side.check_gradients("tp", {**grads, "model.w1.weight": wrong}, reference, rtol=1e-4)
    with pytest.raises(side_by_side.GradientMismatch, match="model.norm.weight"):  # a parameter missing
        side_by_side.check_gradients("dtensor_tp", {"model.w1.weight": grads["model.w1.weight"]}, reference, rtol=1e-4)
    with pytest.raises(side_by_side.GradientMismatch, match="shape"):  # a shard not gathered
        side_by_side.check_gradients("dtensor_tp", {**grads, "model.w1.weight": grads["model.w1.weight"][:4]},
                                     reference, 1e-4)


WRONG = "model.layers.0.attention.wq.weight"  # column-parallel in every TP mode: each rank holds half of its rows


def _gate_with_one_wrong_shard(mode_names: list[str]) -> dict:
    """Per mode: the gate's error after one training step, then its message once rank 1's shard of one gradient
    is off in one entry (gathered, every rank sees it)."""
    from torch.distributed.tensor import DTensor

    cfg = llama.LlamaConfig(**DIMS, max_seq=SEQ)
    idx, targets = harness.random_batch(BATCH, SEQ, cfg.vocab, 1234, torch.device("cpu"))
    model = side_by_side.make_model("llama", cfg, 0)
    reference = side_by_side.reference_run("llama", cfg, model.state_dict(), idx, targets, lr=1e-2)["grads"]
    modes = {e.name: e for e in side_by_side.entries(",".join(mode_names), "", How(thunder_default_executors))}
    out = {}
    for name in mode_names:
        jm = modes[name].build(side_by_side.make_model("llama", cfg, 0))
        harness.train_step(jm, torch.optim.SGD(jm.parameters(), lr=1e-2), idx, targets)
        error = side_by_side.check_gradients(name, side_by_side.full_grads(jm), reference, rtol=1e-4)
        grad = dict(jm.named_parameters())[WRONG].grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        assert local.shape[0] == reference[WRONG].shape[0] // 2, local.shape  # a shard
        if torch.distributed.get_rank() == 1:
            local[0, 0] += 1e-3 * reference[WRONG].abs().max()
        try:
            side_by_side.check_gradients(name, side_by_side.full_grads(jm), reference, rtol=1e-4)
            message = None
        except side_by_side.GradientMismatch as e:
            message = str(e)
        out[name] = {"error": error, "message": message}
    return out


def test_gradient_gate_fails_on_one_wrong_shard():
    """thunder_tp and DTensor TP on 2 ranks: correct gradients pass the gate, one rank's wrong shard fails it."""
    for rank in run_ranks(_gate_with_one_wrong_shard, 2, ["tp", "dtensor_tp"]):
        for name, r in rank.items():
            assert r["error"] <= 1e-5, (name, r)
            assert r["message"] is not None and r["message"].startswith(f"{name}: gradient of {WRONG!r}"), (name, r)


def _steps_without_transport(mode_names: list[str]) -> dict:
    """Per mode: collectives counted in a step with the transport and in one without, whether the parameters were put
    back after steps without transport and torch.distributed's own collectives back in place."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    cfg = llama.LlamaConfig(**DIMS, max_seq=SEQ)
    idx, targets = harness.random_batch(BATCH, SEQ, cfg.vocab, 1234, torch.device("cpu"))
    modes = {e.name: e for e in side_by_side.entries(",".join(mode_names), "", How(thunder_default_executors))}
    def local(p):
        return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
    all_reduce, out = torch.distributed.all_reduce, {}
    for name in mode_names:
        jm = modes[name].build(side_by_side.make_model("llama", cfg, 0))
        opt = torch.optim.SGD(jm.parameters(), lr=1e-2)
        step = partial(harness.train_step, jm, opt, idx, targets)
        step()  # compiled before anything is counted
        counts = []
        for context in (contextlib.nullcontext, transport.without_transport):
            with context(), CommDebugMode() as comm:
                step()
            counts.append(comm.get_total_counts())
        before = [local(p) for p in jm.parameters()]
        with transport.steps_without_transport(list(jm.parameters())):
            step()
            moved = any(not torch.equal(a, local(p)) for a, p in zip(before, jm.parameters(), strict=True))
        out[name] = {"counts": counts, "moved": moved, "transport_back": torch.distributed.all_reduce is all_reduce,
                     "restored": all(torch.equal(a, local(p)) for a, p in zip(before, jm.parameters(), strict=True))}
    return out


def test_steps_without_transport_move_nothing():
    """thunder_tp's and DTensor's loss-parallel and sequence-parallel steps: inside ``without_transport`` no collective
    reaches torch.distributed (outside, every step has some); leaving puts parameters (which the step moved) and
    collectives back."""
    modes = ["tp_lp", "tp_sp", "dtensor_tp_lp", "dtensor_sp"]
    for rank in run_ranks(_steps_without_transport, 2, modes):
        for name, r in rank.items():
            assert r["counts"][0] > 0 and r["counts"][1] == 0, (name, r)
            assert r["moved"] and r["transport_back"] and r["restored"], (name, r)


def test_targets_pair_the_modes_round_by_round():
    """A slow round (the host busy) slows every mode of it: the paired ratio is the ratio within rounds, whatever the
    drift between them; the ratio of medians over all steps mixes rounds."""
    report = compare_report
    tp = {"median_s": 1.0, "round_medians_s": [0.8, 1.6, 0.8]}  # round 2: the host twice as slow for every mode
    dtensor = {"median_s": 1.0, "round_medians_s": [1.0, 2.0, 1.0]}
    single = {"median_s": 1.6, "round_medians_s": [1.44, 2.88, 1.44]}
    targets = report.targets_summary({"tp": tp, "dtensor_tp": dtensor, "thunder": single}, 2)
    assert targets["tp_vs_dtensor"]["ratio_paired_by_round"] == pytest.approx(0.8)
    assert targets["parallel_efficiency"]["value_paired_by_round"] == pytest.approx(0.9)
    assert targets["parallel_efficiency"]["value"] == pytest.approx(0.8)


def test_communication_cost_pairs_by_round():
    """A round where the host is slow slows a mode's steps with and without transport alike: what communication adds
    is the difference within rounds, whatever the drift between them."""
    timed = {"times_s": [0.8, 0.8, 1.6, 1.6, 0.8, 0.8], "round_medians_s": [0.8, 1.6, 0.8]}
    without = {"times_s": [0.7, 0.7, 1.5, 1.5, 0.7, 0.7], "round_medians_s": [0.7, 1.5, 0.7], "minor_faults": [3] * 6}
    cost = transport.communication_cost(timed, without)
    assert cost["rounds"] == 3 and cost["exposed_s"] == pytest.approx(0.1)
    assert cost["without_transport_s"] == pytest.approx(0.7) and cost["without_transport_minor_faults_per_step"] == 3


_PRIORITIZE = """
import json, os, sys, threading
from benchmarks.lib import transport
import torch
ready, stop, tids = threading.Event(), threading.Event(), []
def idle():
    tids.append(threading.get_native_id())
    ready.set()
    stop.wait()
thread = threading.Thread(target=idle)
thread.start()
ready.wait()
if sys.argv[1] == "unprivileged":
    os.setuid(65534)  # nobody: no CAP_SYS_NICE, and RLIMIT_RTPRIO 0
try:
    count, error = transport.prioritize_transport_threads(torch.device("cpu")), None
except SystemExit as e:
    count, error = 0, str(e)
print(json.dumps({"count": count, "error": error, "other": os.sched_getscheduler(tids[0]),
                  "main": os.sched_getscheduler(0), "fifo": os.SCHED_FIFO, "normal": os.SCHED_OTHER}))
stop.set()
thread.join()
"""


@pytest.mark.parametrize("privileges", ["as_run", "unprivileged"])
def test_transport_threads_fifo_leaves_the_main_thread_alone(privileges):
    """``--transport_threads fifo``: every thread but the main one at SCHED_FIFO, the main one as it was; where the
    process may not, an error naming the option and the capability it needs (in a process of its own: the test run's
    threads keep their policy)."""
    if privileges == "unprivileged" and os.geteuid() != 0:
        pytest.skip("dropping privileges needs root; the run as it is covers an unprivileged process")
    proc = subprocess.run([sys.executable, "-c", _PRIORITIZE, privileges], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["main"] == r["normal"], r
    if privileges == "unprivileged" or r["error"] is not None:
        assert r["error"] and "--transport_threads fifo" in r["error"] and "CAP_SYS_NICE" in r["error"], r
        assert r["other"] == r["normal"], r
        return
    assert r["count"] >= 1 and r["other"] == r["fifo"], r


def test_transport_threads_fifo_refused_on_cuda():
    """On CUDA the option is refused with the reason, before any thread changes policy."""
    with pytest.raises(SystemExit, match="for CPU runs"):
        transport.prioritize_transport_threads(torch.device("cuda", 0))


@pytest.mark.slow  # the side-by-side runs and gates: the tests above; HF models under TP: test_hf
def test_compare_hf_against_its_own_tp(tmp_path):
    """HF's own TP and thunder_tp's TP / TP + loss parallel on a 1-layer HF Llama, each gated against one device,
    timed in alternating rounds with and without transport."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # from_pretrained(tp_plan="auto")
    report, stdout = _compare(tmp_path, ",".join(sorted(HF_MODES)), "--compile", "thunder_default", "--rounds", "2",
                              "--without_transport", "true")
    assert set(report["modes"]) == HF_MODES
    _check_modes(report["modes"])
    for name in HF_MODES - {"hf:thunder"}:
        assert report["modes"][name]["transport"]["rounds"] == 2, name
    forward = report["modes"]["hf:tp"]["comm_forward_trace"]["counts"]
    assert forward == {"all_reduce": 3, "all_gather": 1}, forward  # Megatron's minimum for one block
    assert "| hf:tp |" in stdout and "hf_thunder_tp_vs_hf_tp" in stdout
