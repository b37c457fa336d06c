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
                                            probe_points)
from jabasray.planners.autoscale import epoch_time
from jabasray.planners.interval_model import (TERMS, EmulationCost, HostCosts, interval_terms, line_fit,
                                              plan_interval_terms, rank_samples)
from jabasray.planners.perf_model import PerfModel
from jabasray.planners.plan_policy import solve_for_batch
from jabasray.profiles import synthetic_profile
from jabasray.types import Plan, WorkerConfig, solo_unit

COSTS = HostCosts(call_s=0.004, configure_s=0.011, loader_fixed_s=0.0003,
                  loader_per_sample_s=2e-5, similarity_s=0.006, read_s=0.0001)


def test_interval_terms_are_the_named_sum():
    t = interval_terms(0.02, 5, COSTS, samples_per_rank=48, configure=True)
    assert list(t) == list(TERMS)
    assert t["steps"] == 5 * 0.02
    assert t["loader"] == pytest.approx(5 * (0.0003 + 48 * 2e-5), rel=1e-12)
    assert (t["similarity"], t["read"], t["call"], t["configure"]) == (0.006, 0.0001, 0.004, 0.011)
    assert interval_terms(0.02, 5, COSTS, 48, configure=False)["configure"] == 0.0
    # nothing measured yet: Eq. 6 alone
    assert interval_terms(0.02, 5, None, 48, True) == {"steps": 0.1, "loader": 0.0, "similarity": 0.0,
                                                       "read": 0.0, "call": 0.0, "configure": 0.0}
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
    remaining, total, previous, chunk = n, 0.0, None, 0
    while remaining > 0:
        plan = solve_for_batch(traj[min(chunk, len(traj) - 1)], group, model, 8)
        its = min(p, math.ceil(remaining / plan.global_batch_size))
        terms = interval_terms(plan.iteration_time, its, COSTS, rank_samples(plan), plan != previous)
        total += sum(terms.values())
        remaining -= its * plan.global_batch_size
        previous, chunk = plan, chunk + 1
    assert est.epoch_time == pytest.approx(total, rel=1e-12)
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
    assert (c.similarity_s, c.read_s) == (0.005, 2e-4)
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


def test_measured_terms_take_each_terms_slowest_rank():
    fast = SimpleNamespace(wall_time=0.10, terms={"steps": 0.08, "loader": 0.01, "similarity": 0.005, "read": 0.001})
    slow = SimpleNamespace(wall_time=0.12, terms={"steps": 0.11, "loader": 0.004, "similarity": 0.002, "read": 0.001})
    got = measured_terms([fast, slow], call_s=0.13, configure_s=0.02)
    assert got == pytest.approx({"steps": 0.11, "loader": 0.01, "similarity": 0.005, "read": 0.001,
                                 "call": 0.01, "configure": 0.02})
    assert list(got) == list(TERMS)
