"""Smoke test of ``benchmark_litgpt --compare``: every mode runs under torchrun on a tiny config, its every gradient
gated against single device; the gate fails on one wrong shard."""

import json
import math

import pytest
import torch

from benchmarks.lib import harness, llama, side_by_side
from benchmarks.lib.harness import thunder_default_executors
from benchmarks.lib.modes import How
from tests.dist import run_ranks, torchrun

DIMS = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab": 64, "ffn_hidden": 64}
BATCH, SEQ = 2, 8
TINY = ["--llama_config", json.dumps(DIMS), "--micro_batch_size", str(BATCH), "--block_size", str(SEQ),
        "--max_iters", "3", "--warmup_iters", "1", "--fresh_inductor_cache", "false", "--learning_rate", "0.01"]
EVERY_MODE = {
    "eager", "thunder", "thunder_defaults", "thunder_inductor",
    "tp", "tp_auto", "tp_sp", "tp_lp",
    "dtensor_tp_lp", "dtensor_tp_default", "dtensor_tp", "dtensor_sp", "dtensor_tp_compile",
}
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


def test_compare_runs_thunder_tp_against_dtensor(tmp_path):
    """The default side-by-side run: thunder_tp's TP and loss-parallel modes and DTensor's on Thunder's default
    executors (no Inductor compile), each gated against one device and timed."""
    modes = ["eager", "tp", "tp_lp", "dtensor_tp", "dtensor_tp_lp"]
    report, stdout = _compare(tmp_path, ",".join(modes), "--compile", "thunder_default")
    assert set(report["modes"]) == set(modes), sorted(report["modes"])
    _check_modes(report["modes"])
    for name in ("tp", "dtensor_tp"):  # Megatron's minimum, the logits gathered
        r = report["modes"][name]
        forward, backward = (r.get(f"comm_{p}_trace") or r[f"comm_{p}"] for p in ("forward", "backward"))
        assert forward["counts"] == {"all_reduce": 3, "all_gather": 1}, (name, forward)
        assert backward["counts"] == {"all_reduce": 3}, (name, backward)
    assert "| tp |" in stdout and "| dtensor_tp_lp |" in stdout


# every mode: minutes on 2 cores
@pytest.mark.slow
def test_compare_runs_every_mode(tmp_path):
    """Every mode but the Inductor ones (in the slow test), the thunder modes on Thunder's default executors:
    no Inductor compile at all; the report."""
    report, stdout = _compare(tmp_path, "all", "--compile", "thunder_default",
                              "--skip", "dtensor_tp_compile,thunder_inductor")
    modes = report["modes"]
    assert set(modes) == EVERY_MODE - {"dtensor_tp_compile", "thunder_inductor"}, sorted(modes)
    _check_modes(modes)
    # the same model gives the same first-step loss in every Llama mode
    llama = {r["loss_step1"] for r in modes.values() if "loss_step1" in r}
    assert max(llama) - min(llama) <= 1e-4 * max(llama), llama
    # Megatron's minimum: 2 all_reduce per block + the embedding's (forward) / lm_head's (backward), the logits gathered
    for name in ("tp", "dtensor_tp"):
        r = modes[name]
        forward, backward = (r.get(f"comm_{p}_trace") or r[f"comm_{p}"] for p in ("forward", "backward"))
        assert forward["counts"] == {"all_reduce": 3, "all_gather": 1}, (name, forward)
        assert backward["counts"] == {"all_reduce": 3}, (name, backward)
    # parameters: single device holds the whole model, a TP rank its shards (DTensor's and thunder_tp's alike)
    for name, r in modes.items():
        if "param_bytes" in r:
            assert r["param_bytes"] == _llama_param_bytes(r["ranks"]), (name, r["param_bytes"])
    assert "| tp |" in stdout and "| dtensor_sp |" in stdout


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
    model = side_by_side.make_model(cfg, 0)
    reference = side_by_side.reference_run(cfg, model.state_dict(), idx, targets, lr=1e-2)["grads"]
    modes = {e.name: e for e in side_by_side.entries(",".join(mode_names), "", How(thunder_default_executors))}
    out = {}
    for name in mode_names:
        jm = modes[name].build(side_by_side.make_model(cfg, 0))
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


def test_targets_pair_the_modes_round_by_round():
    """A slow round (the host busy) slows every mode of it: the paired ratio is the ratio within rounds, whatever the
    drift between them; the ratio of medians over all steps mixes rounds."""
    report = side_by_side
    tp = {"median_s": 1.0, "round_medians_s": [0.8, 1.6, 0.8]}  # round 2: the host twice as slow for every mode
    dtensor = {"median_s": 1.0, "round_medians_s": [1.0, 2.0, 1.0]}
    single = {"median_s": 1.6, "round_medians_s": [1.44, 2.88, 1.44]}
    targets = report.targets_summary({"tp": tp, "dtensor_tp": dtensor, "thunder": single}, 2)
    assert targets["tp_vs_dtensor"]["ratio_paired_by_round"] == pytest.approx(0.8)
    assert targets["parallel_efficiency"]["value_paired_by_round"] == pytest.approx(0.9)
    assert targets["parallel_efficiency"]["value"] == pytest.approx(0.8)

