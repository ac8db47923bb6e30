"""Smoke run under torchrun: examples/pretrain_fabric.py on a tiny model, 2 ranks."""

from __future__ import annotations

import os

import pytest

from tests.dist import REPO_ROOT, torchrun


@pytest.mark.slow  # reason: litgpt's pretrain under torchrun, compiling a training and a validation program
def test_example_pretrain_fabric(tmp_path):
    stdout, _ = torchrun([os.path.join(REPO_ROOT, "examples", "pretrain_fabric.py"), "--iters", "3", "--n_layer", "1",
                          "--out_dir", str(tmp_path / "out")], timeout=1200)
    assert "iter 3 step 3" in stdout and (tmp_path / "out" / "final" / "lit_model.pth" / ".metadata").is_file()
