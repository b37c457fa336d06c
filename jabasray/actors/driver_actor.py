"""The JABAS driver as a restartable, detached Ray actor: the job outlives its client and the
driver's own death. The client side (start, follow, status, stop) is :mod:`.run_client`.

Design notes:

* **Name.** One actor per run: ``driver:<run name>`` in the Ray namespace ``jabasray``
  (:data:`NAMESPACE`), ``lifetime="detached"`` (a client that disconnects does not end it),
  on the head node or ``DriverOptions.driver_node`` (soft node affinity, so a restart after that
  node died lands elsewhere), ``max_restarts = DriverOptions.driver_max_restarts``. It asks for
  :data:`DRIVER_CPUS`, a token share of a CPU (it only orchestrates): Ray 2.60 ignores a soft
  node affinity for an actor that asks for no resource at all and places it on any node (about
  half the time on another one, where a local run folder does not exist;
  tests/test_multinode.py). The price: a node must have that share free to host the driver
  (a head started with no CPUs never does, and the driver then runs elsewhere), and on the
  driver's node GPU bundles that reserve whole loader CPUs fit one fewer time when they would
  have taken every CPU.
* **The run's spec lives in Ray's GCS key-value store**, not in the actor's constructor
  arguments: Ray keeps large constructor arguments in the object store, owned by the creating
  client, so the restart of a detached actor whose client has left would fail
  (ray-project/ray#53727). The client cloudpickles :class:`JabasDriver`'s arguments under
  ``run/<name>/spec``; the actor gets only the run name. The keys are deleted when the run ends.
* **Training runs in a thread started by ``__init__``**, so an incarnation Ray restarts resumes
  by itself; the actor's methods (``poll``, ``status``, ``stop``) answer meanwhile.
* **Restart.** Ray re-runs ``__init__`` (``was_current_actor_reconstructed``). The new
  incarnation removes what the old one may have left: GPU actors named ``gpu:<run>:...``
  (:func:`gpu_actor_prefix`) and the placement groups recorded in ``run/<name>/pgs`` (Ray also
  removes both when their owner's process dies; this makes it certain). Then
  :meth:`JabasDriver.run` resumes from the run's last checkpoint (every completed epoch kept; the
  interrupted epoch is redone) and the events say so.
* **Progress** (interval and epoch records, events) is appended to a buffer of the current
  incarnation; a client polls ``poll(since, incarnation)`` and replays it into its callbacks.
  A detached run's ``RunConfig.callbacks`` come with the spec and run here, the Tune loggers
  writing into the run folder (:class:`~jabasray.actors.callbacks.RunTrackers`), finished
  before the outcome is handed out.
* **Stop** is checked between intervals (or, with ``at_epoch_end``, after the epoch's
  checkpoint): :class:`StopRequested` leaves :meth:`JabasDriver.run`, whose ``finally`` releases
  the GPU actors and placement groups. Checkpoints are written at epoch ends, so the final
  checkpoint of a stopped run is its last completed epoch; a partial epoch is not kept.
* **End.** A finished, stopped or failed run hands its outcome to every follower in their next
  poll; once one collected it (``release``) and no other follower polled in the last
  :data:`FOLLOWER_ACTIVE_S` (or after :data:`FINISHED_LINGER_S` without any), the actor deletes
  its keys and kills itself.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Any

from ..errors import HookError
from .callbacks import RunTrackers, tracker_callbacks
from .driver import JabasDriver
from .driver_options import DriverCallback
from .run_folder import run_lock
from .run_record import NAMESPACE, kv_delete_run, kv_get, kv_key, kv_put   # noqa: F401 - re-exported

log = logging.getLogger(__name__)

DRIVER_PREFIX = "driver:"       # driver actor name = DRIVER_PREFIX + run name
DRIVER_CPUS = 0.001             # CPUs the driver actor asks for: with none, Ray ignores its node
                                # affinity (module notes)
FINISHED_LINGER_S = 120.0       # an ended run waits this long for a client to collect its outcome
FOLLOWER_ACTIVE_S = 3.0         # a follower that polled this recently still gets the outcome
DONE_STATES = ("finished", "stopped", "failed")


def driver_actor_name(run: str) -> str:
    return f"{DRIVER_PREFIX}{run}"


def gpu_actor_prefix(run: str) -> str:
    """Name prefix of the GPU actors a run's driver actor starts
    (``gpu:<run>:<incarnation>:g<generation>:<node>:rank<rank>``)."""
    return f"gpu:{run}:"


def remove_leftovers(run: str) -> tuple[int, int]:
    """Kill the run's named GPU actors and remove its recorded placement groups that still
    exist. Returns (actors killed, placement groups removed)."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    actors = 0
    prefix = gpu_actor_prefix(run)
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(prefix):
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
                actors += 1
            except ValueError:   # gone meanwhile
                pass
    groups = 0
    table = ray.util.placement_group_table()
    for pg_hex in (kv_get(run, "pgs") or b"").decode().split():
        if table.get(pg_hex, {}).get("state") not in (None, "REMOVED"):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_hex)))
            groups += 1
    kv_put(run, "pgs", b"")
    return actors, groups


class StopRequested(Exception):
    """Raised inside the driver's loop when a client asked the run to stop."""


class ActorJabasDriver(JabasDriver):
    """:class:`JabasDriver` inside the driver actor: names its GPU actors after the run, records
    its placement groups in the KV store, honours stop requests and reports a restart."""

    def __init__(self, *args: Any, run_name: str, incarnation: int, restart_note: str | None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run_name, self.incarnation = run_name, incarnation
        self.restart_note = restart_note
        self.stop_now = threading.Event()          # stop before the next interval
        self.stop_at_epoch_end = threading.Event() # stop after the current epoch's checkpoint
        self.position = (0, 0)                     # (epoch, interval) about to run
        # GPU actors: gpu:<run>:<incarnation>:g<placement>:<node>:rank<r> (placement.actor_name),
        # the prefix a restarted driver finds this run's leftovers by (remove_leftovers)
        self.pool.name_prefix, self.pool.label = gpu_actor_prefix(run_name).rstrip(":"), str(incarnation)

    def _make_actor(self, slot: Any, world_size: int, ray_opts: dict) -> Any:
        return super()._make_actor(slot, world_size, dict(ray_opts, namespace=NAMESPACE))

    def _ensure_placement(self, state: Any, worker_state: Any, epoch: int) -> bool:
        replaced = super()._ensure_placement(state, worker_state, epoch)
        pgs = [pg.id.hex() for pg, _ in (self.pool.placement.pairs.values() if self.pool.placement else [])]
        kv_put(self.run_name, "pgs", " ".join(pgs).encode())
        return replaced

    def _restore_or_start(self, ctl: Any) -> tuple:
        out = super()._restore_or_start(ctl)
        if self.restart_note:
            self._event(self.restart_note + (f"; resumed automatically from {self.last_checkpoint.path.name}"
                                              if self.last_checkpoint else "; no checkpoint yet: "
                                              "started from the beginning"))
        return out

    def _run_interval(self, state: Any, ctl: Any, interval: int, cursor: int, tally: Any) -> int:
        self.position = (state.epochs_done, interval)
        if self.stop_now.is_set():
            raise StopRequested(f"epoch {state.epochs_done}, before interval {interval}")
        return super()._run_interval(state, ctl, interval, cursor, tally)

    def _end_epoch(self, *args: Any, **kwargs: Any) -> tuple:
        out = super()._end_epoch(*args, **kwargs)
        if self.stop_now.is_set() or self.stop_at_epoch_end.is_set():
            raise StopRequested(f"after epoch {out[0].epochs_done - 1}")
        return out


class _Progress(DriverCallback):
    """Appends the driver's records and events to the actor's progress buffer."""

    def __init__(self, sink: "DriverActor") -> None:
        self.sink = sink

    def on_interval(self, driver: Any, record: Any) -> None:
        self.sink._append("interval", record)

    def on_epoch(self, driver: Any, record: Any) -> None:
        self.sink._append("epoch", record)

    def on_event(self, driver: Any, message: str) -> None:
        self.sink._append("event", message)

    def on_phase(self, driver: Any, phase: str) -> None:
        self.sink._append("phase", phase)


def _close(trackers: RunTrackers | None, failed: bool) -> None:
    """End the run's tracker callbacks (their failure is logged: the run's outcome stands)."""
    if trackers is None:
        return
    try:
        trackers.finish(failed)
    except Exception:  # noqa: BLE001 - a logger must not change the run's outcome
        log.exception("the logger callbacks of the run failed to finish")


class DriverActor:
    """The Ray actor hosting one run's driver (module notes). Created by
    :func:`jabasray.actors.run_client.start_run`; ``run_name`` is the only argument."""

    def __init__(self, run_name: str) -> None:
        import ray

        self.run_name = run_name
        self.incarnation = int(kv_get(run_name, "incarnation") or b"0") + 1
        kv_put(run_name, "incarnation", str(self.incarnation).encode())
        with warnings.catch_warnings():   # Ray's property uses its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._lock = threading.Lock()
        self._items: list[tuple[str, Any]] = []
        self._last: dict[str, Any] = {}
        self.state = "starting"
        self._outcome: tuple[str, Any] | None = None
        self._collected = threading.Event()
        self._followers: dict[str, float] = {}     # follower id -> time of its last poll
        self.driver: ActorJabasDriver | None = None
        self.run_dir: str | None = None
        self.epochs: int | None = None
        self.dataset_size: int | None = None
        self._thread = threading.Thread(target=self._main, name=f"jabasray-driver-{run_name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the run
    def _main(self) -> None:
        import ray
        from ray import cloudpickle

        try:
            note = None
            if self.restarted:
                actors, groups = remove_leftovers(self.run_name)
                note = (f"driver actor restarted (incarnation {self.incarnation}) after its process "
                        f"or node died; removed {actors} GPU actor(s) and {groups} placement group(s) "
                        f"left by the old driver")
            blob = kv_get(self.run_name, "spec")
            if blob is None:
                raise RuntimeError(f"run {self.run_name}: its spec is gone from the Ray KV store")
            args, kwargs, run_callbacks = cloudpickle.loads(blob)
            kwargs = dict(kwargs, callbacks=[_Progress(self)])
            self.driver = ActorJabasDriver(*args, run_name=self.run_name, incarnation=self.incarnation,
                                           restart_note=note, **kwargs)
            # a detached run's RunConfig.callbacks run here (callbacks module notes)
            user, trackers = tracker_callbacks(run_callbacks, self.driver.run_dir, self.run_name,
                                               self.driver.job.to_dict())
            self.driver.callbacks += [*user, *([trackers] if trackers else [])]
            self.run_dir = str(self.driver.run_dir)
            self.epochs, self.dataset_size = self.driver.job.epochs, self.driver.dataset_size
            self.state = "running"
            # the storage must be visible from this node before anything is written to it
            # (a restart on a node that does not see a local run folder refuses here)
            self.driver.record.check_marker()
            # one run per run folder (run_folder.run_lock); after a restart Ray says the old
            # incarnation died: its lock is stale
            lock = run_lock(self.driver.run_dir, named_driver=True).acquire(take_over=self.restarted)
            self.driver.lock = lock
            if trackers is not None:
                trackers.start()
            try:
                try:
                    history = self.driver.run()
                finally:
                    lock.release()
            except StopRequested as stop:
                _close(trackers, failed=False)
                self._stopped(str(stop))
            except BaseException:
                _close(trackers, failed=True)
                raise
            else:
                _close(trackers, failed=False)   # their files are in the run folder before the end
                self._end("finished", history)
        except BaseException as e:  # noqa: BLE001 - reported to the client, which re-raises it
            if isinstance(e, HookError):   # the user's code: the client shows its line and frames
                log.error("run %s failed: %s", self.run_name, e)
            else:
                log.exception("run %s failed", self.run_name)
            self._outcome = ("error", e)
            self._append("event", f"run failed: {type(e).__name__}: {e}")
            self.state = "failed"
        self._wait_for_followers()
        try:
            kv_delete_run(self.run_name)
        finally:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _wait_for_followers(self) -> None:
        """Until one follower collected the outcome and no other is still polling (module notes)."""
        import time

        t0 = time.monotonic()
        while time.monotonic() - t0 < FINISHED_LINGER_S:
            now = time.monotonic()
            with self._lock:
                active = [f for f, t in self._followers.items() if now - t < FOLLOWER_ACTIVE_S]
            if self._collected.is_set() and not active:
                return
            time.sleep(0.05)

    def _stopped(self, where: str) -> None:
        from .checkpoint import latest_checkpoint

        cp = latest_checkpoint(self.driver.run_dir)
        kept = cp.epochs_done if cp else 0
        self.driver._event(f"stopped on request ({where}); the last checkpoint "
                           f"{cp.path.name if cp else '(none)'} keeps {kept} completed epoch(s); "
                           f"run it again under the same name to resume")
        self._end("stopped", self.driver.metrics.truncate(kept))

    def _end(self, state: str, history: Any) -> None:
        from .checkpoint import latest_checkpoint
        from .trainer import finish_run

        run = self.driver.run_dir
        self._outcome = ("result", finish_run(history, run,
                                              self.driver.last_checkpoint or latest_checkpoint(run)))
        self.state = state

    def _append(self, kind: str, item: Any) -> None:
        with self._lock:
            self._items.append((kind, item))
            self._last[kind] = item

    # ------------------------------------------------------------------ remote methods
    def poll(self, since: int = 0, incarnation: int | None = None, follower: str | None = None) -> dict:
        """Progress items after ``since`` (from 0 when ``incarnation`` is another one), the index
        to ask from next time, :meth:`status`, and once the run ended its ``outcome``:
        ("result", Result) or ("error", exception). ``follower`` identifies a polling client."""
        import time

        if incarnation != self.incarnation:
            since = 0
        outcome = self._outcome    # read first: set before the state turns final
        with self._lock:
            items = self._items[since:]
            nxt = len(self._items)
            if follower:
                self._followers[follower] = time.monotonic()
        st = self.status()
        return {"incarnation": self.incarnation, "items": items, "next": nxt, "status": st,
                "outcome": outcome if st["state"] in DONE_STATES else None}

    def status(self) -> dict:
        """Where the run is: state, epochs, the running epoch's samples and B_G, the last epoch
        record and the last events; where the driver runs (``pid``, ``node`` IP, ``node_id``)."""
        import ray

        with self._lock:
            interval, epoch = self._last.get("interval"), self._last.get("epoch")
            events = [m for k, m in self._items if k == "event"][-5:]
        drv = self.driver
        cur = drv.position[0] if drv else 0
        done_in_epoch = sum(r.samples for r in drv.metrics.intervals if r.epoch == cur) if drv else 0
        return {"name": self.run_name, "state": self.state, "incarnation": self.incarnation,
                "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "run_dir": self.run_dir,
                "epochs": self.epochs, "epochs_done": len(drv.metrics.epochs) if drv else 0,
                "epoch": cur, "samples": done_in_epoch, "dataset_size": self.dataset_size,
                "global_batch": interval.global_batch if interval else None,
                "last_epoch": epoch.to_dict() if epoch else None, "events": events,
                "gpu_actors": len(drv.gpu_actors()) if drv else 0,
                "error": (f"{type(self._outcome[1]).__name__}: {self._outcome[1]}"
                          if self._outcome and self._outcome[0] == "error" else None)}

    def stop(self, at_epoch_end: bool = False) -> dict:
        """Ask the run to stop before its next interval (or after the current epoch)."""
        if self.driver is not None:
            (self.driver.stop_at_epoch_end if at_epoch_end else self.driver.stop_now).set()
            if self.state == "running":
                self.state = "stopping"
        return self.status()

    def release(self, follower: str | None = None) -> None:
        """``follower`` collected the outcome; the actor exits when no other follower polls."""
        with self._lock:
            self._followers.pop(follower, None)
        self._collected.set()

    def gpu_actors(self) -> list:
        return self.driver.gpu_actors() if self.driver else []


__all__ = ["DriverActor", "ActorJabasDriver", "StopRequested", "NAMESPACE", "DRIVER_PREFIX", "DRIVER_CPUS",
           "DONE_STATES", "driver_actor_name", "gpu_actor_prefix", "remove_leftovers"]
