"""Smoke test of benchmarks/compare_hf.py: HF's own TP and thunder_tp's TP / TP + loss parallel on a 1-layer HF Llama
under torchrun, each gated against one device (first-step loss and every gradient, second-step loss), timed in
alternating rounds with and without transport."""

import json

import pytest

from tests.dist import torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # from_pretrained(tp_plan="auto")

TIMEOUT_S = 1200


@pytest.mark.slow  # compare.py's runs and gates: test_compare_smoke; HF models under TP: test_hf
def test_compare_hf_smoke(tmp_path):
    json_path = tmp_path / "compare_hf.json"
    args = ["--n_layers", "1", "--batch", "1", "--seq", "16", "--steps", "2", "--rounds", "2", "--warmup", "0",
            "--executors", "thunder_default", "--without_transport", "1", "--json_path", str(json_path)]
    stdout, _ = torchrun(["-m", "benchmarks.compare_hf", *args], timeout=TIMEOUT_S)
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
