"""Smoke test of benchmarks/compare.py: every mode runs under torchrun on a tiny config and matches single device."""

import json
import math
import os
import subprocess
import sys

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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
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
