"""Training metrics (``(loss, {name: mean})`` from the user's step) in SMA and burst modes,
reduced by sample counts exactly as in IIDP mode (``engine.train_metrics``), on the session Ray
instance with two emulated GPUs.

Reference: the ``label`` metric is the batch mean of the targets, so the exact interval value
is the mean target over the samples the actors actually served in that interval (SMA: the
indices they report, ``record_samples``; burst: the epoch permutation from the interval's
cursor, ``samples`` long) and the epoch value the mean over all intervals' samples. A plain
mean of per-step (or per-learner, per-rank) means differs whenever a step is ragged: 100
samples at B_G 16 end each epoch with a 4-sample step.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from actors_helpers import metric_loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.actors.metrics import epoch_line
from jabasray.config import JobConfig
from jabasray.engine.sampler import epoch_permutation
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.ray

N, BATCH = 100, 16


def check_reduction(hist, run_dir, labels, served_of):
    """Every interval's and epoch's ``label`` equals the exact mean over the served samples;
    counts are the samples; the epoch's metrics reach metrics.csv/json and the epoch line."""
    assert len(hist.intervals) > 2
    for e in hist.epochs:
        every = []
        for rec in (r for r in hist.intervals if r.epoch == e.epoch):
            served = served_of(rec)
            assert len(served) == rec.samples > 0
            assert rec.train_metric_counts == {"label": rec.samples, "acc": rec.samples, "one": rec.samples}
            assert rec.train_metrics["label"] == pytest.approx(
                math.fsum(labels[served]) / len(served), rel=1e-12, abs=1e-12)
            assert rec.train_metrics["one"] == 1.0
            every += list(served)
        assert sorted(every) == list(range(N))            # each sample once in the epoch
        assert e.train_metrics["label"] == pytest.approx(math.fsum(labels[every]) / N, rel=1e-12)
        assert 0.0 <= e.train_metrics["acc"] <= 1.0
        assert f"train label {e.train_metrics['label']:.4f}" in epoch_line(e)
    # the unweighted mean of interval means is not the answer (the reduction is by samples)
    e0 = [r for r in hist.intervals if r.epoch == 0]
    naive = sum(r.train_metrics["label"] for r in e0) / len(e0)
    assert abs(naive - hist.epochs[0].train_metrics["label"]) > 1e-6
    csv = (run_dir / "metrics.csv").read_text().splitlines()
    header = csv[0].split(",")
    assert "train_label" in header and "train_acc" in header
    last = dict(zip(header, csv[-1].split(",")))
    assert float(last["train_label"]) == pytest.approx(hist.epochs[-1].train_metrics["label"], rel=1e-12)
    saved = json.loads((run_dir / "metrics.json").read_text())
    assert saved["intervals"][0]["train_metric_counts"]["label"] == hist.intervals[0].samples


def test_sma_mode_reduces_training_metrics_by_samples(ray_session, tmp_path):
    ds, _ = tiny_data(N)
    labels = ds.tensors[1].double().numpy()
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])
    job = JobConfig(epochs=2, sync="sma", sma_learners=2, initial_global_batch=BATCH,
                    min_global_batch=BATCH, max_global_batch=BATCH, min_local_batch=4,
                    adapt_interval=2, adaptive=False, autoscale=False, lr=0.05, seed=5)
    run = tmp_path / "run"
    hist = JabasDriver(model_fn, ds, optimizer_fn, metric_loss_fn, job, cluster, run,
                       perf_model=perf_model(),
                       options=DriverOptions(evaluate=False, record_samples=True,
                                             sma_autotune=False)).run()
    assert all(r.learners == [2, 2] for r in hist.intervals)
    check_reduction(hist, run, labels, lambda rec: np.asarray(rec.served))


def test_burst_mode_reduces_training_metrics_by_samples(ray_session, tmp_path):
    ds, _ = tiny_data(N)
    labels = ds.tensors[1].double().numpy()
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])
    job = JobConfig(epochs=2, parallelism="burst", amp_limit=3.0, initial_global_batch=BATCH,
                    min_global_batch=BATCH, max_global_batch=BATCH, min_local_batch=4,
                    adapt_interval=3, adaptive=False, lr_scaling="none", lr=0.05, seed=3)
    run = tmp_path / "run"
    hist = JabasDriver(model_fn, ds, optimizer_fn, metric_loss_fn, job, cluster, run,
                       options=DriverOptions(evaluate=False)).run()

    def served(rec):
        perm = np.asarray(epoch_permutation(job.seed, rec.epoch, N))
        return perm[rec.cursor:rec.cursor + rec.samples]
    check_reduction(hist, run, labels, served)
