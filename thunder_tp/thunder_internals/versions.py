"""The versions of Thunder, torch and transformers that thunder_tp's patches were written for, and the check that
``import thunder_tp`` runs against the installed ones.

``PATCHES`` registers every module of ``thunder_tp/thunder_internals/`` that replaces something of Thunder's or
torch's (docs/design.md, 'Patches of Thunder and torch'), with what it replaces (most declare it to
``thunder_internals.patches``, which installs it on thunder_tp's first use, never at import); ``NOT_PATCHING``
every other module there, with what it does instead (``tests/test_versions.py`` checks that the two cover the
folder). Where Thunder or torch is another version than ``SUPPORTED``, importing thunder_tp issues one
``UnsupportedThunderVersion`` naming the installed and supported versions and the patch modules to port; with
``THUNDER_TP_STRICT_VERSIONS=1`` in the environment it raises ImportError with the same text instead. The installed
versions are read from the packages' metadata, so the check imports neither torch nor Thunder (``import thunder_tp``
stays cheap).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from importlib import metadata

__all__ = ["NOT_PATCHING", "PATCHES", "STRICT_ENV", "SUPPORTED", "UnsupportedThunderVersion", "check", "supports"]

#: distribution -> the versions thunder_tp is written and tested for (pyproject.toml's dependencies say the same,
#: checked by tests/test_versions.py); transformers is optional, checked when an HF plan is made (thunder_tp.plans.hf)
SUPPORTED = {
    "lightning-thunder": "==0.2.6",
    "torch": ">=2.10,<2.13",
    # the version Thunder 0.2.6 tests against and traces (4.57 fails in Thunder's interpreter)
    "transformers": ">=4.52.0,<4.53.0",
}
#: the distributions whose versions ``import thunder_tp`` checks
CHECKED = ("lightning-thunder", "torch")
#: set to 1 to make an unsupported version an ImportError instead of a warning
STRICT_ENV = "THUNDER_TP_STRICT_VERSIONS"


@dataclass(frozen=True)
class Patch:
    """What a module of thunder_internals replaces in ``library`` (a distribution of SUPPORTED)."""

    library: str
    replaces: str


#: module of thunder_internals -> what it patches (docs/design.md, 'Patches of Thunder and torch')
PATCHES = {
    "private": Patch("lightning-thunder", "thunder.thunder_general_jit, thunder.torch._get_fake_arg"),
    "collections_during_compile": Patch("lightning-thunder", "thunder._with_cache_info_ctx"),
    "global_names": Patch("lightning-thunder", "the interpreter's globals_lookup"),
    "builtin_containers": Patch("lightning-thunder", "the interpreter's wrap_args_from_list, wrap_kwargs_from_dict, "
                                                     "_call_dispatch, lookaside and opcode-handler maps"),
    "instructions": Patch("lightning-thunder", "the interpreter's dis, inspect, get_or_make_python_frame"),
    "signatures": Patch("lightning-thunder", "Symbol.normalize"),
    "pytree": Patch("lightning-thunder", "thunder.core.pytree's flattening, wherever imported"),
    "min_cuts": Patch("lightning-thunder", "rematerialization's nx"),
    "untraced": Patch("lightning-thunder", "a general-jit lookaside for dynamo's GenerationTracker.tag"),
    "grad_mode": Patch("lightning-thunder", "general-jit lookasides for torch.inference_mode's __enter__, __exit__"),
    "patches": Patch("lightning-thunder", "general-jit lookasides: the model families' (inside applied() only) and "
                                          "one per dispatcher; installs the others' patches"),
    "inductor": Patch("torch", "VecISA.check_build"),
    "distributed": Patch("torch", "reduce_scatter_tensor and the _c10d_functional reduce_scatter kernels"),
    "dtensor": Patch("torch", "DTensor's, FSDP2's and composable replicate's entry points, wherever bound"),
}
#: every other module of thunder_internals -> what it does instead of patching
NOT_PATCHING = {
    "aten": "names torch's private CPU attention kernels",
    "checkpointing": "tags proxies with Thunder's recompute tag",
    "computation": "reads Thunder's cache entries and traces",
    "dynamo": "asks torch._dynamo's private functions",
    "overlapping_inputs": "checks a call's inputs before Thunder groups them",
    "prologue": "reads and edits TP's own traces' prologues",
    "quiet": "warning and log filters",
    "replay": "lookasides and the interpreter's private calls",
    "sharded_tensor": "builds torch's ShardedTensor from private paths",
    "torch_pytree": "re-exports torch.utils._pytree",
    "transformers": "reads one private function of transformers",
    "versions": "this check",
}


class UnsupportedThunderVersion(UserWarning):
    """Thunder (or torch) is a version that thunder_tp's patches of its internals were not written for."""


def supports(distribution: str, version: str) -> bool:
    """Whether ``version`` of ``distribution`` is in SUPPORTED's range (release numbers compared: ``2.10.0+cpu`` is
    2.10.0; a pre-release of an excluded upper bound, ``2.13.0a0``, is out as 2.13.0 is)."""
    have = _release(version)
    for spec in SUPPORTED[distribution].split(","):
        op, bound = re.fullmatch(r"\s*(==|>=|<)\s*(\S+)\s*", spec).groups()
        want = _release(bound)
        width = max(len(have), len(want))
        h, w = (v + (0,) * (width - len(v)) for v in (have, want))
        if not {"==": h == w, ">=": h >= w, "<": h < w}[op]:
            return False
    return True


def _release(version: str) -> tuple[int, ...]:
    """A version's release numbers: ``2.10.0+cpu`` -> (2, 10, 0); no leading number -> ()."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(n) for n in match[0].split(".")) if match else ()


def installed() -> dict[str, str]:
    """The installed version of each CHECKED distribution found (from its metadata, nothing imported)."""
    found = {}
    for distribution in CHECKED:
        try:
            found[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:  # e.g. a source tree on sys.path: nothing to compare
            pass
    return found


def message(versions: dict[str, str]) -> str | None:
    """The warning's text for these installed versions (distribution -> version), None if all are supported."""
    wrong = {d: v for d, v in versions.items() if d in CHECKED and not supports(d, v)}
    if not wrong:
        return None
    to_port = [f"{module}.py ({patch.replaces})" for module, patch in PATCHES.items() if patch.library in wrong]
    return (
        "thunder_tp was written for " + " and ".join(f"{d}{SUPPORTED[d]}" for d in CHECKED)
        + "; installed: " + ", ".join(f"{d} {v}" for d, v in wrong.items())
        + ". Its patches of their internals, in thunder_tp/thunder_internals/, need porting: "
        + "; ".join(to_port)
        + ". Until then thunder_tp may fail or compute wrong results (that folder's other modules read private "
        "names too: docs/design.md, 'Patches of Thunder and torch'). Install the supported versions "
        f"(requirements-ci.txt pins them), or set {STRICT_ENV}=1 to make this an ImportError."
    )


def check(versions: dict[str, str] | None = None, strict: bool | None = None) -> str | None:
    """Warn (UnsupportedThunderVersion) when ``versions`` (default: ``installed()``) are not SUPPORTED, or raise
    ImportError with the same text when ``strict`` (default: ``THUNDER_TP_STRICT_VERSIONS=1``); returns the text.
    ``import thunder_tp`` calls it once."""
    text = message(installed() if versions is None else versions)
    if text is None:
        return None
    if strict is None:
        strict = os.environ.get(STRICT_ENV, "") not in ("", "0")
    if strict:
        raise ImportError(text)
    warnings.warn(text, UnsupportedThunderVersion, stacklevel=2)
    return text
