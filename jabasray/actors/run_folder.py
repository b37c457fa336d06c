"""One run per run folder: the run lock, the writability probe and the storage marker.

**Probe.** :func:`probe_run_folder` finds every storage problem it can before training, through
the run's filesystem (:mod:`jabasray.storage`): a storage path that is a file, a folder that
cannot be created or written (permissions, read-only file system, full disk, an unreachable
endpoint, missing credentials, a missing bucket), ``metrics.json``/``trajectory.png``/
``checkpoints`` of the wrong kind. Each is a one-line ``ValueError`` naming the location and the
reason.

**Marker.** ``<run>/.jabasray_storage.json`` (:data:`MARKER`, Ray Train's storage marker) holds a
random id written when the run is first started. Whoever starts a run writes it (if absent)
and records its id in Ray's key-value store (:mod:`.run_record`); the driver checks it at every
start and restart, so a driver on a node that does not see the run's storage (a local folder
that is not shared, an unmounted NFS folder) refuses in one line instead of writing a fresh
run onto its own disk.

**Lock** (:func:`run_lock`), by storage:

* a local or NFS folder: :class:`RunLock`. ``<run>/.lock`` holds ``{"pid", "host", "started"}``
  of the process that runs the folder, and that process holds an exclusive ``fcntl.flock`` on
  it for as long as it runs. The kernel drops a flock when its process dies (even by SIGKILL),
  so a lock left behind by a crashed driver is *stale* and is taken over (with one log line
  naming the old pid, host and start time); a live holder makes :meth:`RunLock.acquire` raise
  :class:`RunLockedError` (a ``ValueError``, one line naming the holder). A lock file written by
  another host is not checkable from here and is refused with the path to remove when that run
  is known to be gone.
* S3 (no ``flock``): a lease object created with a conditional write and renewed
  (:class:`jabasray.actors.lease.S3Lease`).
* any other filesystem (GCS, HDFS, ...): within one Ray cluster the named driver actor
  (``driver:<name>``, one per cluster) is the lock; beyond it there is none, and
  :class:`NoLock` says so in one log line.

Different run names under one storage path lock different runs and run side by side (the
shared profile cache under ``<storage>/.profiles`` is written atomically: temp file + rename on
a file system, a single PUT on an object store).
"""
from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from ..storage import StoragePath, as_storage_path, explain, write_probe

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
MARKER = ".jabasray_storage.json"
# What a run folder holds and of which kind (True: file, False: folder).
RUN_FILES = {"metrics.json": True, "trajectory.png": True, "checkpoints": False}


class RunLockedError(ValueError):
    """The run folder is in use by another live run."""


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return explain(e)


def probe_run_folder(run_dir: "str | Path | StoragePath",
                     extra_dirs: tuple["str | Path | StoragePath", ...] = ()) -> StoragePath:
    """Create ``run_dir`` (and ``extra_dirs``, e.g. the profile cache) if needed and prove that
    each can be written (a probe file is written, read back and removed). Returns ``run_dir``
    as a :class:`~jabasray.storage.StoragePath`."""
    import pyarrow.fs

    run = as_storage_path(run_dir)
    if run.is_local:
        local = run.local_path
        for parent in [*reversed(local.parents), local]:
            if parent.exists() and not parent.is_dir():
                raise ValueError(f"storage path {parent} is a file, not a folder; choose another "
                                 f"--storage-path or remove it")
    for d in (run, *map(as_storage_path, extra_dirs)):
        try:
            d.mkdir()
        except Exception as e:  # noqa: BLE001 - OSError, pyarrow errors: one line
            raise ValueError(f"cannot create folder {d}: {_reason(e)}") from None
        try:
            _write_probe(d)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"folder {d} is not writable: {_reason(e)}") from None
    kinds = {pyarrow.fs.FileType.File: True, pyarrow.fs.FileType.Directory: False}
    for name, is_file in RUN_FILES.items():
        p = run / name
        kind = kinds.get(p.info().type)
        if kind is not None and kind != is_file:
            what = "a folder" if is_file else "a file"
            raise ValueError(f"{p} is {what} but must be {'a file' if is_file else 'a folder'}; "
                             f"remove it or choose another --name")
    return run


_write_probe = write_probe   # a seam: tests simulate the kernel's answers (EROFS, EACCES, ENOSPC)


# ---------------------------------------------------------------------- storage marker
def read_marker(run_dir: "str | Path | StoragePath") -> str | None:
    """The run's storage marker id, None when the marker is not there. An unreadable storage
    raises ``OSError`` (the caller says where)."""
    p = as_storage_path(run_dir) / MARKER
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return "(unreadable)"
    return str(data.get("id")) if isinstance(data, dict) else "(unreadable)"


def write_marker(run_dir: "str | Path | StoragePath") -> str:
    """Write the run's storage marker unless it exists; returns its id."""
    run = as_storage_path(run_dir)
    found = read_marker(run)
    if found is not None:
        return found
    marker = {"id": uuid.uuid4().hex, "host": socket.gethostname(),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    (run / MARKER).write_text(json.dumps(marker))
    return marker["id"]


# ---------------------------------------------------------------------- locks
def run_lock(run_dir: "str | Path | StoragePath", named_driver: bool = False) -> Any:
    """The lock of a run folder for its storage (module notes): :class:`RunLock` on a local or
    NFS folder, :class:`~jabasray.actors.lease.S3Lease` on S3, else :class:`NoLock`
    (``named_driver``: a named driver actor guards the run within its Ray cluster)."""
    run = as_storage_path(run_dir)
    if run.is_local:
        return RunLock(run.local_path)
    if run.filesystem.type_name == "s3":
        from .lease import S3Lease
        return S3Lease(run)
    return NoLock(run, named_driver)


class NoLock:
    """A run folder on a filesystem without locks or conditional writes: says so once."""

    def __init__(self, run: StoragePath, named_driver: bool, reason: str = "") -> None:
        self.run_dir, self.named_driver = run, named_driver
        self.reason = reason or f"{run.filesystem.type_name} has neither flock nor conditional writes here"
        self.held = False

    def acquire(self, take_over: bool = False) -> "NoLock":
        if not self.held:
            if self.named_driver:
                log.info("run folder %s: no storage lock (%s); within this Ray cluster the named "
                         "driver actor is the lock, runs from other clusters are not excluded",
                         self.run_dir, self.reason)
            else:
                log.warning("run folder %s: no lock (%s); make sure no other run uses it",
                            self.run_dir, self.reason)
        self.held = True
        return self

    def release(self) -> None:
        self.held = False

    def __enter__(self) -> "NoLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    return True


# Locks this process holds: {lock path: [fd, count]}. Re-entrant within one process, so that the
# CLI can lock before starting Ray and ``JabasTrainer.fit`` lock again inside.
_HELD: dict[str, list[int]] = {}


class RunLock:
    """Exclusive ``flock`` of one local or NFS run folder (module docstring). Use as a context manager or call
    :meth:`acquire` / :meth:`release`. Re-entrant within one process."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._key = os.path.abspath(self.path)
        self._mine = False

    @property
    def held(self) -> bool:
        return self._mine

    def acquire(self, take_over: bool = False) -> "RunLock":
        """Take the lock; ``take_over``: the previous holder is known to be dead (Ray restarted
        the driver actor), so its lock file is removed first (it may be on another host)."""
        if self._mine:
            return self
        if take_over and self._key not in _HELD:
            self.path.unlink(missing_ok=True)
        if self._key in _HELD:
            _HELD[self._key][1] += 1
        else:
            _HELD[self._key] = [self._lock(), 1]
        self._mine = True
        return self

    def release(self) -> None:
        if not self._mine:
            return
        self._mine = False
        entry = _HELD[self._key]
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _HELD[self._key]
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(entry[0])   # drops the flock

    def _lock(self) -> int:
        import fcntl

        host = socket.gethostname()
        for _ in range(10):   # the file can be replaced between open and flock: retry
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ValueError(f"cannot create the run lock {self.path}: {_reason(e)}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ValueError(f"cannot lock {self.path}: {_reason(e)}") from None
                raise RunLockedError(f"run folder {self.run_dir} is in use by "
                                     f"{self._describe(self._read())}; wait for it to finish or "
                                     f"choose another --name") from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:          # the holder released (unlinked) it meanwhile
                os.close(fd)
                continue
            old = self._read()
            if old and old.get("host") not in (None, host):
                os.close(fd)
                raise RunLockedError(f"run folder {self.run_dir} is locked by {self._describe(old)}"
                                     f", which cannot be checked from host {host}; if that run is "
                                     f"gone, remove {self.path}")
            if old and old.get("pid") not in (None, os.getpid()):
                state = "alive but not holding it" if _pid_alive(int(old["pid"])) else "gone"
                log.warning("run folder %s: taking over the stale lock of %s (%s)", self.run_dir,
                            self._describe(old), state)
            info = {"pid": os.getpid(), "host": host,
                    "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            os.fsync(fd)
            return fd
        raise RunLockedError(f"run folder {self.run_dir}: the lock {self.path} keeps changing; "
                             f"another run is starting there")

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _describe(info: dict) -> str:
        if not info:
            return "another process"
        return (f"pid {info.get('pid', '?')} on {info.get('host', '?')} "
                f"(started {info.get('started', '?')})")

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
