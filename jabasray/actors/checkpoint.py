"""Epoch checkpoints of a JABAS run: the driver's state (JSON) + the worker state (tensors).

Layout: ``<run>/checkpoints/epoch_<NNNN>/{worker.pt, driver.json, manifest.json}`` where NNNN is
the number of completed epochs. Every file goes through the run's ``pyarrow.fs`` filesystem
(:mod:`jabasray.storage`): a local or NFS folder, S3, GCS alike.

Safety rules:

* **Nothing is unpickled.** ``driver.json`` and ``manifest.json`` are JSON; ``worker.pt`` is read
  with ``torch.load(weights_only=True)``, which rebuilds only tensors, plain containers and
  numbers/strings. ``worker_state`` is opaque to this module: any nested structure of dicts, lists
  and tuples of tensors and plain numbers/strings (what ``weights_only=True`` loads). A file that
  holds anything else raises :class:`CheckpointError` (a ``ValueError``) naming the file; no code
  in it runs.
* **Committed manifest-last, without renames** (object stores have none): (1) a redone epoch
  whose folder exists loses its manifest first, then its other files; (2) ``worker.pt`` is
  streamed out (hashed while it is written, never held whole in memory), then ``driver.json``;
  on a local or NFS folder both are ``fsync``-ed; (3) ``manifest.json`` - each file's size and
  SHA-256 - is written last. A crash at any point leaves either a folder without a (valid)
  manifest, which is never taken, or the complete checkpoint.
* **Verified.** :func:`latest_checkpoint` walks from the newest checkpoint folder down and returns
  the newest one whose files match their manifest; every newer folder it skips - no manifest
  (an interrupted write or upload), a manifest its files do not match - is reported in one line
  (and in ``skipped``). A remote ``worker.pt`` is downloaded once, in chunks, to a temporary
  file while it is hashed; the worker state is loaded from that verified copy.
* **Pruned through the filesystem.** After a commit only the newest ``keep`` checkpoints up to
  the new one stay (newer ones, e.g. of a run redone from an older checkpoint, stay too); a
  pruned checkpoint loses its manifest first. Leftover folders without a manifest older than
  the new checkpoint are removed.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..serialization import JsonMixin
from ..storage import HashingWriter, StoragePath, as_storage_path, one_line, sha256_of, sync_file
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
    cluster: ClusterSpec                      # GPUs still usable (failed GPUs removed)
    allocation: dict[str, int]                # allocation for the next epoch: GPUs per node
    adaptive: dict = field(default_factory=dict)                  # AdaptiveBatchController state
    forecast: list[float] = field(default_factory=list)           # prediction for the next epoch
    metrics: MetricsHistory = field(default_factory=MetricsHistory)
    job_config: dict = field(default_factory=dict)                # JobConfig.to_dict() of the run
    mid_epoch: dict = field(default_factory=dict)                 # within an epoch (interval
                                        # checkpoints): {"cursor", "interval", "tally"}; {} at a boundary
    allocation_unit: str = "gpus"             # what ``allocation`` counts; checkpoints written
                                              # before any GPU count ran counted pairs
    allreduce_fits: dict = field(default_factory=dict)   # Eq. 3 fits measured on placed actors:
                                        # {fit key: record} (actors.allreduce_fit.measurement_record)

    @classmethod
    def from_dict(cls, data: dict) -> "DriverState":
        """Also reads checkpoints whose allocation counts GPU pairs (no ``allocation_unit``):
        converted to GPUs."""
        if isinstance(data, dict) and "allocation_unit" not in data and isinstance(data.get("allocation"), dict):
            data = {**data, "allocation": {k: 2 * v if isinstance(v, int) else v
                                           for k, v in data["allocation"].items()},
                    "allocation_unit": "gpus"}
        return super().from_dict(data)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint folder (Ray Train's ``Checkpoint.path`` shape): ``path`` is its
    :class:`~jabasray.storage.StoragePath` (``str(path)``: a local path or a URI)."""

    path: StoragePath

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", as_storage_path(self.path))

    @property
    def epochs_done(self) -> int:
        m = _NAME.match(self.path.name)
        return int(m.group(1)) if m else int(self.manifest()["epochs_done"])   # mid-epoch: manifest

    def manifest(self) -> dict:
        return _read_manifest(self.path / MANIFEST)

    def verify(self) -> None:
        """Raise :class:`CheckpointError` unless every file matches ``manifest.json``."""
        files = self.manifest()["files"]
        for name in FILES:
            want = files.get(name)
            if not isinstance(want, dict):
                raise CheckpointError(f"{self.path / MANIFEST} does not list {name}")
            p = self.path / name
            try:
                size = p.size()
                if size == want.get("bytes"):
                    size, digest = (self._fetch(p) if name == "worker.pt" and not p.is_local
                                    else sha256_of(p))
            except (OSError, FileNotFoundError) as e:
                raise CheckpointError(f"{p} cannot be read: {one_line(e)}") from None
            if size != want.get("bytes"):
                raise CheckpointError(f"{p} is truncated or changed: {size} bytes, manifest says "
                                      f"{want.get('bytes')}")
            if digest != want.get("sha256"):
                raise CheckpointError(f"{p} does not match its SHA-256 in {MANIFEST} (corrupt)")

    def load_driver_state(self) -> DriverState:
        p = self.path / "driver.json"
        try:
            return DriverState.from_json(p.read_text())
        except (OSError, FileNotFoundError) as e:
            raise CheckpointError(f"{p} cannot be read: {one_line(e)}") from None
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"{p} is not a valid DriverState JSON file: {one_line(e)}") from None

    def load_worker_state(self) -> Any:
        """The worker state, read with ``torch.load(weights_only=True)`` (never unpickles
        objects); a remote file is downloaded first (once: :meth:`verify` keeps its download)
        and checked against the manifest."""
        p = self.path / "worker.pt"
        if p.is_local:
            return load_tensors(p.local_path)
        want = self.manifest()["files"].get("worker.pt") or {}
        copy = getattr(self, "_download", None)
        if copy is None or not copy[0].exists():
            try:
                self._fetch(p)
            except (OSError, FileNotFoundError) as e:
                raise CheckpointError(f"{p} cannot be read: {one_line(e)}") from None
            copy = self._download
        local, size, digest = copy
        if (size, digest) != (want.get("bytes"), want.get("sha256")):
            raise CheckpointError(f"{p} changed after its manifest was written ({size} bytes "
                                  f"read); refusing to load it")
        return load_tensors(local, label=str(p))

    def _fetch(self, p: StoragePath) -> tuple[int, str]:
        """Download remote ``p`` in chunks to a temporary file, hashing it on the way; the file
        is kept for :meth:`load_worker_state` until this object is garbage-collected. Returns
        (bytes, SHA-256)."""
        import shutil
        import weakref

        folder = tempfile.mkdtemp(prefix="jabasray_checkpoint_")
        weakref.finalize(self, shutil.rmtree, folder, True)
        local = Path(folder) / p.name
        with open(local, "wb") as out:
            w = HashingWriter(out)
            for chunk in p.chunks():
                w.write(chunk)
        object.__setattr__(self, "_download", (local, w.bytes, w.sha256))
        return w.bytes, w.sha256


def load_tensors(path: str | Path, label: str | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU; anything but plain tensor data raises a
    one-line :class:`CheckpointError` naming the file (``label``: the name to report, e.g. the
    URI a temporary download came from); its code never runs."""
    import pickle

    import torch

    path = Path(path)
    label = label or str(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(f"{label} cannot be read: {e.strerror}") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError,
            AttributeError, KeyError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{label} is not a plain tensor file; refusing to load it "
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


def file_sha256(path: str | Path | StoragePath) -> str:
    """SHA-256 (hex) of a file, read in chunks."""
    return sha256_of(path)[1]


def _read_manifest(path: StoragePath) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} cannot be read: no such file") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {one_line(e)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"{path} is not a checkpoint manifest (no 'files' object)")
    return data


def _open_for_write(path: StoragePath) -> Any:
    """The writer of one checkpoint file (a seam: tests hand in ``/dev/full``)."""
    return path.open_output()


def fsync_dir(path: str | Path) -> None:
    """fsync a local folder so that the entries written in it survive a crash (no-op where
    unsupported)."""
    import os
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


def checkpoint_dir(run_dir: str | Path | StoragePath) -> StoragePath:
    return as_storage_path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path | StoragePath, state: DriverState, worker_state: Any,
                    keep: int = 2, folder: str | None = None) -> Checkpoint:
    """Commit ``epoch_<state.epochs_done>`` manifest-last and verified (module docstring); keep
    only the newest ``keep`` ones (0: all). A full disk raises ``OSError`` (ENOSPC) naming the
    run and leaves the previous checkpoints untouched. ``folder``: commit into that folder of
    ``checkpoints/`` instead (the mid-epoch slot :data:`MID_EPOCH`; nothing is pruned)."""
    import torch

    check_plain_data(worker_state)
    root = checkpoint_dir(run_dir)
    final = root / (folder or f"epoch_{state.epochs_done:04d}")
    if final.exists():   # a redone epoch: it stops being a checkpoint before anything changes
        (final / MANIFEST).unlink()
        final.rmtree()
    try:
        files = {}
        with _open_for_write(final / "worker.pt") as fh:
            # through a Python file object locally: a full disk then raises OSError(ENOSPC)
            # (torch.save on a path reports it as an opaque RuntimeError from its C++ stream)
            out = HashingWriter(fh)
            torch.save(worker_state, out)
            sync_file(fh)
        files["worker.pt"] = {"bytes": out.bytes, "sha256": out.sha256}
        text = state.to_json(indent=2).encode()
        with _open_for_write(final / "driver.json") as fh:
            fh.write(text)
            sync_file(fh)
        files["driver.json"] = {"bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()}
        manifest = {"format": FORMAT, "epochs_done": state.epochs_done, "files": files}
        if final.is_local:
            fsync_dir(final.fs_path)   # the files' entries are durable before the manifest exists
        with _open_for_write(final / MANIFEST) as fh:
            fh.write(json.dumps(manifest, indent=2).encode())
            sync_file(fh)
        if final.is_local:
            fsync_dir(final.fs_path)
    except BaseException as e:
        try:
            final.rmtree()
        except Exception:  # noqa: BLE001 - the write's own error is the one to report
            pass
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on the device of {root} while writing "
                          f"checkpoint {final.name}; the previous checkpoints are intact") from None
        raise
    if folder is None:
        _prune(root, keep, state.epochs_done)
    log.debug("checkpoint %s written", final)
    return Checkpoint(final)


def _scan(root: StoragePath) -> dict[int, tuple[StoragePath, bool]]:
    """``{epochs_done: (folder, has a manifest)}`` of the checkpoint folders under ``root``
    (one recursive listing: a single LIST request on an object store)."""
    import pyarrow.fs

    sel = pyarrow.fs.FileSelector(root.fs_path, allow_not_found=True, recursive=True)
    out: dict[int, tuple[StoragePath, bool]] = {}
    base = root.fs_path.rstrip("/") + "/"
    for info in root.filesystem.get_file_info(sel):
        rel = info.path[len(base):] if info.path.startswith(base) else info.path
        parts = rel.split("/")
        m = _NAME.match(parts[0])
        if not m:
            continue
        n = int(m.group(1))
        has = out.get(n, (None, False))[1] or (
            len(parts) == 2 and parts[1] == MANIFEST and info.type == pyarrow.fs.FileType.File)
        out[n] = (root / parts[0], has)
    return out


def _prune(root: StoragePath, keep: int, newest: int) -> None:
    """Remove all checkpoints older than the newest ``keep`` ones up to epoch ``newest``, and
    folders without a manifest older than it (leftovers of interrupted writes)."""
    found = _scan(root)
    committed = sorted(n for n, (_, has) in found.items() if has and n <= newest)
    doomed = committed[:-keep] if keep > 0 and len(committed) > keep else []
    doomed += [n for n, (_, has) in found.items() if not has and n < newest]
    for n in doomed:
        folder = found[n][0]
        (folder / MANIFEST).unlink()
        folder.rmtree()
    for p in root.iterdir():    # temporary folders of older versions (rename-based commits)
        if p.name.startswith((".tmp_", ".old_")):
            p.rmtree()


MID_EPOCH = "mid_epoch"   # the one mid-epoch checkpoint slot (never an epoch_NNNN folder)


def mid_epoch_checkpoint(run_dir: str | Path | StoragePath, epochs_done: int) -> Checkpoint | None:
    """The mid-epoch checkpoint taken within the epoch after ``epochs_done`` completed epochs,
    if it is committed and intact (else None; a corrupt or stale one is reported in one line)."""
    cp = Checkpoint(checkpoint_dir(run_dir) / MID_EPOCH)
    if not (cp.path / MANIFEST).exists():
        return None
    try:
        cp.verify()
    except CheckpointError as e:
        log.warning("mid-epoch checkpoint %s is unusable (%s); resuming from the epoch boundary",
                    cp.path, e)
        return None
    return cp if cp.epochs_done == epochs_done else None


def drop_mid_epoch(run_dir: str | Path | StoragePath) -> None:
    """Remove the mid-epoch checkpoint (manifest first), once an epoch boundary supersedes it."""
    folder = checkpoint_dir(run_dir) / MID_EPOCH
    if (folder / MANIFEST).exists():
        (folder / MANIFEST).unlink()
    if folder.exists():
        folder.rmtree()


def list_checkpoints(run_dir: str | Path | StoragePath) -> list[Checkpoint]:
    """Checkpoint folders that have a manifest, oldest first (not yet verified)."""
    found = _scan(checkpoint_dir(run_dir))
    return [Checkpoint(found[n][0]) for n in sorted(found) if found[n][1]]


def latest_checkpoint(run_dir: str | Path | StoragePath, skipped: list[str] | None = None
                      ) -> Checkpoint | None:
    """The newest checkpoint that passes :meth:`Checkpoint.verify`. Each newer folder that is
    not one (no manifest, or files that do not match it) is reported in one line: appended to
    ``skipped`` when given (the caller reports it), else logged as a warning."""
    found = _scan(checkpoint_dir(run_dir))
    for n in sorted(found, reverse=True):
        folder, has_manifest = found[n]
        cp = Checkpoint(folder)
        try:
            if not has_manifest:
                raise CheckpointError("no manifest: an interrupted write or upload")
            cp.verify()
        except CheckpointError as e:
            msg = f"checkpoint {folder.name} is unusable ({e}); trying the previous one"
            if skipped is not None:
                skipped.append(msg)
            else:
                log.warning(msg)
            continue
        return cp
    return None
