"""Smoke runs under torchrun: benchmarks/bench_fabric.py (the side-by-side benchmark) and examples/pretrain_fabric.py
on a tiny model, 2 ranks."""

from __future__ import annotations

import json
import os

import pytest

from tests.dist import REPO_ROOT, torchrun


@pytest.mark.slow  # reason: two litgpt pretrain runs under torchrun, each compiling (minutes on 2 cores)
def test_bench_fabric_tiny(tmp_path):
    json_path = tmp_path / "fabric.json"
    stdout, _ = torchrun(["-m", "benchmarks.bench_fabric", "--size", "tiny", "--rounds", "1", "--iters", "4",
                          "--warmup", "1", "--out_dir", str(tmp_path / "out"), "--json_path", str(json_path)],
                          timeout=1200)
    result = json.loads(json_path.read_text())
    assert set(result["summary"]) == {"thunder_tp", "model_parallel"} and result["ratio"] > 0
    assert "| thunder_tp |" in stdout and "losses equal within" in stdout


@pytest.mark.slow  # reason: litgpt's pretrain under torchrun, compiling a training and a validation program
def test_example_pretrain_fabric(tmp_path):
    stdout, _ = torchrun([os.path.join(REPO_ROOT, "examples", "pretrain_fabric.py"), "--iters", "3", "--n_layer", "1",
                          "--out_dir", str(tmp_path / "out")], timeout=1200)
    assert "iter 3 step 3" in stdout and (tmp_path / "out" / "final" / "lit_model.pth" / ".metadata").is_file()
