"""Background learners on the GPU actors (DeepPool section 5), the Ray side.

* :class:`BackgroundJob`: what a user submits (plain spec: callables + sizes), picklable.
* :class:`BackgroundHostMixin`: methods a GPU actor inherits (``bg_submit``, ``bg_status``,
  ``bg_cancel``, ``bg_pause``/``bg_resume``, ``bg_state``, ``spare_capacity``,
  ``free_memory``). They drive one :class:`jabasray.engine.multiplex.BackgroundRunner` per
  actor, created on first use; the foreground code of the actor may use the same runner's
  gates (``self.bg_runner().foreground_critical("allreduce")``) and step feedback.
* :func:`submit_background`: place a job on the actor with the most spare capacity among those
  whose free memory holds its ``memory_mb`` (else ``ValueError`` naming ``memory_mb``).
* :class:`BackgroundScheduler`: keeps the handles and the jobs' states; ``rebalance(
  new_actor_handles)`` (called by the driver after every re-placement) moves jobs whose actor
  disappeared to a new actor, where they resume from their state.

**Where a job's state lives.** Never on a node: the engine's periodic checkpoints go to a
scratch file of the actor process (its working copy, gone with the actor). The state that
survives the actor is what the scheduler pulls with ``bg_state`` - the job's model, optimizer,
step and data cursor as ``torch.save`` bytes, through Ray's object store - at every epoch end
(the driver calls :meth:`BackgroundScheduler.checkpoint`; the driver actor hosts the scheduler)
or whenever the user calls it, kept in the scheduler and written to its ``storage`` (the run's
``<run>/background/<job id>.pt`` when a driver calls it; any local path or URI,
:mod:`jabasray.storage`). A job moves with a fresh state when its old actor still answers, else
with the newest pulled one; a job with no state anywhere is failed with an error naming it
(``result()`` raises), never restarted from step 0 in silence.

A background job never fails the foreground: any exception inside it (building the model,
reading data, a training step) is caught on the actor, logged, and reported through the
handle (``progress().state == "failed"``, ``result()`` raises :class:`BackgroundJobFailed`).
Only coarse Ray calls are made (submit, status polls, checkpoint), never one per step.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..storage import StoragePath, as_storage_path
from ..validation import check_float, check_int, check_steps_or_epochs

log = logging.getLogger(__name__)


@dataclass
class BackgroundJob:
    """A small training job to run at low priority on spare GPU capacity."""

    model_fn: Callable[[], Any]                  # () -> nn.Module
    optimizer_fn: Callable[[Any], Any]           # params -> torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], Any]           # (outputs, targets) -> scalar loss
    dataset: Any = None                          # indexable dataset (TensorDataset ...) ...
    data_fn: Callable[[], Any] | None = None     # ... or a function building it on the actor
    steps: int | None = None                     # train this many steps ...
    epochs: int | None = None                    # ... or this many epochs
    batch_size: int = 16                         # background batch (kept small, section 5)
    memory_mb: float = 0.0                       # device memory estimate (MiB)
    checkpoint_every: int = 50                   # steps between its checkpoints (actor's working copy)
    seed: int = 0                                # model init and data order
    name: str = "background"                     # label for logs

    def __post_init__(self) -> None:
        for f in ("model_fn", "optimizer_fn", "loss_fn"):
            if not callable(getattr(self, f)):
                raise ValueError(f"{f} must be callable, got {getattr(self, f)!r}")
        if (self.dataset is None) == (self.data_fn is None):
            raise ValueError("exactly one of dataset and data_fn must be given, got "
                             f"dataset={'set' if self.dataset is not None else None}, "
                             f"data_fn={'set' if self.data_fn is not None else None}")
        check_steps_or_epochs(self.steps, self.epochs)
        check_int("batch_size", self.batch_size, min_value=1)
        check_float("memory_mb", self.memory_mb, min_value=0)
        check_int("checkpoint_every", self.checkpoint_every, min_value=1)
        check_int("seed", self.seed, min_value=0)


class BackgroundJobFailed(RuntimeError):
    """Raised by :meth:`BackgroundHandle.result` when the job failed on its actor."""

    def __init__(self, status: Any) -> None:
        super().__init__(f"background job {status.name} failed at step {status.step}: {status.error}")
        self.status = status


def _failed_status(job_id: str, error: str) -> Any:
    from ..engine.multiplex import BackgroundStatus
    return BackgroundStatus(name=job_id, state="failed", error=error)


class BackgroundHostMixin:
    """Background-learner methods of a GPU actor (one BackgroundRunner per actor).

    The host may define ``device`` (default "cpu") and ``bg_policy`` (a ``MultiplexPolicy``).
    On CPU the device memory is an emulated budget (``bg_set_memory_budget``, default the
    machine's RAM); on CUDA it is ``torch.cuda.mem_get_info``.
    """

    # ---- state, created lazily (the host's __init__ need not call ours)
    def _bg_init(self) -> None:
        if not hasattr(self, "_bg_memory"):
            self._bg_memory: dict[str, float] = {}     # job id -> memory estimate (MiB)
            self._bg_failed: dict[str, Any] = {}       # job id -> status of a job that never started

    def bg_runner(self) -> Any:
        """This actor's BackgroundRunner (created, with its thread, on first use)."""
        self._bg_init()
        runner = getattr(self, "_bg_runner_obj", None)
        if runner is None:
            from ..engine.multiplex import BackgroundRunner
            runner = BackgroundRunner(getattr(self, "device", "cpu"), getattr(self, "bg_policy", None))
            self._bg_runner_obj = runner
        return runner

    def bg_foreground_step(self) -> Any:
        """Context manager for the host's foreground step: feeds the slowdown controller when
        background jobs exist on this actor, a no-op otherwise (no runner thread is started)."""
        runner = getattr(self, "_bg_runner_obj", None)
        return runner.foreground_step() if runner is not None else contextlib.nullcontext()

    def bg_foreground_critical(self, op: str = "allreduce") -> Any:
        """Context manager around a collocation-sensitive foreground op (an all-reduce):
        background work of this actor is paused meanwhile; a no-op without background jobs."""
        runner = getattr(self, "_bg_runner_obj", None)
        return runner.foreground_critical(op) if runner is not None else contextlib.nullcontext()

    def bg_set_memory_budget(self, megabytes: float) -> None:
        """CPU emulation: memory (MiB) this device offers to background jobs."""
        self._bg_budget_mb = check_float("memory_budget_mb", megabytes, min_value=0)

    # ---- capacity
    def free_memory(self) -> float:
        """Free device memory in MiB for a new background job."""
        self._bg_init()
        reserved = sum(mb for jid, mb in self._bg_memory.items() if not self._bg_finished(jid))
        device = str(getattr(self, "device", "cpu"))
        if device.startswith("cuda"):
            import torch
            free, _total = torch.cuda.mem_get_info(torch.device(device))
            return max(0.0, free / 2**20 - reserved)
        budget = getattr(self, "_bg_budget_mb", None)
        if budget is None:
            budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
        return max(0.0, budget - reserved)

    def spare_capacity(self) -> float:
        """Score in [0, 1]: share of the device the foreground leaves idle, split among jobs
        (1.0 before this actor hosted any background job: nothing measured, nothing shared)."""
        runner = getattr(self, "_bg_runner_obj", None)
        return 1.0 if runner is None else float(runner.spare_capacity())

    def _bg_finished(self, job_id: str) -> bool:
        runner = getattr(self, "_bg_runner_obj", None)
        if job_id in self._bg_failed or runner is None:
            return True
        try:
            return runner.status(job_id).finished
        except ValueError:
            return True

    # ---- jobs
    def _bg_scratch(self, job_id: str) -> str:
        """The engine's checkpoint file of ``job_id`` in this actor process's scratch folder (a
        working copy: the state that outlives this actor is what :meth:`bg_state` returns)."""
        folder = getattr(self, "_bg_scratch_dir", None)
        if folder is None:
            folder = self._bg_scratch_dir = tempfile.mkdtemp(prefix="jabasray_bg_")
        return os.path.join(folder, hashlib.sha256(job_id.encode()).hexdigest()[:24] + ".pt")

    def bg_submit(self, job_id: str, job_blob: Any, state: bytes | None = None) -> Any:
        """Build and start ``job_blob`` (a BackgroundJob, or its cloudpickle bytes) as
        ``job_id``, resuming from ``state`` (what :meth:`bg_state` returned on the job's
        previous actor) when given.

        Raises ValueError (naming ``memory_mb``) when the job does not fit in free memory;
        any other error is contained: the job is reported as failed.
        """
        runner = self.bg_runner()
        job = _load_job(job_blob)
        if state is not None and not isinstance(state, (bytes, bytearray)):
            raise ValueError(f"state must be the bytes bg_state returned, or None, got "
                             f"{type(state).__name__}")
        free = self.free_memory()
        if job.memory_mb > free:
            raise ValueError(f"memory_mb must be <= the free memory of this device ({free:.1f} MiB), "
                             f"got {job.memory_mb}")
        self._bg_failed.pop(job_id, None)
        try:
            import torch

            from ..engine.multiplex import BackgroundTask
            scratch = self._bg_scratch(job_id)
            if state is not None:
                with open(scratch, "wb") as fh:
                    fh.write(state)
            elif os.path.exists(scratch):
                os.unlink(scratch)
            torch.manual_seed(job.seed)
            model = job.model_fn()
            dataset = job.dataset if job.dataset is not None else job.data_fn()
            task = BackgroundTask(
                name=job_id, model=model, dataset=dataset,
                optimizer=job.optimizer_fn(model.parameters()), loss_fn=job.loss_fn,
                batch_size=job.batch_size, steps=job.steps, epochs=job.epochs,
                checkpoint_path=scratch, checkpoint_every=job.checkpoint_every, seed=job.seed)
            runner.submit(task)
        except Exception as e:  # noqa: BLE001 - contained, reported through the handle
            log.exception("background job %s could not start", job_id)
            self._bg_failed[job_id] = _failed_status(job_id, f"{type(e).__name__}: {e}")
            return self._bg_failed[job_id]
        self._bg_memory[job_id] = job.memory_mb
        return runner.status(job_id)

    def bg_state(self, job_id: str) -> bytes:
        """The job's state now - model, optimizer, step, data cursor, as ``torch.save`` bytes
        (tensors and plain values only) - taken between two of its steps; it reaches the caller
        through Ray's object store."""
        path = self.bg_runner().checkpoint(job_id)
        with open(path, "rb") as fh:
            return fh.read()

    def bg_status(self, job_id: str) -> Any:
        if job_id in getattr(self, "_bg_failed", {}):
            return self._bg_failed[job_id]
        return self.bg_runner().status(job_id)

    def bg_list(self) -> dict:
        out = dict(getattr(self, "_bg_failed", {}))
        out.update(self.bg_runner().statuses())
        return out

    def bg_cancel(self, job_id: str) -> Any:
        if job_id in getattr(self, "_bg_failed", {}):
            return self._bg_failed[job_id]
        return self.bg_runner().cancel(job_id)

    def bg_pause(self, job_id: str | None = None) -> None:
        """Pause one job, or all background work of this actor (``job_id=None``)."""
        self.bg_runner().pause(job_id)

    def bg_resume(self, job_id: str | None = None) -> None:
        self.bg_runner().resume(job_id)


def _load_job(blob: Any) -> BackgroundJob:
    if isinstance(blob, (bytes, bytearray)):
        import cloudpickle
        blob = cloudpickle.loads(blob)
    if not isinstance(blob, BackgroundJob):
        raise ValueError(f"job_blob must be a BackgroundJob (or its pickle), got {type(blob).__name__}")
    return blob


# --------------------------------------------------------------------------------------------
# User side.
# --------------------------------------------------------------------------------------------

def _actor_key(actor: Any) -> str:
    aid = getattr(actor, "_actor_id", None)
    return aid.hex() if aid is not None else str(id(actor))


def _choose_actor(job: BackgroundJob, actors: Sequence[Any], timeout_s: float | None = None) -> Any:
    """The actor with the most spare capacity among those with ``free_memory >= memory_mb``.
    Every actor is asked at once (one round trip); with ``timeout_s`` an actor that does not
    answer within it (hung, dead) is left out with a warning naming it, and ``TimeoutError``
    (one line) is raised when none answered."""
    import ray

    if not actors:
        raise ValueError("actors must list at least one GPU actor, got none")
    refs = [(a.spare_capacity.remote(), a.free_memory.remote()) for a in actors]
    flat = [r for pair in refs for r in pair]
    ready, _ = ray.wait(flat, num_returns=len(flat), timeout=timeout_s)
    ready = set(ready)
    spare: dict[int, float] = {}
    free: dict[int, float] = {}
    for i, (rs, rf) in enumerate(refs):
        try:
            if rs in ready and rf in ready:
                spare[i], free[i] = ray.get(rs), ray.get(rf)
                continue
            why = f"did not answer within {timeout_s:g}s"
        except Exception as e:  # noqa: BLE001 - a dead actor: not a place for the job
            why = f"failed ({type(e).__name__})"
        log.warning("background: GPU actor %s %s; not placing job %s on it", _actor_key(actors[i]),
                    why, job.name)
    if not spare:
        raise TimeoutError(f"background job {job.name}: no GPU actor answered spare_capacity/"
                           f"free_memory within {timeout_s:g}s")
    fits = [i for i in spare if free[i] >= job.memory_mb]
    if not fits:
        raise ValueError(f"memory_mb must be <= the largest free memory of the devices "
                         f"({max(free.values()):.1f} MiB), got {job.memory_mb}")
    best = max(fits, key=lambda i: (spare[i], free[i], -i))
    return actors[best]


def _get(ref: Any, timeout_s: float | None, what: str) -> Any:
    """``ray.get(ref)`` within ``timeout_s``: a call past it is ``TimeoutError`` naming ``what``."""
    import ray
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"{what} did not return within {timeout_s:g}s") from None


class BackgroundHandle:
    """A submitted background job: ``progress()``, ``result(timeout)``, ``cancel()``."""

    def __init__(self, job_id: str, job: BackgroundJob, actor: Any,
                 timeout_s: float | None = None) -> None:
        self.job_id, self.job, self.actor = job_id, job, actor
        self.timeout_s = timeout_s       # deadline of each Ray call (None: none)
        self.moves = 0
        self.lost: str | None = None     # why the job cannot continue (its state is gone)

    def progress(self) -> Any:
        """The job's current ``BackgroundStatus`` (state, step, total_steps, loss, error)."""
        if self.lost is not None:
            return _failed_status(self.job_id, self.lost)
        return _get(self.actor.bg_status.remote(self.job_id), self.timeout_s,
                    f"bg_status of background job {self.job_id}")

    def result(self, timeout: float | None = None, poll: float = 0.1) -> Any:
        """Wait until the job finished; return its final status.

        Raises ``TimeoutError`` when ``timeout`` passes first and :class:`BackgroundJobFailed`
        when the job failed on its actor or its state was lost.
        """
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.progress()
            if st.finished:
                if st.state == "failed":
                    raise BackgroundJobFailed(st)
                return st
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"background job {self.job_id} not finished after {timeout} s "
                                   f"(step {st.step}/{st.total_steps})")
            time.sleep(poll)

    def cancel(self) -> Any:
        if self.lost is not None:
            return self.progress()
        return _get(self.actor.bg_cancel.remote(self.job_id), self.timeout_s,
                    f"bg_cancel of background job {self.job_id}")

    def __repr__(self) -> str:
        return f"BackgroundHandle({self.job_id!r}, job={self.job.name!r}, moves={self.moves})"


def submit_background(job: BackgroundJob, actors: Sequence[Any], job_id: str | None = None,
                      state: bytes | None = None, timeout_s: float | None = None) -> BackgroundHandle:
    """Place ``job`` on the actor with the most spare capacity that has the memory for it
    (resuming from ``state``, bytes of ``bg_state``, when given). Raises ValueError naming
    ``memory_mb`` when no device has enough free memory. Its state outlives that actor only
    through a :class:`BackgroundScheduler` (module notes). ``timeout_s``: the deadline of each
    Ray call (an actor that does not answer in time is left out; ``TimeoutError`` when none
    answers or the chosen one does not take the job in time)."""
    if not isinstance(job, BackgroundJob):
        raise ValueError(f"job must be a BackgroundJob, got {type(job).__name__}")
    job_id = job_id or f"{job.name}-{uuid.uuid4().hex[:8]}"
    actor = _choose_actor(job, actors, timeout_s)
    _get(actor.bg_submit.remote(job_id, job, state), timeout_s,
         f"bg_submit of background job {job_id} on GPU actor {_actor_key(actor)}")
    log.info("background job %s placed on actor %s", job_id, _actor_key(actor))
    return BackgroundHandle(job_id, job, actor, timeout_s)


class BackgroundScheduler:
    """Tracks background jobs and their states across re-placements of the GPU actors.

    :meth:`checkpoint` pulls every running job's state from its actor (the driver calls it at
    every epoch end); :meth:`rebalance` (called by the driver with the new actor handles after
    every re-placement) resumes every unfinished job whose actor is not among them on a new
    actor, from a fresh state when the old actor still answers, else from the newest pulled
    one. ``storage``: where pulled states are also written (``<job id>.pt``; a local path or
    URI; None: the run's ``<run>/background`` once a driver calls :meth:`checkpoint`, else in
    memory only). ``call_timeout_s``: the deadline of every Ray call it makes (a driver sets it
    to its ``DriverOptions.call_timeout_s``, like its other fan-out calls): an actor that does
    not answer in time is skipped with a warning naming it, never waited on - a hung GPU actor
    is the foreground's failure to find, at its own deadline.
    """

    def __init__(self, actors: Sequence[Any] = (), storage: "str | Path | StoragePath | None" = None,
                 call_timeout_s: float = 120.0) -> None:
        check_float("call_timeout_s", call_timeout_s, min_value=0, min_exclusive=True)
        self.call_timeout_s = float(call_timeout_s)
        self.actors = list(actors)
        self.storage = as_storage_path(storage) if storage is not None else None
        self.handles: dict[str, BackgroundHandle] = {}
        self.states: dict[str, bytes] = {}        # job id -> newest pulled state

    def submit(self, job: BackgroundJob, job_id: str | None = None) -> BackgroundHandle:
        handle = submit_background(job, self.actors, job_id, timeout_s=self.call_timeout_s)
        self.handles[handle.job_id] = handle
        return handle

    def checkpoint(self, storage: "str | Path | StoragePath | None" = None) -> list[str]:
        """Pull the state of every running job whose actor answers (one Ray call per job) and
        keep it (and write it to ``storage``, else to this scheduler's storage). Returns the
        ids of the jobs whose state was taken."""
        import ray

        if storage is not None and self.storage is None:
            self.storage = as_storage_path(storage)
        taken = []
        for jid, h in self.handles.items():
            if h.lost is not None:
                continue
            try:
                st = ray.get(h.actor.bg_status.remote(jid), timeout=self.call_timeout_s)
                if st.state in ("failed", "cancelled") or (st.finished and jid in self.states):
                    continue
                self._keep(jid, ray.get(h.actor.bg_state.remote(jid), timeout=self.call_timeout_s))
            except Exception as e:  # noqa: BLE001 - actor gone or hung: rebalance resumes it
                log.warning("background job %s: no state from its actor %s within %gs (%s)", jid,
                            _actor_key(h.actor), self.call_timeout_s, type(e).__name__)
                continue
            taken.append(jid)
        return taken

    def _keep(self, job_id: str, state: bytes) -> None:
        self.states[job_id] = state
        if self.storage is not None:
            (self.storage / f"{job_id}.pt").write_bytes(state)

    def state(self, job_id: str) -> bytes | None:
        """The newest state of ``job_id`` kept here or in the storage (None: none)."""
        if job_id in self.states:
            return self.states[job_id]
        if self.storage is not None:
            try:
                return (self.storage / f"{job_id}.pt").read_bytes()
            except FileNotFoundError:
                return None
        return None

    def rebalance(self, new_actor_handles: Sequence[Any]) -> list[str]:
        """Move jobs off actors that disappeared; returns the ids of the jobs moved."""
        import ray

        self.actors = list(new_actor_handles)
        alive = {_actor_key(a) for a in self.actors}
        moved = []
        for jid, h in self.handles.items():
            if _actor_key(h.actor) in alive or h.lost is not None:
                continue
            reachable = True
            try:                       # still reachable: a fresh state (stopped there below)
                st = ray.get(h.actor.bg_status.remote(jid), timeout=self.call_timeout_s)
                if st.finished:
                    continue
                self._keep(jid, ray.get(h.actor.bg_state.remote(jid), timeout=self.call_timeout_s))
            except Exception as e:  # noqa: BLE001 - actor gone or hung: the newest pulled state
                reachable = False
                log.info("background job %s: old actor unreachable (%s); resuming from its last "
                         "pulled state", jid, type(e).__name__)
            state = self.state(jid)
            if state is None:
                h.lost = (f"background job {jid}: its actor is gone and none of its state reached "
                          f"the scheduler or its storage (states are pulled at every epoch end "
                          f"and by BackgroundScheduler.checkpoint()); not restarting it from step 0")
                log.error(h.lost)
                continue
            if not self.actors:
                log.warning("background job %s: no actor left to resume on", jid)
                continue
            try:
                actor = _choose_actor(h.job, self.actors, self.call_timeout_s)
            except TimeoutError as e:   # no new actor answers: it stays where it is, tried again next time
                log.warning("background job %s not resumed (it stays on its old actor): %s", jid, e)
                continue
            try:                       # stop it on the old actor (a busy one when it gets to it)
                ref = h.actor.bg_cancel.remote(jid)
                if reachable:
                    ray.get(ref, timeout=self.call_timeout_s)
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
            h.actor, h.timeout_s = actor, self.call_timeout_s
            try:
                _get(actor.bg_submit.remote(jid, h.job, state), self.call_timeout_s,
                     f"bg_submit of background job {jid} on GPU actor {_actor_key(actor)}")
            except TimeoutError as e:   # sent: it starts once the actor answers; state kept here
                log.warning("background job %s: %s", jid, e)
                continue
            h.moves += 1
            moved.append(jid)
            log.info("background job %s resumed on actor %s", jid, _actor_key(h.actor))
        return moved
