"""Smoke test of benchmarks/bench_moe.py's GPU path on the CPU: one rank of a fake group of 8 (``--one_rank 8``) at
the fine-grained config's shapes, built on the meta device, both modes: whole experts (EP) and split experts (TP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.dist import REPO_ROOT

ONE_RANK = ["--one_rank", "8", "--configs", "fine", "--tokens", "64", "--steps", "2", "--rounds", "1", "--warmup", "1"]


@pytest.mark.slow  # the benchmark's own smoke; expert parallelism itself: test_expert_parallel
def test_one_rank_of_8_fine_grained(tmp_path):
    """Each mode times its steps and holds the same parameter bytes; EP issues its all_to_alls (3 forward, 2
    backward) where TP all-reduces once each way."""
    json_path = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_moe", *ONE_RANK, "--json_path", str(json_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    report = json.loads(json_path.read_text())
    assert report["tp"] == 8
    modes = report["results"]["fine"]
    assert set(modes) == {"tp", "ep"}, modes
    for mode, r in modes.items():
        assert r["median_s"] > 0, (mode, r)
    assert modes["ep"]["param_bytes"] == modes["tp"]["param_bytes"], modes
    kinds = {mode: {p: {k: v["count"] for k, v in r["collectives"][p]["by_kind"].items()}
                    for p in ("forward", "backward")} for mode, r in modes.items()}
    assert kinds["ep"]["forward"]["all_to_all"] == 3 and kinds["ep"]["backward"]["all_to_all"] == 2, kinds
    assert kinds["tp"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}, kinds
