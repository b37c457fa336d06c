"""Client side of the driver actor (:mod:`.driver_actor`): start a run, follow its progress,
ask where it is, stop it. Used by ``JabasTrainer.fit()`` and ``jabasray train/status/attach/stop``;
any process connected to the Ray cluster can use them (a Python script, a ``ray job submit``
entry point, a second terminal).

Following a run means polling the actor every ``poll_s`` seconds for its new progress items and
replaying them into the caller's callbacks (:class:`DriverCallback`), which therefore run in the
caller's process, shortly after the fact; their ``driver`` argument is a :class:`RemoteDriver`.
While Ray restarts the actor, polls fail with ``ActorUnavailableError``; the follower waits and
continues with the new incarnation's items. ``KeyboardInterrupt`` only detaches the caller.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

from .driver_actor import DONE_STATES, DRIVER_CPUS, DRIVER_PREFIX, NAMESPACE, DriverActor, driver_actor_name, kv_put
from .driver_options import DriverCallback, DriverOptions

log = logging.getLogger(__name__)


class RemoteDriver:
    """What callbacks get as ``driver`` when the driver is an actor."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name, self.handle = name, handle

    def gpu_actors(self) -> list:
        import ray
        return ray.get(self.handle.gpu_actors.remote())


def connect(address: str | None = None) -> None:
    """Connect to the running Ray cluster (never start one: a run lives on a cluster that
    outlives the command). ValueError (one line) when there is none."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        raise ValueError(f"ray_address: no running Ray cluster at {address!r} ({e}); pass the "
                         f"cluster a run was started on with --ray-address or RAY_ADDRESS") from None


def running_runs() -> list[str]:
    """Names of the runs whose driver actor exists (running, or ended and not yet collected)."""
    import ray
    return sorted(e["name"][len(DRIVER_PREFIX):] for e in ray.util.list_named_actors(all_namespaces=True)
                  if e["namespace"] == NAMESPACE and e["name"].startswith(DRIVER_PREFIX))


def _runs_text() -> str:
    return ", ".join(running_runs()) or "none"


def find_driver(name: str) -> Any:
    """The driver actor of run ``name``; ValueError (one line, naming the runs that exist) if none."""
    import ray
    try:
        return ray.get_actor(driver_actor_name(name), namespace=NAMESPACE)
    except ValueError:
        raise ValueError(f"run {name!r} has no running driver (unknown or finished); running runs: "
                         f"{_runs_text()}") from None


def _driver_node(options: DriverOptions) -> str:
    """Ray node id of ``options.driver_node`` (node id or IP), else of the head node."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    want = options.driver_node
    for n in nodes:
        if want is None and "node:__internal_head__" in n.get("Resources", {}):
            return n["NodeID"]
        if want is not None and want in (n["NodeID"], n.get("NodeManagerAddress")):
            return n["NodeID"]
    if want is None:
        return ray.get_runtime_context().get_node_id()
    raise ValueError(f"driver_node must be the id or IP of a live Ray node, got {want!r}; nodes: "
                     f"{', '.join(n['NodeManagerAddress'] + ' ' + n['NodeID'][:12] for n in nodes)}")


def start_run(name: str, driver_args: tuple, driver_kwargs: dict, options: DriverOptions,
              callbacks: Sequence[Any] = ()) -> Any:
    """Start run ``name``'s driver actor with :class:`JabasDriver` ``(*driver_args,
    **driver_kwargs)`` (module notes of :mod:`.driver_actor`) on the head node or
    ``options.driver_node``: :data:`DRIVER_CPUS` CPUs and a soft node affinity to it.
    ``callbacks`` (``RunConfig.callbacks`` of a detached run) run in the actor. Refused
    (ValueError, one line) when a driver of that name exists. Returns the actor handle."""
    import ray
    from ray import cloudpickle
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    check_name_free(name)
    node = _driver_node(options)
    kv_put(name, "spec", cloudpickle.dumps((tuple(driver_args), dict(driver_kwargs), list(callbacks))))
    try:
        return ray.remote(DriverActor).options(
            name=driver_actor_name(name), namespace=NAMESPACE, lifetime="detached",
            num_cpus=DRIVER_CPUS,
            resources=dict(options.driver_resources or {}), max_restarts=options.driver_max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote(name)
    except ValueError:   # created by someone else since the check
        raise _name_taken(name) from None


def _name_taken(name: str) -> ValueError:
    return ValueError(f"name: run {name!r} is already running (driver actor "
                      f"{driver_actor_name(name)!r}); attach to it with `jabasray attach {name}` "
                      f"or choose another name")


def check_name_free(name: str) -> None:
    """One-line ValueError when a driver actor of run ``name`` is running; an ended run whose
    outcome nobody collected is released (its name is free again)."""
    if name in running_runs():
        if status(name)["state"] not in DONE_STATES:
            raise _name_taken(name)
        _release(name)


def _release(name: str, handle: Any = None, follower: str | None = None, timeout_s: float = 60.0) -> None:
    """Tell an ended run's actor its outcome was collected and wait until it is gone (it
    deletes its KV keys and kills itself once no other follower polls), so that the name is
    free when this returns."""
    (handle or find_driver(name)).release.remote(follower)
    t0 = time.monotonic()
    while name in running_runs() and time.monotonic() - t0 < timeout_s:
        time.sleep(0.05)


def _ask(name: str, handle: Any, method: str, *args: Any) -> Any:
    """``handle.<method>(*args)``; a driver that Ray is restarting is a one-line ValueError."""
    import ray
    from ray.exceptions import ActorUnavailableError

    try:
        return ray.get(getattr(handle, method).remote(*args))
    except ActorUnavailableError:
        raise ValueError(f"run {name!r}: its driver actor is restarting; try again in a few "
                         f"seconds") from None


def status(name: str) -> dict:
    """:meth:`DriverActor.status` of run ``name``."""
    return _ask(name, find_driver(name), "status")


def stop(name: str, at_epoch_end: bool = False, wait: bool = True, poll_s: float = 0.5) -> dict:
    """Ask run ``name`` to stop (before its next interval, or after the current epoch's
    checkpoint); with ``wait``, return once its actors are released (the final status)."""
    handle = find_driver(name)
    st = _ask(name, handle, "stop", at_epoch_end)
    if st["state"] in DONE_STATES:
        raise ValueError(f"run {name!r} has already {st['state']}; running runs: {_runs_text()}")
    from ray.exceptions import RayActorError

    while wait and st["state"] not in DONE_STATES:
        time.sleep(poll_s)
        try:
            st = _ask(name, handle, "status")
        except RayActorError:
            # it ended and exited between two polls (its followers had collected the outcome)
            return {**st, "state": "stopped"}
    return st


def follow(name: str, callbacks: Sequence[DriverCallback] | None = None, poll_s: float = 0.5,
           restart_timeout_s: float = 600.0) -> Any:
    """Stream run ``name``'s progress into ``callbacks`` until it ends; return its ``Result``
    (a stopped run: the completed epochs) or raise the driver's error. Then the actor exits.
    ``callbacks`` None: the console, as ``fit()`` shows it (one line per epoch on stdout, the
    events on stderr, a progress bar on a terminal); ``()``: nothing."""
    if callbacks is None:
        from .callbacks import ConsoleReporter

        reporter = ConsoleReporter()
        try:
            st = status(name)
            total = (st["epochs"] or 0) * (st["dataset_size"] or 0) or None
        except ValueError:   # restarting (or unknown: the follow below says so in one line)
            total = None
        reporter.start(total)
        try:
            return follow(name, [reporter], poll_s, restart_timeout_s)
        finally:
            reporter.close()
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    import uuid

    handle = find_driver(name)
    view = RemoteDriver(name, handle)
    me = uuid.uuid4().hex
    since, incarnation, unavailable_since = 0, None, None
    try:
        while True:
            try:
                reply = ray.get(handle.poll.remote(since, incarnation, me), timeout=60)
                unavailable_since = None
            except (ActorUnavailableError, GetTimeoutError):   # restarting, or busy
                reply = None
            except RayActorError as e:
                if name not in running_runs():
                    raise RuntimeError(f"the driver actor of run {name!r} died and was not restarted "
                                       f"({type(e).__name__}); its last checkpoint is kept: run it "
                                       f"again under the same name to resume") from None
                reply = None
            if reply is None:
                unavailable_since = unavailable_since or time.monotonic()
                if time.monotonic() - unavailable_since > restart_timeout_s:
                    raise RuntimeError(f"the driver actor of run {name!r} did not answer for "
                                       f"{restart_timeout_s:.0f}s")
                time.sleep(poll_s)
                continue
            if reply["incarnation"] != incarnation and incarnation is not None:
                log.warning("run %s: driver actor restarted (incarnation %d)", name, reply["incarnation"])
            incarnation = reply["incarnation"]
            for kind, item in reply["items"]:
                for cb in callbacks:
                    hook = getattr(cb, f"on_{kind}", None)   # on_phase is optional
                    if hook is not None:
                        hook(view, item)
            since = reply["next"]
            if reply["outcome"] is not None:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        log.warning("detached from run %s; it keeps running while its Ray cluster does: "
                    "`jabasray attach %s`, `jabasray stop %s`", name, name, name)
        raise
    kind, value = reply["outcome"]
    _release(name, handle, me)
    if kind == "error":
        raise value
    return value


__all__ = ["RemoteDriver", "connect", "running_runs", "find_driver", "start_run", "status", "stop",
           "follow"]
