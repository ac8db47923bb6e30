"""Smoke test of benchmarks/bench_rank.py: a tiny llama at TP=4 as one rank of a fake group on the CPU, ``--quick``
(no code generation), every mode that runs on the CPU, the table and the projection printed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.dist import REPO_ROOT

TINY = ["--model", "tiny", "--tp", "4", "--quick", "--layers", "0,1", "--full_layers", "2", "--seq", "32",
        "--context", "16", "--decode_batches", "1", "--steps", "2", "--warmup", "1", "--project"]


@pytest.mark.slow  # the benchmark's own smoke, run before measuring with it (its two reports are default tests)
def test_tiny_tp4_on_cpu(tmp_path):
    json_path = tmp_path / "rank.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_rank", *TINY, "--json_path", str(json_path)],
                          cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900, env={"OMP_NUM_THREADS": "1", **_env()})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for line in ("mode (a) skipped: nvFuser runs on CUDA only", "mode (e) skipped: CUDA graphs need CUDA",
                 "| 4 | (b) thunder_tp, Inductor regions |", "| 4 | 1 | (d) thunder_tp decode step, compiled whole |",
                 "alpha-beta parameters",
                 "training TP=4: (b) vs (c):"):
        assert line in out, (line, out[-5000:])
    rows = {(r["workload"], r["mode"]): r for r in json.loads(json_path.read_text())["rows"]}
    assert set(rows) == {("training", "b"), ("training", "c"), ("decode", "d"), ("decode", "f")}, rows
    for key, row in rows.items():
        assert "error" not in row and row["loss_finite"], (key, row)
        assert set(row["depths"]) == {"0", "1"}, key  # both depths measured (JSON keys)
        p = row["projection"]
        assert p["no_overlap_s"] >= p["overlap_s"] > 0 and p["comm_s"] > 0, (key, p)
    # the same Llama, the same shards: thunder_tp and DTensor hold the same parameter bytes per rank
    assert rows["training", "b"]["param_bytes"] == rows["training", "c"]["param_bytes"]
    train = rows["training", "b"]["collectives"]
    assert {k for k, _, _ in train["forward"]} >= {"reduce_scatter", "all_gather"}, train  # sequence parallel
    assert all(size == 4 for _, size, _ in train["forward"] + train["backward"]), train


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}


def _training_row(mode: str, loss: float) -> dict:
    """A training row of bench_rank's results at one depth: its first loss, one collective."""
    return {"workload": "training", "mode": mode, "tp": 8, "batch": 1, "param_bytes": 1,
            "depths": {1: {"samples": [{"loss": loss}]}},
            "collectives": {"forward": [["all_gather", 8, 4]], "backward": []}}


def test_report_fails_where_the_backends_losses_differ():
    """(a) and (b) run the same weights and batch: their losses must agree within bf16's rounding."""
    from benchmarks import bench_rank as report
    lines, failed = report._structure_lines([_training_row("a", 11.75), _training_row("b", 11.8125)], "bfloat16")
    assert not failed and "loss 11.7500 vs 11.8125" in lines[0], lines
    lines, failed = report._structure_lines([_training_row("a", 11.75), _training_row("b", 12.5)], "bfloat16")
    assert failed and "FAILED" in lines[0], lines
    assert report._structure_lines([_training_row("a", 11.75), _training_row("b", 11.8125)], "float32")[1]

