"""The run lock on S3, which has no ``flock``: a lease object written with conditional writes.

``<run>/.lease`` holds ``{"owner", "host", "pid", "started", "expires"}`` (``expires``: Unix
time). Taking the lease is ``PutObject`` with ``If-None-Match: *``: S3 creates the object only
when no object of that key exists, atomically, so of two runs started at once exactly one
succeeds (HTTP 412 for the other). The holder renews the lease every ``ttl_s / 3`` seconds with
``PutObject`` + ``If-Match: <its own ETag>``, so a renewal never overwrites a lease someone else
took. A lease whose ``expires`` has passed belongs to a run that died without releasing it: it
is taken over with ``If-Match: <that lease's ETag>`` (one log line naming the old holder); a
live one makes :meth:`S3Lease.acquire` raise :class:`~jabasray.actors.run_folder.RunLockedError`
(one line naming the holder and when the lease expires). Release deletes the object.

pyarrow's ``S3FileSystem`` has no conditional writes, so this module talks to S3 through
``botocore`` (installed with ``boto3``) with the endpoint, region and credentials of the run's
filesystem; without ``botocore`` it falls back to :class:`~jabasray.actors.run_folder.NoLock`'s
one line. Re-entrant within one process (the CLI takes the lock, then ``fit()`` again).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from ..storage import StoragePath
from .run_folder import RunLockedError

log = logging.getLogger(__name__)

LEASE_NAME = ".lease"
LEASE_TTL_S = 60.0      # a holder that stops renewing loses the lease after this long

# Leases this process holds: {lease uri: [S3Lease, count]} (re-entrant within one process)
_HELD: dict[str, list] = {}
_HELD_LOCK = threading.Lock()


def s3_client(filesystem: Any) -> Any:
    """A botocore S3 client with the endpoint, region and credentials of a pyarrow
    ``S3FileSystem`` (credentials it left unset come from botocore's usual chain: the
    ``AWS_*`` environment variables, the shared config, the instance profile)."""
    import botocore.session

    from .ray_internals import s3_filesystem_options

    opts = s3_filesystem_options(filesystem)  # only its region is public (ray_internals)
    endpoint = opts.get("endpoint_override") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"{opts.get('scheme') or 'https'}://{endpoint}"
    session = botocore.session.get_session()
    return session.create_client(
        "s3", endpoint_url=endpoint, region_name=opts.get("region") or None,
        aws_access_key_id=opts.get("access_key") or None,
        aws_secret_access_key=opts.get("secret_key") or None,
        aws_session_token=opts.get("session_token") or None)


def _precondition_failed(e: Exception) -> bool:
    code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
    status = getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or status in (409, 412)


class S3Lease:
    """The lease of one run folder on S3 (module notes). Use as a context manager or call
    :meth:`acquire` / :meth:`release`."""

    def __init__(self, run_dir: StoragePath, ttl_s: float = LEASE_TTL_S) -> None:
        self.run_dir = run_dir
        self.object = run_dir / LEASE_NAME
        bucket, _, key = self.object.fs_path.partition("/")
        self.bucket, self.key = bucket, key
        self.ttl_s = float(ttl_s)
        self.owner = uuid.uuid4().hex
        self.etag: str | None = None
        self._lost = False                 # a renewal found the lease taken by someone else
        self._mine = False
        self._client: Any = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._mine

    @property
    def lost(self) -> bool:
        """True once a renewal found the lease taken over by another run (this process stalled
        for longer than ``ttl_s``): the run must stop writing."""
        with _HELD_LOCK:
            entry = _HELD.get(str(self.object))
        return (entry[0] if entry else self)._lost

    # ------------------------------------------------------------------ public
    def acquire(self, take_over: bool = False) -> "S3Lease":
        """Take the lease; ``take_over``: the previous holder is known to be dead (Ray restarted
        the driver actor), so a lease it left is replaced even before it expires."""
        if self._mine:
            return self
        key = str(self.object)
        with _HELD_LOCK:
            if key in _HELD:
                _HELD[key][1] += 1
                self._mine = True
                return self
        try:
            self._client = s3_client(self.run_dir.filesystem)
        except ImportError:
            from .run_folder import NoLock
            self._fallback = NoLock(self.run_dir, False, "conditional writes on S3 need botocore "
                                    "(pip install boto3)").acquire()
            self._mine = True
            return self
        self._take(take_over)
        with _HELD_LOCK:
            _HELD[key] = [self, 1]
        self._mine = True
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                         name=f"jabasray-lease-{self.run_dir.name}")
        self._renewer.start()
        return self

    def release(self) -> None:
        if not self._mine:
            return
        self._mine = False
        if getattr(self, "_fallback", None) is not None:
            return
        key = str(self.object)
        with _HELD_LOCK:
            entry = _HELD.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _HELD[key]
            holder = entry[0]
        holder._stop.set()
        if holder._renewer is not None:
            holder._renewer.join(timeout=10)
        if holder.etag is not None and not holder._lost:
            try:
                holder._client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=holder.etag)
            except Exception as e:  # noqa: BLE001 - taken over meanwhile, or S3 gone: it expires
                log.info("run folder %s: lease not deleted (%s); it expires by itself",
                         self.run_dir, type(e).__name__)

    def __enter__(self) -> "S3Lease":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------ internals
    def _body(self) -> bytes:
        now = time.time()
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "started": getattr(self, "_started", None) or _iso(now),
                           "expires": now + self.ttl_s}).encode()

    def _take(self, take_over: bool) -> None:
        """Create the lease object (If-None-Match); an expired (or, with ``take_over``, any)
        lease is replaced (If-Match on its ETag); a live one raises RunLockedError."""
        self._started = _iso(time.time())
        for _ in range(5):    # the lease may change between our reads and writes: retry
            try:
                r = self._client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(),
                                            IfNoneMatch="*")
                self.etag = r["ETag"]
                return
            except Exception as e:  # noqa: BLE001 - botocore ClientError
                if not _precondition_failed(e):
                    raise ValueError(f"run folder {self.run_dir}: cannot write the lease "
                                     f"{self.object}: {e}") from None
            old, etag = self._read()
            if etag is None:          # released meanwhile
                continue
            expired = float(old.get("expires", 0)) < time.time()
            if not (expired or take_over):
                left = float(old.get("expires", 0)) - time.time()
                raise RunLockedError(f"run folder {self.run_dir} is in use by {_describe(old)} "
                                     f"(its lease {self.object} is renewed, next expiry in "
                                     f"{left:.0f}s); wait for it to finish or choose another --name")
            try:
                r = self._client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(),
                                            IfMatch=etag)
            except Exception as e:  # noqa: BLE001
                if _precondition_failed(e):
                    continue          # someone else took it first: look again
                raise ValueError(f"run folder {self.run_dir}: cannot write the lease "
                                 f"{self.object}: {e}") from None
            self.etag = r["ETag"]
            log.warning("run folder %s: taking over the %s lease of %s", self.run_dir,
                        "expired" if expired else "dead driver's", _describe(old))
            return
        raise RunLockedError(f"run folder {self.run_dir}: the lease {self.object} keeps changing; "
                             f"another run is starting there")

    def _read(self) -> tuple[dict, str | None]:
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as e:  # noqa: BLE001
            if getattr(e, "response", {}).get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return {}, None
            raise
        try:
            data = json.loads(r["Body"].read() or b"{}")
        except ValueError:
            data = {}
        return (data if isinstance(data, dict) else {}), r["ETag"]

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                r = self._client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(),
                                            IfMatch=self.etag)
                self.etag = r["ETag"]
            except Exception as e:  # noqa: BLE001
                if _precondition_failed(e):
                    self._lost = True
                    log.error("run folder %s: the lease %s was taken over by another run (this "
                              "process did not renew it for %.0fs); stop this run", self.run_dir,
                              self.object, self.ttl_s)
                    return
                log.warning("run folder %s: lease renewal failed (%s); retrying", self.run_dir,
                            type(e).__name__)


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def _describe(info: dict) -> str:
    if not info:
        return "another run"
    return (f"pid {info.get('pid', '?')} on {info.get('host', '?')} "
            f"(started {info.get('started', '?')})")


__all__ = ["S3Lease", "s3_client", "LEASE_NAME", "LEASE_TTL_S"]
