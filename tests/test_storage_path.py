"""Where a run's results go: ``RunConfig.path`` of a local storage path is absolute, so the path
printed at the end of a job (also one submitted with ``ray job submit``) says where the files
are. URIs and a given ``storage_filesystem`` resolve as in Ray Train; bad input is one line."""
from __future__ import annotations

from pathlib import Path

import pytest

from jabasray.config import RunConfig


def test_relative_storage_path_is_taken_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = RunConfig("runs", "digits").path
    assert path.local_path == tmp_path / "runs" / "digits" and str(path) == str(tmp_path / "runs" / "digits")


def test_absolute_and_home_storage_paths_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert RunConfig(str(tmp_path / "shared"), "a").path.local_path == tmp_path / "shared" / "a"
    assert RunConfig(tmp_path / "shared", "a").path.local_path == tmp_path / "shared" / "a"
    assert RunConfig("~/runs", "a").path.local_path == tmp_path / "runs" / "a"
    assert RunConfig("~/runs", "a").path.local_path.is_absolute() and Path("~").expanduser() == tmp_path
    assert RunConfig(f"file://{tmp_path}/runs", "a").path.local_path == tmp_path / "runs" / "a"


def test_uris_and_given_filesystems_resolve_as_in_ray_train():
    import pyarrow.fs
    from ray.train.v2._internal.execution.storage import get_fs_and_path

    mock = RunConfig("mock://netloc/bucket/runs", "a")
    fs, path = get_fs_and_path("mock://netloc/bucket/runs")   # Ray Train's own resolution
    assert type(mock.storage.filesystem) is type(fs) and mock.storage.fs_path == path
    assert mock.path.fs_path == "bucket/runs/a"
    given = pyarrow.fs.SubTreeFileSystem("/tmp", pyarrow.fs.LocalFileSystem())
    cfg = RunConfig("bucket/runs", "a", storage_filesystem=given)
    assert cfg.path.filesystem is given and cfg.path.fs_path == "bucket/runs/a"


@pytest.mark.parametrize("kwargs, message", [
    (dict(storage_path="s4://bucket/runs"), "storage_path has the unknown URI scheme 's4' in "
                                            "'s4://bucket/runs'; use a local path or one of file://, s3://"),
    (dict(storage_path=""), "storage_path must be a non-empty local path or URI, got ''"),
    (dict(storage_path=3), "storage_path must be a non-empty local path or URI, got 3"),
    (dict(storage_path="/x", storage_filesystem="s3"), "storage_filesystem must be a "
                                                       "pyarrow.fs.FileSystem or None, got str"),
    (dict(storage_path="s3://b/x", storage_filesystem="FS"), "storage_filesystem must be a "
                                                             "pyarrow.fs.FileSystem or None"),
])
def test_bad_storage_input_is_one_line_at_construction(kwargs, message):
    if kwargs.get("storage_filesystem") == "FS":
        import pyarrow.fs
        kwargs["storage_filesystem"] = pyarrow.fs.LocalFileSystem()
        message = "storage_path must be a path on storage_filesystem without its scheme"
    with pytest.raises(ValueError) as e:
        RunConfig(name="a", **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
