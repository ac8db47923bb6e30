"""HF checkpoint directories (save_pretrained: one model.safetensors, or a sharded index) loaded into a meta-device
TP=2 model slice by slice; saved with ck.save and exported back with `export --hf` for from_pretrained."""

import os

import pytest
import thunder
import torch

import thunder_tp
import thunder_tp.checkpoint as ck
from tests.dist import run_ranks
from tests.hf_models import batch, make_config, make_model
from tests.tp_checks import FAST_EXECUTORS, assert_close_scaled, rank_and_size
from thunder_tp import TensorParallel
from thunder_tp.checkpoint import safetensors_dir
from thunder_tp.checkpoint.tensors import model_tensors

pytest.importorskip("transformers")


def _meta_tp_model(name: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(name), torch_dtype=torch.float64)
    return thunder.jit(model, transforms=[TensorParallel(thunder_tp.plans.hf(model))], executors=FAST_EXECUTORS)


def _loss(model) -> torch.Tensor:
    idx = batch()
    return model(input_ids=idx, labels=idx, use_cache=False).loss


def _counting_reads():
    """Count the bytes of every slice read from a safetensors file (this rank's requests)."""
    read = {"bytes": 0}
    original = safetensors_dir.SafetensorsSlice.__getitem__

    def counted(self, index):
        t = original(self, index)
        read["bytes"] += t.numel() * t.element_size()
        return t

    safetensors_dir.SafetensorsSlice.__getitem__ = counted
    return read, lambda: setattr(safetensors_dir.SafetensorsSlice, "__getitem__", original)


def _load_and_export(directory: str, name: str, dcp_dir: str, out: str) -> dict:
    rank, _ = rank_and_size()
    expected = _loss(make_model(name))
    jm = _meta_tp_model(name)
    read, restore = _counting_reads()
    try:
        ck.load(directory, jm)
    finally:
        restore()
    assert_close_scaled(_loss(jm), expected, rtol=1e-6, atol=1e-6, what="loss after ck.load")
    # this rank's pieces of every state-dict entry (a tied embedding's twice: it is the head's weight too)
    share = sum(t.local.numel() * t.local.element_size() for t in model_tensors(jm).values())
    ck.save(dcp_dir, jm)
    torch.distributed.barrier()
    if rank == 0:
        ck.export(dcp_dir, out, hf=True)
    torch.distributed.barrier()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float64)
    assert_close_scaled(_loss(exported), expected, rtol=1e-6, atol=1e-6, what="loss of the exported model")
    return {"read": read["bytes"], "share": share}


@pytest.mark.parametrize("name, shard_size", [
    pytest.param("llama", None, id="single-file", marks=pytest.mark.slow),  # sharded-tied reads the same format
    pytest.param("gemma", "100KB", id="sharded-tied"),
])
def test_hf_directory_loads_into_a_meta_tp_model_and_exports_back(tmp_path, name, shard_size):
    saved = tmp_path / "hf"
    make_model(name).save_pretrained(saved, **({"max_shard_size": shard_size} if shard_size else {}))
    index = os.path.isfile(saved / "model.safetensors.index.json")
    assert index == bool(shard_size), os.listdir(saved)
    results = run_ranks(_load_and_export, 2, str(saved), name, str(tmp_path / "dcp"), str(tmp_path / "out"))
    full = sum(os.path.getsize(saved / f) for f in os.listdir(saved) if f.endswith(".safetensors"))
    for rank, r in enumerate(results):
        assert r["read"] == r["share"] < 0.75 * full, (rank, r, full)  # its slices only, never the whole file
