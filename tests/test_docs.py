"""Every Python block of the README and docs runs as written (tests/doc_blocks.py says how), or says why not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.dist import REPO_ROOT, run_ranks
from tests.doc_blocks import Block, _block, blocks, run_on_rank

_ALL = blocks()


def test_a_skipped_block_says_why():
    assert all(len(b.reason) > 10 for b in _ALL if not b.runs), [(b.where, b.reason) for b in _ALL if not b.runs]


def test_a_block_without_a_marker_is_refused():
    with pytest.raises(ValueError, match="needs a `<!-- doc-test"):
        _block("README.md:1", "x = 1\n", "Some prose.")
    with pytest.raises(ValueError, match="unknown doc-test marker"):
        _block("README.md:1", "x = 1\n", "<!-- doc-test: torchrun 2 after nothing-such -->")


@pytest.mark.parametrize("block", [b for b in _ALL if b.runs], ids=lambda b: b.where)
def test_block_runs(block: Block, tmp_path):
    if block.ranks is None:
        result = subprocess.run([sys.executable, "-c", block.script()], cwd=tmp_path, capture_output=True, text=True,
                                timeout=600, env=_plain_env())
        assert result.returncode == 0, f"{block.where}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    else:
        run_ranks(run_on_rank, block.ranks, block.script(), str(tmp_path))


def _plain_env() -> dict:
    import os

    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
