"""thunder_tp's import quiets the messages its use causes (thunder_tp/thunder_internals/quiet.py) and only those."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import thunder_tp.thunder_internals.quiet  # noqa: F401
from tests.dist import REPO_ROOT


def _pythons(*codes: str) -> list[subprocess.CompletedProcess]:
    """Each of ``codes`` in a fresh interpreter where every UserWarning is an error, side by side."""
    command = [sys.executable, "-W", "error::UserWarning", "-c"]
    procs = [subprocess.Popen([*command, code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT) for code in codes]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs, strict=True)]
    finally:
        for p in procs:
            p.kill()


def test_importing_thunder_tp_does_not_raise_the_transformer_engine_warning():
    control, quiet = _pythons(
        "import thunder",  # the warning this environment raises (no Transformer Engine here)
        "import thunder_tp, thunder, warnings\n"
        "try:\n    warnings.warn('a user warning', UserWarning)\n"
        "except UserWarning:\n    print('user warnings untouched')")
    assert control.returncode != 0 and "transformer_engine module not found!" in control.stderr, control
    assert quiet.returncode == 0 and "transformer_engine" not in quiet.stderr, quiet.stderr
    assert quiet.stdout.strip() == "user warnings untouched", quiet


def test_only_the_no_cuda_runtime_record_is_dropped():
    logger = logging.getLogger("torch.utils.cpp_extension")

    def record(msg: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, ("/usr/local",), None)

    assert not logger.filter(record("No CUDA runtime is found, using CUDA_HOME='%s'"))
    assert logger.filter(record("another message about CUDA_HOME='%s'"))


def _warnings_of(save) -> list[str]:
    """The UserWarnings ``save()`` issues (DCP's category; not the DeprecationWarnings that Python hides from users
    and that a first save can raise by importing the model families, torchao's among them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_checkpoint_saves_over_a_directory_without_dcps_warnings(tmp_path):
    """thunder_tp.checkpoint.save twice to one directory, in a process without a process group: no warning, where
    DCP's own save warns (the control: the test would see them)."""
    import torch
    import torch.distributed.checkpoint as dcp

    import thunder_tp.checkpoint as ck

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    for _ in range(2):
        assert _warnings_of(lambda: ck.save(tmp_path / "ours", model, optimizer)) == []
        control = _warnings_of(lambda: dcp.save({"w": model.weight.detach()}, checkpoint_id=str(tmp_path / "dcp")))
    assert any("Detected an existing checkpoint" in m for m in control), control
    assert any("torch.distributed is disabled" in m for m in control), control
