"""An interval's prediction as the sum of named terms (planners/interval_model.py), the terms
measured on placed actors (actors/interval_costs.py), the emulation's cost inside the
iteration-time model, and the auto-scaler's epoch time as the sum of the same interval terms.
No Ray, no torch: reference computations by hand."""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest

from jabasray.actors.interval_costs import (emulation_fits, host_costs, measured_terms,
                                            probe_points, ragged_extra)
from jabasray.planners.autoscale import epoch_time
from jabasray.engine.sampler import iteration_indices
from jabasray.planners.interval_model import (TERMS, EmulationCost, HostCosts, interval_terms, line_fit,
                                              plan_interval_terms, ragged_iteration_time, ragged_remainder,
                                              ragged_step_time, rank_samples)
from jabasray.planners.perf_model import PerfModel
from jabasray.planners.plan_policy import solve_for_batch
from jabasray.profiles import synthetic_profile
from jabasray.types import Plan, WorkerConfig, solo_unit

COSTS = HostCosts(call_s=0.004, configure_s=0.011, loader_fixed_s=0.0003,
                  loader_per_sample_s=2e-5, similarity_s=0.006, read_s=0.0001,
                  ragged_fixed_s=0.003, ragged_per_worker_s=0.001)


def test_interval_terms_are_the_named_sum():
    t = interval_terms(0.02, 5, COSTS, samples_per_rank=48, configure=True)
    assert list(t) == list(TERMS)
    assert t["steps"] == 5 * 0.02
    assert t["loader"] == pytest.approx(5 * (0.0003 + 48 * 2e-5), rel=1e-12)
    assert (t["similarity"], t["read"], t["call"], t["configure"]) == (0.006, 0.0001, 0.004, 0.011)
    assert interval_terms(0.02, 5, COSTS, 48, configure=False)["configure"] == 0.0
    # nothing measured yet: Eq. 6 alone
    assert interval_terms(0.02, 5, None, 48, True) == {"steps": 0.1, "ragged": 0.0, "loader": 0.0,
                                                       "similarity": 0.0, "read": 0.0, "call": 0.0,
                                                       "configure": 0.0}
    # the last of the 5 iterations is the epoch's ragged one: 4 full steps and its own time
    r = interval_terms(0.02, 5, COSTS, 48, True, ragged_time=0.05, ragged_samples_per_rank=20)
    assert (r["steps"], r["ragged"]) == (4 * 0.02, 0.05)
    assert r["loader"] == pytest.approx(4 * (0.0003 + 48 * 2e-5) + 0.0003 + 20 * 2e-5, rel=1e-12)
    assert {k: v for k, v in r.items() if k not in ("steps", "ragged", "loader")} == \
        {k: v for k, v in t.items() if k not in ("steps", "ragged", "loader")}
    assert sum(interval_terms(0.02, 0, COSTS, 48, True).values()) == 0.0


@pytest.mark.parametrize("field", ["call_s", "configure_s", "loader_fixed_s", "loader_per_sample_s",
                                   "similarity_s", "read_s"])
def test_host_costs_refuse_negative_terms(field):
    with pytest.raises(ValueError, match=field):
        HostCosts(**{field: -1.0})


def test_rank_samples_counts_a_solo_gpu_twice():
    plan = Plan(global_batch_size=0, local_batch_size=8, iteration_time=0.01,
                workers=[WorkerConfig("fast", 2, 1), WorkerConfig(solo_unit("slow"), 3, 0)])
    assert rank_samples(plan) == 8 * max(2 * 2, 3 * 1 * 2)
    terms = plan_interval_terms(plan, 4, COSTS, configure=False)
    assert terms == interval_terms(0.01, 4, COSTS, 48, False)


@pytest.mark.parametrize("local_batch, layout", [(1, [1]), (3, [2, 1]), (4, [3, 3]), (5, [1, 2, 2])])
def test_ragged_remainder_is_the_samplers_last_iteration(local_batch, layout):
    """Every interval of 1-4 iterations from every cursor the sampler reaches, on every dataset
    size up to 70: the remainder is what the sampler's last iteration of the interval consumes
    when that one is ragged (0 otherwise), and ceil(R / W) is the largest micro-batch it hands
    out (the size the ragged step is predicted at)."""
    workers = sum(layout)
    full = local_batch * workers
    for size in range(1, 71):
        for p in range(1, 5):
            cursor = 0
            while cursor < size:
                its = []
                for _ in range(p):
                    if its and its[-1][0].epoch_end:
                        break
                    at = its[-1][0].next_cursor if its else cursor
                    its.append([iteration_indices(0, 0, at, local_batch, layout, r, size)
                                for r in range(len(layout))])
                last = its[-1]
                got = ragged_remainder(size - cursor, len(its), full)
                if last[0].ragged:
                    assert got == last[0].global_batch > 0
                    assert max(len(mb) for rank in last for mb in rank.micro_batches) == \
                        math.ceil(got / workers)
                else:
                    assert got == 0
                cursor = its[0][0].next_cursor      # the next interval starts one iteration on


def test_ragged_iteration_time_runs_each_gpus_workers_per_vsw():
    """A GPU runs a ragged step per VSW, its VSWs concurrently as the profile's VSWs: Eq. 6 at
    its VSWs and GA steps and ceil(R / W) samples, plus the measured extra (fixed, and per
    decoupled worker of the GPU); the slowest GPU sets the pace. A solo GPU runs both groups'
    workers."""
    model = _model().with_measured_costs(COSTS, {}).for_allocation(3, False)
    plan = Plan(global_batch_size=8 * 2 * (4 + 3), local_batch_size=8, iteration_time=0.01,
                workers=[WorkerConfig("fast", 2, 1), WorkerConfig(solo_unit("slow"), 3, 0)])
    want = max(model.iteration_time("fast", 4, 2, 1) + 0.003 + 4 * 0.001,
               model.iteration_time("slow", 4, 6, 0) + 0.003 + 6 * 0.001)
    assert ragged_step_time(model, "slow", 6, 0, 4) == model.iteration_time("slow", 4, 6, 0)
    assert ragged_iteration_time(plan, 50, model, COSTS) == pytest.approx(want, rel=1e-12)
    terms = plan_interval_terms(plan, 3, COSTS, remainder=50, model=model)
    assert terms["ragged"] == pytest.approx(want, rel=1e-12) and terms["steps"] == pytest.approx(0.02)
    # the loader reads two full batches of the busiest GPU (the solo one: 8 x 6) and a ragged one
    assert terms["loader"] == pytest.approx(2 * COSTS.loader_s(8 * 6) + COSTS.loader_s(4 * 6), rel=1e-12)
    # no model (a plan alone): the ragged step is charged a full iteration
    assert plan_interval_terms(plan, 3, COSTS, remainder=50)["ragged"] == 0.01
    assert plan_interval_terms(plan, 3, COSTS)["ragged"] == 0.0
    # a ragged step never takes less than nothing, whatever the measured extra
    assert ragged_iteration_time(plan, 50, model, HostCosts(ragged_fixed_s=-10.0)) == 0.0


def test_ragged_extra_is_the_line_through_the_median_residuals_per_vsw_count():
    """Per probed ragged step the slowest rank's pace minus the slowest rank's Eq. 6 at its
    (VSWs, size); the line through the median residual at one VSW and at four: its value at 0
    VSWs and its slope; signed; one count: its median, slope 0; (0, 0) without ragged steps."""
    model = _model()
    steps_a = [[1, 7, 0.050], [4, 6, 0.200], [1, 5, 0.040], [4, 3, 0.120], [1, 4, 0.900], [4, 2, 0.110]]
    steps_b = [[1, 7, 0.060], [4, 6, 0.190], [1, 5, 0.045], [4, 3, 0.100], [1, 4, 0.030], [4, 2, 0.100]]
    replies = [{"gpu_type": "fast", "ragged": steps_a}, {"gpu_type": "slow", "ragged": steps_b}]
    res = [max(a[2], b[2]) - max(model.iteration_time("fast", a[1], a[0], 0),
                                 model.iteration_time("slow", a[1], a[0], 0))
           for a, b in zip(steps_a, steps_b)]
    at1, at4 = sorted(res[0::2])[1], sorted(res[1::2])[1]     # (one slow step, 0.9 s, is not the median)
    slope = (at4 - at1) / 3
    assert ragged_extra(replies, model) == pytest.approx((at1 - slope, slope), rel=1e-12)
    one = [{"gpu_type": "fast", "ragged": steps_a[0:3:2]}]
    assert ragged_extra(one, model) == pytest.approx(
        ((steps_a[0][2] - model.iteration_time("fast", 7, 1, 0)
          + steps_a[2][2] - model.iteration_time("fast", 5, 1, 0)) / 2, 0.0), rel=1e-12)
    assert ragged_extra([{"gpu_type": "fast", "ragged": []}], model) == (0.0, 0.0)
    assert ragged_extra([{"gpu_type": "fast"}], model) == (0.0, 0.0)


def test_emulation_cost_is_the_least_squares_line_with_its_signs_kept():
    cost = EmulationCost.through([(0.001, 0.005), (0.004, 0.011)])
    assert (cost.a, cost.b) == pytest.approx((0.003, 2.0))
    assert cost.time(0.002) == pytest.approx(0.007)
    xs = [0.001, 0.002, 0.003, 0.005]
    ys = [0.004, 0.0061, 0.0079, 0.0121]
    b = (sum(x * y for x, y in zip(xs, ys)) - sum(xs) * sum(ys) / 4) / (sum(x * x for x in xs) - sum(xs) ** 2 / 4)
    got = EmulationCost.through(list(zip(xs, ys)))
    assert (got.a, got.b) == pytest.approx((sum(ys) / 4 - b * sum(xs) / 4, b), rel=1e-9)
    # a negative intercept: through the origin instead
    origin = EmulationCost.through([(0.001, 0.001), (0.004, 0.010)])
    assert (origin.a, origin.b) == (0.0, pytest.approx((0.001 * 0.001 + 0.004 * 0.010) / (0.001 ** 2 + 0.004 ** 2)))
    one = EmulationCost.through([(0.002, 0.005)])             # one point: an offset
    assert (one.a, one.b) == pytest.approx((0.003, 1.0))
    falling = EmulationCost.through([(0.001, 0.006), (0.004, 0.005)])   # noise: never a speed-up
    assert falling.b == 1.0 and falling.a == pytest.approx(0.0055 - 0.0025)
    for bad in (dict(a=-0.001, b=1.0), dict(a=0.0, b=0.0)):
        with pytest.raises(ValueError, match="emulation_cost"):
            EmulationCost(**bad)
    with pytest.raises(ValueError, match="point"):
        EmulationCost.through([])


def _model(**kw) -> PerfModel:
    return PerfModel({"fast": synthetic_profile("fast"), "slow": synthetic_profile("slow", time_per_sample=3e-3)},
                     num_gpus=4, **kw)


def test_perf_model_adds_the_emulation_term_to_eq6():
    plain = _model()
    cost = EmulationCost(a=0.002, b=1.5)
    emu = plain.with_measured_costs(COSTS, {"slow": cost})
    for bl, n, ga in itertools.product((8, 16, 24), (1, 2), (0, 2)):
        base = plain.breakdown("slow", bl, n, ga)
        got = emu.breakdown("slow", bl, n, ga)
        assert got.total == pytest.approx(0.002 + 1.5 * base.total, rel=1e-12)
        assert got.t_emulation == pytest.approx(got.total - base.total, rel=1e-12)
        assert emu.model_iteration_time("slow", bl, n, ga) == pytest.approx(base.total, rel=1e-12)
        assert emu.iteration_time("fast", bl, n, ga) == plain.iteration_time("fast", bl, n, ga)
        vec = emu.iteration_times("slow", bl, n, [ga])[0]
        assert vec == pytest.approx(got.total, rel=1e-12)
    # the measured costs travel with every copy the planners make
    other = emu.for_allocation(2, True)
    assert other.host_costs is COSTS and other.emulation_fits == {"slow": cost}
    assert emu.with_profiles(emu.profiles).emulation_fits == {"slow": cost}


def test_epoch_time_sums_the_interval_terms_of_the_plans_run():
    """Walk the epoch by hand: chunks of p iterations at each B_G of the trajectory, each the
    plan's interval terms, a changed plan charged its configure call."""
    model = _model().with_measured_costs(COSTS, {}).for_allocation(2, False)
    group, traj, n, p = ["fast"], [32, 32, 64], 500, 3
    est = epoch_time(group, model, traj, n, p, 8)
    remaining, total, previous, chunk, ragged_seen = n, 0.0, None, 0, []
    while remaining > 0:
        plan = solve_for_batch(traj[min(chunk, len(traj) - 1)], group, model, 8)
        its = min(p, math.ceil(remaining / plan.global_batch_size))
        last = remaining - (its - 1) * plan.global_batch_size     # the interval's last iteration
        ragged, ragged_read = None, 0
        if last < plan.global_batch_size:                         # ... is the epoch's ragged one
            workers = plan.global_batch_size // plan.local_batch_size
            ragged_read = math.ceil(last / workers) * max(w.num_workers for w in plan.workers)
            ragged = max(model.iteration_time(w.gpu, math.ceil(last / workers), w.num_vsw, w.num_ga)
                         + COSTS.ragged_fixed_s + COSTS.ragged_per_worker_s * w.num_workers
                         for w in plan.workers)
            ragged_seen.append(ragged)
        terms = interval_terms(plan.iteration_time, its, COSTS, rank_samples(plan), plan != previous,
                               ragged_time=ragged, ragged_samples_per_rank=ragged_read)
        total += sum(terms.values())
        remaining -= its * plan.global_batch_size
        previous, chunk = plan, chunk + 1
    assert est.epoch_time == pytest.approx(total, rel=1e-12)
    assert len(ragged_seen) == 1     # 500 samples: the epoch ends with a ragged iteration
    bare = epoch_time(group, _model().for_allocation(2, False), traj, n, p, 8)
    assert est.epoch_time > bare.epoch_time


def test_host_costs_from_probe_replies():
    replies = [{"work_s": 0.30, "configure_s": 0.002, "similarity_s": 0.004, "read_s": 1e-4,
                "loader": [[8, 0.0010], [64, 0.0024]]},
               {"work_s": 0.32, "configure_s": 0.003, "similarity_s": 0.005, "read_s": 2e-4,
                "loader": [[8, 0.0012], [64, 0.0020]]}]
    c = host_costs(replies, call_s=0.335)
    assert c.call_s == pytest.approx(0.015)
    assert c.configure_s == pytest.approx(0.015 + 0.003)
    # the similarity collective's own time: the least of the ranks' (the last to arrive waits
    # for nobody); every other term the slowest rank's
    assert (c.similarity_s, c.read_s) == (0.004, 2e-4)
    # the slowest rank per size: (8, 1.2 ms), (64, 2.4 ms) -> a line through both
    assert c.loader_per_sample_s == pytest.approx(0.0012 / 56)
    assert c.loader_fixed_s == pytest.approx(0.0012 - 8 * 0.0012 / 56)


def test_line_fit_never_negative():
    assert line_fit([(8, 2.0), (64, 9.0)]) == pytest.approx((1.0, 0.125), rel=1e-12)
    # a negative intercept: the least-squares line through the origin instead
    assert line_fit([(8, 0.5), (64, 8.0)]) == pytest.approx((0.0, (8 * 0.5 + 64 * 8.0) / (64 + 64 ** 2)))
    assert line_fit([(8, 2.0), (64, 1.0)]) == (1.5, 0.0)
    assert line_fit([(8, 2.0)]) == (2.0, 0.0)
    assert line_fit([]) == (0.0, 0.0)
    a, b = line_fit([(1, 3.0), (2, 5.0), (3, 7.0)])
    assert (a, b) == pytest.approx((1.0, 2.0))


def test_probe_points_are_the_profiles_two_points_per_local_batch():
    model = _model()
    prof = model.profiles["fast"]
    want = []
    for b in prof.batches:
        want += [(b.local_batch, 1)] + ([(b.local_batch, b.max_num_vsw)] if b.max_num_vsw > 1 else [])
    assert probe_points(model, "fast") == want
    assert probe_points(model, "other") == [] and probe_points(object(), "fast") == []


def test_emulation_fits_take_the_pace_or_each_types_own_time():
    model = _model()
    points = [(8, 1), (8, 4), (16, 1)]
    x = [model.model_iteration_time("fast", bl, n, 0) for bl, n in points]
    # per point [own times, paces] of three timed steps
    r0 = {"gpu_type": "fast", "steps": [[[0.010, 0.020, 0.012], [0.011, 0.021, 0.013]],
                                        [[0.050, 0.040, 0.041], [0.052, 0.044, 0.060]],
                                        [[0.020, 0.020, 0.020], [0.020, 0.020, 0.020]]]}
    r1 = {"gpu_type": "fast", "steps": [[[0.011, 0.011, 0.011], [0.012, 0.022, 0.016]],
                                        [[0.044, 0.044, 0.060], [0.051, 0.045, 0.061]],
                                        [[0.030, 0.030, 0.030], [0.030, 0.030, 0.031]]]}
    # one GPU type: the slowest rank's mean pace (r1 at every point) against the model's time
    fits = emulation_fits([r0, r1], points, model)
    want = EmulationCost.through([(x[0], (0.012 + 0.022 + 0.016) / 3), (x[1], (0.051 + 0.045 + 0.061) / 3),
                                  (x[2], (0.030 + 0.030 + 0.031) / 3)])
    assert (fits["fast"].a, fits["fast"].b) == pytest.approx((want.a, want.b), rel=1e-12)
    # mixed types: each type's own times, per step its slowest rank, the median over steps:
    # (.011, .020, .012) -> .012, (.050, .044, .060) -> .050, (.03, .03, .03) -> .03
    y = [model.model_iteration_time("slow", bl, n, 0) for bl, n in points]
    slow = {"gpu_type": "slow", "steps": [[[0.1] * 3, [0.1] * 3], [[0.3] * 3, [0.3] * 3], [[0.2] * 3, [0.2] * 3]]}
    fits = emulation_fits([r0, r1, slow], points, model)
    want = EmulationCost.through([(x[0], 0.012), (x[1], 0.050), (x[2], 0.030)])
    assert (fits["fast"].a, fits["fast"].b) == pytest.approx((want.a, want.b), rel=1e-12)
    want = EmulationCost.through([(y[0], 0.1), (y[1], 0.3), (y[2], 0.2)])
    assert (fits["slow"].a, fits["slow"].b) == pytest.approx((want.a, want.b), rel=1e-12)
    assert emulation_fits([r0], [], model) == {}
    assert emulation_fits([{"gpu_type": "fast", "steps": []}], points, model) == {}


def test_measured_terms_take_each_terms_slowest_rank_and_the_similaritys_least():
    fast = SimpleNamespace(wall_time=0.10, terms={"steps": 0.08, "ragged": 0.03, "loader": 0.01,
                                                  "similarity": 0.005, "read": 0.001})
    slow = SimpleNamespace(wall_time=0.12, terms={"steps": 0.11, "ragged": 0.02, "loader": 0.004,
                                                  "similarity": 0.002, "read": 0.001})
    got = measured_terms([fast, slow], call_s=0.13, configure_s=0.02)
    assert got == pytest.approx({"steps": 0.11, "ragged": 0.03, "loader": 0.01, "similarity": 0.002,
                                 "read": 0.001, "call": 0.01, "configure": 0.02})
    assert list(got) == list(TERMS)
