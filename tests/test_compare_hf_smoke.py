"""Smoke test of benchmarks/compare_hf.py: HF's own TP and thunder_tp's TP / TP + loss parallel on a 1-layer HF Llama
under torchrun, each gated against one device (first-step loss and every gradient, second-step loss), timed in
alternating rounds with and without transport."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.dist import BENCHMARKS, REPO_ROOT, free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # from_pretrained(tp_plan="auto")

TIMEOUT_S = 1200


def test_compare_hf_smoke(tmp_path):
    json_path = tmp_path / "compare_hf.json"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(BENCHMARKS, "compare_hf.py"), "--n_layers", "1", "--batch", "1", "--seq", "16", "--steps", "2",
           "--rounds", "2", "--warmup", "0", "--executors", "thunder_default", "--without_transport", "1",
           "--json_path", str(json_path)]
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"compare_hf.py did not finish within {TIMEOUT_S} s\n{stdout[-3000:]}\n{stderr[-5000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}"
    results = json.loads(json_path.read_text())
    assert set(results["modes"]) == {"hf_tp", "thunder_tp", "thunder_tp_lp"}
    for name, mode in results["modes"].items():
        assert len(mode["times_s"]) == 2 and len(mode["round_medians_s"]) == 2, name
        assert mode["grad_error"] < 1e-4, name
        assert mode["transport"]["rounds"] == 2, name
    thunder = results["modes"]["thunder_tp"]["collectives"]
    # Megatron's minimum for one block: 2 all_reduces + the embedding's forward, 2 + ... backward; 1 logits gather
    assert thunder["forward"]["by_kind"]["all_reduce"]["count"] == 3
    assert thunder["forward"]["by_kind"]["all_gather"]["count"] == 1
    assert "hf_tp: " in stdout and "alternating rounds" in stdout
