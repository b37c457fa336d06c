"""Every private Ray API (and the one pyarrow internal) jabasray's Ray layer uses, in one module,
with a check that the installed versions still have them.

Where a public API does the job it is used instead (``ray.PlacementGroupID`` and
``ray.util.placement_group.PlacementGroup`` to remove a recorded placement group;
``ray.nodes()`` and ``ray.available_resources()`` where totals do). What has no public
counterpart in the tested Ray:

* **Ray's key-value store** (the GCS's, namespaced): ``ray.experimental.internal_kv``'s
  ``_internal_kv_put`` / ``_internal_kv_get`` / ``_internal_kv_del`` (``del_by_prefix``). A run's
  record lives there (:mod:`.run_record`: the driver actor's spec, incarnation, placement
  groups, the storage record), because it must outlive the driver's process and node.
* **The free resources of each node**: ``ray._private.state.available_resources_per_node``.
  ``ray.available_resources()`` is the cluster's sum, ``ray.nodes()`` and
  ``ray.util.state.list_nodes()`` give totals only (the latter also needs the dashboard), and
  the auto-scaler must know which node can still host a GPU pair.
* **The nodes that are draining**: ``ray._private.state.state.get_draining_nodes()`` (Ray node
  id -> the drain deadline in ms, 0: none), the GCS's own list, which Ray Serve reads too. A
  drain request (``ray drain-node``, a cloud's preemption notice through KubeRay or the
  autoscaler) marks a node that Ray will schedule nothing new on and that goes at its deadline;
  ``ray.nodes()`` still calls it alive and the state API needs the dashboard.
* **When each node started and ended**: the GCS's node records (``GcsNodeInfo``:
  ``start_time_ms``, when the raylet started; ``end_time_ms``, when the GCS marked it dead;
  ``resources_total``), read through the driver's GCS client
  (``ray._private.worker.global_worker.gcs_client.get_all_node_info()``). ``ray.nodes()``
  drops both times, and the public ``ray.util.state.list_nodes(detail=True)`` that has them
  needs the dashboard (absent from a minimal install, off with ``include_dashboard=False``).
  The GPU-hours a job reports as held (:mod:`.cluster_view`, rule 6) are these lifetimes.
* **Where a `ray start` on this machine wrote its address**: ``ray._common.utils.
  get_ray_address_file`` (Ray's temp folder: RAY_TMPDIR, else TMPDIR, else /tmp). ``ray.init()``
  reads it itself but then refuses the ``num_cpus`` and resources of a local instance, and
  ``address="auto"`` also joins any Ray process it finds on the machine (another user's local
  instance); ``jabasray train`` joins a `ray start` cluster only.
* **An S3 filesystem's endpoint and credentials** (pyarrow): ``S3FileSystem`` exposes only
  ``region``; its other constructor arguments are readable only from what pickling rebuilds it
  from (``__reduce__()[1][0]``, a dict of them). The S3 lease (:mod:`.lease`) needs them to talk
  to the same endpoint with the same credentials through botocore.

:data:`TESTED_RAY` is the range of Ray releases the suite passed on (``pyproject.toml`` bounds
Ray to it; ``jabasray.tuner.tune_internals`` checks its Tune internals against the same range).
:func:`problems` lists, one line each, an installed Ray outside that range and every internal
above that is missing; ``tests/test_ray_internals.py`` fails on either, and a test there fails
when a private Ray name is used anywhere else in ``jabasray/``. An accessor whose internal is
gone raises :class:`RayInternalsError` (one line) instead of an ``AttributeError`` deep inside.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

log = logging.getLogger(__name__)

TESTED_RAY = ((2, 60), (2, 60))   # (major, minor) of the oldest and newest Ray tested, inclusive

# (module, attribute, its parameters in order: a changed signature counts as missing)
RAY_INTERNALS = (
    ("ray.experimental.internal_kv", "_internal_kv_put", ("key", "value", "overwrite", "namespace")),
    ("ray.experimental.internal_kv", "_internal_kv_get", ("key", "namespace")),
    ("ray.experimental.internal_kv", "_internal_kv_del", ("key", "del_by_prefix", "namespace")),
    ("ray._private.state", "available_resources_per_node", ()),
    ("ray._private.state", "state.get_draining_nodes", ()),
    ("ray._private.worker", "global_worker", ()),
    ("ray._raylet", "InnerGcsClient.get_all_node_info", ("self", "timeout")),
    ("ray._common.utils", "get_ray_address_file", ("temp_dir",)),
)
S3_OPTION_KEYS = ("endpoint_override", "scheme", "region", "access_key", "secret_key", "session_token")


class RayInternalsError(RuntimeError):
    """The installed Ray (or pyarrow) lacks an internal jabasray uses (one line)."""


def _minor(version: str) -> tuple[int, int] | None:
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def tested_text() -> str:
    """:data:`TESTED_RAY` as text: ``2.60`` or ``2.59 to 2.60``."""
    lo, hi = TESTED_RAY
    return f"{lo[0]}.{lo[1]}" + ("" if lo == hi else f" to {hi[0]}.{hi[1]}")


def version_problem(version: str, who: str = "jabasray's Ray layer",
                    where: str = "jabasray/actors/ray_internals.py") -> str | None:
    """One line when Ray ``version`` is outside :data:`TESTED_RAY`, else None; ``who`` relies
    on the internals listed in ``where``."""
    lo, hi = TESTED_RAY
    v = _minor(version)
    if v is not None and lo <= v <= hi:
        return None
    return (f"Ray {version} is outside the range {who} was tested with (Ray {tested_text()}): "
            f"it relies on internals of Ray ({where}); run the test suite on it, then widen "
            f"TESTED_RAY and pyproject's bound")


def _params(fn: Any) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _internal(module: str, name: str, params: tuple[str, ...]) -> Any:
    """The internal ``module.name`` (``name`` may be dotted: an attribute of an object of the
    module; None when missing or its leading parameters changed)."""
    import importlib
    try:
        fn: Any = importlib.import_module(module)
    except ImportError:
        return None
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if fn is None or (_params(fn) or ())[:len(params)] != params:
        return None
    return fn


def _s3_options_problem() -> str | None:
    """What is wrong with reading an ``S3FileSystem``'s options (None: nothing)."""
    try:
        from pyarrow.fs import S3FileSystem
        want = dict(endpoint_override="127.0.0.1:9", scheme="http", region="r", access_key="a",
                    secret_key="s", session_token="t")
        got = S3FileSystem(**want).__reduce__()[1][0]
        return None if all(got.get(k) == v for k, v in want.items()) else "its options differ"
    except Exception as e:  # noqa: BLE001 - any change of the layout
        return f"{type(e).__name__}: {e}"


def missing_internals(include_pyarrow: bool = True) -> list[str]:
    """The internals of the module notes that the installed Ray (and pyarrow) lack."""
    out = [f"{m}.{n}{p}" for m, n, p in RAY_INTERNALS if _internal(m, n, p) is None]
    if include_pyarrow and _s3_options_problem() is not None:
        out.append(f"pyarrow.fs.S3FileSystem().__reduce__()[1][0] ({_s3_options_problem()})")
    return out


def problems(version: str | None = None) -> list[str]:
    """One line per problem: Ray ``version`` (default: the installed one) outside
    :data:`TESTED_RAY`, then one for the missing internals."""
    return problem_lines(version, version_problem, missing_internals(),
                         "internals jabasray uses", "jabasray/actors/ray_internals.py")


def problem_lines(version: str | None, version_check: Any, missing: list[str], what: str,
                  where: str) -> list[str]:
    """The lines of a ``problems()`` check (this module's, the Tune integration's): the version
    outside :data:`TESTED_RAY` (``version_check(version)``; default: the installed Ray), then
    one line naming the ``missing`` internals (``what`` they are, the module ``where`` they are used)."""
    if version is None:
        import ray
        version = ray.__version__
    out = [p for p in [version_check(version)] if p]
    if missing:
        out.append(f"Ray {version} lacks {what}: {', '.join(missing)} ({where})")
    return out


@functools.lru_cache(maxsize=None)
def _require(module: str, name: str) -> Any:
    """The internal ``module.name`` of :data:`RAY_INTERNALS`; :class:`RayInternalsError` (one
    line) when it is missing. Checked once per process."""
    params = next(p for m, n, p in RAY_INTERNALS if (m, n) == (module, name))
    fn = _internal(module, name, params)
    if fn is None:
        import ray
        raise RayInternalsError(f"Ray {ray.__version__} lacks {module}.{name}{params}, which "
                                f"jabasray uses (jabasray/actors/ray_internals.py); install a Ray "
                                f"within {tested_text()} (pyproject.toml)")
    return fn


# ---------------------------------------------------------------------- the accessors
def kv_put(key: bytes, value: bytes, namespace: str) -> None:
    """Store ``value`` under ``key`` in Ray's key-value store (overwriting)."""
    _require("ray.experimental.internal_kv", "_internal_kv_put")(key, value, overwrite=True,
                                                                 namespace=namespace)


def kv_get(key: bytes, namespace: str) -> bytes | None:
    """The value under ``key`` in Ray's key-value store (None: none)."""
    return _require("ray.experimental.internal_kv", "_internal_kv_get")(key, namespace=namespace)


def kv_delete(key: bytes, namespace: str, prefix: bool = False) -> None:
    """Delete ``key`` (``prefix``: every key that starts with it) from Ray's key-value store."""
    _require("ray.experimental.internal_kv", "_internal_kv_del")(key, del_by_prefix=prefix,
                                                                 namespace=namespace)


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Ray node id -> that node's free resources, as the GCS reports them now."""
    return _require("ray._private.state", "available_resources_per_node")()


def draining_nodes() -> dict[str, float | None]:
    """Ray node id -> the unix time (s) by which each draining node goes (None: no deadline),
    as the GCS reports them now; {} when no node drains."""
    got = _require("ray._private.state", "state.get_draining_nodes")()
    return {str(k): (float(v) / 1000.0 if v else None) for k, v in got.items()}


def ray_address_file() -> str:
    """The file where a `ray start` on this machine wrote its cluster's address (it may not
    exist), in Ray's temp folder as Ray itself resolves it."""
    return str(_require("ray._common.utils", "get_ray_address_file")(None))


def node_lifetimes(timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Every node the GCS knows, alive or dead: ``{"node_id", "start_s", "end_s" (None while
    alive), "resources" (its total resources), "labels"}``, times in unix seconds as the GCS recorded
    them (the raylet's clock for the start, the GCS's for the end; millisecond resolution).
    Needs a connected driver (``ray.init``)."""
    _require("ray._raylet", "InnerGcsClient.get_all_node_info")
    client = getattr(_require("ray._private.worker", "global_worker"), "gcs_client", None)
    if client is None:
        raise RuntimeError("no GCS client: ray.init() was not called in this process")
    out = []
    for info in client.get_all_node_info(timeout=timeout_s).values():
        end_ms = int(info.end_time_ms)
        alive = info.state == 0   # GcsNodeInfo.ALIVE
        out.append({"node_id": info.node_id.hex(), "start_s": int(info.start_time_ms) / 1000.0,
                    "end_s": end_ms / 1000.0 if (end_ms and not alive) else None,
                    "resources": {str(k): float(v) for k, v in info.resources_total.items()},
                    "labels": {str(k): str(v) for k, v in info.labels.items()}})
    return out


def s3_filesystem_options(filesystem: Any) -> dict[str, Any]:
    """The endpoint, scheme, region and credentials a pyarrow ``S3FileSystem`` was built with
    (:data:`S3_OPTION_KEYS`; empty values left out). Only ``region`` is public; the rest comes
    from the arguments pickling rebuilds it from (module notes)."""
    opts: dict[str, Any] = {"region": getattr(filesystem, "region", None)}
    try:
        built = filesystem.__reduce__()[1][0]
    except Exception as e:  # noqa: BLE001 - a changed layout: one line, not a traceback
        raise RayInternalsError(f"cannot read the endpoint and credentials of {type(filesystem).__name__} "
                                f"(pyarrow changed what it pickles: {type(e).__name__}: {e}); see "
                                f"jabasray/actors/ray_internals.py") from None
    if isinstance(built, dict):
        opts.update({k: built.get(k) for k in S3_OPTION_KEYS if k != "region"})
    return {k: v for k, v in opts.items() if v}


__all__ = ["TESTED_RAY", "RAY_INTERNALS", "RayInternalsError", "tested_text", "version_problem",
           "missing_internals", "problems", "kv_put", "kv_get", "kv_delete",
           "available_resources_per_node", "draining_nodes", "node_lifetimes", "s3_filesystem_options"]
