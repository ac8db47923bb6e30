"""Smoke test of benchmarks/compare.py: every mode runs under torchrun on a tiny config and matches single device."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.dist import REPO_ROOT, free_port

TINY = ["--dim", "32", "--n_layers", "1", "--n_heads", "4", "--n_kv_heads", "2", "--vocab", "64", "--ffn_hidden", "64",
        "--batch", "2", "--seq", "8", "--steps", "2", "--warmup", "1", "--scaling_layers", "1,2", "--scaling_repeats", "1",
        "--fresh_inductor_cache", "0"]


def test_compare_runs_every_mode(tmp_path):
    json_path, png_path = tmp_path / "compare.json", tmp_path / "compare.png"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()),
           os.path.join(REPO_ROOT, "benchmarks", "compare.py"), *TINY,
           "--json_path", str(json_path), "--png_path", str(png_path)]
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)  # this checkout's thunder_tp
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-5000:]}\n{proc.stderr[-10000:]}"

    report = json.loads(json_path.read_text())
    modes = report["modes"]
    expected = {
        "single_eager", "single_thunder", "single_thunder_defaults", "thunder_tp_tp", "thunder_tp_sp", "thunder_tp_tp_lp",
        "dtensor_tp_lp",
        "dtensor_tp_default", "dtensor_tp", "dtensor_sp", "dtensor_tp_compile",
        "litgpt_single_thunder", "litgpt_thunder_tp_tp", "litgpt_thunder_tp_sp",
    }
    assert set(modes) == expected, sorted(modes)
    for name, r in modes.items():
        if "skipped" in r:  # only torch.compile may be skipped, with its reason
            assert name == "dtensor_tp_compile" and r["skipped"], (name, r)
            continue
        assert r["loss_ok"], (name, r)
        assert 0 <= r["grad_error"] <= 1e-4, (name, r["grad_error"])  # every gradient gathered and checked
        reference = r["reference_losses"][0]
        assert math.isclose(r["loss_step1"], reference, rel_tol=1e-4), (name, r["loss_step1"], reference)
        assert r["median_s"] > 0 and len(r["times_s"]) == 2, (name, r)
    # the same model gives the same first-step loss in every Llama mode
    llama = {r["loss_step1"] for n, r in modes.items() if not n.startswith("litgpt") and "loss_step1" in r}
    assert max(llama) - min(llama) <= 1e-4 * max(llama), llama
    assert report["modes"]["thunder_tp_tp"]["comm_backward_trace"]["counts"] == {"all_reduce": 3}  # 2 per block + lm_head
    assert set(report["transform_scaling"]) == {"1", "2"}
    assert png_path.stat().st_size > 0
    assert "| thunder_tp_tp |" in proc.stdout


def _compare_module():
    spec = importlib.util.spec_from_file_location("compare", os.path.join(REPO_ROOT, "benchmarks", "compare.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_gradient_gate_fails_on_one_wrong_shard():
    """One rank's half of one gradient off by 1e-3 of the largest entry: the gate names the mode and the parameter."""
    compare = _compare_module()
    torch.manual_seed(0)
    reference = {"model.w1.weight": torch.randn(8, 4, dtype=torch.float64), "model.norm.weight": torch.randn(4, dtype=torch.float64)}
    grads = {name: g.float() for name, g in reference.items()}
    assert compare.check_gradients("thunder_tp_tp", grads, reference, rtol=1e-4) < 1e-6  # fp32 rounding passes
    wrong = grads["model.w1.weight"].clone()
    wrong[4:] += 1e-3 * reference["model.w1.weight"].abs().max().item()
    with pytest.raises(compare.GradientMismatch, match=r"thunder_tp_tp: gradient of 'model.w1.weight'"):
        compare.check_gradients("thunder_tp_tp", {**grads, "model.w1.weight": wrong}, reference, rtol=1e-4)
    with pytest.raises(compare.GradientMismatch, match="model.norm.weight"):
        compare.check_gradients("dtensor_tp", {"model.w1.weight": grads["model.w1.weight"]}, reference, rtol=1e-4)
