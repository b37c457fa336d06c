"""CPU emulation of a GPU type: how long an emulated GPU's step takes (``DriverOptions.emulation``).

An emulated GPU of speed ``s`` (< 1, ``ClusterSpec`` node speed) runs its real step on the host's
CPU, then sleeps so that the step takes what a device ``s`` times as fast as one host core would
take. Two rules for the sleep:

* ``"compute"`` (the default): ``sleep = c * (1 / s - 1)`` with ``c`` the step's measured *wall*
  compute time (engine ``StepStats.compute_time``). When more actors compute at once than the
  host has cores, ``c`` grows with the number of busy actors: every emulated GPU becomes slower
  the more of them are placed. The performance model accounts for it (``PerfModel``'s
  ``host_devices``, the shared cores), so the plans are right about it, but an allocation of 8
  emulated GPUs on 2 cores then runs each of them at a quarter of its speed, and comparisons of
  allocations of different sizes (GPU-seconds) are biased against the larger one.

* ``"wait"`` (fair): the emulated step time is the step's *compute CPU* time ``t_cpu`` divided
  by ``s``: the CPU seconds, over the step, of the threads that compute it - the stepping
  thread (forward, backward and the update run there on CPU) and the engine's VSW dispatcher
  threads (:meth:`jabasray.engine.iidp.IIDPWorker.helper_cpu_s`) - which do not grow while the
  actor waits for a core. Not counted: the collective's transport threads and the engine's
  communication thread (an emulated GPU's link is not its compute: as on a GPU, communication
  shows through the wall time, below) and Ray's own threads (their bursts would be stretched by
  1 / s into noise). The actor sleeps until ``t_cpu / s`` seconds after the step began,
  ``sleep = max(0, t_cpu / s - wall)`` (the wall time includes the all-reduce's wait for slower
  actors, so a step never takes less than the slowest actor's emulated time, as on GPUs). Each
  emulated GPU's time then depends only on its own work and speed, not on how many others share the host, as long as the host keeps up:
  every actor needs on average ``s`` of a core, so the sum of the placed actors' speeds must not
  exceed the host's cores (:func:`host_keeps_up`). When it does not, a step's wall compute time
  exceeds ``t_cpu / s`` - the *overrun* (:func:`wait_overrun`), reported per interval (``IntervalReply.emulation_overrun``) and
  logged - and that step is slower than the emulated device. The performance model then plans
  without shared cores (``host_devices`` None), as for real GPUs.

Speeds >= 1 cannot be emulated by either rule (no sleep; the actor warns once).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

from ..validation import check_choice

EMULATION_MODES = ("compute", "wait")


def compute_sleep(compute_time: float, speed: float) -> float:
    """The "compute" rule: seconds to sleep after ``compute_time`` of (wall) compute to emulate
    ``speed`` < 1: ``compute_time * (1 / speed - 1)``; 0 for speed >= 1."""
    if speed >= 1.0 or compute_time <= 0:
        return 0.0
    return compute_time * (1.0 / speed - 1.0)


def wait_sleep(cpu_time: float, wall_time: float, speed: float) -> float:
    """The "wait" rule: seconds to sleep after a step that used ``cpu_time`` CPU seconds and has
    taken ``wall_time`` so far (waits for other actors in its all-reduce included): the step
    should take ``cpu_time / speed``; ``max(0, cpu_time / speed - wall_time)`` (speed >= 1: 0)."""
    if speed >= 1.0:
        return 0.0
    return max(0.0, max(0.0, cpu_time) / speed - wall_time)


def wait_overrun(cpu_time: float, compute_wall: float, speed: float) -> float:
    """Seconds by which the host's cores fell behind the "wait" rule in one step: the step's
    wall compute time (forward/backward, without the all-reduce's wait for other actors)
    beyond ``cpu_time / speed`` (speed >= 1: 0)."""
    if speed >= 1.0:
        return 0.0
    return max(0.0, compute_wall - max(0.0, cpu_time) / speed)


def host_keeps_up(speeds: Iterable[float], host_cpus: float) -> bool:
    """The "wait" rule's fairness condition: ``sum(min(s, 1)) <= host_cpus`` (every emulated GPU
    needs ``s`` of a core on average while the others sleep)."""
    return sum(min(float(s), 1.0) for s in speeds) <= float(host_cpus) + 1e-9


class StepTimer:
    """Wall and compute-CPU seconds of one step: ``with StepTimer(helper_cpu) as t: ...;
    t.wall, t.cpu``; ``cpu`` is this thread's CPU time plus the growth of ``helper_cpu()``,
    the cumulative CPU seconds of the other threads that compute the step (None: none)."""

    def __init__(self, helper_cpu: Callable[[], float] | None = None) -> None:
        self._helper = helper_cpu

    def __enter__(self) -> "StepTimer":
        self._h0 = self._helper() if self._helper is not None else 0.0
        self._w0, self._c0 = time.perf_counter(), time.thread_time()
        self.wall = self.cpu = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._w0
        self.cpu = time.thread_time() - self._c0
        if self._helper is not None:
            self.cpu += self._helper() - self._h0


def check_emulation(mode: str) -> str:
    """``mode`` if it is one of :data:`EMULATION_MODES`, else a one-line ValueError."""
    return check_choice("emulation", mode, EMULATION_MODES)


__all__ = ["EMULATION_MODES", "StepTimer", "check_emulation", "compute_sleep", "host_keeps_up",
           "wait_overrun", "wait_sleep"]
