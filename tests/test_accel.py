"""Which allocator core runs: the compiled one only when it was built from these sources."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import gpudash
from gpudash import _accel, _sourcehash

PKG = Path(gpudash.__file__).resolve().parent


def test_the_fingerprint_follows_every_source_file(tmp_path):
    shutil.copy(PKG / "_core.pyx", tmp_path)
    shutil.copytree(PKG / "_csrc", tmp_path / "_csrc")
    first = _sourcehash.source_hash(tmp_path)
    assert first == _sourcehash.source_hash(PKG)
    pxi = sorted((tmp_path / "_csrc").glob("*.pxi"))[-1]
    pxi.write_text(pxi.read_text() + "\n# changed\n")
    assert _sourcehash.source_hash(tmp_path) != first
    assert _sourcehash.source_hash(tmp_path / "nowhere") is None


def test_an_extension_from_other_sources_is_not_used(monkeypatch):
    monkeypatch.delenv(_accel.ENV, raising=False)
    try:
        from gpudash import _core
    except ImportError:
        pytest.skip("the compiled core is not built here")
    assert _core.SOURCE_HASH == _sourcehash.source_hash(PKG)
    assert _accel._load() == (_core, "")
    monkeypatch.setattr(_sourcehash, "source_hash", lambda _dir: "0" * 64)
    core, reason = _accel._load()
    assert core is None and "built from other sources" in reason and "rebuild" in reason


def test_the_environment_variable_chooses_the_pure_models(monkeypatch):
    monkeypatch.setenv(_accel.ENV, "1")
    assert _accel._load() == (None, f"{_accel.ENV} is set")
    monkeypatch.setenv(_accel.ENV, "0")
    assert _accel._load()[1] != f"{_accel.ENV} is set"


def test_describe_says_which_core_runs_and_why(monkeypatch):
    monkeypatch.setattr(_accel, "COMPILED", False)
    monkeypatch.setattr(_accel, "REASON", f"{_accel.ENV} is set")
    assert _accel.describe() == f"pure Python ({_accel.ENV} is set)"
    if _accel._core is not None:
        monkeypatch.setattr(_accel, "COMPILED", True)
        assert _accel.describe().startswith("compiled (gpudash._core, _core")
