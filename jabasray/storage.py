"""Where run files live: one filesystem abstraction, ``pyarrow.fs``, resolved as Ray Train does.

A storage location is a :class:`StoragePath`: a ``pyarrow.fs.FileSystem`` and a path on it (a
local absolute path, ``bucket/prefix`` on S3 or GCS, ...). Everything jabasray writes or reads
of a run - checkpoints, ``metrics.json``/``.csv``, ``trajectory.png``, the exported checkpoint,
the profile cache - goes through it, so a local folder, an NFS mount, ``s3://`` and ``gs://``
behave alike.

**Resolution** (:func:`resolve`, Ray Train's ``get_fs_and_path``): with a ``storage_filesystem``
the path is taken as it is (already stripped of its scheme, e.g. ``bucket/runs``); a URI
(``s3://bucket/runs``, ``gs://...``, ``file:///...``, ``hdfs://...``) is opened with
``pyarrow.fs.FileSystem.from_uri`` (credentials, region and endpoint from the usual
environment variables: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_ENDPOINT_URL``,
``GOOGLE_APPLICATION_CREDENTIALS``, ...); anything else is a local path, made absolute (``~``
expanded, relative to the current directory). An unknown scheme is a one-line ``ValueError``
(:func:`check_storage_path`, no network), and :func:`write_probe` proves before any work that
the location can be written and read back (the run folder's probe turns an unreachable
endpoint, missing or wrong credentials, a missing bucket, a read-only folder into one line
naming the location, :func:`explain` adding what to check).

**Streams.** Large files are written and read in chunks of :data:`CHUNK` bytes through the
filesystem's streams (S3: multipart uploads, ranged reads), never held whole in memory.
Small files (:meth:`StoragePath.write_text`) are replaced atomically: on a local or NFS folder
through a temporary file and a rename, on an object store by the single ``PUT`` that object
stores make atomic anyway. Nothing here renames a folder (object stores have no renames):
multi-file commits (checkpoints) are ordered by their writers, the manifest last.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

CHUNK = 16 * 2**20   # bytes per read/write of a streamed copy (S3: one ranged GET each)

# URI schemes pyarrow.fs.FileSystem.from_uri opens (the filesystems Ray Train supports).
SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "mock")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# pyarrow's FileSystem.type_name -> the URI scheme that names it again
_TYPE_SCHEME = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs", "mock": "mock", "abfs": "abfs"}


def uri_scheme(storage_path: str | os.PathLike) -> str | None:
    """The scheme of a URI (``"s3"`` of ``s3://bucket/x``), None for a plain path."""
    m = _SCHEME.match(str(storage_path))
    return m.group(1).lower() if m else None


def check_storage_path(storage_path: Any, storage_filesystem: Any = None,
                       field: str = "storage_path") -> None:
    """One-line ``ValueError`` for a storage path that can never work (no network): not a
    non-empty path or URI, an unknown URI scheme, a ``storage_filesystem`` that is not a
    ``pyarrow.fs.FileSystem``, or a URI given together with one."""
    if not isinstance(storage_path, (str, os.PathLike)) or not str(storage_path):
        raise ValueError(f"{field} must be a non-empty local path or URI, got {storage_path!r}")
    scheme = uri_scheme(storage_path)
    if storage_filesystem is not None:
        import pyarrow.fs

        if not isinstance(storage_filesystem, pyarrow.fs.FileSystem):
            raise ValueError(f"storage_filesystem must be a pyarrow.fs.FileSystem or None, got "
                             f"{type(storage_filesystem).__name__}")
        if scheme is not None:
            raise ValueError(f"{field} must be a path on storage_filesystem without its scheme "
                             f"(e.g. 'bucket/runs' for s3://bucket/runs), got {str(storage_path)!r}")
    elif scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"{field} has the unknown URI scheme {scheme!r} in {str(storage_path)!r}; "
                         f"use a local path or one of {', '.join(s + '://' for s in SCHEMES)}")


def resolve(storage_path: str | os.PathLike, storage_filesystem: Any = None) -> "StoragePath":
    """The :class:`StoragePath` of ``storage_path`` (module notes). One-line ``ValueError`` when
    it cannot be opened (unknown scheme, a filesystem pyarrow cannot build)."""
    import pyarrow.fs

    check_storage_path(storage_path, storage_filesystem)
    text = str(storage_path)
    if storage_filesystem is not None:
        return StoragePath(storage_filesystem, posixpath.normpath(text) if text != "/" else text)
    if uri_scheme(text) is None:
        return StoragePath(pyarrow.fs.LocalFileSystem(),
                           str(Path(text).expanduser().absolute()))
    try:
        fs, path = pyarrow.fs.FileSystem.from_uri(text)
    except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError, ImportError: one line
        raise ValueError(f"storage_path {text!r} cannot be opened: {one_line(e)}") from None
    return StoragePath(fs, path.rstrip("/") or path)


def as_storage_path(location: "str | os.PathLike | StoragePath") -> "StoragePath":
    """``location`` as a :class:`StoragePath` (a plain path or URI is resolved)."""
    return location if isinstance(location, StoragePath) else resolve(location)


def one_line(e: BaseException) -> str:
    """The first line of an error's text (pyarrow's S3 errors span several; an ``OSError``
    from the OS: its ``strerror``), or its type's name."""
    text = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)).strip()
    return (text.splitlines()[0].strip() if text else type(e).__name__)[:300]


@dataclass(frozen=True)
class StoragePath:
    """A file or folder on a ``pyarrow.fs`` filesystem, with the pathlib-like methods run files
    need. ``str()`` is its URI (a local path stays a plain path)."""

    filesystem: Any       # pyarrow.fs.FileSystem
    fs_path: str          # path on that filesystem (no scheme; Ray Train's "fs path")

    # ------------------------------------------------------------------ names
    def __truediv__(self, name: str) -> "StoragePath":
        return StoragePath(self.filesystem, posixpath.join(self.fs_path, str(name)))

    def __str__(self) -> str:
        return self.uri

    @property
    def name(self) -> str:
        return posixpath.basename(self.fs_path.rstrip("/"))

    @property
    def parent(self) -> "StoragePath":
        return StoragePath(self.filesystem, posixpath.dirname(self.fs_path.rstrip("/")) or "/")

    @property
    def is_local(self) -> bool:
        """On this machine's own file system (a local disk or a mounted NFS folder)."""
        return self.filesystem.type_name == "local"

    @property
    def local_path(self) -> Path | None:
        """The ``Path`` of a local location, None on a remote filesystem."""
        return Path(self.fs_path) if self.is_local else None

    @property
    def uri(self) -> str:
        """``s3://bucket/x``, ``gs://bucket/x``; a local location: its absolute path."""
        kind = self.filesystem.type_name
        if kind == "local":
            return self.fs_path
        return f"{_TYPE_SCHEME.get(kind, kind)}://{self.fs_path}"

    # ------------------------------------------------------------------ queries
    def info(self) -> Any:
        return self.filesystem.get_file_info(self.fs_path)

    def exists(self) -> bool:
        import pyarrow.fs
        return self.info().type != pyarrow.fs.FileType.NotFound

    def is_file(self) -> bool:
        import pyarrow.fs
        return self.info().type == pyarrow.fs.FileType.File

    def is_dir(self) -> bool:
        import pyarrow.fs
        return self.info().type == pyarrow.fs.FileType.Directory

    def size(self) -> int:
        """Size in bytes (``FileNotFoundError`` when missing)."""
        import pyarrow.fs
        info = self.info()
        if info.type == pyarrow.fs.FileType.NotFound:
            raise FileNotFoundError(f"{self} does not exist")
        return int(info.size or 0)

    def iterdir(self) -> list["StoragePath"]:
        """The entries of this folder (empty when it does not exist), sorted by name."""
        import pyarrow.fs
        sel = pyarrow.fs.FileSelector(self.fs_path, allow_not_found=True, recursive=False)
        return sorted((StoragePath(self.filesystem, i.path) for i in
                       self.filesystem.get_file_info(sel)), key=lambda p: p.fs_path)

    # ------------------------------------------------------------------ whole small files
    def read_bytes(self) -> bytes:
        with self.filesystem.open_input_stream(self.fs_path) as f:
            return f.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> "StoragePath":
        """Replace the file atomically (module notes): readers see the old or the new bytes."""
        if self.is_local:
            _atomic_local_write(Path(self.fs_path), data)
        else:
            with self.filesystem.open_output_stream(self.fs_path) as f:
                f.write(data)
        return self

    def write_text(self, text: str) -> "StoragePath":
        return self.write_bytes(text.encode())

    # ------------------------------------------------------------------ streams
    def open_input(self) -> IO[bytes]:
        """A sequential binary reader (read it in :data:`CHUNK` pieces)."""
        if self.is_local:
            return open(self.fs_path, "rb")
        return self.filesystem.open_input_stream(self.fs_path)

    def open_output(self) -> IO[bytes]:
        """A binary writer that creates or truncates the file (parent folders included). Local:
        a Python file, so the writer can ``fsync`` it (:func:`sync_file`)."""
        if self.is_local:
            Path(self.fs_path).parent.mkdir(parents=True, exist_ok=True)
            return open(self.fs_path, "wb")
        return self.filesystem.open_output_stream(self.fs_path)

    def chunks(self, size: int = CHUNK) -> Iterator[bytes]:
        """The file's bytes, ``size`` at a time."""
        with self.open_input() as f:
            while True:
                b = f.read(size)
                if not b:
                    return
                yield b

    def download(self, local: str | os.PathLike) -> Path:
        """Copy this file to the local file ``local`` in chunks; returns its Path."""
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        with open(local, "wb") as out:
            for b in self.chunks():
                out.write(b)
        return local

    def upload(self, local: str | os.PathLike) -> "StoragePath":
        """Copy the local file ``local`` here in chunks."""
        with open(local, "rb") as src, self.open_output() as out:
            shutil.copyfileobj(src, out, CHUNK)
        return self

    # ------------------------------------------------------------------ changes
    def mkdir(self) -> "StoragePath":
        """Create this folder and its parents (object stores: nothing to do but a marker)."""
        self.filesystem.create_dir(self.fs_path, recursive=True)
        return self

    def unlink(self, missing_ok: bool = True) -> None:
        try:
            self.filesystem.delete_file(self.fs_path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        """Remove this folder and everything under it (nothing when it does not exist)."""
        try:
            self.filesystem.delete_dir(self.fs_path)
        except FileNotFoundError:
            pass


class HashingWriter:
    """A binary writer that passes every byte to ``raw`` and counts and hashes it (SHA-256):
    a file's manifest entry without reading the file again."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.bytes, self._sha = raw, 0, hashlib.sha256()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self.bytes += len(view)
        self.raw.write(view)
        return len(view)

    def flush(self) -> None:
        self.raw.flush()

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


def sync_file(fh: Any) -> None:
    """Flush and ``fsync`` a local file (no-op for remote streams: their close commits them)."""
    fh.flush()
    fileno = getattr(fh, "fileno", None)
    if fileno is not None:
        try:
            os.fsync(fileno())
        except (OSError, ValueError, NotImplementedError):   # no real descriptor
            pass


def sha256_of(location: "StoragePath | str | os.PathLike") -> tuple[int, str]:
    """(bytes, SHA-256 hex) of a file, read in chunks."""
    loc = as_storage_path(location)
    h, n = hashlib.sha256(), 0
    for b in loc.chunks():
        h.update(b)
        n += len(b)
    return n, h.hexdigest()


def _atomic_local_write(path: Path, data: bytes) -> None:
    from .serialization import atomic_write_bytes

    atomic_write_bytes(path, data)


def write_probe(folder: StoragePath) -> None:
    """Prove that ``folder`` (which exists) takes a file: write one, read it back, remove it.
    Raises the filesystem's own error (OSError and pyarrow's errors) otherwise."""
    import errno
    import uuid

    probe = folder / f".probe_{uuid.uuid4().hex[:12]}"
    body = b"jabasray write probe\n" * 64
    try:
        with probe.open_output() as fh:
            fh.write(body)
            sync_file(fh)
        if probe.read_bytes() != body:
            raise OSError(errno.EIO, "the probe file does not read back what was written")
    finally:
        try:
            probe.unlink()
        except Exception:  # noqa: BLE001 - the write's own error is the one to report
            pass


def explain(e: BaseException) -> str:
    """The error's first line, with what to check for the usual cloud failures."""
    text = one_line(e)
    low = str(e).lower()
    if any(k in low for k in ("access_denied", "accessdenied", "invalidaccesskeyid",
                              "signaturedoesnotmatch", "no credentials", "credential",
                              "forbidden", "403")):
        return (f"{text} (check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                f"GOOGLE_APPLICATION_CREDENTIALS, or pass storage_filesystem)")
    if any(k in low for k in ("curlcode", "connect", "resolve host", "network", "timed out")):
        return f"{text} (check the endpoint and the network: AWS_ENDPOINT_URL, the region)"
    return text


__all__ = ["CHUNK", "SCHEMES", "StoragePath", "HashingWriter", "resolve", "as_storage_path",
           "check_storage_path", "write_probe", "explain", "uri_scheme", "one_line", "sha256_of",
           "sync_file"]
