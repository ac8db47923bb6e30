"""The version guard (issue 77): another Thunder (or torch) than the one thunder_tp's patches were written for gets one
UnsupportedThunderVersion naming the versions and the patch modules to port, or an ImportError in strict mode; the
registry of patches covers thunder_internals/ and agrees with pyproject.toml and docs/design.md."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.test_one_door import violations
from thunder_tp.thunder_internals import versions

REPO = Path(__file__).resolve().parent.parent
INTERNALS = REPO / "thunder_tp" / "thunder_internals"
SUPPORTED = {"lightning-thunder": "0.2.6", "torch": "2.10.0"}


def _patches_of(library: str) -> list[str]:
    return [m for m, patch in versions.PATCHES.items() if patch.library == library]


def _check(monkeypatch, installed: dict[str, str]) -> list[warnings.WarningMessage]:
    """The warnings ``versions.check()`` issues with ``installed`` as the detected versions, strict mode off."""
    monkeypatch.setattr(versions, "installed", lambda: dict(installed))
    monkeypatch.delenv(versions.STRICT_ENV, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.check()
    return caught


def test_another_thunder_warns_once_naming_each_patch_module(monkeypatch):
    caught = _check(monkeypatch, {**SUPPORTED, "lightning-thunder": "0.3.0"})
    assert [w.category for w in caught] == [versions.UnsupportedThunderVersion]
    assert issubclass(versions.UnsupportedThunderVersion, UserWarning)
    text = str(caught[0].message)
    assert "lightning-thunder 0.3.0" in text and "lightning-thunder==0.2.6" in text and "torch>=2.10,<2.13" in text
    assert versions.STRICT_ENV in text
    thunder = _patches_of("lightning-thunder")
    assert len(thunder) >= 8 and all(f"{m}.py (" in text for m in thunder), text
    assert not any(f"{m}.py" in text for m in _patches_of("torch")), text  # torch is supported: its patches hold


def test_another_torch_names_the_torch_patches(monkeypatch):
    caught = _check(monkeypatch, {**SUPPORTED, "torch": "2.13.0"})
    assert [w.category for w in caught] == [versions.UnsupportedThunderVersion]
    text = str(caught[0].message)
    assert "torch 2.13.0" in text and all(f"{m}.py (" in text for m in _patches_of("torch"))
    assert not any(f"{m}.py" in text for m in _patches_of("lightning-thunder")), text


def test_both_wrong_is_still_one_warning(monkeypatch):
    caught = _check(monkeypatch, {"lightning-thunder": "0.3.0", "torch": "2.9.0"})
    assert len(caught) == 1 and all(f"{m}.py (" in str(caught[0].message) for m in versions.PATCHES)


@pytest.mark.parametrize("installed", [SUPPORTED, {"lightning-thunder": "0.2.6", "torch": "2.12.1+cu128"}, {}])
def test_the_supported_versions_give_no_warning(monkeypatch, installed):
    assert _check(monkeypatch, installed) == []
    assert versions.check(installed) is None


def test_the_installed_versions_are_supported():
    """This environment (requirements-ci.txt's pins) is what the patches were written for."""
    assert versions.message(versions.installed()) is None, versions.installed()


def test_strict_mode_raises_import_error_with_the_same_text(monkeypatch):
    wrong = {**SUPPORTED, "lightning-thunder": "0.3.0"}
    monkeypatch.setattr(versions, "installed", lambda: dict(wrong))
    monkeypatch.setenv(versions.STRICT_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict raises instead of warning
        with pytest.raises(ImportError) as raised:
            versions.check()
    assert str(raised.value) == versions.message(wrong)
    monkeypatch.setenv(versions.STRICT_ENV, "0")
    with pytest.warns(versions.UnsupportedThunderVersion):
        versions.check()


_FAKE_THUNDER = ("import importlib.metadata as m; real = m.version; "
                 "m.version = lambda d: '0.3.0' if d == 'lightning-thunder' else real(d); import thunder_tp")


@pytest.mark.parametrize("strict", [False, True])
def test_import_thunder_tp_runs_the_check(strict):
    """``import thunder_tp`` with another Thunder: one warning, or with THUNDER_TP_STRICT_VERSIONS=1 an ImportError."""
    import os

    env = {k: v for k, v in os.environ.items() if k != versions.STRICT_ENV}
    if strict:
        env[versions.STRICT_ENV] = "1"
    result = subprocess.run([sys.executable, "-c", _FAKE_THUNDER], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    if strict:
        assert result.returncode != 0 and "ImportError: thunder_tp was written for" in result.stderr, result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stderr.count("UnsupportedThunderVersion: thunder_tp was written for") == 1, result.stderr
    assert "lightning-thunder 0.3.0" in result.stderr and "private.py (" in result.stderr


@pytest.mark.parametrize("distribution, version, supported", [
    ("torch", "2.10.0", True), ("torch", "2.10.0+cpu", True), ("torch", "2.12.1", True), ("torch", "2.9.1", False),
    ("torch", "2.13.0", False), ("torch", "2.13.0a0+git1234", False), ("lightning-thunder", "0.2.6", True),
    ("lightning-thunder", "0.2.5", False), ("lightning-thunder", "0.2.7", False), ("lightning-thunder", "0.3.0", False),
    ("transformers", "4.52.4", True), ("transformers", "4.57.1", False),
])
def test_supports(distribution, version, supported):
    assert versions.supports(distribution, version) is supported


def test_every_module_of_thunder_internals_is_registered():
    """Each module there either patches (PATCHES, with the library it patches) or says what it does instead."""
    modules = {p.stem for p in INTERNALS.glob("*.py") if p.stem != "__init__"}
    assert not set(versions.PATCHES) & set(versions.NOT_PATCHING)
    assert set(versions.PATCHES) | set(versions.NOT_PATCHING) == modules, (
        f"unregistered: {sorted(modules - set(versions.PATCHES) - set(versions.NOT_PATCHING))}; "
        f"gone: {sorted(set(versions.PATCHES) | set(versions.NOT_PATCHING) - modules)}")
    assert all(patch.library in versions.CHECKED and patch.replaces for patch in versions.PATCHES.values())
    assert all(versions.NOT_PATCHING.values())


def test_a_module_that_assigns_into_thunder_or_torch_is_a_registered_patch():
    """What tests/test_one_door.py counts as a patch (an assignment to an attribute of theirs) is in PATCHES."""
    patching = {p.stem for p in INTERNALS.glob("*.py") if any(": patches " in v for v in violations(p.read_text()))}
    assert patching and patching <= set(versions.PATCHES), sorted(patching - set(versions.PATCHES))


def test_pyproject_declares_the_supported_versions():
    pyproject = (REPO / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.M | re.S)[1]
    declared = set(re.findall(r'"([^"]+)"', dependencies))
    assert declared == {f"{d}{versions.SUPPORTED[d]}" for d in versions.CHECKED}, declared
    pins = dict(re.findall(r"^([\w-]+)==(\S+)", (REPO / "requirements-ci.txt").read_text(), re.M))
    assert all(versions.supports(d, pins[d]) for d in versions.SUPPORTED), pins


def test_design_doc_names_every_patch_module():
    design = (REPO / "docs" / "design.md").read_text()
    section = design.split("## Patches of Thunder and torch", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{m}.py`" in section for m in versions.PATCHES), section
    assert "THUNDER_TP_STRICT_VERSIONS" in section and "UnsupportedThunderVersion" in section
