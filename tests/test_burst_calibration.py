"""Burst mode's predicted interval times (actors.burst_host.BurstIntervals), without Ray.

A stub plan source and a stub pool stand in for the planner and the actors. Every interval's
record carries a prediction (so the epoch line compares the training time with a prediction,
not with 0), the first interval predicts the planner's time, and each next one the planner's
time times the calibration factor learnt from the intervals before it: the log-EWMA
(smoothing 0.5) of measured / predicted per-iteration time, recomputed here from the records.
"""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from jabasray.actors.burst_host import BurstIntervals
from jabasray.actors.gpu_actor import IntervalReply
from jabasray.actors.metrics import EpochTally, epoch_line, epoch_record
from jabasray.config import JobConfig

PLANNED_S = 0.002      # the stub planner's iteration time (the real one under-predicts too)
STEP_S = 0.01          # what an iteration takes in the stub actors


class Plans:
    def plan(self, global_batch, total_gpus):
        return SimpleNamespace(iteration_time=PLANNED_S, gpu_counts=[2, 1], amplification_limit=2.0,
                               blocks=[], to_dict=lambda: {})


class Pool:
    slots = [0, 1]

    def call_all(self, *args):
        return None


def train(req):
    time.sleep(STEP_S * req.num_iterations)
    reply = IntervalReply(rank=0, num_iterations=req.num_iterations, samples=req.num_iterations * 16,
                          loss=1.0, phi=None, lr=0.1, compute_time=0.0, comm_time=0.0,
                          update_time=0.0, emulation_sleep=0.0, wall_time=STEP_S,
                          end_cursor=req.cursor + 16 * req.num_iterations)
    return [reply], reply.end_cursor


def test_burst_intervals_predict_with_the_calibration_learnt_before_them():
    job = JobConfig(parallelism="burst", adapt_interval=2, initial_global_batch=16,
                    min_global_batch=16, min_local_batch=8, adaptive=False)
    bursts = BurstIntervals(Plans())
    tally, records, cursor = EpochTally(), [], 0
    for k in range(4):
        rec, cursor = bursts.run(job, 128, 0, 2 * k, k, cursor, 16, Pool(), train)
        records.append(rec)
        tally.add(rec)
    log_factor = 0.0
    for rec in records:
        factor = math.exp(log_factor)
        assert rec.burst["calibration_factor"] == pytest.approx(factor)
        assert rec.predicted_time_s == pytest.approx(PLANNED_S * factor * rec.num_iterations)
        measured = rec.time_s / rec.num_iterations
        assert rec.burst["measured_iteration_s"] == pytest.approx(measured)
        log_factor += 0.5 * math.log(measured / (PLANNED_S * factor))
    assert records[0].burst["calibration_factor"] == 1.0
    # the calibrated error shrinks from the planner's (about 5x under) towards the measured time
    assert abs(records[-1].burst["calibrated_error"]) < abs(records[0].burst["calibrated_error"])
    rec = epoch_record(tally, epoch=0, allocation={"fast": 1}, gpu_types=["fast", "fast"],
                       trajectory=[16], forecast=[], val_metrics={}, replaced=False,
                       predicted_time_s=None, time_s=1.0)
    assert rec.predicted_train_time_s == pytest.approx(sum(r.predicted_time_s for r in records))
    assert rec.predicted_train_time_s > 0
    assert f"vs predicted {rec.predicted_train_time_s:.1f}s" in epoch_line(rec)
