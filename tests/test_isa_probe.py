"""Inductor's CPU vector-ISA probe: a load that succeeded once is not probed again; a failed one is."""

import subprocess

import pytest
from torch._inductor import cpu_vec_isa
from torch._inductor.cpu_vec_isa import VecAVX2, VecISA

from thunder_tp.thunder_internals import inductor as isa_probe

pytestmark = pytest.mark.usefixtures("speedups_applied")  # Thunder's speed-ups in this module's jits


@pytest.fixture
def fresh_inductor_cache(tmp_path, monkeypatch):
    """Inductor's on-disk cache in an empty folder (the state of a machine's first process)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path


def _no_child(*args, **kwargs):
    raise AssertionError(f"a probe's child process was started: {args}")


def test_a_successful_probe_is_answered_by_its_marker_without_a_child(fresh_inductor_cache, monkeypatch):
    assert VecISA.check_build is isa_probe.check_build
    if not VecAVX2().check_build(VecISA._avx_code):
        pytest.skip("this machine's compiler or CPU cannot build Inductor's AVX2 probe")
    assert list(fresh_inductor_cache.rglob(f"*{isa_probe._MARKER_SUFFIX}")), "no marker left by the probe"
    monkeypatch.setattr(cpu_vec_isa.subprocess, "check_call", _no_child)
    assert VecAVX2().check_build(VecISA._avx_code)


def test_a_failed_probe_leaves_no_marker_and_runs_again(fresh_inductor_cache, monkeypatch):
    children = []

    def failing_child(*args, **kwargs):
        children.append(args)
        raise subprocess.CalledProcessError(1, args[0])

    monkeypatch.setattr(cpu_vec_isa.subprocess, "check_call", failing_child)
    code = VecISA._avx_code + "\n// a probe whose load fails\n"
    assert not VecAVX2().check_build(code)
    if not children:
        pytest.skip("this machine's compiler cannot build Inductor's AVX2 probe")
    assert not list(fresh_inductor_cache.rglob(f"*{isa_probe._MARKER_SUFFIX}"))
    assert not VecAVX2().check_build(code)
    assert len(children) == 2, "a failed probe was not run again"
