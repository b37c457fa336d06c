"""Epoch checkpoints of a JABAS run: the driver's state (JSON) + the worker state (tensors).

Layout: ``<run>/checkpoints/epoch_<NNNN>/{driver.json, worker.pt, manifest.json}`` where NNNN is
the number of completed epochs.

Safety rules (issue 14):

* **Nothing is unpickled.** ``driver.json`` and ``manifest.json`` are JSON; ``worker.pt`` is read
  with ``torch.load(weights_only=True)``, which rebuilds only tensors, plain containers and
  numbers/strings. ``worker_state`` is opaque to this module: any nested structure of dicts, lists
  and tuples of tensors and plain numbers/strings (what ``weights_only=True`` loads). A file that
  holds anything else raises :class:`CheckpointError` (a ``ValueError``) naming the file; no code
  in it runs.
* **Atomic.** A checkpoint is written into a temporary folder beside the final one, every file and
  the folder are ``fsync``-ed, then the folder is renamed into place (and the parent fsynced): a
  crash leaves either the old state or the complete new one, never a half-written checkpoint.
* **Verified.** ``manifest.json`` lists each file's size and SHA-256. :func:`latest_checkpoint`
  walks from the newest checkpoint down and returns the newest one whose files match their
  manifest; every checkpoint it skips is reported in one log line (and in ``skipped``).
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..serialization import JsonMixin
from ..types import ClusterSpec
from .metrics import MetricsHistory

log = logging.getLogger(__name__)

_NAME = re.compile(r"^epoch_(\d{4,})$")
MANIFEST = "manifest.json"
FILES = ("driver.json", "worker.pt")
FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (corrupt, truncated, or not plain data)."""


@dataclass
class DriverState(JsonMixin):
    """What the driver needs to continue a run at an epoch boundary."""

    epochs_done: int                          # completed epochs
    iteration: int                            # global iterations done (for LR warm-up)
    cluster: ClusterSpec                      # GPUs still usable (failed pairs removed)
    allocation: dict[str, int]                # allocation for the next epoch
    adaptive: dict = field(default_factory=dict)                  # AdaptiveBatchController state
    forecast: list[float] = field(default_factory=list)           # prediction for the next epoch
    metrics: MetricsHistory = field(default_factory=MetricsHistory)
    job_config: dict = field(default_factory=dict)                # JobConfig.to_dict() of the run


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder (Ray Train's ``Checkpoint.path`` shape)."""

    path: Path

    @property
    def epochs_done(self) -> int:
        return int(_NAME.match(self.path.name).group(1))

    def verify(self) -> None:
        """Raise :class:`CheckpointError` unless every file matches ``manifest.json``."""
        manifest = _read_manifest(self.path / MANIFEST)
        for name in FILES:
            want = manifest["files"].get(name)
            if not isinstance(want, dict):
                raise CheckpointError(f"{self.path / MANIFEST} does not list {name}")
            p = self.path / name
            try:
                size = p.stat().st_size
            except OSError as e:
                raise CheckpointError(f"{p} cannot be read: {e.strerror}") from None
            if size != want.get("bytes"):
                raise CheckpointError(f"{p} is truncated or changed: {size} bytes, manifest says "
                                      f"{want.get('bytes')}")
            if file_sha256(p) != want.get("sha256"):
                raise CheckpointError(f"{p} does not match its SHA-256 in {MANIFEST} (corrupt)")

    def load_driver_state(self) -> DriverState:
        try:
            return DriverState.load(self.path / "driver.json")
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    def load_worker_state(self) -> Any:
        """The worker state, read with ``torch.load(weights_only=True)`` (never unpickles objects)."""
        return load_tensors(self.path / "worker.pt")


def load_tensors(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU; anything but plain tensor data raises a
    one-line :class:`CheckpointError` naming the file (its code never runs)."""
    import pickle

    import torch

    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror}") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError,
            AttributeError, KeyError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a plain tensor file; refusing to load it "
                              f"(weights_only): {first[:200]}") from None


_PLAIN = (int, float, bool, str, bytes, type(None))


def check_plain_data(value: Any, where: str = "worker_state") -> None:
    """Raise ``ValueError`` naming the first element of ``value`` that ``torch.load(weights_only=
    True)`` could not load back: allowed are dicts (str/int keys), lists, tuples, tensors, numbers,
    strings, None, torch dtypes/devices/sizes. Checked before writing so a checkpoint that could
    not be resumed is never written."""
    import torch

    if type(value) in (dict, OrderedDict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise ValueError(f"{where} key {k!r} must be a str or int, got {type(k).__name__}")
            check_plain_data(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)) and type(value) in (list, tuple, torch.Size):
        for i, v in enumerate(value):
            check_plain_data(v, f"{where}[{i}]")
    elif not isinstance(value, (torch.Tensor, torch.dtype, torch.device, *_PLAIN)):
        raise ValueError(f"{where} must hold only tensors, numbers, strings and dicts/lists of "
                         f"them (what torch.load(weights_only=True) loads), got "
                         f"{type(value).__module__}.{type(value).__name__}")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"{path} is not a checkpoint manifest (no 'files' object)")
    return data


def fsync_dir(path: str | Path) -> None:
    """fsync a folder so that a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _open_for_write(path: Path):
    return open(path, "wb")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, state: DriverState, worker_state: Any,
                    keep: int = 2) -> Checkpoint:
    """Write ``epoch_<state.epochs_done>`` atomically and verified (module docstring); keep only
    the newest ``keep`` intact ones. A full disk raises ``OSError`` (ENOSPC) naming the run and
    leaves the previous checkpoints untouched."""
    import torch

    check_plain_data(worker_state)
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"epoch_{state.epochs_done:04d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp_"))
    try:
        # through a Python file object: a full disk then raises OSError(ENOSPC) (torch.save on a
        # path reports it as an opaque RuntimeError from its C++ stream)
        with _open_for_write(tmp / "worker.pt") as fh:
            torch.save(worker_state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        state.save(tmp / "driver.json")
        _fsync_file(tmp / "driver.json")
        files = {}
        for name in FILES:
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
        manifest = {"format": FORMAT, "epochs_done": state.epochs_done, "files": files}
        with open(tmp / MANIFEST, "w") as fh:
            json.dump(manifest, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        if final.exists():   # a redone epoch: move the old one aside first (rename is atomic)
            old = Path(tempfile.mkdtemp(dir=root, prefix=".old_"))
            os.replace(final, old / final.name)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on the device of {root} while writing "
                          f"checkpoint {final.name}; the previous checkpoints are intact") from None
        raise
    _prune(run_dir, keep, final)
    log.debug("checkpoint %s written", final)
    return Checkpoint(final)


def _prune(run_dir: str | Path, keep: int, newest: Path) -> None:
    """Remove stale temporary folders and all checkpoints older than the newest ``keep`` ones
    up to ``newest`` (newer ones, e.g. of a run redone from an older checkpoint, stay)."""
    root = checkpoint_dir(run_dir)
    for p in root.iterdir():
        if p.name.startswith((".tmp_", ".old_")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    cps = [c for c in list_checkpoints(run_dir) if c.epochs_done <= Checkpoint(newest).epochs_done]
    if keep > 0 and len(cps) > keep:
        for old in cps[:-keep]:
            shutil.rmtree(old.path, ignore_errors=True)


def list_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """Checkpoint folders that have a manifest, oldest first (not yet verified)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [Checkpoint(p) for p in root.iterdir()
             if p.is_dir() and _NAME.match(p.name) and (p / MANIFEST).exists()]
    return sorted(found, key=lambda c: c.epochs_done)


def latest_checkpoint(run_dir: str | Path, skipped: list[str] | None = None) -> Checkpoint | None:
    """The newest checkpoint that passes :meth:`Checkpoint.verify`. Each newer one that fails is
    reported in one line: appended to ``skipped`` when given (the caller reports it), else
    logged as a warning."""
    for cp in reversed(list_checkpoints(run_dir)):
        try:
            cp.verify()
        except CheckpointError as e:
            msg = f"checkpoint {cp.path.name} is unusable ({e}); trying the previous one"
            if skipped is not None:
                skipped.append(msg)
            else:
                log.warning(msg)
            continue
        return cp
    return None
