"""Smoke test of benchmarks/bench_generate.py: a 1-layer llama, a few tokens, 2 ranks (torchrun, and the warm gloo
ranks of tests/dist.py), ``--compile thunder_default`` (no Inductor compile: quick on a small CPU machine)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from benchmarks import bench_generate as bench
from tests.dist import torchrun

TINY = ["--n_layer", "1", "--n_embd", "64", "--n_head", "4", "--n_query_groups", "2", "--intermediate_size", "128",
        "--vocab", "256", "--prompt_len", "8", "--new_tokens", "3", "--rounds", "1", "--compile", "thunder_default"]
TIMEOUT_S = 300

pytest.importorskip("litgpt")


def _check(res: dict, modes: list[str], batch: int, itemsize: int) -> None:
    """Every mode timed with the reference tokens; (d) at Megatron's decode collectives, minus the embedding's
    all_reduce (its embedding is replicated), and with half the KV cache; (c), where it ran, at the minimum with the
    sampler's all_gather of each rank's (largest logit, index) in place of the logits', and with half the cache;
    (c'), where it ran, with the logits' all_gather."""
    results = res["results"]
    assert list(results) == modes, results
    for name, r in results.items():
        assert "error" not in r, (name, r)
        assert r["ttft_median_s"] > 0 and r["decode_tokens_per_s_median"] > 0, (name, r)
        assert r.get("compiles", 2) == 2, (name, r)  # Thunder modes: prefill and decode, over both generations
    act, logits = batch * 64 * itemsize, batch * 256 * itemsize  # one decode step's (batch, 1, n_embd) and logits
    assert results["manual_tp"]["decode_collectives"] == {"all_reduce": {"count": 2, "bytes": 2 * act},
                                                          "all_gather": {"count": 1, "bytes": logits}}, results
    full_kv = 2 * batch * 2 * (8 + 3) * 16 * itemsize  # k and v: (batch, 2 K/V groups, context, head size)
    assert results["manual_tp"]["kv_cache_bytes"] == full_kv // 2, results
    candidates = batch * 2 * 8 * 2  # one float64 (value, index) pair a row from each of the 2 ranks
    for name, gathered in (("tp", candidates), ("tp_gather", logits)):
        if name in results:
            tp = results[name]["decode_collectives"]
            want = {"all_reduce": {"count": 3, "bytes": 3 * act}, "all_gather": {"count": 1, "bytes": gathered}}
            assert tp == want, (name, tp)
            assert results[name]["kv_cache_bytes"] == full_kv // 2, results
            assert results[name]["param_bytes"] < results["eager"]["param_bytes"], results


# the command line; test_batched_bf16 runs the benchmark on the warm ranks (~2 minutes on 2 cores)
@pytest.mark.slow
def test_torchrun(tmp_path):
    """Batch 1 (litgpt's generate loop), fp32, from the command line: every mode."""
    modes = ["thunder", "eager", "tp", "tp_gather", "manual_tp"]
    json_path = tmp_path / "results.json"
    stdout, stderr = torchrun(["-m", "benchmarks.bench_generate", *TINY, "--modes", ",".join(modes), "--json_path",
                               str(json_path)],
                              timeout=TIMEOUT_S, cwd=str(tmp_path))
    output = stdout + stderr
    _check(json.loads(json_path.read_text()), modes, 1, 4)
    assert "| (c) thunder_tp TP, TP=2 | 2 |" in output and "manual_tp, collectives per rank" in output, output[-4000:]


def _run(argv: list[str]) -> tuple[int, dict]:
    """The benchmark on this gloo rank of tests/dist.py (no pinning: the pool's processes keep their cores)."""
    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json") if dist.get_rank() == 0 else ""
        args = bench.parse_args([*TINY, *argv, "--pin_cores", "0", "--json_path", path])
        code = bench.run(args, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
        return code, json.loads(Path(path).read_text()) if path else {}


def test_batched_bf16():
    """Batch 2 (litgpt's batched loop), bf16, on the warm gloo ranks of tests/dist.py; the Thunder builds are
    tp's, sampling on shards and with the logits gathered (test_torchrun, slow, runs every mode from the
    command line)."""
    from tests.dist import run_ranks

    modes = ["eager", "tp", "tp_gather", "manual_tp"]
    (code, res), (code1, _) = run_ranks(_run, 2, ["--batch", "2", "--dtype", "bfloat16", "--modes", ",".join(modes)])
    assert code == code1 == 0
    _check(res, modes, 2, 2)


def test_tokens_must_match_up_to_a_near_tie():
    import torch

    tokens = torch.tensor([[1, 2, 3], [1, 2, 3]])
    logits = torch.zeros(2, 3, 8)
    logits[1, 1, 2], logits[1, 1, 5] = 4.0, 3.9999  # row 1's second token: 2 by a hair over 5
    ref = bench.Reference(tokens, lambda: logits, eps=1e-6)  # tolerance: 32 eps * largest logit 4 = 1.28e-4
    assert bench.check_tokens("x", tokens.clone(), ref) == []
    ties = bench.check_tokens("x", torch.tensor([[1, 2, 3], [1, 5, 0]]), ref)
    assert [(t["row"], t["token"]) for t in ties] == [(1, 1)] and ties[0]["gap"] < ties[0]["tolerance"], ties
    with pytest.raises(bench.TokenMismatch, match=r"x: .* row 1, new token 1: \[6, 0\] vs \[2, 3\]"):
        bench.check_tokens("x", torch.tensor([[1, 2, 3], [1, 6, 0]]), ref)
