"""Checkpoints never unpickle objects, are committed manifest-last (no renames) with a verified
manifest, and a corrupt or half-written newest checkpoint falls back to the newest intact one.
Local folders here; the same code on S3 is tested in test_storage_s3.py. No Ray here."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import OrderedDict

import numpy as np
import pytest
import torch

from jabasray.actors.checkpoint import (CheckpointError, DriverState, file_sha256,
                                        latest_checkpoint, list_checkpoints, save_checkpoint)
from jabasray.cli import main
from jabasray.types import ClusterSpec


class _Payload:
    """Unpickling this creates ``marker`` (what a crafted checkpoint would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _state(epochs_done: int) -> DriverState:
    cl = ClusterSpec.emulated({"fast": (1, 2, 1.0)})
    return DriverState(epochs_done=epochs_done, iteration=10 * epochs_done, cluster=cl,
                       allocation={cl.nodes[0].name: 1})


def _worker(e: int) -> dict:
    # an opaque nested structure, as other components put into worker_state
    return {"model": OrderedDict(w=torch.full((3,), float(e))),
            "ranks": [{"rng": torch.arange(4, dtype=torch.uint8), "step": e, "name": "r0"},
                      ({"m": torch.zeros(2)}, 1.5, None, True)],
            "dtype": torch.float32}


def _rewrite_manifest(cp_dir) -> None:
    """What an attacker with write access does: make the manifest match the crafted file."""
    m = json.loads((cp_dir / "manifest.json").read_text())
    for name in m["files"]:
        m["files"][name] = {"bytes": (cp_dir / name).stat().st_size,
                            "sha256": file_sha256(cp_dir / name)}
    (cp_dir / "manifest.json").write_text(json.dumps(m))


def test_opaque_worker_state_round_trips_through_weights_only(tmp_path):
    save_checkpoint(tmp_path, _state(1), _worker(1))
    cp = latest_checkpoint(tmp_path)
    got = cp.load_worker_state()
    want = _worker(1)
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["ranks"][0]["rng"], want["ranks"][0]["rng"])
    assert got["ranks"][0]["step"] == 1 and got["ranks"][0]["name"] == "r0"
    assert got["ranks"][1][1:] == (1.5, None, True) and got["dtype"] is torch.float32
    assert cp.load_driver_state() == _state(1)


@pytest.mark.parametrize("bad, where", [
    ({"rng": np.zeros(3)}, "worker_state['rng']"),
    ({"a": [1, {"f": lambda: 0}]}, "worker_state['a'][1]['f']"),
    ({(1, 2): torch.zeros(1)}, "worker_state key (1, 2)"),
])
def test_state_that_weights_only_cannot_load_is_refused_before_writing(tmp_path, bad, where):
    with pytest.raises(ValueError) as e:
        save_checkpoint(tmp_path, _state(1), bad)
    assert str(e.value).startswith(where)
    assert list_checkpoints(tmp_path) == []


def test_crafted_pickle_is_refused_in_one_line_and_never_runs(tmp_path, capsys):
    run = tmp_path / "r"
    save_checkpoint(run, _state(1), _worker(1))
    cp_dir = run / "checkpoints" / "epoch_0001"
    marker = tmp_path / "pwned"
    torch.save({"w": _Payload(marker)}, cp_dir / "worker.pt")
    _rewrite_manifest(cp_dir)                         # passes the checksum check
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(run).load_worker_state()
    assert str(e.value).startswith(f"{cp_dir / 'worker.pt'} is not a plain tensor file")
    assert "\n" not in str(e.value) and not marker.exists()
    # the CLI: one line naming the file, exit 2, nothing ran (no Ray, no marker)
    assert main(["train", "--resume", "--storage-path", str(tmp_path), "--name", "r"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(cp_dir / "worker.pt") in err[0] and "weights_only" in err[0]
    assert not marker.exists()
    # the payload is live: the unsafe load this replaced would have run it
    torch.load(cp_dir / "worker.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "is truncated or changed"),
    ("flip", "does not match its SHA-256"),
    ("driver", "driver.json is truncated or changed"),
    ("manifest", "manifest.json is not valid JSON"),
    ("missing", "worker.pt cannot be read"),
])
def test_corrupt_newest_checkpoint_falls_back_to_newest_intact(tmp_path, damage, reason):
    for e in (1, 2, 3):
        save_checkpoint(tmp_path, _state(e), _worker(e), keep=3)
    d = tmp_path / "checkpoints" / "epoch_0003"
    w = d / "worker.pt"
    if damage == "truncate":
        w.write_bytes(w.read_bytes()[:-100])
    elif damage == "flip":
        b = bytearray(w.read_bytes())
        b[len(b) // 2] ^= 0xFF
        w.write_bytes(bytes(b))
    elif damage == "driver":
        (d / "driver.json").write_text("{")
    elif damage == "manifest":
        (d / "manifest.json").write_text("{\"files\":")
    else:
        w.unlink()
    skipped: list[str] = []
    cp = latest_checkpoint(tmp_path, skipped)
    assert cp.epochs_done == 2
    assert torch.equal(cp.load_worker_state()["model"]["w"], torch.full((3,), 2.0))
    assert len(skipped) == 1 and "epoch_0003" in skipped[0] and reason in skipped[0]
    # redoing epoch 3 replaces the corrupt one; pruning keeps the newest intact ones
    save_checkpoint(tmp_path, _state(3), _worker(3), keep=2)
    assert [c.epochs_done for c in list_checkpoints(tmp_path)] == [2, 3]
    assert latest_checkpoint(tmp_path).epochs_done == 3


def test_every_checkpoint_corrupt_gives_none_and_reports_each(tmp_path):
    for e in (1, 2):
        save_checkpoint(tmp_path, _state(e), _worker(e))
        (tmp_path / "checkpoints" / f"epoch_{e:04d}" / "worker.pt").write_bytes(b"x")
    skipped: list[str] = []
    assert latest_checkpoint(tmp_path, skipped) is None and len(skipped) == 2


def test_disk_full_while_writing_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _state(1), _worker(1))
    # the real kernel error: the worker state is written to /dev/full
    monkeypatch.setattr("jabasray.actors.checkpoint._open_for_write",
                        lambda path: open("/dev/full", "wb"))
    with pytest.raises(OSError) as e:
        save_checkpoint(tmp_path, _state(2), _worker(2))
    assert e.value.errno == errno.ENOSPC and "epoch_0002" in str(e.value)
    assert "previous checkpoints are intact" in str(e.value)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["epoch_0001"]   # no temp folder left
    assert latest_checkpoint(tmp_path).epochs_done == 1


def test_crash_between_files_leaves_no_visible_checkpoint(tmp_path, monkeypatch):
    """A failure after worker.pt but before the manifest: the new checkpoint never appears and
    its partial folder is removed."""
    save_checkpoint(tmp_path, _state(1), _worker(1))

    def boom(self, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(DriverState, "to_json", boom)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _state(2), _worker(2))
    assert [c.epochs_done for c in list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch_0001"]


_KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint_safety import _state, _worker
    from jabasray.actors.checkpoint import DriverState, save_checkpoint
    def die(self, **kwargs):           # after worker.pt is written, before the manifest
        os.kill(os.getpid(), signal.SIGKILL)
    DriverState.to_json = die
    save_checkpoint(sys.argv[1], _state(2), _worker(2))
""")


def test_writer_killed_before_the_manifest_is_skipped_with_one_line_and_redone(tmp_path):
    """A driver killed mid-commit (SIGKILL: no clean-up runs) leaves epoch_0002 with its
    worker.pt but no manifest: it is never taken, reported in one line, and redoing the epoch
    replaces it."""
    save_checkpoint(tmp_path, _state(1), _worker(1))
    here = os.path.dirname(__file__)
    p = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), here],
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == -signal.SIGKILL
    half = tmp_path / "checkpoints" / "epoch_0002"
    assert (half / "worker.pt").stat().st_size > 0 and not (half / "manifest.json").exists()
    skipped: list[str] = []
    assert latest_checkpoint(tmp_path, skipped).epochs_done == 1
    assert skipped == ["checkpoint epoch_0002 is unusable (no manifest: an interrupted write or "
                       "upload); trying the previous one"]
    save_checkpoint(tmp_path, _state(2), _worker(2))
    assert latest_checkpoint(tmp_path).epochs_done == 2
    assert torch.equal(latest_checkpoint(tmp_path).load_worker_state()["model"]["w"],
                       torch.full((3,), 2.0))


def test_redone_epoch_loses_its_manifest_before_anything_else(tmp_path, monkeypatch):
    """Redoing an epoch whose checkpoint exists: the old manifest goes first, so a crash
    while the new files are written never leaves the old manifest over new files."""
    save_checkpoint(tmp_path, _state(1), _worker(1))
    save_checkpoint(tmp_path, _state(2), _worker(2))
    seen = []
    real = DriverState.to_json

    def look(self, **kwargs):   # the new worker.pt is written; the old manifest must be gone
        seen.append((tmp_path / "checkpoints" / "epoch_0002" / "manifest.json").exists())
        raise KeyboardInterrupt
    monkeypatch.setattr(DriverState, "to_json", look)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _state(2), _worker(7))
    monkeypatch.setattr(DriverState, "to_json", real)
    assert seen == [False]
    assert latest_checkpoint(tmp_path).epochs_done == 1
