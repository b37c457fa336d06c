"""Background learners multiplexed next to a foreground job on one device (DeepPool section 5).

Implementation notes
--------------------
Paper: DeepPool, section 5 and Fig. 11 / section 7.2.
A low-priority *background* training job uses the spare capacity of a device while the
*foreground* job keeps nearly its isolated quality of service. The mechanisms, each a knob of
:class:`MultiplexPolicy` so a benchmark can add them one at a time (Fig. 11):

1. Stream priorities (``stream_priority``): on CUDA the background issues on a stream of the
   LEAST priority and the foreground on streams of the GREATEST priority
   (:func:`jabasray.engine.streams.stream_priorities`; CUDA: lower number = higher priority,
   ``priority_range()`` is ``(least, greatest)``, e.g. ``(0, -5)``, and the default 0 is the
   least, so it is the foreground that must be raised). An IIDP / SMA worker's streams
   (:class:`~jabasray.engine.streams.Lanes`) are foreground streams already; a foreground loop
   of its own issues on :attr:`BackgroundRunner.foreground_stream`.
2. Launch pacing (``max_outstanding``): at most this many background launches (one training
   step, or one graph launch) may be queued on the device per job; the runner records a CUDA
   event after each launch and blocks the background thread on the oldest one before issuing
   more (:class:`LaunchPacer`). This keeps the shared driver/device queues short, so the
   foreground's launches are not stuck behind background work (head-of-line blocking).
3. CUDA graphs (``cuda_graphs``): a job's whole training step (forward, backward, optimizer)
   is captured once (``torch.cuda.graph``) and replayed with one launch. Only when the
   optimizer can be captured (:func:`graph_capture_blocker`: every param group
   ``capturable=True`` for optimizers with that option - Adam, AdamW, ...; plain SGD, whose
   step has no step-count tensor; nothing else), otherwise the job runs eagerly and says why
   once. Warm-up changes nothing: the whole-network recipe's side-stream warm-up steps ARE the
   job's own first ``GRAPH_WARMUP_STEPS`` steps, run eagerly on their own batches on the
   (non-default) background stream - they create the optimizer state the graph then updates in
   place - and capture itself executes nothing; the captured step first runs (replay) on the
   batch it was captured for. So a graphed job does exactly the eager job's steps. A capture
   failure or a batch of another shape falls back to eager execution with a log line. With
   ``graph_pieces > 1`` the step is captured as several graphs sharing one memory pool (the
   forward, the backward cut at parameter-gradient boundaries, the optimizer) and each piece
   is launched only when the previous one has finished and the pause gate is open, so a
   foreground op that pauses the background waits on the device for at most one piece. The LR
   is a constant of the graph (background jobs have no scheduler). A foreground must wait on
   its own stream (``torch.cuda.current_stream().synchronize()``), not the whole device:
   ``torch.cuda.synchronize()`` waits for the background's work too, and CUDA refuses it
   while the background captures its graph.
4. Slowdown feedback (``slowdown_target``, ``pause_ops``, ``op_slowdown_threshold``):
   (a) operations known or observed to suffer from collocation (all-reduce first of all) pause
   the background while the foreground runs them (``with runner.foreground_critical(op)`` or
   ``with runner.foreground_op(op)``, which learns sensitivity from measured op times);
   (b) foreground step times (``with runner.foreground_step()``) feed a
   :class:`SlowdownController` which throttles the background (a delay before each launch,
   multiplicative increase / decrease) whenever the measured slowdown exceeds the target.
   The isolated step time is re-measured every ``probe_interval`` foreground steps by holding
   the background for one step.
5. Small background batches (``max_background_batch``): the background batch is capped, so its
   kernels are short and the non-preemptive device scheduler hands the device back quickly.

On CPU there are no streams or events: the background runs on a thread, a launch completes
when the step returns (so pacing is trivially satisfied), and the pause gates, throttle delay
and feedback loop are the same code, which is what the tests exercise.

Every background job checkpoints its own state (model, optimizer, step, epoch, cursor) to its
``checkpoint_path`` (atomic write), so it can resume elsewhere. An exception inside a job is
caught and logged; the job is marked ``failed`` with the error text; the foreground never sees it.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..validation import check_float, check_int, check_steps_or_epochs
from .streams import new_stream

log = logging.getLogger(__name__)

JOB_STATES = ("queued", "running", "paused", "done", "failed", "cancelled")


# --------------------------------------------------------------------------------------------
# Policy and its pure parts (controller, pacer).
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MultiplexPolicy:
    """Which DeepPool mechanisms are on, and their parameters."""

    stream_priority: bool = True          # CUDA: background on the lowest-priority stream
    max_outstanding: int | None = 2       # launch pacing: queued launches per job (None = off)
    cuda_graphs: bool = True              # CUDA: capture a job's step as a graph
    slowdown_target: float | None = 0.18  # max foreground slowdown before throttling (None = off)
    pause_ops: tuple[str, ...] = ("allreduce",)   # foreground ops that always pause background
    op_slowdown_threshold: float | None = 1.5     # learn: op colocated/isolated > this -> pause
    probe_interval: int = 20              # foreground steps between two isolated re-measurements
    max_background_batch: int | None = 32 # cap of the background batch (None = job's own)
    drain_on_pause: bool = True           # pausing waits for in-flight background work
    graph_pieces: int = 1                 # CUDA graphs: a captured step cut into about this many
                                          # pieces (forward, parts of backward, optimizer), each
                                          # launched when the previous one finished (1: whole)

    def __post_init__(self) -> None:
        if self.max_outstanding is not None:
            check_int("max_outstanding", self.max_outstanding, min_value=1)
        if self.slowdown_target is not None:
            check_float("slowdown_target", self.slowdown_target, min_value=0)
        if self.op_slowdown_threshold is not None:
            check_float("op_slowdown_threshold", self.op_slowdown_threshold, min_value=1)
        check_int("probe_interval", self.probe_interval, min_value=1)
        check_int("graph_pieces", self.graph_pieces, min_value=1)
        if self.max_background_batch is not None:
            check_int("max_background_batch", self.max_background_batch, min_value=1)

    @classmethod
    def naive(cls) -> "MultiplexPolicy":
        """Plain collocation: no priority, pacing, graphs, feedback or batch cap."""
        return cls(stream_priority=False, max_outstanding=None, cuda_graphs=False,
                   slowdown_target=None, pause_ops=(), op_slowdown_threshold=None,
                   max_background_batch=None, drain_on_pause=False)


@dataclass
class SlowdownController:
    """Throttle of the background from foreground step times (DeepPool's feedback loop).

    ``slowdown = colocated / isolated - 1`` with exponential moving averages (weight ``ema``
    for the newest sample). Above ``target`` the delay before each background launch grows
    ``delay <- clamp(max(delay, min_delay) * increase)``; at or below it shrinks
    ``delay <- delay * decrease`` (and snaps to 0 under ``min_delay``).
    """

    target: float = 0.18
    increase: float = 2.0
    decrease: float = 0.7
    min_delay: float = 1e-3
    max_delay: float = 0.5
    ema: float = 0.3
    isolated: float | None = None
    colocated: float | None = None
    delay: float = 0.0

    def observe(self, seconds: float, colocated: bool) -> float:
        """Feed one foreground step time; returns the new background delay (seconds)."""
        if colocated:
            self.colocated = _ema(self.colocated, seconds, self.ema)
        else:
            self.isolated = _ema(self.isolated, seconds, self.ema)
            return self.delay
        s = self.slowdown
        if s is None:
            return self.delay
        if s > self.target:
            self.delay = min(self.max_delay, max(self.delay, self.min_delay) * self.increase)
        else:
            self.delay *= self.decrease
            if self.delay < self.min_delay:
                self.delay = 0.0
        return self.delay

    @property
    def slowdown(self) -> float | None:
        if not self.isolated or self.colocated is None:
            return None
        return self.colocated / self.isolated - 1.0


def _ema(old: float | None, new: float, w: float) -> float:
    return new if old is None else (1 - w) * old + w * new


class LaunchPacer:
    """Bound on outstanding (issued, not finished) launches of one job.

    ``acquire()`` blocks until fewer than ``limit`` launches are outstanding, waiting on the
    oldest completion handle (a CUDA event: ``query()``/``synchronize()``). ``launched(h)``
    registers a launch; ``h=None`` means it already completed (CPU).
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.outstanding: collections.deque = collections.deque()
        self.max_seen = 0
        self.waits = 0

    def _reap(self) -> None:
        while self.outstanding and self.outstanding[0].query():
            self.outstanding.popleft()

    def acquire(self) -> None:
        self._reap()
        if self.limit is None:
            return
        while len(self.outstanding) >= self.limit:
            self.waits += 1
            self.outstanding.popleft().synchronize()
            self._reap()

    def launched(self, handle: Any) -> None:
        if handle is not None:
            self.outstanding.append(handle)
        self.max_seen = max(self.max_seen, len(self.outstanding) + (handle is None))

    def drain(self) -> None:
        """Wait for every outstanding launch (called by the launching thread only)."""
        while self.outstanding:
            self.outstanding.popleft().synchronize()


GRAPH_WARMUP_STEPS = 3    # eager steps (on the background stream) before a capture


def graph_capture_blocker(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer.step()`` cannot be captured in a CUDA graph, or ``None`` if it can.

    torch 2.13's rule: an optimizer with a ``capturable`` option (Adam, AdamW, Adamax, NAdam,
    RAdam, RMSprop, Rprop, ASGD, Adadelta) raises inside a capture unless every param group has
    ``capturable=True`` (its step counters then live on the device); plain ``SGD`` keeps no
    step counter (its momentum buffers are made by the eager warm-up steps and updated in
    place); any other optimizer (Adagrad's CPU step tensor, LBFGS's closure, ...) is not
    known to be capturable.
    """
    name = type(optimizer).__name__
    if "capturable" in optimizer.defaults:
        off = [i for i, g in enumerate(optimizer.param_groups) if not g.get("capturable", False)]
        if off:
            return (f"{name} param group(s) {off} have capturable=False "
                    f"(construct it with capturable=True to allow graph capture)")
        return None
    if type(optimizer) is torch.optim.SGD:
        return None
    return f"{name} is not known to be CUDA-graph capturable (only SGD or capturable=True optimizers)"


# --------------------------------------------------------------------------------------------
# Jobs.
# --------------------------------------------------------------------------------------------

@dataclass
class BackgroundTask:
    """A background training job on one device (engine level: live objects)."""

    name: str
    model: nn.Module
    dataset: Any                               # indexable (TensorDataset or dataset[i] -> tuple)
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int
    steps: int | None = None                   # stop after this many steps ...
    epochs: int | None = None                  # ... or this many epochs (one of the two)
    checkpoint_path: str | None = None         # own checkpoint (resumed from when it exists)
    checkpoint_every: int = 50                 # steps between two checkpoints
    seed: int = 0                              # data order

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        check_int("batch_size", self.batch_size, min_value=1)
        check_steps_or_epochs(self.steps, self.epochs)
        check_int("checkpoint_every", self.checkpoint_every, min_value=1)
        if len(self.dataset) < 1:
            raise ValueError("dataset must hold at least one sample, got an empty dataset")


@dataclass
class BackgroundStatus:
    """Progress of one background job (plain data, safe to send over Ray)."""

    name: str
    state: str                      # one of JOB_STATES
    step: int = 0                   # optimizer steps done
    total_steps: int = 0            # steps to do in all
    epoch: int = 0
    samples: int = 0                # samples trained on (this placement and earlier ones)
    last_loss: float | None = None
    error: str | None = None        # "<ExceptionType>: message" when failed
    busy_seconds: float = 0.0       # time spent in its steps on this runner
    graphed: bool = False           # replaying a CUDA graph
    checkpoint_path: str | None = None

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "cancelled")

    @property
    def progress(self) -> float:
        return self.step / self.total_steps if self.total_steps else 0.0


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of a background job in ``epoch``: a seeded permutation of ``range(n)``;
    batches are consecutive slices of it (the last one may be short)."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    return torch.randperm(n, generator=g)


class _Job:
    """Runtime state of one task: data cursor, pacer, graph, status."""

    def __init__(self, task: BackgroundTask, device: torch.device, batch_size: int,
                 max_outstanding: int | None) -> None:
        self.task = task
        self.device = device
        self.batch_size = batch_size
        self.n = len(task.dataset)
        self.steps_per_epoch = -(-self.n // batch_size)
        total = task.steps if task.steps is not None else task.epochs * self.steps_per_epoch
        self.status = BackgroundStatus(name=task.name, state="queued", total_steps=total,
                                       checkpoint_path=task.checkpoint_path)
        self.cursor = 0
        self.perm: torch.Tensor | None = None
        self.paused = False
        self.cancel = False
        self.pacer = LaunchPacer(max_outstanding)
        self.graph: Any = None
        self.graph_failed = False             # no graph for this job (not capturable / failed)
        self.eager_steps = 0                  # eager steps on this runner (graph warm-up)
        self.loss_t: torch.Tensor | None = None
        self.last_event: Any = None           # CUDA: event after its newest launch
        self.lock = threading.Lock()
        task.model.to(device)
        if task.checkpoint_path and Path(task.checkpoint_path).exists():
            self.load(task.checkpoint_path)

    @property
    def runnable(self) -> bool:
        """Not finished, not paused, not cancelled: the runner may issue its next step."""
        return not self.status.finished and not self.paused and not self.cancel

    # ---- data
    def _order(self) -> torch.Tensor:
        if self.perm is None:
            self.perm = epoch_order(self.n, self.task.seed, self.status.epoch)
        return self.perm

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self._order()[self.cursor:self.cursor + self.batch_size]
        ds = self.task.dataset
        tensors = getattr(ds, "tensors", None)
        if tensors is not None:
            x, y = tensors[0][idx], tensors[1][idx]
        else:
            items = [ds[int(i)] for i in idx]
            x = torch.stack([torch.as_tensor(it[0]) for it in items])
            y = torch.stack([torch.as_tensor(it[1]) for it in items])
        self.cursor += len(idx)
        if self.cursor >= self.n:
            self.cursor, self.perm = 0, None
            self.status.epoch += 1
        return x, y

    # ---- checkpoint
    def save(self, path: str | None = None) -> str:
        path = path or self.task.checkpoint_path
        if not path:
            raise ValueError(f"checkpoint_path must be set to checkpoint job {self.task.name!r}, got None")
        state = {"model": self.task.model.state_dict(), "optimizer": self.task.optimizer.state_dict(),
                 "step": self.status.step, "epoch": self.status.epoch, "cursor": self.cursor,
                 "samples": self.status.samples, "last_loss": self.status.last_loss,
                 "perm": self.perm}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
        return str(path)

    def load(self, path: str) -> None:
        import pickle

        try:   # tensors and plain values only: a crafted file's code never runs
            state = torch.load(path, map_location=self.device, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
            raise ValueError(f"checkpoint_path {path} of background job {self.task.name!r} is not a "
                             f"plain tensor file; refusing to load it ({type(e).__name__})") from None
        self.task.model.load_state_dict(state["model"])
        self.task.optimizer.load_state_dict(state["optimizer"])
        self.status.step = int(state["step"])
        self.status.epoch = int(state["epoch"])
        self.status.samples = int(state.get("samples", 0))
        self.status.last_loss = state.get("last_loss")
        self.cursor = int(state["cursor"])
        self.perm = state.get("perm")
        log.info("background job %s resumed from %s at step %d", self.task.name, path, self.status.step)


# --------------------------------------------------------------------------------------------
# The runner.
# --------------------------------------------------------------------------------------------

class BackgroundRunner:
    """Trains background jobs at low priority next to a foreground workload on one device.

    Foreground side::

        with runner.foreground_step():                 # measured; feeds the controller
            loss = fwd_bwd(...)
            with runner.foreground_critical("allreduce"):  # background paused meanwhile
                all_reduce(...)
            with runner.foreground_op("optimizer"):    # paused only if observed to suffer
                opt.step()

    Background side: ``submit(task)``, ``status(name)``, ``pause/resume``, ``cancel``,
    ``checkpoint``, ``wait``. One daemon thread runs the jobs round-robin, one launch at a time.
    """

    def __init__(self, device: str | torch.device = "cpu",
                 policy: MultiplexPolicy | None = None,
                 controller: SlowdownController | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # the background thread binds itself to the device: it needs the index ("cuda" is
            # the caller's current device)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.policy = policy or MultiplexPolicy()
        self.controller = controller or SlowdownController(
            target=self.policy.slowdown_target if self.policy.slowdown_target is not None else 0.0)
        self.is_cuda = self.device.type == "cuda"
        self._jobs: dict[str, _Job] = {}
        self._order: list[str] = []
        self._rr = 0
        self._cv = threading.Condition()
        self._paused = 0              # pause() calls + active critical sections + probe holds
        self._busy = False            # a background launch is executing (CPU) right now
        self._waiters = 0             # callers waiting for a step boundary (the loop yields)
        self._current: _Job | None = None   # the job of that launch
        self._stop = False
        self._probe_countdown = self.policy.probe_interval
        self._op_stats: dict[str, list[float | None]] = {}   # op -> [isolated, colocated]
        self.sensitive_ops: set[str] = set(self.policy.pause_ops)
        self._fg_busy = 0.0
        self._t_start = time.perf_counter()
        self.bg_stream: Any = None
        # the stream a foreground loop that is not an IIDP/SMA worker (whose Lanes are
        # foreground streams already) should issue on: greatest priority with stream_priority,
        # else the current (default-priority) stream
        self.foreground_stream: Any = None
        if self.is_cuda:
            if self.policy.stream_priority:
                self.bg_stream = new_stream(self.device, "background")
                self.foreground_stream = new_stream(self.device, "foreground")
            else:
                self.bg_stream = new_stream(self.device, "default")
                self.foreground_stream = torch.cuda.current_stream(self.device)
        self._thread = threading.Thread(target=self._loop, name="jabas-background", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- job management
    def submit(self, task: BackgroundTask) -> str:
        """Start ``task`` (resuming from its checkpoint if present); returns its name."""
        if not isinstance(task, BackgroundTask):
            raise ValueError(f"task must be a BackgroundTask, got {type(task).__name__}")
        with self._cv:
            if task.name in self._jobs and not self._jobs[task.name].status.finished:
                raise ValueError(f"name must be unique among running jobs, got {task.name!r}")
        bs = task.batch_size
        cap = self.policy.max_background_batch
        if cap is not None and bs > cap:
            log.info("background job %s: batch %d capped to %d (small background batches)",
                     task.name, bs, cap)
            bs = cap
        job = _Job(task, self.device, bs, self.policy.max_outstanding)
        if self.is_cuda and self.policy.cuda_graphs:
            blocker = graph_capture_blocker(task.optimizer)
            if blocker is not None:          # said once per job; it runs eagerly
                log.info("background job %s: no CUDA graph, running eagerly: %s", task.name, blocker)
                job.graph_failed = True
        if job.status.step >= job.status.total_steps:
            job.status.state = "done"
        with self._cv:
            self._jobs[task.name] = job
            if task.name not in self._order:
                self._order.append(task.name)
            self._cv.notify_all()
        return task.name

    def _job(self, name: str) -> _Job:
        with self._cv:
            if name not in self._jobs:
                raise ValueError(f"job must be one of {sorted(self._jobs)}, got {name!r}")
            return self._jobs[name]

    def status(self, name: str) -> BackgroundStatus:
        job = self._job(name)
        with job.lock:
            if job.loss_t is not None:
                if job.last_event is not None:
                    job.last_event.synchronize()      # the loss of its newest finished step
                job.status.last_loss = float(job.loss_t)
            return replace(job.status)

    def statuses(self) -> dict[str, BackgroundStatus]:
        with self._cv:
            names = list(self._jobs)
        return {n: self.status(n) for n in names}

    def pause(self, name: str | None = None) -> None:
        """Pause one job, or (``name=None``) the whole background until ``resume()``."""
        if name is None:
            self._hold(+1)
            return
        job = self._job(name)
        with self._cv:
            job.paused = True
            if job.status.state == "running":
                job.status.state = "paused"
            while self._busy and self._current is job:     # let its running step finish
                self._cv.wait()

    def resume(self, name: str | None = None) -> None:
        if name is None:
            self._hold(-1)
            return
        job = self._job(name)
        with self._cv:
            job.paused = False
            if job.status.state == "paused":
                job.status.state = "running"
            self._cv.notify_all()

    def cancel(self, name: str) -> BackgroundStatus:
        job = self._job(name)
        with self._cv:
            job.cancel = True
            if not job.status.finished:
                job.status.state = "cancelled"
            self._cv.notify_all()
        return self.status(name)

    def checkpoint(self, name: str, path: str | None = None) -> str:
        """Write the job's state (model, optimizer, step, data cursor) now; returns the path."""
        job = self._job(name)
        with self._cv:                      # never in the middle of one of its steps
            # the loop starts no step while a caller waits: without this the loop's thread takes
            # the lock back for its next step before the woken caller does, and a checkpoint of
            # a running job can wait for the whole job
            self._waiters += 1
            try:
                while self._busy:
                    self._cv.wait()
                job.pacer.drain()
                with job.lock:
                    return job.save(path)
            finally:
                self._waiters -= 1
                self._cv.notify_all()

    def wait(self, name: str, timeout: float | None = None) -> BackgroundStatus:
        """Block until the job finished (done/failed/cancelled) or ``timeout`` passed."""
        end = None if timeout is None else time.monotonic() + timeout
        job = self._job(name)
        with self._cv:
            while not job.status.finished:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(timeout=0.05 if left is None else min(left, 0.05))
        return self.status(name)

    def close(self) -> None:
        """Stop the background thread (jobs keep their last checkpoints)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def __enter__(self) -> "BackgroundRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- foreground side
    def _hold(self, delta: int) -> None:
        """Pause (``delta=+1``) or release (``-1``) the background for a foreground op.

        Pausing closes the gate before the background's next launch. With ``drain_on_pause``
        the foreground's work also starts after the background's in-flight work, without the
        foreground's thread ever waiting for the background (DeepPool section 5: no foreground
        stall): on CUDA its CURRENT stream (the stream the foreground op is issued on, e.g. the
        IIDP worker's communication lane) waits on the device for each job's newest launch
        event (older launches of a job precede it on the background stream); a launch the
        background thread is issuing at this moment is not waited for (it runs at low
        priority). On CPU a launch is the step running on the background thread, so the
        caller waits for that thread to finish it (the same happens-before, with threads)."""
        with self._cv:
            self._paused = max(0, self._paused + delta)
            if delta > 0 and self.policy.drain_on_pause and not self.is_cuda:
                while self._busy:                   # CPU: let the running step finish
                    self._cv.wait()
            self._cv.notify_all()
        if delta > 0 and self.policy.drain_on_pause and self.is_cuda:
            foreground = torch.cuda.current_stream(self.device)
            for job in list(self._jobs.values()):   # CUDA: in-flight launches finish first
                ev = job.last_event                 # newest launch; older ones precede it
                if ev is not None:
                    foreground.wait_event(ev)       # on the device, not on this thread

    @contextlib.contextmanager
    def foreground_critical(self, op: str = "allreduce") -> Iterator[None]:
        """Pause the background while the foreground runs ``op`` (e.g. an all-reduce)."""
        self._hold(+1)
        try:
            yield
        finally:
            self._hold(-1)

    @contextlib.contextmanager
    def foreground_op(self, op: str) -> Iterator[None]:
        """Run a foreground op; pause the background during it if it is (observed to be)
        sensitive. Its duration, isolated or colocated, teaches the sensitivity."""
        sensitive = op in self.sensitive_ops
        colocated = not sensitive and self._background_active()
        if sensitive:
            self._hold(+1)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if sensitive:
                self._hold(-1)
            else:
                self._learn_op(op, dt, colocated)

    def _learn_op(self, op: str, seconds: float, colocated: bool) -> None:
        st = self._op_stats.setdefault(op, [None, None])
        i = 1 if colocated else 0
        st[i] = _ema(st[i], seconds, self.controller.ema)
        thr = self.policy.op_slowdown_threshold
        if thr is not None and st[0] and st[1] is not None and st[1] / st[0] > thr:
            if op not in self.sensitive_ops:
                log.info("foreground op %s slows down %.2fx when colocated: pausing background "
                         "during it from now on", op, st[1] / st[0])
                self.sensitive_ops.add(op)

    @contextlib.contextmanager
    def foreground_step(self) -> Iterator[None]:
        """Measure one foreground step and feed the slowdown controller. Every
        ``probe_interval`` steps the background is held for one step to re-measure the
        isolated step time."""
        probe = False
        self._probe_countdown -= 1
        if self._probe_countdown <= 0 or self.controller.isolated is None:
            probe = self._any_runnable()
            self._probe_countdown = self.policy.probe_interval
        if probe:
            self._hold(+1)
        colocated = not probe and self._background_active()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if probe:
                self._hold(-1)
            self.report_foreground_step(dt, colocated=colocated)

    def report_foreground_step(self, seconds: float, colocated: bool | None = None) -> float:
        """Feed an externally measured foreground step time; returns the background delay."""
        self._fg_busy += seconds
        if colocated is None:
            colocated = self._background_active()
        if self.policy.slowdown_target is None:
            return 0.0
        return self.controller.observe(seconds, colocated)

    def foreground_utilization(self) -> float:
        """Fraction of wall time since the runner started spent in reported foreground steps."""
        wall = time.perf_counter() - self._t_start
        return min(1.0, self._fg_busy / wall) if wall > 0 else 0.0

    def spare_capacity(self) -> float:
        """A score in [0, 1]: idle share of the foreground, split among running jobs."""
        active = sum(1 for j in self._jobs.values() if not j.status.finished)
        return max(0.0, 1.0 - self.foreground_utilization()) / (1 + active)

    # ---------------------------------------------------------------- background thread
    def _any_runnable(self) -> bool:
        return any(j.runnable for j in self._jobs.values())

    def _background_active(self) -> bool:
        return self._paused == 0 and self._any_runnable()

    def _next_job(self) -> _Job | None:
        n = len(self._order)
        for k in range(n):
            name = self._order[(self._rr + k) % n]
            job = self._jobs.get(name)
            if job is not None and job.runnable:
                self._rr = (self._rr + k + 1) % n
                return job
        return None

    def _loop(self) -> None:
        if self.is_cuda:
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                while not self._stop and (self._paused > 0 or self._waiters > 0
                                          or not self._any_runnable()):
                    self._cv.wait(timeout=0.1)
                if self._stop:
                    return
                job = self._next_job()
                if job is None:
                    continue
                delay = self.controller.delay if self.policy.slowdown_target is not None else 0.0
            if delay > 0:
                time.sleep(delay)
            with self._cv:                        # re-check the gates (after the throttle delay)
                if self._stop or self._paused > 0 or self._waiters > 0 or job.paused or job.cancel:
                    continue
                self._busy, self._current = True, job
            try:
                self._run_one(job)
            finally:
                with self._cv:
                    self._busy, self._current = False, None
                    self._cv.notify_all()

    def _run_one(self, job: _Job) -> None:
        """One training step of ``job``; errors are contained here (never reach the foreground)."""
        t0 = time.perf_counter()
        try:
            with job.lock:
                if job.status.state in ("queued", "paused"):
                    job.status.state = "running"
                job.pacer.acquire()
                x, y = job.next_batch()
                handle = self._step(job, x, y)
                job.pacer.launched(handle)
                job.last_event = handle
                job.status.step += 1
                job.status.samples += len(y)
                if job.cancel:                 # cancelled meanwhile: keep that state
                    return
                if job.status.step >= job.status.total_steps:
                    job.pacer.drain()
                    if job.loss_t is not None:
                        job.status.last_loss = float(job.loss_t)
                    if job.task.checkpoint_path:
                        job.save()
                    job.status.state = "done"
                elif job.task.checkpoint_path and job.status.step % job.task.checkpoint_every == 0:
                    job.pacer.drain()
                    job.save()
        except Exception as e:  # noqa: BLE001 - a background job must never fail the foreground
            log.exception("background job %s failed at step %d", job.task.name, job.status.step)
            job.status.state = "failed"
            job.status.error = f"{type(e).__name__}: {e}"
        finally:
            job.status.busy_seconds += time.perf_counter() - t0

    def _between_pieces(self, job: _Job) -> None:
        """Background thread, between two pieces of a job's captured step (module notes, item
        3): the previous piece's event becomes the job's newest launch (what a pause makes the
        foreground's stream wait for), the thread waits for it (one piece outstanding), then
        for the pause gate to open: a foreground op waits for at most one piece."""
        ev = torch.cuda.Event()
        ev.record(self.bg_stream)
        job.last_event = ev
        ev.synchronize()
        with self._cv:
            while self._paused > 0 and not self._stop:
                self._cv.wait(timeout=0.1)

    def _step(self, job: _Job, x: torch.Tensor, y: torch.Tensor) -> Any:
        """Issue one training step; returns a completion handle (CUDA event) or None (CPU)."""
        task = job.task
        if not self.is_cuda:
            job.loss_t = _eager_step(task, x, y)
            return None
        with torch.cuda.stream(self.bg_stream):
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            full = len(y) == job.batch_size
            if (self.policy.cuda_graphs and not job.graph_failed and full and job.graph is None
                    and job.eager_steps >= GRAPH_WARMUP_STEPS):
                job.graph = _GraphedStep.capture(task, x, y, self.bg_stream, self.policy.graph_pieces)
                job.graph_failed = job.graph is None
                job.status.graphed = job.graph is not None
            if job.graph is not None and full:
                job.loss_t = job.graph.replay(x, y, lambda: self._between_pieces(job))
            else:
                job.loss_t = _eager_step(task, x, y)
                job.eager_steps += 1
            ev = torch.cuda.Event()
            ev.record(self.bg_stream)
            return ev


def _eager_step(task: BackgroundTask, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One eager training step of ``task`` (zero_grad, forward, backward, step); its loss."""
    task.optimizer.zero_grad(set_to_none=True)
    loss = task.loss_fn(task.model(x), y)
    loss.backward()
    task.optimizer.step()
    return loss.detach()


class _GraphedStep:
    """A whole training step captured as one CUDA graph (static input/target tensors).

    Follows the whole-network capture recipe, except that the warm-up steps are the job's
    own eager steps (module notes, item 3): capture of ``forward -> loss -> backward ->
    optimizer.step`` (gradients set to None first, so backward allocates them in the graph's
    pool) on the background stream. Capture records kernels and executes none, so it changes
    no weight and no optimizer state.
    """

    def __init__(self, graphs: list[Any], static_x: torch.Tensor, static_y: torch.Tensor,
                 static_loss: torch.Tensor) -> None:
        self.graphs, self.x, self.y, self.loss = graphs, static_x, static_y, static_loss

    @classmethod
    def capture(cls, task: BackgroundTask, x: torch.Tensor, y: torch.Tensor,
                stream: Any, pieces: int = 1) -> "_GraphedStep | None":
        try:
            static_x, static_y = x.clone(), y.clone()
            task.optimizer.zero_grad(set_to_none=True)
            if pieces == 1:
                graph = torch.cuda.CUDAGraph()
                # thread_local: the foreground thread keeps issuing work while we capture.
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    static_loss = task.loss_fn(task.model(static_x), static_y)
                    static_loss.backward()
                    task.optimizer.step()
                graphs = [graph]
            else:
                graphs, static_loss = _capture_pieces(task, static_x, static_y, stream, pieces)
            log.info("background job %s: training step captured as %d CUDA graph(s)", task.name, len(graphs))
            return cls(graphs, static_x, static_y, static_loss)
        except Exception as e:  # noqa: BLE001 - fall back to eager execution
            log.info("background job %s: CUDA graph capture failed (%s: %s); running eagerly",
                     task.name, type(e).__name__, e)
            return None

    def replay(self, x: torch.Tensor, y: torch.Tensor,
               between: Callable[[], None] | None = None) -> torch.Tensor:
        """Refill the static inputs, replay the pieces in capture order, ``between()`` before
        every piece but the first (the runner's pacing and pause gate)."""
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        for i, graph in enumerate(self.graphs):
            if i and between is not None:
                between()
            graph.replay()
        return self.loss.detach()


def _capture_pieces(task: BackgroundTask, static_x: torch.Tensor, static_y: torch.Tensor, stream: Any,
                    pieces: int) -> tuple[list[Any], torch.Tensor]:
    """The job's step captured as about ``pieces`` graphs sharing one memory pool (replayed
    in capture order): the forward and loss, the backward cut every ``ceil(P / (pieces - 2))``
    parameter gradients (a post-accumulate-grad hook ends one capture and begins the next;
    backward runs on this thread, ``set_multithreading_enabled(False)``, so every capture
    begins and ends on the thread that captures), the optimizer step. Executes nothing."""
    params = [p for p in task.model.parameters() if p.requires_grad]
    every = max(1, math.ceil(len(params) / max(1, pieces - 2)))
    pool = torch.cuda.graph_pool_handle()
    graphs: list[Any] = []
    current: list[Any] = []
    seen = [0]

    def begin() -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        current.append(graph)

    def end() -> None:
        graph = current.pop()
        graph.capture_end()
        graphs.append(graph)

    def cut(_param: torch.Tensor) -> None:
        seen[0] += 1
        if seen[0] % every == 0 and seen[0] < len(params):
            end()
            begin()

    handles = [p.register_post_accumulate_grad_hook(cut) for p in params]
    torch.cuda.synchronize()
    try:
        with torch.cuda.stream(stream), torch.autograd.set_multithreading_enabled(False):
            begin()
            static_loss = task.loss_fn(task.model(static_x), static_y)
            end()
            begin()
            static_loss.backward()
            end()
            begin()
            task.optimizer.step()
            end()
    except BaseException:
        for graph in current:              # a capture left open by the failure
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001 - the capture already failed
                pass
        raise
    finally:
        for h in handles:
            h.remove()
    return graphs, static_loss
