"""The one plan policy (jabasray.planners.solve_for_batch): checked against a reference built
from the plain Alg. 1 transcription per B_L; its search bounds; and the consistency the issue
asks for: for every B_G of a forecast trajectory, the plan the auto-scaler assumed is the plan
the driver runs (no Ray: the driver's planning runs in-process)."""
from __future__ import annotations

import pytest

from jabasray.planners import NoPlanError, solve_for_batch
from jabasray.planners.autoscale import choose_allocation
from jabasray.planners.config_solver import (MAX_LOCAL_BATCH_CANDIDATES, MAX_WORKERS_PER_GPU,
                                             solve_configuration_detailed,
                                             solve_configuration_reference)
from jabasray.planners.perf_model import PerfModel
from jabasray.profiles import synthetic_profile
from jabasray.types import ClusterSpec, NodeSpec


def model(min_bl: int = 8, num_batches: int = 6) -> PerfModel:
    base = synthetic_profile("fast", min_local_batch=min_bl, num_batches=num_batches)
    return PerfModel({"fast": base, "slow": base.scaled(0.5, "slow")})


class Cap:
    """The model with max B_L capped: Alg. 1 with min B_L = cap solves exactly that B_L."""

    def __init__(self, m, cap):
        self.m, self.cap = m, cap

    def max_local_batch(self, g):
        return min(self.m.max_local_batch(g), self.cap)

    def __getattr__(self, name):
        return getattr(self.m, name)


def reference(bg, gpus, m, min_bl, tol):
    """The policy written out from the plain O(L M^2 N_H) Alg. 1 reference, B_L by B_L."""
    def per_bl(b):
        return [p for bl in range(min_bl, m.max_local_batch("fast") + 1, min_bl)
                if (p := solve_configuration_reference(b, gpus, Cap(m, bl), bl)) is not None]
    plans = per_bl(bg)
    if not plans and bg < 2 * len(gpus) * min_bl:
        plans = per_bl(2 * len(gpus) * min_bl)
    if not plans:
        return None
    near = [p for p in plans if abs(p.global_batch_size - bg) <= tol * bg]
    if near:
        return max(near, key=lambda p: (p.throughput, -p.local_batch_size))
    return min(plans, key=lambda p: (abs(p.global_batch_size - bg), -p.throughput))


@pytest.mark.parametrize("gpus", [["fast"], ["fast", "slow"], ["fast", "fast", "slow"]])
@pytest.mark.parametrize("bg", [8, 40, 64, 70, 100, 150, 333])
@pytest.mark.parametrize("tol", [0.0, 0.05, 0.5])
def test_policy_equals_the_reference(gpus, bg, tol):
    m = model().for_allocation(2 * len(gpus), False)
    want = reference(bg, gpus, m, 8, tol)
    got = solve_for_batch(bg, gpus, m, 8, tolerance=tol)
    assert got.global_batch_size == want.global_batch_size
    assert got.local_batch_size == want.local_batch_size
    assert got.iteration_time == pytest.approx(want.iteration_time, rel=1e-12)
    assert got.requested_global_batch_size == want.requested_global_batch_size   # floor raise too


def test_policy_keeps_the_batch_where_alg1_doubles_it():
    """B_G 100 on one pair: Alg. 1 maximises B_G*/t and may round far away from 100; the policy
    stays within alpha/2 when any B_L allows it."""
    m = model().for_allocation(2, False)
    free = solve_configuration_detailed(100, ["fast"], m, 8).plan
    plan = solve_for_batch(100, ["fast"], m, 8, tolerance=0.05)
    assert abs(plan.global_batch_size - 100) <= 5
    assert abs(plan.global_batch_size - 100) <= abs(free.global_batch_size - 100)


def test_below_the_floor_runs_the_floor_and_says_so():
    m = model().for_allocation(6, False)
    plan = solve_for_batch(8, ["fast", "fast", "slow"], m, 8)
    assert plan.requested_global_batch_size == 48 and plan.global_batch_size == 48


def test_local_batches_restrict_the_candidates():
    m = model().for_allocation(2, False)
    plan = solve_for_batch(96, ["fast"], m, 8, local_batches=[16])
    assert plan.local_batch_size == 16 and plan.global_batch_size == 96
    with pytest.raises(ValueError, match="local_batches must be multiples of min_local_batch 8"):
        solve_for_batch(96, ["fast"], m, 8, local_batches=[12])
    with pytest.raises(NoPlanError, match="^global_batch: no local batch"):
        solve_for_batch(96, ["fast"], m, 8, local_batches=[800])
    with pytest.raises(ValueError, match="tolerance must be"):
        solve_for_batch(96, ["fast"], m, 8, tolerance=-0.1)


class Counting:
    """Counts the model calls the search makes (its work)."""

    def __init__(self, m):
        self.m, self.calls = m, 0

    def iteration_times(self, *a):
        self.calls += 1
        return self.m.iteration_times(*a)

    def iteration_time(self, *a):
        self.calls += 1
        return self.m.iteration_time(*a)

    def __getattr__(self, name):
        return getattr(self.m, name)


@pytest.mark.parametrize("bg", [100_000_000, 99_999_999_999, 10 ** 30])
def test_huge_batches_are_refused_before_any_work(bg):
    """The work is bounded by construction: a B_G beyond N_H * MAX_WORKERS_PER_GPU workers at the
    largest B_L is refused with an error naming global_batch, without one model evaluation; the
    solver alone skips every B_L in O(1) each and says the batch is too large."""
    m = Counting(model().for_allocation(4, False))
    with pytest.raises(NoPlanError, match=r"^global_batch: \d+ is too large for 2 GPU unit\(s\): it must be <= "):
        solve_for_batch(bg, ["fast", "slow"], m, 8)
    res = solve_configuration_detailed(bg, ["fast", "slow"], m, 8)
    assert res.plan is None and "too large" in res.reason
    assert m.calls == 0


def test_the_largest_allowed_batch_is_solved_within_the_bound():
    """Right at the bound every GPU takes at most MAX_WORKERS_PER_GPU workers."""
    m = model(num_batches=2).for_allocation(4, False)
    bg = 2 * 16 * 2 * MAX_WORKERS_PER_GPU            # B_L 16, M = N_H * K
    plan = solve_for_batch(bg, ["fast", "fast"], m, 8)
    assert plan.global_batch_size == bg
    assert all(w.num_workers <= MAX_WORKERS_PER_GPU for w in plan.workers)


def test_too_many_local_batch_candidates_names_min_local_batch():
    base = synthetic_profile("g", min_local_batch=1, num_batches=2)
    big = PerfModel({"g": base})

    class Huge:
        def max_local_batch(self, g):
            return 10 * MAX_LOCAL_BATCH_CANDIDATES

        def __getattr__(self, name):
            return getattr(big, name)
    with pytest.raises(ValueError, match="^min_local_batch must be >= 10 "):
        solve_for_batch(64, ["g"], Huge(), 1)


def test_answers_remembered_per_local_batch_and_m_are_the_plain_ones(monkeypatch):
    """``solutions`` (kept per (B_L, M) across calls on one group) changes no answer: over a
    random walk of B_G on several groups every plan equals the one solved from scratch (its
    request included) and every NoPlanError says the same; many B_G share an M (hits), and the
    memo stays within its bound, dropping its oldest answers."""
    from jabasray.planners import config_solver, plan_policy

    monkeypatch.setattr(plan_policy, "MAX_SOLUTIONS", 6)
    solved = []
    real = config_solver.solve_local_batch
    monkeypatch.setattr(plan_policy, "solve_local_batch", lambda *a, **kw: solved.append(1) or real(*a, **kw))
    rng = __import__("random").Random(3)
    m = model()
    for gpus in (["fast"], ["fast", "slow"], ["slow", "fast", "fast"], ["fast/solo", "slow"]):
        gm = m.for_allocation(2 * len(gpus), False)
        solutions, tables = {}, {}
        bg, plain_solves, memo_solves = 40, 0, 0
        for _ in range(60):
            bg = max(1, bg + rng.randint(-12, 14))
            answers = []
            for memo in (None, solutions):
                before = len(solved)
                try:
                    answers.append(solve_for_batch(bg, gpus, gm, 8, tolerance=0.05, tables=tables,
                                                   solutions=memo))
                except NoPlanError as e:
                    answers.append(e.reason)
                if memo is None:
                    plain_solves += len(solved) - before
                else:
                    memo_solves += len(solved) - before
            assert answers[0] == answers[1], (gpus, bg)
            assert len(solutions) <= 6
        assert 6 < memo_solves < plain_solves / 2, gpus     # more answers than the bound: some dropped


# ---------------------------------------------------------------------------- consistency
@pytest.mark.parametrize("counts", [(4, 2), (3, 1)])
def test_autoscaler_assumes_the_plans_the_driver_runs(counts):
    """For every B_G of a forecast trajectory (the GPR+ESM forecaster on growing trajectories),
    the plan in the auto-scaler's decision is the plan the driver's _plan gives on the chosen
    allocation's slots -- the same function, the same model retargeting, the same tolerance."""
    from actors_helpers import perf_model
    from jabasray.actors.driver import JabasDriver
    from jabasray.planners.job_planner import plan_tolerance
    from jabasray.actors.placement import group_gpus, slots_for
    from jabasray.planners.autoscale import enumerate_allocations
    from jabasray.adaptive import GBSForecaster
    from jabasray.config import JobConfig

    job = JobConfig(min_local_batch=8, min_global_batch=16, initial_global_batch=64, alpha=0.1,
                    max_global_batch=1024, adapt_interval=5)
    cluster = ClusterSpec(nodes=[NodeSpec("a0", "fast", counts[0]), NodeSpec("b0", "slow", counts[1])])
    pm = perf_model(min_local_batch=8, max_local_batch=64)
    f = GBSForecaster("ensemble", min_batch=16, max_batch=1024, random_state=0)
    f.fit([[64, 70, 77, 85, 93, 100], [100, 110, 121, 133, 146, 160]])
    forecast = [int(round(b)) for b in f.predict_epoch(3000, job.adapt_interval)]
    assert len(set(forecast)) > 3          # a real trajectory, several distinct B_G
    for objective in ("time", "cost"):
        d = choose_allocation(cluster, pm, forecast, 3000, job.adapt_interval, job.min_local_batch,
                              objective=objective, tolerance=plan_tolerance(job))
        drv = JabasDriver(lambda: None, [0] * 3000, None, None, job, cluster, "unused", perf_model=pm)
        slots = slots_for(cluster, {k: v for k, v in d.allocation.node_gpus.items() if v})
        for bg in forecast:
            assumed = d.plans[bg]
            assert drv._plan(slots, bg) == assumed, (objective, bg)
        for alloc in enumerate_allocations(cluster):   # every allocation, solo GPUs included
            slots = slots_for(cluster, {k: v for k, v in alloc.node_gpus.items() if v})
            assert group_gpus(slots) == alloc.group_gpus(cluster)
