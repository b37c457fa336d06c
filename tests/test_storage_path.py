"""Where a run's results go: ``RunConfig.path`` is absolute, so the path printed at the end of a
job (also one submitted with ``ray job submit``) says where the files are."""
from __future__ import annotations

from pathlib import Path

from jabasray.config import RunConfig


def test_relative_storage_path_is_taken_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert RunConfig("runs", "digits").path == tmp_path / "runs" / "digits"


def test_absolute_and_home_storage_paths_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert RunConfig(str(tmp_path / "shared"), "a").path == tmp_path / "shared" / "a"
    assert RunConfig("~/runs", "a").path == tmp_path / "runs" / "a"
    assert RunConfig("~/runs", "a").path.is_absolute() and Path("~").expanduser() == tmp_path
