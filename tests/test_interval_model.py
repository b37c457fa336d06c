"""An interval's prediction as the sum of named terms (planners/interval_model.py), the terms
measured on placed actors (actors/interval_costs.py), the emulation's cost inside the
iteration-time model, and the auto-scaler's epoch time as the sum of the same interval terms.
No Ray, no torch: reference computations by hand."""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from jabasray.actors.interval_costs import (PROBE_GA_ROUNDS, emulation_fits, host_costs, measured_terms,
                                            own_pace, probe_points, ragged_extra)
from jabasray.planners.autoscale import epoch_time
from jabasray.engine.sampler import iteration_indices
from jabasray.planners.interval_model import (TERMS, EmulationCost, HostCosts, interval_terms, line_fit,
                                              plan_interval_terms, relative_line_fit, ragged_iteration_time, ragged_remainder,
                                              ragged_step_time, rank_samples, distinct_workers)
from jabasray.planners.perf_model import PerfModel
from jabasray.planners.plan_policy import solve_for_batch
from jabasray.profiles import synthetic_profile
from jabasray.types import Plan, WorkerConfig, solo_unit, unit_gpu

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


@pytest.mark.parametrize("seed", range(20))
def test_ragged_step_and_busiest_rank_over_distinct_configurations_equal_the_per_gpu_maximum(seed):
    """The ragged step's pace and the busiest rank's samples are taken over the plan's distinct
    unit configurations (:func:`distinct_workers`); on random plans of up to 300 units with
    repeated configurations (pairs and solo GPUs of two types, measured lines per type or not)
    they equal, to the last digit, the maximum over every unit as the plain computation has it."""
    rng = np.random.default_rng(seed)
    model = _model().with_measured_costs(COSTS, {}).for_allocation(64, True)
    by_type = (("fast", float(rng.uniform(-0.002, 0.004)), float(rng.uniform(-1e-3, 2e-3))),) if seed % 2 else ()
    costs = HostCosts(ragged_fixed_s=float(rng.uniform(0, 0.01)), ragged_per_worker_s=float(rng.uniform(0, 2e-3)),
                      ragged_by_type=by_type)
    configs = [WorkerConfig(rng.choice(["fast", "slow", solo_unit("fast"), solo_unit("slow")]),
                            int(rng.integers(1, 4)), int(rng.integers(0, 3))) for _ in range(int(rng.integers(1, 6)))]
    workers = [configs[int(i)] for i in rng.integers(0, len(configs), int(rng.integers(1, 300)))]
    bl = int(rng.choice([8, 16, 24]))
    plan = Plan(global_batch_size=2 * bl * sum(w.num_workers for w in workers), local_batch_size=bl,
                iteration_time=0.01, workers=workers)
    assert distinct_workers(plan) == list(dict.fromkeys(workers)) and len(distinct_workers(plan)) <= len(configs)
    for remainder in (1, int(rng.integers(2, plan.global_batch_size))):
        size = -(-remainder // (plan.global_batch_size // bl))
        plain = max(model.iteration_time(unit_gpu(w.gpu)[0], size, w.num_vsw * (2 if unit_gpu(w.gpu)[1] else 1),
                                         w.num_ga)
                    + costs.ragged_extra_s(w.num_workers * (2 if unit_gpu(w.gpu)[1] else 1), unit_gpu(w.gpu)[0])
                    for w in workers)
        assert ragged_iteration_time(plan, remainder, model, costs) == max(0.0, plain)
        busiest = max(w.num_workers * (2 if unit_gpu(w.gpu)[1] else 1) for w in workers)
        assert rank_samples(plan, size) == size * busiest
        assert rank_samples(plan) == bl * busiest


def test_ragged_extra_is_the_line_through_the_median_residuals_per_vsw_count():
    """Per probed ragged step (``[VSWs, size, pace, own]``) the slowest rank's pace minus the
    slowest rank's Eq. 6 at its (VSWs, size); the line through the median residual at one VSW
    and at four: its value at 0 VSWs and its slope; signed; one count: its median, slope 0;
    zeros without ragged steps. On mixed types also per type: the type's own pace (its slowest
    own time plus the step's tail after the last own time) against its own Eq. 6."""
    model = _model()
    steps_a = [[1, 7, 0.050, 0.020], [4, 6, 0.200, 0.080], [1, 5, 0.040, 0.015],
               [4, 3, 0.120, 0.070], [1, 4, 0.900, 0.012], [4, 2, 0.110, 0.060]]
    steps_b = [[1, 7, 0.060, 0.055], [4, 6, 0.190, 0.180], [1, 5, 0.045, 0.040],
               [4, 3, 0.100, 0.090], [1, 4, 0.030, 0.030], [4, 2, 0.100, 0.100]]
    replies = [{"gpu_type": "fast", "ragged": steps_a}, {"gpu_type": "slow", "ragged": steps_b}]

    def line(res):
        at1, at4 = sorted(res[0::2])[1], sorted(res[1::2])[1]
        slope = (at4 - at1) / 3
        return at1 - slope, slope

    res = [max(a[2], b[2]) - max(model.iteration_time("fast", a[1], a[0], 0),
                                 model.iteration_time("slow", a[1], a[0], 0))
           for a, b in zip(steps_a, steps_b)]
    tails = [max(a[2], b[2]) - max(a[3], b[3]) for a, b in zip(steps_a, steps_b)]
    fast = line([a[3] + t - model.iteration_time("fast", a[1], a[0], 0) for a, t in zip(steps_a, tails)])
    slow = line([b[3] + t - model.iteration_time("slow", b[1], b[0], 0) for b, t in zip(steps_b, tails)])
    got = ragged_extra(replies, model)
    assert (got["ragged_fixed_s"], got["ragged_per_worker_s"]) == pytest.approx(line(res), rel=1e-12)
    assert [g for g, _, _ in got["ragged_by_type"]] == ["fast", "slow"]
    assert got["ragged_by_type"][0][1:] == pytest.approx(fast, rel=1e-12)
    assert got["ragged_by_type"][1][1:] == pytest.approx(slow, rel=1e-12)
    # the fast type's ragged step costs less than the slow type's per worker, and HostCosts
    # charges each type its own line, a type it has no line for the placement's
    costs = HostCosts(**got)
    assert costs.ragged_extra_s(4, "fast") == pytest.approx(fast[0] + 4 * fast[1], rel=1e-12)
    assert costs.ragged_extra_s(4, "other") == pytest.approx(line(res)[0] + 4 * line(res)[1], rel=1e-12)
    assert HostCosts.from_json(costs.to_json()) == costs
    one = [{"gpu_type": "fast", "ragged": steps_a[0:3:2]}]
    assert ragged_extra(one, model) == {
        "ragged_fixed_s": pytest.approx((steps_a[0][2] - model.iteration_time("fast", 7, 1, 0)
                                         + steps_a[2][2] - model.iteration_time("fast", 5, 1, 0)) / 2, rel=1e-12),
        "ragged_per_worker_s": 0.0, "ragged_by_type": ()}
    none = {"ragged_fixed_s": 0.0, "ragged_per_worker_s": 0.0, "ragged_by_type": ()}
    assert ragged_extra([{"gpu_type": "fast", "ragged": []}], model) == none
    assert ragged_extra([{"gpu_type": "fast"}, {"gpu_type": "slow"}], model) == none


def test_ragged_iteration_time_charges_each_type_its_own_line():
    model = _model().for_allocation(3, False)
    costs = HostCosts(ragged_fixed_s=0.5, ragged_per_worker_s=0.5,
                      ragged_by_type=(("fast", 0.001, 0.002), ("slow", 0.003, 0.004)))
    plan = Plan(global_batch_size=8 * 2 * (4 + 3), local_batch_size=8, iteration_time=0.01,
                workers=[WorkerConfig("fast", 2, 1), WorkerConfig(solo_unit("slow"), 3, 0)])
    want = max(model.iteration_time("fast", 4, 2, 1) + 0.001 + 4 * 0.002,
               model.iteration_time("slow", 4, 6, 0) + 0.003 + 6 * 0.004)
    assert ragged_iteration_time(plan, 50, model, costs) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="ragged_by_type"):
        HostCosts(ragged_by_type=(("fast", float("nan"), 0.0),))


def test_emulation_cost_is_the_least_relative_squares_line_with_its_signs_kept():
    cost = EmulationCost.through([(0.001, 0.005), (0.004, 0.011)])    # two points: through both
    assert (cost.a, cost.b) == pytest.approx((0.003, 2.0))
    assert cost.time(0.002) == pytest.approx(0.007)
    # reference: ordinary least squares on the rows (1 / y, x / y) -> 1, i.e. the relative error
    xs = [0.001, 0.002, 0.003, 0.005, 0.020]
    ys = [0.004, 0.0061, 0.0079, 0.0121, 0.050]
    ref, *_ = np.linalg.lstsq(np.array([[1 / y, x / y] for x, y in zip(xs, ys)]), np.ones(len(xs)), rcond=None)
    got = EmulationCost.through(list(zip(xs, ys)))
    assert (got.a, got.b) == pytest.approx(tuple(ref), rel=1e-9)
    assert relative_line_fit(list(zip(xs, ys))) == pytest.approx(tuple(ref), rel=1e-9)
    # the plain least-squares line fits the large point and misses the small ones by more
    plain_a, plain_b = line_fit(list(zip(xs, ys)))
    rel = lambda a, b: max(abs(a + b * x - y) / y for x, y in zip(xs, ys))   # noqa: E731
    assert rel(got.a, got.b) < rel(plain_a, plain_b)
    # a negative intercept is kept (the all-reduce inside t_model is not stretched); below the
    # smallest model time fitted the line goes on in proportion to the model time (never <= 0)
    neg = EmulationCost.through([(0.030, 0.036), (0.080, 0.115)])
    assert neg.a == pytest.approx(0.036 - 0.030 * (0.079 / 0.050)) and neg.a < 0 and neg.x_min == 0.030
    assert neg.time(0.080) == pytest.approx(0.115) and neg.time(0.050) == pytest.approx(neg.a + neg.b * 0.050)
    assert neg.time(0.001) == pytest.approx(0.001 * 0.036 / 0.030)
    assert neg.time(0.001) > 0 and neg.time(0.0) == 0.0
    assert list(neg.time(np.array([0.001, 0.030, 0.080]))) == pytest.approx([0.0012, 0.036, 0.115])
    # GA rounds are added at their own ratio whatever the rest
    assert neg.with_rounds(0.010, 0.020).time(0.021, 0.020) == pytest.approx(0.001 * 0.036 / 0.030 + 0.040)
    with pytest.raises(ValueError, match="positive at x_min"):
        EmulationCost(a=-0.01, b=1.0, x_min=0.005)
    one = EmulationCost.through([(0.002, 0.005)])             # one point: an offset
    assert (one.a, one.b) == pytest.approx((0.003, 1.0))
    falling = EmulationCost.through([(0.001, 0.006), (0.004, 0.005)])   # noise: never a speed-up
    assert falling.b == 1.0 and falling.a == pytest.approx(0.0055 - 0.0025)
    for bad in (dict(a=float("nan"), b=1.0), dict(a=0.0, b=0.0), dict(a=0.0, b=1.0, round_b=0.0)):
        with pytest.raises(ValueError, match="emulation_cost"):
            EmulationCost(**bad)
    # a GA round's ratio: measured over Eq. 6's round; unchanged where either is not positive
    assert cost.with_rounds(0.002, 0.007) == EmulationCost(a=cost.a, b=cost.b, round_b=3.5, x_min=0.001)
    assert cost.with_rounds(0.002, 0.007).time(0.010, 0.004) == pytest.approx(0.003 + 2.0 * 0.006 + 3.5 * 0.004)
    assert cost.rounds_b == cost.b and cost.time(0.010, 0.004) == pytest.approx(0.003 + 2.0 * 0.010)
    assert cost.with_rounds(0.002, -0.001) is cost and cost.with_rounds(0.0, 0.001) is cost
    # records written before the ratio existed load as lines without it
    assert EmulationCost.from_dict({"a": 0.001, "b": 1.2}) == EmulationCost(a=0.001, b=1.2)
    assert EmulationCost.from_json(cost.with_rounds(0.002, 0.007).to_json()).round_b == 3.5
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
    # GA rounds at their own measured ratio: t = a + b (t_model - n_GA t_vsw) + round_b n_GA t_vsw
    rounds = emu.with_measured_costs(COSTS, {"slow": EmulationCost(a=0.002, b=1.5, round_b=2.5)})
    for bl, n, ga in itertools.product((8, 16, 24), (1, 2), (0, 1, 3)):
        base = plain.breakdown("slow", bl, n, ga)
        want = 0.002 + 1.5 * (base.total - ga * base.t_vsw) + 2.5 * ga * base.t_vsw
        assert rounds.iteration_time("slow", bl, n, ga) == pytest.approx(want, rel=1e-12)
        assert rounds.iteration_times("slow", bl, n, [ga])[0] == pytest.approx(want, rel=1e-12)
        assert rounds.model_iteration_time("slow", bl, n, ga) == pytest.approx(base.total, rel=1e-12)
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
        want += [(b.local_batch, 1, 0)] + ([(b.local_batch, b.max_num_vsw, 0)] if b.max_num_vsw > 1 else [])
    first = prof.batches[0]
    assert probe_points(model, "fast") == want + [(first.local_batch, first.max_num_vsw, PROBE_GA_ROUNDS)]
    assert probe_points(model, "other") == [] and probe_points(object(), "fast") == []


def test_own_pace_is_the_types_slowest_own_time_plus_the_steps_tail():
    # ranks: fast, fast, slow; the step ended 5 ms after the slowest own time (the all-reduce)
    own, pace = [0.010, 0.012, 0.030], [0.035, 0.034, 0.035]
    assert own_pace(own, pace, [True, True, False]) == pytest.approx(0.012 + 0.005)
    assert own_pace(own, pace, [False, False, True]) == pytest.approx(0.035)     # the step's pace
    assert own_pace([0.02, 0.03], [0.02, 0.025], [True, False]) == 0.02          # no negative tail


def test_emulation_fits_take_the_pace_or_each_types_own_pace():
    model = _model()
    points = [(8, 1, 0), (8, 4, 0), (16, 1, 0)]
    x = [model.model_iteration_time("fast", bl, n, 0) for bl, n, _ in points]
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
    assert fits["fast"] == want and fits["fast"].round_b is None
    # mixed types: each type's own pace per step (its slowest own time + the step's tail after
    # the slowest rank's own time), the median over steps. The slow rank's steps: own .1/.3/.2,
    # pace .104/.306/.2 -> tails .004 .. .006 at every point (the fast ranks end earlier)
    y = [model.model_iteration_time("slow", bl, n, 0) for bl, n, _ in points]
    slow = {"gpu_type": "slow", "steps": [[[0.1] * 3, [0.104] * 3], [[0.3] * 3, [0.306] * 3], [[0.2] * 3, [0.2] * 3]]}
    fits = emulation_fits([r0, r1, slow], points, model)
    # fast: (.011+.004, .020+.004, .012+.004) -> .016; (.050, .044, .060) + .006 -> .056; .03
    want = EmulationCost.through([(x[0], 0.016), (x[1], 0.056), (x[2], 0.030)])
    assert (fits["fast"].a, fits["fast"].b) == pytest.approx((want.a, want.b), rel=1e-12)
    want = EmulationCost.through([(y[0], 0.104), (y[1], 0.306), (y[2], 0.2)])
    assert (fits["slow"].a, fits["slow"].b) == pytest.approx((want.a, want.b), rel=1e-12)
    assert emulation_fits([r0], [], model) == {}
    assert emulation_fits([{"gpu_type": "fast", "steps": []}], points, model) == {}


def test_emulation_fits_measure_a_ga_round_against_the_same_point_without_rounds():
    """The point with GA rounds does not move the line; a round's ratio is (its time - the
    line's time at the same point without rounds) / rounds over Eq. 6's round, t_vsw."""
    model = _model()
    points = [(8, 1, 0), (8, 4, 0), (16, 1, 0), (8, 4, 2)]
    paces = [0.010, 0.030, 0.016, 0.090]
    reply = {"gpu_type": "fast", "steps": [[[p] * 3, [p] * 3] for p in paces]}
    fit = emulation_fits([reply], points, model)["fast"]
    x = [model.model_iteration_time("fast", bl, n, ga) for bl, n, ga in points]
    line = EmulationCost.through(list(zip(x[:3], paces[:3])))
    t_vsw = model.breakdown("fast", 8, 4, 0).t_vsw
    assert (x[3] - x[1]) / 2 == pytest.approx(t_vsw, rel=1e-12)
    assert (fit.a, fit.b) == (line.a, line.b)
    assert fit.round_b == pytest.approx((0.090 - line.time(x[1])) / 2 / t_vsw, rel=1e-12)
    # what the actors then ran at that point, the fit predicts
    emu = model.with_measured_costs(None, {"fast": fit})
    assert emu.iteration_time("fast", 8, 4, 2) == pytest.approx(0.090, rel=1e-12)
    # rounds timed at no cost (noise): the line's own slope for them
    flat = {"gpu_type": "fast", "steps": [[[p] * 3, [p] * 3] for p in paces[:3] + [line.time(x[1]) - 1e-4]]}
    assert emulation_fits([flat], points, model)["fast"].round_b is None


def test_measured_terms_take_each_terms_slowest_rank_and_the_similaritys_least():
    fast = SimpleNamespace(wall_time=0.10, terms={"steps": 0.08, "ragged": 0.03, "loader": 0.01,
                                                  "similarity": 0.005, "read": 0.001})
    slow = SimpleNamespace(wall_time=0.12, terms={"steps": 0.11, "ragged": 0.02, "loader": 0.004,
                                                  "similarity": 0.002, "read": 0.001})
    got = measured_terms([fast, slow], call_s=0.13, configure_s=0.02)
    assert got == pytest.approx({"steps": 0.11, "ragged": 0.03, "loader": 0.01, "similarity": 0.002,
                                 "read": 0.001, "call": 0.01, "configure": 0.02})
    assert list(got) == list(TERMS)
