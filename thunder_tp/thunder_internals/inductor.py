"""Inductor's CPU vector-ISA probe runs once per machine, not once in every process.

Before its first C++ kernel, each process checks every vector ISA its CPU advertises (AVX-512 VNNI, AVX-512 and AVX2
on this project's machine): Inductor compiles a tiny library per ISA (cached on disk) and loads it in a child Python
that imports torch. That is 12.6 s per process here (torch 2.10, 2 cores): every rank, every restart and every test
process paid it before its first step (pytorch/pytorch issue 140970). A successful load now leaves a marker file
beside the library, and a process that finds the marker answers without the child; a failed probe leaves none and
runs again next time, as before. PyTorch's pull request 190561 proposes the same marker. Installed by
``patches.install()``, not at import.
"""

from __future__ import annotations

from pathlib import Path

from torch._inductor import cpu_vec_isa
from torch._inductor.cpu_vec_isa import VecISA

from thunder_tp.thunder_internals import patches

__all__ = ["check_build"]

_inductor_check_build = VecISA.check_build
_MARKER_SUFFIX = ".thunder_tp_load_ok"


def _marker(isa: VecISA, code: str) -> Path:
    """The marker of `code` built for `isa`: beside the source Inductor writes (its name is the probe's key)."""
    from torch._inductor.codecache import write

    _, source = write(code, "cpp", extra=cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags()))
    return Path(source + _MARKER_SUFFIX)


def check_build(self: VecISA, code: str) -> bool:
    """Inductor's ``VecISA.check_build``, answered by its marker where an earlier process's probe succeeded."""
    marker = _marker(self, code)
    if marker.exists():
        return True
    ok = _inductor_check_build(self, code)
    if ok:
        marker.touch()
    return ok


#: for every Inductor compile of the process once installed (thunder_tp's regions compile when they first run, after
#: Thunder's compile), answering as the probe would
patches.declare(VecISA, "check_build", check_build)
