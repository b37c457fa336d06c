"""The driver's pure pieces (no Ray): the interval and epoch records built from the actors'
replies and the epoch's tally (actors/metrics.py), the start-or-resume decision
(actors/recovery.py), the re-profiling budget (planners/job_planner.py), the SMA learners of a
placement (actors/sma_learners.py); the next epoch's forecast is tested with the forecaster in
test_forecast.py. Exact bookkeeping against hand-computed values and the
functions they are built on."""
from __future__ import annotations

from dataclasses import replace

import math
from types import SimpleNamespace

import pytest

from actors_helpers import perf_model
from jabasray.actors.checkpoint import DriverState, latest_checkpoint, save_checkpoint
from jabasray.actors.driver_options import DriverOptions
from jabasray.actors.metrics import EpochTally, MetricsHistory, epoch_record, interval_record
from jabasray.actors.fanout import ActorFailure
from jabasray.actors.placement import Slot, full_allocation, multi_node, slots_for
from jabasray.actors.recovery import restart, restore_or_start
from jabasray.actors.sma_learners import placement_learners
from jabasray.actors.sma_state import pack_sma
from jabasray.adaptive import AdaptiveBatchController
from jabasray.config import JobConfig
from jabasray.planners.correction import OnlineCorrection
from jabasray.planners.job_planner import JobPlanner
from jabasray.types import ClusterSpec, NodeSpec

CLUSTER = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2), NodeSpec("n1", "slow", 2)])


def _reply(samples, loss=0.5, phi=0.25, lr=0.01, iterations=3):
    return SimpleNamespace(samples=samples, loss=loss, phi=phi, lr=lr, num_iterations=iterations)


def test_interval_record_takes_rank0s_values_and_all_ranks_samples():
    replies = [_reply(24), _reply(40, loss=9.0, phi=9.0, lr=9.0, iterations=9)]
    rec = interval_record(replies, 2.0, epoch=1, interval=2, iteration=7, cursor=96,
                          requested_global_batch=60, global_batch=64, local_batch=8, plan=None)
    assert (rec.num_iterations, rec.loss, rec.phi, rec.lr) == (3, 0.5, 0.25, 0.01)
    assert (rec.samples, rec.throughput, rec.time_s) == (64, 32.0, 2.0)
    assert (rec.epoch, rec.interval, rec.iteration, rec.cursor) == (1, 2, 7, 96)
    assert (rec.requested_global_batch, rec.global_batch, rec.local_batch) == (60, 64, 8)
    assert interval_record(replies, 0.0, epoch=0, interval=0, iteration=0, cursor=0,
                           requested_global_batch=1, global_batch=1, local_batch=1,
                           plan=None).throughput == 0.0


def test_epoch_record_is_the_tally_with_the_predictions():
    tally = EpochTally()
    for i, (loss, its, secs, pred) in enumerate([(2.0, 3, 1.5, 1.0), (1.0, 1, 0.5, None)]):
        tally.add(interval_record([_reply(10 * its, loss=loss, iterations=its, lr=0.1 * (i + 1))],
                                  secs, epoch=0, interval=i, iteration=0, cursor=0,
                                  requested_global_batch=8, global_batch=8, local_batch=4,
                                  plan=None, predicted_time_s=pred))
    rec = epoch_record(tally, epoch=0, allocation={"n0": 1}, gpu_types=["fast", "fast"],
                       trajectory=[8, 8], forecast=[8.0, 9.0], val_metrics={"accuracy": 0.75},
                       replaced=True, predicted_time_s=2.5, time_s=4.0)
    assert rec.train_loss == pytest.approx((2.0 * 3 + 1.0 * 1) / 4, rel=1e-15)
    assert (rec.samples, rec.train_time_s, rec.throughput) == (40, 2.0, 20.0)
    assert rec.predicted_train_time_s == 1.0            # intervals without a prediction add 0
    assert (rec.time_s, rec.gpu_seconds, rec.lr) == (4.0, 8.0, 0.2)   # lr: the last interval's
    assert (rec.val_accuracy, rec.predicted_time_s, rec.replaced) == (0.75, 2.5, True)
    assert (rec.allocation, rec.predicted_trajectory, rec.trajectory) == ({"n0": 1}, [8.0, 9.0], [8, 8])


def test_fresh_start_then_resume(tmp_path):
    job = JobConfig(epochs=3, initial_global_batch=16, min_global_batch=8, max_global_batch=64,
                    min_local_batch=4)
    asked = []

    def choose(cluster, forecast):
        asked.append((cluster, forecast))
        return {"n1": 1}

    ctl = AdaptiveBatchController(job)
    cp, state, events = restore_or_start(tmp_path, job, CLUSTER, ctl, choose)
    assert cp is None and events == [] and asked == [(CLUSTER, None)]
    assert (state.epochs_done, state.iteration, state.allocation) == (0, 0, {"n1": 1})
    assert state.adaptive == ctl.state_dict() and state.job_config == job.to_dict()

    ctl.update(0.0)                                        # B_G grows; checkpoint after 1 epoch
    ctl.end_epoch()
    saved = DriverState(epochs_done=1, iteration=5, cluster=CLUSTER, allocation=full_allocation(CLUSTER),
                        adaptive=ctl.state_dict(), metrics=MetricsHistory(events=["x"]),
                        job_config=job.to_dict())
    save_checkpoint(tmp_path, saved, None)
    other = AdaptiveBatchController(job)
    resumed = JobConfig(**{**job.to_dict(), "epochs": 5})  # more epochs: still the same run
    cp, state, events = restore_or_start(tmp_path, resumed, CLUSTER, other, choose)
    assert cp.path == latest_checkpoint(tmp_path).path and len(asked) == 1
    assert events == [f"resumed from {cp.path} after 1 epoch(s)"]
    assert (state.epochs_done, state.iteration, state.metrics.events) == (1, 5, ["x"])
    assert other.state_dict() == ctl.state_dict() and other.global_batch == ctl.global_batch > 16
    with pytest.raises(ValueError, match="job_config differs .*'seed'"):
        restore_or_start(tmp_path, JobConfig(**{**job.to_dict(), "seed": 99}), CLUSTER, other, choose)


def test_restart_restores_the_controller_and_rechooses_the_allocation(tmp_path):
    job = JobConfig(initial_global_batch=16, min_global_batch=8, max_global_batch=64, min_local_batch=4)
    ctl = AdaptiveBatchController(job)
    ctl.update(0.0)
    saved = DriverState(epochs_done=2, iteration=9, cluster=CLUSTER, allocation=full_allocation(CLUSTER),
                        adaptive=ctl.state_dict(), forecast=[20.0, 22.0], job_config=job.to_dict())
    save_checkpoint(tmp_path, saved, None)
    asked = []

    def choose(cluster, forecast):
        asked.append((cluster, forecast))
        return {"n1": 1}

    slots = slots_for(CLUSTER, full_allocation(CLUSTER))          # ranks 0-1 on n0, 2-3 on n1
    other = AdaptiveBatchController(job)
    cp, state, events = restart(tmp_path, ActorFailure([1], RuntimeError("x")), [slots[1]], other,
                                choose, alive_nodes=set())
    left = ClusterSpec(nodes=[replace(CLUSTER.nodes[0], num_gpus=1), CLUSTER.nodes[1]])
    assert asked == [(left, [20.0, 22.0])]   # n0 keeps its other GPU
    assert (state.cluster, state.allocation, state.epochs_done) == (asked[0][0], {"n1": 1}, 2)
    assert other.state_dict() == ctl.state_dict()
    assert events == [f"GPU actor failure: rank 1 (fast on n0) (RuntimeError); restarting epoch 3 "
                      f"from {cp.path.name} without that GPU, allocation {{'n1': 1}}"]


def test_take_reprofile_counts_against_the_budget():
    job = JobConfig(min_local_batch=8, min_global_batch=16, initial_global_batch=64)
    correction = OnlineCorrection(smoothing=1.0, threshold=2.0)
    planner = JobPlanner(job, 3000, correction=correction, max_reprofiles=1)
    planner.use_model(perf_model(min_local_batch=8, max_local_batch=64))
    assert planner.take_reprofile() is None and planner.reprofiles == 0     # nothing measured
    planner.observe(["fast"], 1.0, 3.0)                                     # 3x off: beyond x2
    note = planner.reprofile_note()
    assert note is not None and planner.take_reprofile() == note and planner.reprofiles == 1
    assert planner.take_reprofile() is None and planner.reprofile_note() == note   # budget spent
    fixed = JobPlanner(job, 3000, correction=correction)                    # given model: 0
    assert fixed.reprofile_note() == note and fixed.take_reprofile() is None


def _slots(types):
    return [Slot(rank=r, node="n0", gpu_type=t, speed=1.0, group=r % 2, pair=r // 2)
            for r, t in enumerate(types)]


def test_placement_learners_continue_the_checkpointed_counts_on_the_same_gpus():
    opts = DriverOptions()
    iidp = JobConfig()
    assert placement_learners(iidp, opts, _slots("aa"), {"w": 1}) == (None, None)
    sma = JobConfig(sync="sma", sma_learners=2)
    restored, fresh = placement_learners(sma, opts, _slots("aabb"), None)   # fresh actors
    assert restored is None and fresh.counts == [2, 2, 2, 2] and fresh.pairs == {
        "pair0": ["rank0", "rank1"], "pair1": ["rank2", "rank3"]}
    ws = pack_sma([{"r": r} for r in range(4)], [3, 3, 1, 1], list("aabb"), fresh.tuner_json())
    restored, learners = placement_learners(sma, opts, _slots("aabb"), ws)
    assert restored.states == [{"r": r} for r in range(4)] and learners.counts == [3, 3, 1, 1]
    assert learners.tuner_json() == fresh.tuner_json()
    assert learners.pack(restored.states, list("aabb")) == ws          # round trip
    fixed = placement_learners(sma, DriverOptions(sma_autotune=False), _slots("aabb"), ws)[1]
    assert fixed.tuner is None and fixed.counts == [3, 3, 1, 1]


def test_multi_node():
    assert not multi_node(_slots("ab")) and multi_node(
        [Slot(rank=0, node="n0", gpu_type="a", speed=1.0, group=0, pair=0),
         Slot(rank=1, node="n1", gpu_type="a", speed=1.0, group=1, pair=0)])


def test_training_metrics_are_reduced_by_sample_counts_exactly():
    """step_fn metrics: every forward reports its batch mean; ranks, intervals and the epoch sum
    mean x samples and divide by the samples (float64), which equals the plain mean over every
    sample the epoch trained on - whatever the forwards' sizes; they reach the CSV row
    (train_<name>), the epoch line and Result.metrics (the flat row)."""
    import random
    from jabasray.actors.metrics import MetricsHistory, epoch_line, metrics_csv

    rng = random.Random(3)
    tally, every = EpochTally(), []
    for i in range(3):                                  # intervals
        replies = []
        for rank in range(3):                           # ranks with different forward sizes
            sums, counts = {"acc": 0.0}, {"acc": 0}
            for _ in range(rng.randint(1, 4)):          # forwards (VSW micro-batches, ragged)
                vals = [rng.random() for _ in range(rng.randint(1, 9))]
                every.extend(vals)
                sums["acc"] += (sum(vals) / len(vals)) * len(vals)
                counts["acc"] += len(vals)
            r = _reply(counts["acc"])
            r.metric_sums, r.metric_counts = sums, counts
            replies.append(r)
        rec = interval_record(replies, 1.0, epoch=0, interval=i, iteration=0, cursor=0,
                              requested_global_batch=8, global_batch=8, local_batch=4, plan=None)
        assert rec.train_metric_counts["acc"] == sum(r.metric_counts["acc"] for r in replies)
        tally.add(rec)
        tally_last = rec
    rec = epoch_record(tally, epoch=0, allocation={"n0": 2}, gpu_types=["fast"] * 2, trajectory=[8],
                       forecast=[], val_metrics={"accuracy": 0.5}, replaced=False, predicted_time_s=None,
                       time_s=1.0)
    assert rec.train_metrics["acc"] == pytest.approx(math.fsum(every) / len(every), rel=1e-13)
    assert rec.flat()["train_acc"] == rec.train_metrics["acc"]
    assert f"train acc {rec.train_metrics['acc']:.4f}" in epoch_line(rec)
    hist = MetricsHistory(epochs=[rec])
    header, row = metrics_csv(hist).splitlines()[:2]
    assert "train_acc" in header.split(",")
    back = type(rec).from_dict(rec.to_dict())
    assert back.train_metrics == rec.train_metrics
    # the trackers get the means as train_<name> (the CSV's names), never the raw sums
    from jabasray.actors.callbacks import scalar_metrics
    for record, prefix in ((rec, "epoch"), (tally_last, "interval")):
        got = scalar_metrics(record, prefix)
        assert got[f"{prefix}/train_acc"] == record.train_metrics["acc"]
        assert not any("metric_sums" in k or "metric_counts" in k or "train_metrics/" in k for k in got)
