"""JobConfig.max_local_batch (AdaptDL's local_bsz_bounds upper bound): validated in one line,
honoured by every plan the job's planner makes (against the solver on a capped model, and the
uncapped optimum differs), and handed to the profiler."""
from __future__ import annotations

import pytest

from actors_helpers import perf_model
from jabasray.config import JobConfig
from jabasray.planners.config_solver import LocalBatchBound
from jabasray.planners.job_planner import JobPlanner, plan_tolerance
from jabasray.planners.plan_policy import solve_for_batch
from jabasray.types import ClusterSpec, NodeSpec


@pytest.mark.parametrize("value, message", [
    (4, r"^max_local_batch must be an integer >= 8, got 4$"),
    (0, r"^max_local_batch must be an integer >= 8, got 0$"),
    (16.5, r"^max_local_batch must be an integer >= 8, got 16.5$"),
    ("32", r"^max_local_batch must be an integer >= 8, got '32'$"),
])
def test_bad_max_local_batch_is_one_line(value, message):
    with pytest.raises(ValueError, match=message):
        JobConfig(min_local_batch=8, max_local_batch=value)


@pytest.mark.parametrize("units", [["fast"], ["fast", "fast/solo"], ["fast/solo"]])
def test_every_plan_respects_the_bound(units):
    base = perf_model(min_local_batch=8, max_local_batch=64)
    free_job = JobConfig(min_local_batch=8, min_global_batch=16, initial_global_batch=64, max_global_batch=1024)
    job = JobConfig(**{**free_job.to_dict(), "max_local_batch": 16})
    capped, free = JobPlanner(job, 4096), JobPlanner(free_job, 4096)
    capped.use_model(base)
    free.use_model(base)
    n = sum(1 if u.endswith("/solo") else 2 for u in units)
    differs = False
    for bg in (16, 48, 64, 96, 200, 512, 1000):
        plan = capped.plan(bg, units, False)
        assert plan.local_batch_size <= 16
        want = solve_for_batch(bg, units, LocalBatchBound(base.for_allocation(n, False), 16), 8,
                               tolerance=plan_tolerance(job))
        assert plan == want
        differs |= free.plan(bg, units, False).local_batch_size > 16
    assert differs          # the bound is what changed the plans
    assert capped.alloc_model(n, False).max_local_batch("fast") == 16


def test_profiling_gets_the_bound(monkeypatch, tmp_path):
    from jabasray.profiler import cluster as pc
    from jabasray.profiler import measure

    seen = {}

    def fake_profile_model(*args, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(measure, "profile_model", fake_profile_model)
    job = JobConfig(min_local_batch=4, min_global_batch=8, initial_global_batch=16, max_local_batch=12)
    cl = ClusterSpec(nodes=[NodeSpec("n0", "fast", 1)])
    with pytest.raises(RuntimeError, match="stop here"):
        pc.job_perf_model(lambda: None, [(0, 0)], cl, job, loss_fn=None, optimizer_fn=None, device="cpu",
                          emulate=True, torch_threads=1, bucket_cap_mb=1.0, cache_dir=tmp_path)
    assert seen["max_local_batch"] == 12 and seen["min_local_batch"] == 4
