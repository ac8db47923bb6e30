"""Every Python block of the README and docs runs as written (tests/doc_blocks.py says how), or says why not; every
dotted `thunder_tp.` name they write resolves."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from tests.dist import REPO_ROOT, run_ranks
from tests.doc_blocks import DOCUMENTS, REPO, Block, _block, blocks, run_on_rank

_ALL = blocks()
_DOTTED = re.compile(r"\bthunder_tp(?:\.\w+)+")


def test_a_skipped_block_says_why():
    assert all(len(b.reason) > 10 for b in _ALL if not b.runs), [(b.where, b.reason) for b in _ALL if not b.runs]


def test_a_slow_block_names_the_test_that_runs_the_same():
    """A block left to the slow run names the test file of the default run that does what it does."""
    named = {b.where: re.search(r"tests/test_\w+\.py", b.slow) for b in _ALL if b.slow}
    assert named and all(m and (REPO / m[0]).is_file() for m in named.values()), named


def test_a_block_without_a_marker_is_refused():
    with pytest.raises(ValueError, match="needs a `<!-- doc-test"):
        _block("README.md:1", "x = 1\n", "Some prose.")
    with pytest.raises(ValueError, match="unknown doc-test marker"):
        _block("README.md:1", "x = 1\n", "<!-- doc-test: torchrun 2 after nothing-such -->")


@pytest.mark.parametrize("block", [pytest.param(b, marks=[pytest.mark.slow] if b.slow else [], id=b.where)
                                   for b in _ALL if b.runs])
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


def test_every_dotted_name_in_the_docs_resolves():
    """`thunder_tp.plans.litgpt.GPTWithLoss` and the like, in prose and code, name what they say (attribute by
    attribute, as a reader's code reaches them; a submodule its package does not import is imported)."""
    written = {(m[0], f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}")
               for path in DOCUMENTS for text in [path.read_text()] for m in _DOTTED.finditer(text)}
    assert len({name for name, _ in written}) > 20, sorted(written)  # the pattern finds the docs' names
    unresolved = sorted((where, name) for name, where in written if not _resolves(name))
    assert not unresolved, unresolved


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    value = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            value = getattr(value, part)
        except AttributeError:
            try:
                value = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                return False
    return True
