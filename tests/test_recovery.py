"""Recovery from every failure point, on the session Ray instance: a GPU actor lost
during start-up or the first epoch is recovered like a later loss (a checkpoint exists from the
start); exhausted restarts end in one line naming the failure and the last checkpoint; a driver
that dies mid-epoch resumes without losing a completed epoch; a corrupt newest checkpoint is
reported and training resumes from the one before, ending with the same weights."""
from __future__ import annotations

import shutil

import pytest
import torch

from actors_helpers import KillOnce, assert_each_sample_once_per_epoch, loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.checkpoint import latest_checkpoint, list_checkpoints
from jabasray.actors.driver import DriverCallback, DriverOptions, JabasDriver
from jabasray.config import FailureConfig, JobConfig
from jabasray.errors import JobFailed
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.ray

# Two GPUs: one lost leaves one (any GPU count trains), both killed at once are a collective
# abort. Each GPU-actor process costs seconds of CPU on a small machine: few actors keep the
# module quick.
PAIR = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])


def _job(epochs: int = 2) -> JobConfig:
    return JobConfig(epochs=epochs, initial_global_batch=32, min_global_batch=16,
                     max_global_batch=64, min_local_batch=4, adapt_interval=2, autoscale=False,
                     seed=1)


def _driver(run_dir, cls=JabasDriver, callbacks=(), failure=None, **opts):
    ds, val = tiny_data(160)
    return cls(model_fn, ds, optimizer_fn, loss_fn, _job(), PAIR, run_dir, val_dataset=val,
               perf_model=perf_model(), options=DriverOptions(failure_grace_s=6, record_samples=True, **opts),
               callbacks=list(callbacks), failure=failure)


class _DiesAtStartUp(JabasDriver):
    """The first GPU actor ever created dies before its set-up call (lost during start-up)."""

    killed = False

    def _make_actor(self, slot, world_size, ray_opts):
        import ray
        handle = super()._make_actor(slot, world_size, ray_opts)
        if not _DiesAtStartUp.killed:
            _DiesAtStartUp.killed = True
            ray.kill(handle, no_restart=True)
        return handle


@pytest.mark.parametrize("when", ["start-up", "first epoch"])
def test_actor_lost_before_any_epoch_is_recovered(ray_session, tmp_path, when):
    if when == "start-up":
        _DiesAtStartUp.killed = False
        drv = _driver(tmp_path / "run", cls=_DiesAtStartUp)
    else:
        drv = _driver(tmp_path / "run", callbacks=[KillOnce(epoch=0, rank=1)])
    hist = drv.run()
    assert [e.epoch for e in hist.epochs] == [0, 1]
    fail = [m for m in hist.events if "failure" in m]
    assert len(fail) == 1 and "restarting epoch 1 from epoch_0000 without that GPU" in fail[0]
    assert all(len(e.gpu_types) == 1 for e in hist.epochs)      # only the dead actor's GPU left out
    assert_each_sample_once_per_epoch(hist, 160)       # the redone epoch 0 once, whole
    assert latest_checkpoint(tmp_path / "run").epochs_done == 2


class _KillMany(DriverCallback):
    """At interval 1 of epoch 0, ``ray.kill`` several actors at once (as an NCCL abort does)."""

    def __init__(self, ranks) -> None:
        self.ranks, self.done = ranks, False

    def on_interval(self, driver, record):
        import ray
        if not self.done and record.epoch == 0 and record.interval == 1:
            self.done = True
            for r in self.ranks:
                ray.kill(driver.gpu_actors()[r], no_restart=True)


def test_simultaneous_failures_retry_on_the_same_gpus(ray_session, tmp_path):
    """Both actors killed at once (nodes alive): the run is not shrunk; epoch 0 is redone on
    the same 2 GPUs from its checkpoint and every epoch trains each sample once."""
    drv = _driver(tmp_path / "run", callbacks=[_KillMany([0, 1])])
    hist = drv.run()
    assert [e.epoch for e in hist.epochs] == [0, 1]
    fail = [m for m in hist.events if "failure" in m]
    assert len(fail) == 1 and "2 ranks failed at once" in fail[0] and "retrying on the same GPUs" in fail[0]
    assert all(e.allocation == {"n0": 2} and len(e.gpu_types) == 2 for e in hist.epochs)
    assert_each_sample_once_per_epoch(hist, 160)
    assert latest_checkpoint(tmp_path / "run").load_driver_state().cluster == PAIR


def test_exhausted_restarts_end_in_one_line_naming_failure_and_checkpoint(ray_session, tmp_path):
    drv = _driver(tmp_path / "run", callbacks=[KillOnce(epoch=0, rank=1)], failure=FailureConfig(max_failures=0))
    with pytest.raises(JobFailed) as e:
        drv.run()
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("giving up after 1 GPU actor failures (max_failures=0); the last: "
                          "GPU actor failure: rank 1 (fast on n0)")
    assert f"last checkpoint {tmp_path / 'run' / 'checkpoints' / 'epoch_0000'} (0 epoch(s) done" in msg
    assert drv.gpu_actors() == []


class _DriverDies(DriverCallback):
    """Stops the driver in the middle of epoch 1 (its checkpoint of epoch 0 is on disk)."""

    def on_interval(self, driver, record):
        if record.epoch == 1 and record.interval == 1:
            raise SystemExit("driver killed")


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    """The uninterrupted 2-epoch run on a GPU pair that the restarted runs must end equal to."""
    run = tmp_path_factory.mktemp("reference") / "run"
    _driver(run).run()
    return run


def test_driver_dying_mid_epoch_resumes_without_losing_a_completed_epoch(reference, tmp_path):
    with pytest.raises(SystemExit):
        _driver(tmp_path / "run", callbacks=[_DriverDies()]).run()
    assert latest_checkpoint(tmp_path / "run").epochs_done == 1
    drv = _driver(tmp_path / "run")
    hist = drv.run()
    assert any(m.startswith(f"resumed from {tmp_path / 'run' / 'checkpoints' / 'epoch_0001'} "
                            f"after 1 epoch") for m in hist.events)
    assert [e.epoch for e in hist.epochs] == [0, 1]
    _assert_same_weights(tmp_path / "run", reference)


def test_corrupt_newest_checkpoint_resumes_from_the_one_before(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)                           # a finished run, as the reference
    w = run / "checkpoints" / "epoch_0002" / "worker.pt"
    w.write_bytes(w.read_bytes()[:-64])                       # truncated newest checkpoint
    drv = _driver(run)
    hist = drv.run()
    bad = [m for m in hist.events if "epoch_0002 is unusable" in m]
    assert len(bad) == 1 and "worker.pt is truncated or changed" in bad[0]
    assert any("after 1 epoch" in m for m in hist.events)     # resumed from epoch_0001
    assert [e.epoch for e in hist.epochs] == [0, 1]
    assert [c.epochs_done for c in list_checkpoints(run)] == [1, 2]
    _assert_same_weights(run, reference)


def _assert_same_weights(a, b) -> None:
    wa = latest_checkpoint(a).load_worker_state()["model"]
    wb = latest_checkpoint(b).load_worker_state()["model"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
