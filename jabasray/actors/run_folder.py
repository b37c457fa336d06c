"""One run per run folder: the run lock and the writability probe.

**Lock.** ``<run>/.lock`` holds ``{"pid", "host", "started"}`` of the process that runs the
folder, and that process holds an exclusive ``fcntl.flock`` on it for as long as it runs. The
kernel drops a flock when its process dies (even by SIGKILL), so a lock left behind by a crashed
driver is *stale* and is taken over (with one log line naming the old pid, host and start time);
a live holder makes :meth:`RunLock.acquire` raise :class:`RunLockedError` (a ``ValueError``, one
line naming the holder). A lock file written by another host is not checkable from here and is
refused with the path to remove when that run is known to be gone. Different run names under
one storage path lock different files and run side by side (the shared profile cache under
``<storage>/.profiles`` is written atomically: temp file + rename).

**Probe.** :func:`probe_run_folder` finds every file-system problem it can before training: a
storage path that is a file, a folder that cannot be created or written (permissions, read-only
file system, full disk), ``metrics.json``/``trajectory.png``/``checkpoints`` of the wrong kind.
Each is a one-line ``ValueError`` naming the path and the reason.
"""
from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import socket
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
# What a run folder holds and of which kind (True: file, False: folder).
RUN_FILES = {"metrics.json": True, "trajectory.png": True, "checkpoints": False}


class RunLockedError(ValueError):
    """The run folder is in use by another live run."""


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def probe_run_folder(run_dir: str | Path, extra_dirs: tuple[str | Path, ...] = ()) -> Path:
    """Create ``run_dir`` (and ``extra_dirs``, e.g. the profile cache) if needed and prove that
    each can be written (a probe file is written, fsynced and removed). Returns ``run_dir``."""
    run_dir = Path(run_dir)
    for parent in [*reversed(run_dir.parents), run_dir]:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"storage path {parent} is a file, not a folder; choose another "
                             f"--storage-path or remove it")
    for name, is_file in RUN_FILES.items():
        p = run_dir / name
        if p.exists() and p.is_dir() == is_file:
            kind = "a folder" if is_file else "a file"
            raise ValueError(f"{p} is {kind} but must be {'a file' if is_file else 'a folder'}; "
                             f"remove it or choose another --name")
    for d in (run_dir, *map(Path, extra_dirs)):
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create folder {d}: {_reason(e)}") from None
        try:
            _write_probe(d)
        except OSError as e:
            raise ValueError(f"folder {d} is not writable: {_reason(e)}") from None
    return run_dir


def _write_probe(folder: Path) -> None:
    fd, path = tempfile.mkstemp(dir=folder, prefix=".probe_")
    try:
        os.write(fd, b"jabasray write probe\n" * 64)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)


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
    """Exclusive lock of one run folder (module docstring). Use as a context manager or call
    :meth:`acquire` / :meth:`release`. Re-entrant within one process."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._key = os.path.abspath(self.path)
        self._mine = False

    @property
    def held(self) -> bool:
        return self._mine

    def acquire(self) -> "RunLock":
        if self._mine:
            return self
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
