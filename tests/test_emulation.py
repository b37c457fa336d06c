"""The emulated GPU's step time (jabasray.actors.emulation, DriverOptions.emulation).

The "wait" rule makes a step take cpu_time / speed whatever the host's contention: an in-process
GPUActor is given a step timer reporting fixed CPU and wall seconds (time.sleep recorded, not
slept), and its sleeps and overrun are checked to the exact arithmetic; the "compute" rule
scales the engine's compute time. No timing is asserted.
"""
from __future__ import annotations

import threading
import time

import pytest

from actors_helpers import loss_fn, model_fn, optimizer_fn, tiny_data
from jabasray.actors import gpu_actor
from jabasray.actors.driver_options import DriverOptions
from jabasray.actors.emulation import StepTimer, compute_sleep, host_keeps_up, wait_overrun, wait_sleep
from jabasray.actors.gpu_actor import GPUActor, IntervalRequest
from jabasray.actors.placement import Slot
from jabasray.actors.rendezvous import Rendezvous
from jabasray.config import JobConfig


def test_rules_arithmetic():
    assert wait_sleep(0.01, 0.002, 0.25) == pytest.approx(0.038)     # until 0.04 s
    assert wait_sleep(0.01, 0.05, 0.25) == 0.0                        # already later: no sleep
    assert wait_sleep(0.01, 0.002, 1.0) == 0.0 and wait_sleep(0.01, 0.0, 2.0) == 0.0
    assert wait_overrun(0.01, 0.05, 0.25) == pytest.approx(0.01)
    assert wait_overrun(0.01, 0.03, 0.25) == 0.0
    assert compute_sleep(0.02, 0.5) == pytest.approx(0.02) and compute_sleep(0.02, 1.5) == 0.0
    assert host_keeps_up([0.25] * 8, 2) and not host_keeps_up([0.5] * 4 + [0.25] * 4, 2)
    assert host_keeps_up([3.0, 1.0], 2)          # a speed >= 1 needs at most one core


def test_bad_emulation_mode_is_a_one_line_error():
    with pytest.raises(ValueError, match="emulation must be one of 'compute', 'wait', got 'sleep'"):
        DriverOptions(emulation="sleep")


class FixedTimer:
    """A StepTimer stand-in: every step used ``cpu`` CPU seconds in ``wall`` wall seconds."""
    cpu = wall = 0.0

    def __init__(self, helper_cpu=None):
        self.helper_cpu = helper_cpu

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _run(monkeypatch, emulation: str, speed: float, cpu: float, wall: float):
    slept: list[float] = []
    timer = type("T", (FixedTimer,), {"cpu": cpu, "wall": wall})
    monkeypatch.setattr(gpu_actor, "StepTimer", timer)
    monkeypatch.setattr(gpu_actor.time, "sleep", slept.append)
    ds, _ = tiny_data(64)
    slot = Slot(rank=0, node="n0", gpu_type="slow", speed=speed, group=0, pair=0)
    actor = GPUActor(slot, 1, JobConfig(seed=1), model_fn, optimizer_fn, loss_fn, ds, "cpu", True,
                     emulation=emulation)
    actor.setup(Rendezvous("127.0.0.1", 29500, 1))
    actor.configure(1, 0, 8)
    try:
        reply = actor.run_interval(IntervalRequest(
            epoch=0, cursor=0, num_iterations=3, local_batch=8, layout=[1], iteration=0,
            base_lr=None, base_batch=8, lr_scaling="none", warmup_iterations=0, similarity=False))
    finally:
        monkeypatch.undo()
        actor.shutdown()
    return reply, slept


def test_wait_rule_sleeps_until_cpu_over_speed(monkeypatch):
    reply, slept = _run(monkeypatch, "wait", 0.25, cpu=0.01, wall=0.002)
    assert slept == pytest.approx([0.038] * 3)
    assert reply.emulation_sleep == pytest.approx(3 * 0.038)


def test_wait_rule_reports_the_host_falling_behind(monkeypatch):
    """CPU time 0 (target 0): every step's engine compute time is overrun, nothing is slept."""
    reply, slept = _run(monkeypatch, "wait", 0.25, cpu=0.0, wall=0.01)
    assert slept == [] and reply.emulation_sleep == 0.0
    assert reply.emulation_overrun == pytest.approx(reply.compute_time) and reply.compute_time > 0


def test_compute_rule_scales_the_engine_compute_time(monkeypatch):
    reply, slept = _run(monkeypatch, "compute", 0.25, cpu=123.0, wall=0.0)   # timer unused
    assert len(slept) == 3 and reply.emulation_overrun == 0.0
    assert sum(slept) == pytest.approx(reply.compute_time * 3.0)


def test_wait_emulation_plans_without_shared_cores():
    """PerfModel.host_devices: the shared-core count under "compute", None under "wait"."""
    from actors_helpers import profile
    from jabasray.profiler.cluster import job_perf_model
    from jabasray.types import ClusterSpec

    cluster = ClusterSpec.emulated({"fast": (1, 4, 0.25)})
    kw = dict(loss_fn=loss_fn, optimizer_fn=optimizer_fn, device="cpu", emulate=True,
              torch_threads=1, bucket_cap_mb=25.0, cache_dir="/nonexistent", host_cpus=2,
              profiles={"fast": profile("fast", 0.25)})
    shared = job_perf_model(model_fn, None, cluster, JobConfig(), **kw)
    fair = job_perf_model(model_fn, None, cluster, JobConfig(), shared_host=False, **kw)
    assert shared.host_devices == 2 and fair.host_devices is None


def _burn(seconds: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def test_step_timer_counts_the_computing_threads_only():
    """The "wait" rule's CPU time is this thread's plus the helper threads' the engine reports
    (its VSW dispatchers), never another thread's: a thread burning 60 ms of CPU while the
    timed block sleeps adds nothing, a helper counter that grows by 0.5 s adds exactly that."""
    other = threading.Thread(target=_burn, args=(0.06,))
    with StepTimer() as t:
        other.start()
        other.join()
    assert t.cpu < 0.02 and t.wall >= 0.06
    helper = iter([10.0, 10.5])
    with StepTimer(lambda: next(helper)) as t:
        _burn(0.02)
    assert 0.52 <= t.cpu < 0.6


def test_vsw_dispatchers_count_their_jobs_cpu():
    from jabasray.engine.streams import VSWThreadPool

    pool = VSWThreadPool(2)
    try:
        assert pool.cpu_s == 0.0
        pool.run([lambda: None, lambda: _burn(0.03), lambda: _burn(0.02)])
        assert 0.05 <= pool.cpu_s < 0.09
        pool.resize(1)                     # a stopped thread keeps its share in the total
        assert pool.cpu_s >= 0.05
        before = pool.cpu_s
        pool.run([lambda: _burn(0.02), lambda: None])   # the caller's job is not the pool's
        assert pool.cpu_s - before < 0.01
    finally:
        pool.close()
