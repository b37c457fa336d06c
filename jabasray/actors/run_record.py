"""What Ray's key-value store (the GCS) remembers of a run's storage, and the checks that use it.

A run's storage is the source of truth for its checkpoints; Ray's KV store keeps a second,
small record under ``run/<name>/storage/<hash of the run folder's URI>``: the storage URI, the id of the run's storage marker
(:data:`.run_folder.MARKER`) and the last committed epoch. It survives the driver (its process,
its node) for as long as the Ray cluster lives, so a restarted driver can tell "this run has no
checkpoint yet" from "I cannot see this run's checkpoints":

* :meth:`RunRecord.begin` (whoever starts the run, before any actor): writes the marker if
  absent and records its id.
* :meth:`RunRecord.check_marker` (the driver, at every start and restart, before it writes
  anything): the marker must be visible and carry the recorded id. A missing marker means the
  storage is unreachable from this node or a local folder that is not shared with it (the run
  was started elsewhere): :class:`~jabasray.errors.StorageUnavailable`, one line, instead of a
  fresh run on this node's own disk.
* :meth:`RunRecord.check_checkpoint` (after the driver chose its checkpoint): the epoch the
  record names must be visible - its manifest exists (a corrupt one may be skipped; a missing
  one is refused, never a silent start from an older state or from scratch).
* :meth:`RunRecord.committed` (after every checkpoint, and when a restart goes back to an older
  one, before a redone epoch removes the newer manifest).

Without Ray (or with no record, e.g. a :class:`~jabasray.actors.driver.JabasDriver` used
directly) the driver is its own starter: it writes the marker and the record itself.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from ..errors import StorageUnavailable
from ..storage import StoragePath, explain
from . import ray_internals
from .run_folder import MARKER, read_marker, write_marker

log = logging.getLogger(__name__)

NAMESPACE = "jabasray"          # Ray namespace of driver actors, their GPU actors and KV keys


# ---------------------------------------------------------------------- GCS key-value store
def kv_key(run: str, what: str) -> bytes:
    return f"run/{run}/{what}".encode()


def kv_put(run: str, what: str, value: bytes) -> None:
    """Store ``value`` as run ``run``'s ``what`` in Ray's key-value store."""
    ray_internals.kv_put(kv_key(run, what), value, namespace=NAMESPACE)


def kv_get(run: str, what: str) -> bytes | None:
    """Run ``run``'s ``what`` from Ray's key-value store (None: none)."""
    return ray_internals.kv_get(kv_key(run, what), namespace=NAMESPACE)


def kv_delete(run: str, what: str) -> None:
    """Delete run ``run``'s ``what`` from Ray's key-value store."""
    ray_internals.kv_delete(kv_key(run, what), namespace=NAMESPACE)


def kv_delete_run(run: str) -> None:
    """Delete every key of run ``run`` from Ray's key-value store."""
    ray_internals.kv_delete(f"run/{run}/".encode(), namespace=NAMESPACE, prefix=True)


def _ray_up() -> bool:
    try:
        import ray
    except ImportError:   # pragma: no cover
        return False
    return ray.is_initialized()


def _node() -> str:
    """This process's Ray node (id prefix and IP), for messages."""
    try:
        import ray
        ctx = ray.get_runtime_context()
        return f"{ctx.get_node_id()[:12]} ({ray.util.get_node_ip_address()})"
    except Exception:  # noqa: BLE001 - outside Ray
        import socket
        return socket.gethostname()


@dataclass
class StorageRecord:
    uri: str                      # the run folder
    marker: str                   # id of its storage marker
    epochs_done: int | None = None  # last committed checkpoint (None: none yet)


class RunRecord:
    """The KV record of run ``name`` whose folder is ``run`` (module notes)."""

    def __init__(self, name: str, run: StoragePath) -> None:
        import hashlib
        self.name, self.run = name, run
        self._what = f"storage/{hashlib.sha256(str(run).encode()).hexdigest()[:16]}"

    # ------------------------------------------------------------------ record
    def get(self) -> StorageRecord | None:
        if not _ray_up():
            return None
        raw = kv_get(self.name, self._what)
        return StorageRecord(**json.loads(raw)) if raw is not None else None

    def _put(self, rec: StorageRecord) -> None:
        if _ray_up():
            kv_put(self.name, self._what, json.dumps(rec.__dict__).encode())

    def forget(self) -> None:
        if _ray_up():
            kv_delete(self.name, self._what)

    # ------------------------------------------------------------------ the steps
    def begin(self) -> str:
        """The starter's step: write the marker (if absent), record its id. Returns the id."""
        marker = write_marker(self.run)
        old = self.get()
        self._put(StorageRecord(str(self.run), marker,
                                old.epochs_done if old is not None and old.marker == marker else None))
        return marker

    def check_marker(self) -> None:
        """The driver's step at every start and restart (module notes)."""
        try:
            marker = read_marker(self.run)
        except Exception as e:  # noqa: BLE001 - OSError, pyarrow errors
            raise StorageUnavailable(f"run {self.name!r}: the driver on node {_node()} cannot "
                                     f"read its storage {self.run}: {explain(e)}") from None
        rec = self.get()
        if rec is None:                 # nobody started it through a client: we are the starter
            self.begin()
            return
        if marker is None:
            done = ("" if rec.epochs_done is None else
                    f"; Ray's key-value store records epoch_{rec.epochs_done:04d} as committed there")
            raise StorageUnavailable(
                f"run {self.name!r}: the driver on node {_node()} does not see the run's storage "
                f"{self.run} (its marker {MARKER} is missing{done}); the storage is unreachable "
                f"from this node or a local folder not shared with it - use a folder every node "
                f"mounts (NFS) or a cloud URI (s3://, gs://); refusing to start from scratch")
        if marker != rec.marker:
            raise StorageUnavailable(
                f"run {self.name!r}: the storage marker in {self.run} (id {marker}) is not the one "
                f"this run was started with (id {rec.marker}); another run replaced the folder")

    def check_checkpoint(self, epochs_done: int | None) -> None:
        """After the driver chose its checkpoint (``epochs_done``; None: none): the epoch the
        record names must be visible (module notes)."""
        rec = self.get()
        if rec is None or rec.epochs_done is None:
            return
        if epochs_done is not None and epochs_done >= rec.epochs_done:
            return
        from .checkpoint import MANIFEST, checkpoint_dir
        manifest = checkpoint_dir(self.run) / f"epoch_{rec.epochs_done:04d}" / MANIFEST
        if manifest.exists():           # visible but corrupt: the skip was reported
            return
        found = "none" if epochs_done is None else f"epoch_{epochs_done:04d}"
        raise StorageUnavailable(
            f"run {self.name!r}: Ray's key-value store records epoch_{rec.epochs_done:04d} as "
            f"committed to {self.run}, but the driver on node {_node()} sees no such checkpoint "
            f"(newest it sees: {found}); the storage is unreachable from this node or not shared "
            f"with it; refusing to start from an older state")

    def committed(self, epochs_done: int) -> None:
        rec = self.get()
        if rec is None:
            return
        rec.epochs_done = int(epochs_done)
        self._put(rec)


__all__ = ["RunRecord", "StorageRecord", "NAMESPACE", "kv_key", "kv_put", "kv_get", "kv_delete_run"]
