"""Execution abstraction for virtual stream workers: CUDA streams/events on CUDA, threads on CPU.

IIDP (JABAS section 4, Fig. 5) runs one *VSW dispatcher* thread per virtual stream worker
inside one GPU process; each dispatcher launches its kernels on its own CUDA stream, and
gradient communication plus weight update run on further streams. This module hides the
device-specific parts:

* :class:`Lanes` owns the streams of one device: one per VSW, one for local aggregation and
  all-reduce (``comm``), one for the weight update (``update``). On CPU every stream is
  ``None``, every event is ``None`` and ``context(None)`` is a no-op: CPU kernels run
  synchronously on the thread that issues them, so ordering is given by the threads and the
  locks of the caller - the same happens-before relations that the events express on CUDA.
* Stream priorities (DeepPool section 5): every lane is a *foreground* stream, created at the
  device's HIGHEST priority, so that a background job's kernels (issued on a *background*,
  lowest-priority stream by :class:`~jabasray.engine.multiplex.BackgroundRunner`) yield to
  them in the device's block scheduler. CUDA's rule: a LOWER number is a HIGHER priority;
  ``torch.cuda.Stream.priority_range()`` returns ``(least, greatest)``, e.g. ``(0, -5)``, and
  the default priority 0 is already the least one - so a background stream cannot go below
  the default, the foreground must be raised above it (:func:`stream_priorities`).
* :class:`VSWThreadPool` is a persistent pool of dispatcher threads (no thread is created per
  step). ``run(fns)`` runs ``fns[0]`` (the main VSW) inline on the calling thread and the rest
  on the pool, so ``num_vsw=1`` costs no thread hand-off at all.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from ..validation import check_choice


STREAM_ROLES = ("foreground", "background", "default")


def stream_priorities(priority_range: tuple[int, int]) -> tuple[int, int]:
    """``(foreground, background)`` priorities from ``torch.cuda.Stream.priority_range()``.

    CUDA: lower number = higher priority; the range is ``(least, greatest)``, e.g. ``(0, -5)``
    -> foreground ``-5`` (greatest), background ``0`` (least). Either order of the pair is
    accepted; a device without priorities reports ``(0, 0)`` and both are 0.
    """
    try:
        a, b = (int(v) for v in priority_range)
    except (TypeError, ValueError):
        raise ValueError(f"priority_range must be a pair of ints (least, greatest), "
                         f"got {priority_range!r}") from None
    return min(a, b), max(a, b)


def stream_priority(role: str) -> int:
    """The CUDA priority of a stream of ``role`` on this machine (``"default"``: 0)."""
    check_choice("role", role, STREAM_ROLES)
    if role == "default":
        return 0
    fg, bg = stream_priorities(torch.cuda.Stream.priority_range())
    return fg if role == "foreground" else bg


def new_stream(device: torch.device | str, role: str = "foreground") -> Any:
    """A new CUDA stream on ``device`` with the priority of ``role`` (see the module notes)."""
    return torch.cuda.Stream(device=device, priority=stream_priority(role))


class Lanes:
    """Streams and events of one device (CUDA, all foreground priority), or their no-op CPU
    twins."""

    def __init__(self, device: torch.device, role: str = "foreground") -> None:
        check_choice("role", role, STREAM_ROLES)
        self.device = device
        self.role = role
        self.is_cuda = device.type == "cuda"
        self.vsw: list[Any] = []
        self.comm = self._new_stream()
        self.update = self._new_stream()

    def _new_stream(self) -> Any:
        if not self.is_cuda:
            return None
        return new_stream(self.device, self.role)

    def resize(self, num_vsw: int) -> None:
        """Keep one stream per VSW (streams are reused across reconfigurations)."""
        while len(self.vsw) < num_vsw:
            self.vsw.append(self._new_stream())
        del self.vsw[num_vsw:]

    def context(self, stream: Any) -> contextlib.AbstractContextManager:
        """``with lanes.context(s):`` issues work on ``s`` (CUDA) or runs inline (CPU)."""
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)

    def device_context(self) -> contextlib.AbstractContextManager:
        """``with lanes.device_context():`` makes this device current on the calling thread
        (CUDA: a fresh thread starts on device 0); no-op on CPU."""
        if not self.is_cuda:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def record(self, stream: Any = None) -> Any:
        """Record an event on ``stream`` (default: the current stream); ``None`` on CPU."""
        if not self.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else self.current())
        return ev

    @staticmethod
    def wait(stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (no-op on CPU)."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


class DispatcherThread:
    """One persistent thread with its own job queue (a VSW dispatcher, or IIDP's
    communication thread); ``submit(fn)`` returns a Future, jobs run in submission order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.cpu_s = 0.0        # this thread's CPU seconds in its jobs so far (time.thread_time)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            t0 = time.thread_time()
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self.cpu_s += time.thread_time() - t0
                fut.set_exception(e)
            else:
                self.cpu_s += time.thread_time() - t0
                fut.set_result(result)

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class VSWThreadPool:
    """Persistent dispatcher threads for VSWs 1..n-1 (one dedicated thread per VSW, so VSW
    ``v`` always runs on the same thread, concurrently with the others); VSW 0 runs on the
    caller's thread."""

    def __init__(self, num_workers: int = 0) -> None:
        self._threads: list[DispatcherThread] = []
        self._stopped_cpu_s = 0.0
        self.resize(num_workers)

    @property
    def size(self) -> int:
        return len(self._threads)

    @property
    def cpu_s(self) -> float:
        """CPU seconds the pool's threads spent in their jobs so far (threads stopped by a
        ``resize`` keep theirs in the total)."""
        return self._stopped_cpu_s + sum(t.cpu_s for t in self._threads)

    def resize(self, num_workers: int) -> None:
        """Hold exactly ``num_workers`` threads (existing threads are kept)."""
        while len(self._threads) < num_workers:
            self._threads.append(DispatcherThread(f"vsw-{len(self._threads) + 1}"))
        while len(self._threads) > num_workers:
            t = self._threads.pop()
            t.stop()
            self._stopped_cpu_s += t.cpu_s

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``fns[0]`` inline and ``fns[i]`` on thread ``i-1``; return all results.

        All functions are always waited for; the first exception (in VSW order) is re-raised.
        """
        if not 1 <= len(fns) <= self.size + 1:
            raise ValueError(f"fns must hold 1..{self.size + 1} functions, got {len(fns)}")
        futures = [t.submit(f) for t, f in zip(self._threads, fns[1:])]
        results: list[Any] = [None] * len(fns)
        error: BaseException | None = None
        try:
            results[0] = fns[0]()
        except BaseException as e:  # noqa: BLE001 - re-raised after the others finished
            error = e
        for i, fut in enumerate(futures, start=1):
            try:
                results[i] = fut.result()
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error
        return results

    def close(self) -> None:
        self.resize(0)
