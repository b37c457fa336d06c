"""The driver's online correction end to end (``DriverOptions(online_correction=True)``), on the
session Ray instance: every interval's measured iteration time updates the correction factor,
the next interval's plan and the next epoch's predicted time are made with the updated factor.

Exact bookkeeping: the test replays the driver's records through its own
:class:`OnlineCorrection` (c <- c (t_meas / t_pred)^w per interval, t_pred the plan's
per-iteration time, t_meas the time of the interval's iterations (its measured "steps" term)
/ iterations) and checks that

* each interval's plan is the uncorrected plan with its time multiplied by the factor the
  replay holds before that interval (one GPU type: the correction scales every time alike);
* the driver ends with the replayed factor, far below 1: the hand-made profile is that of a GPU
  100 times slower than the emulated one (seconds per iteration predicted; the tiny MLP takes
  milliseconds, tens under heavy load);
* epoch 1's predicted time is the auto-scaler's estimate on the corrected model with the
  factor after epoch 0, i.e. the uncorrected estimate times that factor; epoch 0's is the
  uncorrected one.
"""
from __future__ import annotations

import pytest

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.config import JobConfig
from jabasray.planners import epoch_time, solve_for_batch
from jabasray.planners.correction import CorrectedModel, OnlineCorrection
from jabasray.planners.job_planner import batch_trajectory, initial_trajectory, plan_tolerance
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.ray

SMOOTHING = 0.5


def test_measured_times_correct_the_next_plans_and_the_next_epoch_estimate(ray_session, tmp_path):
    ds, _ = tiny_data(160)
    job = JobConfig(epochs=2, initial_global_batch=32, min_global_batch=16, max_global_batch=64,
                    min_local_batch=4, adapt_interval=2, autoscale=False, seed=1)
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])   # one pair
    base = perf_model({"fast": 0.01})
    opts = DriverOptions(online_correction=True, correction_smoothing=SMOOTHING,
                         reprofile_threshold=1e6, evaluate=False, failure_grace_s=10)
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, cluster, tmp_path / "run",
                      perf_model=base, options=opts)
    hist = drv.run()
    assert [e.epoch for e in hist.epochs] == [0, 1]

    model = base.for_allocation(2, False)
    replay = OnlineCorrection(SMOOTHING, 1e6)
    tol = plan_tolerance(job)

    def estimate(m, forecast):
        traj = batch_trajectory(forecast or initial_trajectory(job, len(ds)))
        return epoch_time(["fast"], m, traj, len(ds), job.adapt_interval, job.min_local_batch,
                          tolerance=tol).epoch_time

    for epoch in hist.epochs:
        forecast = epoch.predicted_trajectory
        corrected = estimate(CorrectedModel(model, replay), forecast)
        assert epoch.predicted_time_s == pytest.approx(corrected, rel=1e-12)
        assert epoch.predicted_time_s == pytest.approx(replay.factor("fast") * estimate(model, forecast),
                                                       rel=1e-9)
        for rec in [r for r in hist.intervals if r.epoch == epoch.epoch]:
            uncorrected = solve_for_batch(rec.requested_global_batch, ["fast"], model,
                                          job.min_local_batch, tolerance=tol)
            assert rec.plan.local_batch_size == uncorrected.local_batch_size
            assert rec.plan.workers == uncorrected.workers
            assert rec.plan.iteration_time == pytest.approx(
                replay.factor("fast") * uncorrected.iteration_time, rel=1e-9)
            assert rec.predicted_time_s == pytest.approx(rec.plan.iteration_time * rec.num_iterations,
                                                         rel=1e-12)
            replay.observe(["fast"], rec.plan.iteration_time,
                           rec.measured_terms["steps"] / rec.num_iterations)   # the iterations alone

    factor = drv.planner.correction.factor("fast")
    assert factor == pytest.approx(replay.factor("fast"), rel=1e-12)
    assert factor < 0.5                                   # the measurements moved the model
    # epoch 1 was planned and estimated with the factor epoch 0's intervals produced
    ep0 = [r for r in hist.intervals if r.epoch == 0]
    assert len(ep0) >= 2
    assert hist.epochs[0].predicted_time_s == pytest.approx(estimate(model, hist.epochs[0].predicted_trajectory),
                                                            rel=1e-12)
    assert hist.epochs[1].predicted_time_s < 0.5 * estimate(model, hist.epochs[1].predicted_trajectory)
