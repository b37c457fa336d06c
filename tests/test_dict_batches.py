"""A job whose batches are dicts (a step_fn, as most language models have) is profiled through
its own step_fn and collate_fn, so it needs no given profiles: the profiler's timed steps run
the user's step on the user's batches; end to end, such a job trains on Ray without profiles."""
from __future__ import annotations

import sys

import pytest
import torch
from ray import cloudpickle
import torch.nn.functional as F

from actors_helpers import model_fn, optimizer_fn
from jabasray.actors.hooks import JobHooks, probe_job


def dict_rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return [{"features": x[i], "label": y[i]} for i in range(n)]


def collate(rows):
    return {"features": torch.stack([r["features"] for r in rows]),
            "label": torch.stack([r["label"] for r in rows])}


class CountingStep:
    """step_fn over dict batches; counts the samples it saw (picklable, plain object)."""

    def __init__(self) -> None:
        self.samples = 0

    def __call__(self, model, batch):
        assert isinstance(batch, dict)
        self.samples += len(batch["label"])
        out = model(batch["features"])
        acc = (out.argmax(1) == batch["label"]).double().mean()
        return F.cross_entropy(out, batch["label"]), {"acc": acc}   # with a training metric


# Ray workers cannot import this test module: ship its functions and classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_profile_runs_the_jobs_step_on_its_dict_batches(tmp_path):
    from jabasray.profiler.measure import profile_model

    step = CountingStep()
    prof = profile_model(model_fn, dict_rows(40), step_fn=step, collate_fn=collate, min_local_batch=4,
                         max_local_batch=8, warmup=0, repeats=1, allreduce=False, max_num_vsw=2)
    assert [b.local_batch for b in prof.batches] == [4, 8]
    assert all(b.compute_time_1 > 0 and 0 <= b.zeta <= 1 for b in prof.batches)
    assert step.samples > 0                        # the timed steps ran the user's step
    # the probe hands such rows to the profiler as plain samples (not only tensor pairs)
    report = probe_job(model_fn, optimizer_fn, None, JobHooks(step_fn=step, collate_fn=collate),
                       dataset=dict_rows(100), want_profile_rows=True)
    assert report.error is None and isinstance(report.profile_rows, list) and len(report.profile_rows) == 64
    assert set(report.profile_rows[0]) == {"features", "label"}
    plain = probe_job(model_fn, optimizer_fn, None, JobHooks(collate_fn=collate), dataset=dict_rows(100),
                      want_profile_rows=True)
    assert plain.error is not None                 # no step_fn: the default step needs (x, y)


@pytest.mark.ray
def test_dict_batch_job_trains_without_given_profiles(ray_session, host_measurements, tmp_path):
    from jabasray.actors.driver import DriverOptions, JabasDriver
    from jabasray.config import JobConfig
    from jabasray.types import ClusterSpec, NodeSpec

    rows = dict_rows(160)
    job = JobConfig(epochs=1, initial_global_batch=16, min_global_batch=8, max_global_batch=32,
                    min_local_batch=4, max_local_batch=8, adapt_interval=2, autoscale=False, seed=0)
    report = probe_job(model_fn, optimizer_fn, None, JobHooks(step_fn=CountingStep(), collate_fn=collate),
                       dataset=rows, want_profile_rows=True)
    # one GPU (a solo unit still runs a plan): dict batches train for any GPU count, and each GPU
    # actor is a Ray worker importing torch
    drv = JabasDriver(model_fn, rows, optimizer_fn, None, job,
                      ClusterSpec(nodes=[NodeSpec("n0", "fast", 1, speed=1.0)]), tmp_path / "run",
                      hooks=JobHooks(step_fn=CountingStep(), collate_fn=collate),
                      profile_data=report.profile_rows,
                      options=DriverOptions(evaluate=False,
                                            profile_cache_dir=str(host_measurements(tmp_path / "prof"))))
    hist = drv.run()
    assert [e.epoch for e in hist.epochs] == [0]
    assert sum(r.samples for r in hist.intervals) == len(rows)
    assert all(r.plan is not None and r.plan.local_batch_size <= 8 for r in hist.intervals)
    profiled = [f for f in (tmp_path / "prof").glob("*.json")
                if not f.name.startswith(("allreduce-", "contention-"))]   # beside the host's
    assert len(profiled) == 1                                # profiled, not given
    acc = hist.epochs[0].train_metrics["acc"]               # the step's metric, epoch mean
    assert 0.0 <= acc <= 1.0 and hist.epochs[0].flat()["train_acc"] == acc
    assert sum(r.train_metric_counts["acc"] for r in hist.intervals) == len(rows)
