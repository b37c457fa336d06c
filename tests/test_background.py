"""Background jobs on GPU actors: placement, progress, containment and re-placement.

The real GPUActor is written elsewhere; these tests use a tiny actor class that inherits the
mixin (``Host``). Spare capacity is fixed per test actor so placement is deterministic."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from jabasray.actors.background import (BackgroundHostMixin, BackgroundJob,
                                        BackgroundJobFailed, BackgroundScheduler,
                                        submit_background)
from jabasray.engine.multiplex import MultiplexPolicy, epoch_order


def make_model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def make_opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def make_data():
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g))


def broken_model():
    raise RuntimeError("no such layer")


def job(steps=5, memory_mb=10.0, every=50, model_fn=make_model, batch_size=8):
    return BackgroundJob(model_fn=model_fn, optimizer_fn=make_opt, loss_fn=nn.functional.cross_entropy,
                         data_fn=make_data, steps=steps, batch_size=batch_size,
                         memory_mb=memory_mb, checkpoint_every=every, seed=3)


def reference(steps: int, batch_size: int = 8) -> nn.Module:
    torch.manual_seed(3)
    model = make_model()
    opt = make_opt(model.parameters())
    X, Y = make_data().tensors
    epoch, cursor, perm = 0, 0, epoch_order(len(Y), 3, 0)
    for _ in range(steps):
        idx = perm[cursor:cursor + batch_size]
        cursor += len(idx)
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[idx]), Y[idx]).backward()
        opt.step()
        if cursor >= len(Y):
            epoch, cursor = epoch + 1, 0
            perm = epoch_order(len(Y), 3, epoch)
    return model


class Host(BackgroundHostMixin):
    """A stand-in GPU actor: fixed spare capacity, emulated memory budget."""

    def __init__(self, spare: float = 0.5, memory_mb: float = 100.0) -> None:
        self.device = "cpu"
        self.bg_policy = MultiplexPolicy(max_background_batch=None)
        self._spare = spare
        self.bg_set_memory_budget(memory_mb)

    def spare_capacity(self) -> float:
        return self._spare

    def ping(self) -> str:
        return "ok"


# ---------------------------------------------------------------- no Ray

def test_job_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="dataset and data_fn"):
        BackgroundJob(make_model, make_opt, nn.functional.cross_entropy, steps=1)
    with pytest.raises(ValueError, match="steps and epochs"):
        BackgroundJob(make_model, make_opt, nn.functional.cross_entropy, data_fn=make_data)
    with pytest.raises(ValueError, match="memory_mb"):
        job(memory_mb=-1)
    with pytest.raises(ValueError, match="batch_size"):
        job(batch_size=0)
    with pytest.raises(ValueError, match="model_fn"):
        BackgroundJob(None, make_opt, nn.functional.cross_entropy, data_fn=make_data, steps=1)


def test_mixin_in_process_memory_accounting_and_containment(tmp_path):
    host = Host(memory_mb=50.0)
    assert host.free_memory() == 50.0
    st = host.bg_submit("long", job(steps=10**6, memory_mb=30.0))
    assert st.name == "long" and st.total_steps == 10**6
    assert host.free_memory() == pytest.approx(20.0)
    with pytest.raises(ValueError, match="memory_mb"):
        host.bg_submit("b", job(memory_mb=25.0))
    host.bg_submit("short", job(steps=6, memory_mb=20.0))
    assert host.free_memory() == pytest.approx(0.0) or host.bg_status("short").finished
    final = host.bg_runner().wait("short", timeout=60)
    assert final.state == "done" and final.step == 6
    assert host.bg_cancel("long").state == "cancelled"
    assert host.free_memory() == 50.0                       # released when finished
    bad = host.bg_submit("bad", job(model_fn=broken_model))
    assert bad.state == "failed" and "RuntimeError: no such layer" in bad.error
    assert host.bg_status("bad").state == "failed"
    assert 0.0 <= BackgroundHostMixin.spare_capacity(host) <= 1.0
    host.bg_submit("paused", job(steps=10**6))
    _advances(host, "paused")                       # positive control: it trains when not paused
    with host.bg_foreground_critical("allreduce"):
        before = host.bg_status("paused").step
        time.sleep(0.3)
        assert host.bg_status("paused").step == before
    _advances(host, "paused")                       # and goes on after the critical section
    with host.bg_foreground_step():
        pass
    host.bg_cancel("paused")
    host.bg_runner().close()


def test_foreground_gates_are_free_without_background_jobs():
    host = Host()
    with host.bg_foreground_step(), host.bg_foreground_critical():
        pass
    assert getattr(host, "_bg_runner_obj", None) is None    # no runner thread was started


# ---------------------------------------------------------------- Ray

@pytest.fixture(scope="module")
def hosts(ray_session):
    ray = ray_session
    import sys

    from ray import cloudpickle
    # Ray workers cannot import this test module: ship its classes/functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    Remote = ray.remote(num_cpus=0)(Host)
    actors = [Remote.remote(spare=0.9, memory_mb=20.0),     # most spare, little memory
              Remote.remote(spare=0.6, memory_mb=500.0)]
    ray.get([a.ping.remote() for a in actors])
    yield ray, actors, Remote
    for a in actors:
        ray.kill(a)


def test_submit_places_on_most_spare_actor_that_fits(hosts, tmp_path):
    ray, actors, _ = hosts
    small = submit_background(job(steps=4, memory_mb=5.0), actors)
    assert small.actor is actors[0]                          # spare 0.9, 20 MiB suffice
    big = submit_background(job(steps=4, memory_mb=100.0), actors)
    assert big.actor is actors[1]                            # 0.9 lacks memory; next is 0.6
    with pytest.raises(ValueError, match="memory_mb"):
        submit_background(job(memory_mb=10_000.0), actors)
    assert small.result(timeout=60).step == 4
    st = big.result(timeout=60)
    assert st.state == "done" and st.samples == 4 * 8 and st.progress == 1.0


def test_failure_is_reported_through_the_handle(hosts, tmp_path):
    ray, actors, _ = hosts
    h = submit_background(job(model_fn=broken_model), actors)
    with pytest.raises(BackgroundJobFailed, match="no such layer"):
        h.result(timeout=30)
    assert h.progress().state == "failed"
    assert ray.get(h.actor.ping.remote()) == "ok"            # the host (foreground) is fine


def test_cancel_and_progress(hosts, tmp_path):
    ray, actors, _ = hosts
    h = submit_background(job(steps=10**6), actors)
    deadline = time.monotonic() + 30
    while h.progress().step < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h.progress().state == "running"
    assert h.cancel().state == "cancelled"
    assert h.result(timeout=5).state == "cancelled"


def test_rebalance_resumes_from_the_pulled_state_on_a_new_actor(hosts, tmp_path):
    """The scheduler pulls the job's state (through the object store) and writes it to its
    storage; the job's actor dies; it resumes on another actor from that state (not step 0)
    and ends exactly where an uninterrupted run ends."""
    ray, actors, Remote = hosts
    doomed = Remote.remote(spare=1.0, memory_mb=500.0)      # the job lands here first
    sched = BackgroundScheduler([doomed] + actors, storage=str(tmp_path))
    steps = 400
    h = sched.submit(job(steps=steps, every=5), job_id="moving")
    assert h.actor is doomed
    deadline = time.monotonic() + 60
    while h.progress().step < 12 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sched.checkpoint() == ["moving"]
    pulled = torch.load(tmp_path / "moving.pt", weights_only=True)["step"]
    assert pulled >= 12
    ray.kill(doomed)                                         # the node is gone
    moved = sched.rebalance(actors)
    assert moved == ["moving"] and h.moves == 1 and h.actor is actors[0]
    assert h.progress().step >= pulled                       # from its state, not step 0
    st = h.result(timeout=120)
    assert st.step == steps
    assert sched.rebalance(actors) == []                     # nothing left to move
    state = torch.load(__import__("io").BytesIO(ray.get(h.actor.bg_state.remote("moving"))),
                       weights_only=True)
    assert state["step"] == steps
    ref = reference(steps)
    got = make_model()
    got.load_state_dict(state["model"])
    for p, q in zip(got.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_job_whose_state_never_left_its_dead_actor_fails_naming_it(hosts):
    ray, actors, Remote = hosts
    doomed = Remote.remote(spare=1.0, memory_mb=500.0)
    sched = BackgroundScheduler([doomed] + actors)
    h = sched.submit(job(steps=10**6), job_id="unsaved")
    while h.progress().step < 2:
        time.sleep(0.02)
    ray.kill(doomed)                                         # before any checkpoint() pulled it
    assert sched.rebalance(actors) == []
    with pytest.raises(BackgroundJobFailed) as e:
        h.result(timeout=5)
    assert str(e.value).startswith("background job unsaved failed at step 0: background job "
                                   "unsaved: its actor is gone and none of its state reached")
    assert str(e.value).endswith("not restarting it from step 0")


def _advances(host, name: str, timeout: float = 30.0) -> None:
    """Background job ``name`` makes a step within ``timeout`` seconds."""
    start = host.bg_status(name).step
    deadline = time.monotonic() + timeout
    while host.bg_status(name).step == start:
        assert time.monotonic() < deadline, f"background job {name} made no step in {timeout}s"
        time.sleep(0.01)


class Stuck(Host):
    """A GPU actor hung in its calls (a blocked collective, a stuck loader): every call after
    ``hang()`` waits behind it."""

    def hang(self) -> None:
        time.sleep(3600)


def test_background_calls_have_deadlines_and_skip_a_hung_actor(hosts, caplog):
    """With a deadline (the driver's call_timeout_s), a hung actor is left out of placement with
    a warning naming it, never waited on: submit places on the actor that answers; a job whose
    only candidate is hung fails in one line; rebalance onto a hung actor returns (the job is
    not moved, its state kept) and moves it once a live actor is offered."""
    import logging

    ray, actors, _ = hosts
    T = 4     # the deadline (s): each wait on the hung actor lasts this long (3 waits); a live
    #           actor answers its calls in well under 1 s even on a loaded 2-core machine
    for a in actors:     # the first job of an actor imports the engine: not what is timed here
        submit_background(job(steps=1, memory_mb=5.0), [a]).result(timeout=120)
    stuck = ray.remote(num_cpus=0)(Stuck).remote(spare=1.0, memory_mb=500.0)   # the most spare
    ray.get(stuck.ping.remote())
    stuck.hang.remote()
    key = stuck._actor_id.hex()
    try:
        with caplog.at_level(logging.WARNING, logger="jabasray.actors.background"):
            t0 = time.monotonic()
            h = submit_background(job(steps=2, memory_mb=5.0), [stuck, actors[1]], timeout_s=T)
            assert time.monotonic() - t0 >= T                  # it waited its deadline, no more
            assert h.actor is actors[1] and h.timeout_s == T
            assert any(key in r.getMessage() and f"did not answer within {T}s" in r.getMessage()
                       for r in caplog.records)
            assert h.result(timeout=60).state == "done"
            with pytest.raises(TimeoutError, match=rf"^background job background: no GPU actor answered .* within {T}s$"):
                submit_background(job(), [stuck], timeout_s=T)

            sched = BackgroundScheduler([actors[1]], call_timeout_s=T)
            long = sched.submit(job(steps=100_000, memory_mb=5.0))
            assert sched.checkpoint() == [long.job_id]
            assert sched.rebalance([stuck]) == []              # hung: not moved, not waited on
            assert long.actor is actors[1] and long.job_id in sched.states
            assert long.progress().state == "running"          # still where it was
            assert any(f"background job {long.job_id} not resumed" in r.getMessage() for r in caplog.records)
            assert sched.rebalance([actors[0]]) == [long.job_id]
            assert long.actor is actors[0] and long.progress().state in ("running", "queued")
            long.cancel()
    finally:
        ray.kill(stuck)
