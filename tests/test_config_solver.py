"""Configuration solver (JABAS Alg. 1): optimal under the model, checked against exhaustive
enumeration on many random small instances, against the plain-Python reference, and on the
paper's Figure 8 example."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from jabasray.planners import solve_configuration
from jabasray.planners.config_solver import (explain_configuration, fastest_per_worker_count,
                                             min_max_assignment, min_max_assignment_reference,
                                             num_workers_per_group,
                                             solve_configuration_detailed,
                                             solve_configuration_reference)
from jabasray.types import Plan


class MonotoneModel:
    """Random but plausible time model: per type a speed, a log-like VSW throughput curve and
    a fixed overhead; time grows with B_L, n_vsw and n_GA. n_max shrinks with B_L."""

    def __init__(self, rng: random.Random, types: list[str], min_bl: int) -> None:
        self.p = {}
        for g in types:
            self.p[g] = dict(speed=rng.uniform(0.5, 3.0), expo=rng.uniform(0.3, 1.0),
                             over=rng.uniform(0.0, 2.0), maxbl=min_bl * rng.randint(1, 4),
                             nmax=rng.randint(1, 4))
        self.calls = 0

    def max_local_batch(self, gpu):
        return self.p[gpu]["maxbl"]

    def max_num_vsw(self, gpu, local_batch):
        q = self.p[gpu]
        return max(1, q["nmax"] - (local_batch // q["maxbl"]) + 1) if local_batch <= q["maxbl"] else 0

    def iteration_time(self, gpu, local_batch, num_vsw, num_ga):
        self.calls += 1
        q = self.p[gpu]
        t_vsw = local_batch * num_vsw ** q["expo"] / q["speed"]
        return t_vsw * (num_ga + 1) + q["over"] + 0.1 * num_vsw


class TableModel(MonotoneModel):
    """Arbitrary (non-monotone) times from a random table: stresses exactness of the DP."""

    def __init__(self, rng, types, min_bl):
        super().__init__(rng, types, min_bl)
        self.rng = rng
        self.table = {}

    def iteration_time(self, gpu, local_batch, num_vsw, num_ga):
        key = (gpu, local_batch, num_vsw, num_ga)
        if key not in self.table:
            self.table[key] = round(self.rng.uniform(1.0, 20.0), 1)  # ties on purpose
        return self.table[key]


def exhaustive(global_batch, gpus, model, min_bl):
    """Best throughput over every B_L and every per-GPU (n_vsw, n_GA) with sum of workers = M."""
    best = 0.0
    max_bl = min(model.max_local_batch(g) for g in gpus)
    for bl in range(min_bl, max_bl + 1, min_bl):
        m = num_workers_per_group(global_batch, bl)
        if m < len(gpus):
            break
        per_gpu = []
        for g in gpus:
            opts = [(nv * (ga + 1), model.iteration_time(g, bl, nv, ga))
                    for nv in range(1, min(m, model.max_num_vsw(g, bl)) + 1)
                    for ga in range(0, m // nv) if nv * (ga + 1) <= m]
            per_gpu.append(opts)

        def rec(j, rest, worst):
            if j == len(gpus):
                return worst if rest == 0 else math.inf
            out = math.inf
            for k, t in per_gpu[j]:
                if k <= rest - (len(gpus) - j - 1):
                    out = min(out, rec(j + 1, rest - k, max(worst, t)))
            return out

        t = rec(0, m, 0.0)
        if t < math.inf:
            best = max(best, bl * m * 2 / t)
    return best


def check_plan(plan: Plan, gpus, model, global_batch):
    m = plan.num_workers_per_group
    assert plan.global_batch_size == plan.local_batch_size * m * 2
    assert m == num_workers_per_group(global_batch, plan.local_batch_size)
    assert [w.gpu for w in plan.workers] == list(gpus)
    times = []
    for w in plan.workers:
        assert 1 <= w.num_vsw <= model.max_num_vsw(w.gpu, plan.local_batch_size)
        assert w.num_ga >= 0
        times.append(model.iteration_time(w.gpu, plan.local_batch_size, w.num_vsw, w.num_ga))
    assert plan.iteration_time == pytest.approx(max(times), rel=1e-12)
    assert plan.requested_global_batch_size == global_batch


@pytest.mark.parametrize("model_cls", [MonotoneModel, TableModel])
def test_solver_matches_exhaustive_on_random_instances(model_cls):
    rng = random.Random(1234 if model_cls is MonotoneModel else 99)
    solved = unsolved = 0
    for case in range(60):
        types = [f"g{i}" for i in range(rng.randint(2, 4))]
        n_h = rng.randint(1, 4 if len(types) < 4 else 3)
        gpus = [rng.choice(types) for _ in range(n_h)]
        min_bl = rng.choice([1, 2, 4])
        model = model_cls(rng, types, min_bl)
        global_batch = rng.randint(2, 18) * min_bl
        want = exhaustive(global_batch, gpus, model, min_bl)
        plan = solve_configuration(global_batch, gpus, model, min_bl)
        ref = solve_configuration_reference(global_batch, gpus, model, min_bl)
        if want == 0.0:
            assert plan is None and ref is None, (case, plan)
            unsolved += 1
            continue
        solved += 1
        assert plan is not None and ref is not None, case
        check_plan(plan, gpus, model, global_batch)
        check_plan(ref, gpus, model, global_batch)
        assert plan.throughput == pytest.approx(want, rel=1e-12), case
        assert ref.throughput == pytest.approx(want, rel=1e-12), case
    assert solved >= 30 and unsolved >= 1  # both branches exercised


def exhaustive_units(global_batch, units, model, min_bl):
    """exhaustive() over similarity units written out directly: a pair "g" takes (n_vsw, n_GA)
    per GPU; a solo "g/solo" GPU runs both groups, 2 n_vsw VSWs of n_GA each (time and n_max of
    its GPU at 2 n_vsw), for n_vsw * (n_GA + 1) workers per group. Best throughput 2 B_L M / T."""
    best = 0.0
    gpus = [(u.split("/")[0], u.endswith("/solo")) for u in units]
    max_bl = min(model.max_local_batch(g) for g, _ in gpus)
    for bl in range(min_bl, max_bl + 1, min_bl):
        m = num_workers_per_group(global_batch, bl)
        if m < len(gpus):
            break
        opts = [[(nv * (ga + 1), model.iteration_time(g, bl, nv * (2 if solo else 1), ga))
                 for nv in range(1, m + 1) if nv * (2 if solo else 1) <= model.max_num_vsw(g, bl)
                 for ga in range(0, m // nv) if nv * (ga + 1) <= m] for g, solo in gpus]
        best_t = math.inf
        for combo in itertools.product(*opts):
            if sum(k for k, _ in combo) == m:
                best_t = min(best_t, max(t for _, t in combo))
        if best_t < math.inf:
            best = max(best, bl * m * 2 / best_t)
    return best


def test_solo_units_match_exhaustive_on_random_instances():
    """A GPU without a partner (one GPU, odd counts) as a solo unit: the solver's plan is the
    exhaustive optimum over its doubled-VSW configurations, and its workers run 2 n_vsw VSWs
    that fit the GPU's n_max."""
    rng = random.Random(7)
    solved = 0
    for case in range(50):
        types = [f"g{i}" for i in range(rng.randint(1, 3))]
        units = [rng.choice(types) + ("/solo" if rng.random() < 0.6 else "") for _ in range(rng.randint(1, 3))]
        min_bl = rng.choice([1, 2, 4])
        model = MonotoneModel(rng, types, min_bl)
        for g in types:
            model.p[g]["nmax"] = rng.randint(2, 6)
        global_batch = rng.randint(2, 18) * min_bl
        want = exhaustive_units(global_batch, units, model, min_bl)
        plan = solve_configuration(global_batch, units, model, min_bl)
        ref = solve_configuration_reference(global_batch, units, model, min_bl)
        if want == 0.0:
            assert plan is None and ref is None, case
            continue
        solved += 1
        for p in (plan, ref):
            assert p.throughput == pytest.approx(want, rel=1e-12), case
            assert [w.gpu for w in p.workers] == units
            assert p.global_batch_size == 2 * p.local_batch_size * p.num_workers_per_group
            for w in p.workers:
                g, solo = w.gpu.split("/")[0], w.gpu.endswith("/solo")
                assert w.num_vsw * (2 if solo else 1) <= model.max_num_vsw(g, p.local_batch_size)
    assert solved >= 25


def test_min_max_assignment_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 5))
        total = int(rng.integers(1, 11))
        tables = []
        for _ in range(n):
            t = rng.integers(1, 9, size=total + 1).astype(float)
            t[rng.random(total + 1) < 0.3] = np.inf
            t[0] = np.inf
            tables.append(t)
        got = min_max_assignment(tables, total)
        best = math.inf
        import itertools
        for ks in itertools.product(range(1, total + 1), repeat=n):
            if sum(ks) == total:
                best = min(best, max(tables[j][k] for j, k in enumerate(ks)))
        if best == math.inf:
            assert got is None
        else:
            assert got is not None and got[0] == best
            assert sum(got[1]) == total
            assert max(tables[j][k] for j, k in enumerate(got[1])) == best


@pytest.mark.parametrize("max_runs", [64, 0])
def test_min_max_assignment_is_the_plain_computation_exactly(monkeypatch, max_runs):
    """The bitset search (threshold and backtracking) returns exactly what the plain-Python
    recurrence and set-based backtracking return - the same T and the same k of every GPU -
    and T is the exhaustive optimum; GPUs share table objects (one per type) in any order, as
    the solver hands them over, including long runs of one type. ``max_runs`` 0: every sumset
    by convolution (the path of sets full of holes)."""
    from jabasray.planners import config_solver
    monkeypatch.setattr(config_solver, "_MAX_RUNS", max_runs)
    rng = np.random.default_rng(11)
    solved = 0
    for trial in range(300):
        total = int(rng.integers(1, 40))
        types = []
        for _ in range(int(rng.integers(1, 4))):
            t = rng.integers(1, int(rng.choice([4, 30, 1000])), size=total + 1).astype(float)
            t[rng.random(total + 1) < rng.random() * 0.6] = np.inf
            t[0] = np.inf
            types.append(t)
        n = int(rng.integers(1, min(total, 12) + 1))
        tables = [types[int(rng.integers(0, len(types)))] for _ in range(n)]
        if trial % 2:
            tables.sort(key=id)              # runs of one type, as group H lists nodes
        got, want = min_max_assignment(tables, total), min_max_assignment_reference(tables, total)
        assert got == want, trial
        if n <= 4 and total <= 10:           # exhaustive optimum
            best = min((max(tables[j][k] for j, k in enumerate(ks))
                        for ks in itertools.product(range(1, total + 1), repeat=n) if sum(ks) == total),
                       default=math.inf)
            assert (got is None) == (best == math.inf) and (got is None or got[0] == best)
        if got is not None:
            solved += 1
            assert sum(got[1]) == total and max(tables[j][k] for j, k in enumerate(got[1])) == got[0]
    assert solved >= 150


def test_worker_configs_are_the_plain_per_unit_lookup():
    """A plan's per-unit configurations, read once per (unit, k), are exactly the plain per-unit
    lookup into the type tables (same values, plain ints), on random groups of up to 300 units
    of three unit names (a solo one among them) and random tables."""
    from jabasray.planners.config_solver import _TypeTable, worker_configs
    from jabasray.types import WorkerConfig
    rng = np.random.default_rng(5)
    for _ in range(50):
        size = int(rng.integers(2, 40))
        per_type = {g: _TypeTable(rng.random(size), rng.integers(1, 9, size), rng.integers(0, 5, size))
                    for g in ("fast", "slow", "slow/solo")}
        n = int(rng.integers(1, 300))
        gpus = [str(g) for g in rng.choice(list(per_type), n)]
        ks = [int(k) for k in rng.integers(1, min(size, int(rng.integers(2, 6))), n)]
        got = worker_configs(gpus, ks, per_type)
        want = [WorkerConfig(g, int(per_type[g].nvsw[k]), int(per_type[g].nga[k])) for g, k in zip(gpus, ks)]
        assert got == want
        assert all(type(w.num_vsw) is int and type(w.num_ga) is int for w in got)


def test_figure8_example():
    """Paper Figure 8: B_G = 12, H = {GPU_A, GPU_B}, B_L = 1 (so M = 6).

    The figure's times are not in the text, so they are chosen here to reproduce its story:
    GPU_A has two configurations with 2 decoupled workers, a1 = (n_vsw 2, n_GA 0) and
    a2 = (1, 1), and a2 is pruned as slower; the optimum C* = {a3, a4} takes the minimum
    iteration time, here a3 = GPU_A with 3 workers (3 VSWs) and a4 = GPU_B with 3 workers
    (1 VSW, 2 GA steps), bottleneck 3.0 s; B_G* = 12.
    """
    times = {
        "A": {(1, 0): 1.0, (2, 0): 1.5, (1, 1): 2.0, (3, 0): 2.5, (1, 2): 3.0, (2, 1): 3.2,
              (1, 3): 4.0, (1, 4): 5.0, (2, 2): 4.6, (3, 1): 4.9, (1, 5): 6.0},
        "B": {(1, 0): 1.2, (1, 1): 2.2, (1, 2): 3.0, (1, 3): 4.1, (1, 4): 5.2, (1, 5): 6.3},
    }

    class Fig8Model:
        def max_local_batch(self, gpu):
            return 1

        def max_num_vsw(self, gpu, local_batch):
            return 3 if gpu == "A" else 1

        def iteration_time(self, gpu, local_batch, num_vsw, num_ga):
            return times[gpu].get((num_vsw, num_ga), 100.0)

    # line 20: a2 = (1 VSW, 1 GA) is pruned, a1 = (2 VSWs, 0 GA) kept for 2 workers on GPU_A
    table = fastest_per_worker_count(Fig8Model(), "A", 1, 5, 3)
    assert (int(table.nvsw[2]), int(table.nga[2]), float(table.best[2])) == (2, 0, 1.5)
    res = solve_configuration_detailed(12, ["A", "B"], Fig8Model(), 1)
    plan = res.plan
    assert res.reason == "ok"
    assert plan.global_batch_size == 12 and plan.local_batch_size == 1
    assert [tuple(w) for w in plan.workers] == [("A", 3, 0), ("B", 1, 2)]
    assert plan.iteration_time == 3.0
    assert plan.throughput == 4.0
    ref = solve_configuration_reference(12, ["A", "B"], Fig8Model(), 1)
    assert ref.iteration_time == 3.0


def test_no_plan_reason_and_line9_break():
    class Flat:
        def max_local_batch(self, gpu):
            return 8

        def max_num_vsw(self, gpu, local_batch):
            return 2

        def iteration_time(self, gpu, local_batch, num_vsw, num_ga):
            return 1.0 + num_ga

    # B_G = 8 with min B_L 4 and 3 GPUs per group: M = 1 < 3 -> no plan, reason says so;
    # the smallest B_G that works is 4 * (2 * 3 - 1) = 20 (M = round(2.5) = 3).
    res = solve_configuration_detailed(8, ["a", "a", "b"], Flat(), 4)
    assert res.plan is None
    assert "too small" in res.reason and "B_G >= 20" in res.reason
    assert [o.note for o in res.outcomes] == ["stop: M < N_H (line 9)"]
    assert solve_configuration(8, ["a", "a", "b"], Flat(), 4) is None
    assert explain_configuration(8, ["a", "a", "b"], Flat(), 4) == res.reason
    assert explain_configuration(24, ["a", "a", "b"], Flat(), 4) == "ok"
    assert solve_configuration(19, ["a", "a", "b"], Flat(), 4) is None
    assert solve_configuration(20, ["a", "a", "b"], Flat(), 4).global_batch_size == 24
    # min B_L larger than every max B_L
    res = solve_configuration_detailed(64, ["a"], Flat(), 16)
    assert res.plan is None and "min_local_batch 16" in res.reason


def test_rounding_of_m_and_result_json_round_trip():
    assert num_workers_per_group(10, 4) == 1   # 1.25 -> 1
    assert num_workers_per_group(12, 4) == 2   # 1.5 -> 2 (half up, not banker's)
    assert num_workers_per_group(20, 4) == 3   # 2.5 -> 3

    class Lin:
        def max_local_batch(self, gpu):
            return 4

        def max_num_vsw(self, gpu, local_batch):
            return 2

        def iteration_time(self, gpu, local_batch, num_vsw, num_ga):
            return local_batch * (num_ga + 1) * (1 + 0.5 * (num_vsw - 1)) + 0.3

    res = solve_configuration_detailed(20, ["x", "x"], Lin(), 2)
    assert res.plan is not None
    again = type(res).from_json(res.to_json())
    assert again == res
    assert Plan.from_json(res.plan.to_json()) == res.plan


@pytest.mark.parametrize("args, field", [
    ((0, ["a"], 1), "global_batch_size"),
    ((8, [], 1), "group_gpus"),
    ((8, "a", 1), "group_gpus"),
    ((8, ["a", ""], 1), "group_gpus[1]"),
    ((8, ["a"], 0), "min_local_batch"),
])
def test_bad_input_names_field(args, field):
    class M:
        def max_local_batch(self, gpu):
            return 4

        def max_num_vsw(self, gpu, local_batch):
            return 1

        def iteration_time(self, gpu, local_batch, num_vsw, num_ga):
            return 1.0

    gb, gpus, mbl = args
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        solve_configuration(gb, gpus, M(), mbl)
    with pytest.raises(ValueError, match="model must provide"):
        solve_configuration(8, ["a"], object(), 1)


def test_large_m_uses_fft_path_and_matches_reference():
    """M in the hundreds (FFT sumsets, galloping threshold search) against the reference DP."""
    rng = random.Random(5)
    for case in range(3):
        types = ["p", "q", "r"]
        model = TableModel(rng, types, 1)
        for g in types:
            model.p[g]["maxbl"] = 2
            model.p[g]["nmax"] = 3
        gpus = ["p", "q", "r", "q"]
        plan = solve_configuration(2 * 150 + case, gpus, model, 1)
        ref = solve_configuration_reference(2 * 150 + case, gpus, model, 1)
        assert plan is not None and ref is not None
        check_plan(plan, gpus, model, 2 * 150 + case)
        assert plan.throughput == pytest.approx(ref.throughput, rel=1e-12)


def test_planners_import_neither_torch_nor_ray():
    import subprocess
    import sys
    code = ("import sys, jabasray.planners, jabasray.planners.autoscale, jabasray.commands.plan; "
            "print('torch' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_max_deviation_keeps_the_global_batch_close():
    """Alg. 1 maximises B_G*/t, so with a fixed per-step cost it prefers rounding M up:
    B_G = 64, B_L in {8, .., 48}: B_L = 48 gives M = round(0.67) = 1, B_G* = 96. With
    max_deviation = 0 only B_L with 2 B_L M = 64 exactly remain (8, 16, 32)."""
    class Overhead:
        def max_local_batch(self, gpu):
            return 48

        def max_num_vsw(self, gpu, local_batch):
            return 2

        def iteration_time(self, gpu, local_batch, num_vsw, num_ga):
            return 1.0 + 0.001 * local_batch * num_vsw * (num_ga + 1)

    plan = solve_configuration(64, ["g"], Overhead(), 8)
    assert plan.global_batch_size == 96 and plan.local_batch_size == 48
    exact = solve_configuration(64, ["g"], Overhead(), 8, max_deviation=0.0)
    # B_L 8, 16 and 32 all take 1.032 s for 64 samples: ties keep the smaller B_L (line 24)
    assert exact.global_batch_size == 64 and exact.local_batch_size == 8
    res = solve_configuration_detailed(64, ["g"], Overhead(), 8, max_deviation=0.0)
    assert [o.local_batch for o in res.outcomes if o.note.startswith("skipped")] == [24, 40, 48]
    with pytest.raises(ValueError, match="max_deviation"):
        solve_configuration(64, ["g"], Overhead(), 8, max_deviation=-1)
