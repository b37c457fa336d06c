"""JabasTrainer end to end on the session Ray instance: exact re-placement, resume, background
scheduler hook. Reference = an uninterrupted run without re-placement. Every fit runs its driver
in this process (``DriverOptions(driver="local")``): the driver actor path is tested in
test_driver_actor.py, and here it would only add one Ray worker process (~4 s of CPU) per fit."""
from __future__ import annotations

import pytest
import torch

from actors_helpers import assert_each_sample_once_per_epoch, loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.driver import DriverOptions
from jabasray.actors.trainer import JabasTrainer, Result
from jabasray.config import JobConfig, RunConfig
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.ray

CLUSTER = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])


def job(epochs: int) -> JobConfig:
    # adaptive batching ON: the B_G trajectory must also come out identical
    return JobConfig(epochs=epochs, initial_global_batch=24, min_global_batch=16, max_global_batch=96,
                     min_local_batch=4, adapt_interval=2, alpha=0.25, gamma=0.9, autoscale=False,
                     lr=0.05, lr_scaling="sqrt", warmup_iterations=3, seed=5)


def fit(tmp_path, name: str, epochs: int, **opts) -> Result:
    ds, val = tiny_data(200)
    return JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, job(epochs), cluster=CLUSTER,
                        run_config=RunConfig(str(tmp_path), name), val_dataset=val,
                        perf_model=perf_model(), options=DriverOptions(record_samples=True, driver="local", **opts)).fit()


def weights(result: Result) -> dict:
    return result.run_checkpoint.load_worker_state()


def assert_same_training(a: Result, b: Result) -> None:
    wa, wb = weights(a), weights(b)
    for k in wa["model"]:
        torch.testing.assert_close(wa["model"][k], wb["model"][k], rtol=1e-6, atol=1e-7)
    for sa, sb in zip(wa["optimizer"]["state"].values(), wb["optimizer"]["state"].values()):
        torch.testing.assert_close(sa["momentum_buffer"], sb["momentum_buffer"], rtol=1e-6, atol=1e-7)
    assert [e.trajectory for e in a.history.epochs] == [e.trajectory for e in b.history.epochs]
    assert [r.lr for r in a.history.intervals] == pytest.approx([r.lr for r in b.history.intervals])


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    return fit(tmp_path_factory.mktemp("ref"), "ref", epochs=2)


def test_reference_run_writes_metrics_plot_and_checkpoint(reference):
    r = reference
    assert r.metrics_path.exists() and r.plot_path.read_bytes()[:4] == b"\x89PNG"
    assert r.run_checkpoint.epochs_done == 2
    assert len(r.history.epochs) == 2 and r.metrics["epoch"] == 1
    # B_G adapted (gamma=0.9 -> it grows) and every interval ran a plan on one pair
    assert r.history.epochs[1].trajectory[-1] > 24
    for rec in r.history.intervals:
        assert rec.global_batch == rec.plan.global_batch_size == rec.local_batch * 2 * rec.plan.num_workers_per_group
    assert_each_sample_once_per_epoch(r.history, 200)
    assert not any(e.replaced for e in r.history.epochs)


def test_forced_replacement_every_epoch_is_exact(reference, tmp_path):
    calls = []

    class Background:
        def rebalance(self, handles):
            calls.append(len(handles))

    ds, val = tiny_data(200)
    tr = JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, job(2), cluster=CLUSTER,
                      run_config=RunConfig(str(tmp_path), "forced"), val_dataset=val,
                      perf_model=perf_model(),   # in-process driver: the hook's list is here
                      options=DriverOptions(force_replacement=True, driver="local"),
                      background=Background())
    forced = tr.fit()
    assert [e.replaced for e in forced.history.epochs] == [False, True]
    assert calls == [2, 2]                       # the scheduler saw both placements
    assert_same_training(forced, reference)


def test_resume_after_interruption_equals_uninterrupted(reference, tmp_path):
    first = fit(tmp_path, "resumed", epochs=1)
    assert first.run_checkpoint.epochs_done == 1
    second = fit(tmp_path, "resumed", epochs=2)
    assert any("resumed" in m for m in second.history.events)
    assert [e.epoch for e in second.history.epochs] == [0, 1]
    assert_same_training(second, reference)
    # a different job on the same run folder is refused, naming the field
    ds, _ = tiny_data(200)
    with pytest.raises(ValueError, match=r"holds another job's checkpoints \(job_config.alpha: 0.25 -> 0.5\)"):
        JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, JobConfig(**{**job(3).to_dict(), "alpha": 0.5}),
                     cluster=CLUSTER, run_config=RunConfig(str(tmp_path), "resumed"),
                     perf_model=perf_model()).fit()
