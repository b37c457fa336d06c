"""The simulator (:mod:`jabasray.sim`): its bookkeeping, each policy against a brute force or a
case whose answer is known, and the auto-scaler's shortcuts for large clusters against the
exhaustive search. No Ray, no torch.

Time model: synthetic profiles (:func:`jabasray.profiles.synthetic_profile`) scaled per GPU type;
convergence: :class:`Noise`, a constant gradient noise scale (Pollux's efficiency and the
two-group similarity in closed form), so that every expected value is a formula.
"""
from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest

from jabasray.config import JobConfig
from jabasray.planners.autoscale import (choose_allocation, class_allocations,
                                         enumerate_allocations, epoch_lower_bound, node_classes,
                                         peak_throughputs)
from jabasray.planners.perf_model import PerfModel, emulated_profiles
from jabasray.profiles import synthetic_profile
from jabasray.sim.baselines import batch_grid, equal_batch_plan, goodput
from jabasray.sim.clusters import derived_profile, paper_cluster, type_profiles
from jabasray.sim.loop import simulate
from jabasray.sim.policies import POLICIES, SimState, best_goodput, make_policy
from jabasray.planners.job_planner import JobPlanner
from jabasray.types import ClusterSpec, NodeSpec

N = 3000


class Noise:
    """Constant noise scale B_noise: efficiency (B_noise + M0) / (B_noise + B) (Pollux), the
    two halves' similarity 1 / (1 + 2 B_noise / B), progress in samples at M0, accuracy
    1 - exp(-progress / scale)."""

    metric_name = "accuracy"
    higher_is_better_ = True

    def __init__(self, noise: float = 100.0, m0: int = 32, scale: float = 4000.0) -> None:
        self.noise, self.m0, self.scale = noise, m0, scale

    def efficiency(self, progress, batch):
        return (self.noise + self.m0) / (self.noise + batch)

    def similarity(self, progress, batch):
        return 1.0 / (1.0 + 2.0 * self.noise / batch)

    def step(self, progress, batch, samples):
        return progress + samples * self.efficiency(progress, batch)

    def metric(self, progress):
        return 1.0 - math.exp(-progress / self.scale)


def _model(speeds=None, **kw):
    base = synthetic_profile("base", **kw)
    return PerfModel(emulated_profiles(base, speeds or {"fast": 2.0, "slow": 1.0}))


CLUSTER = ClusterSpec([NodeSpec("f0", "fast", 2, tflops=2.0), NodeSpec("s0", "slow", 2, tflops=1.0),
                       NodeSpec("s1", "slow", 2, tflops=1.0)])
JOB = JobConfig(initial_global_batch=32, min_global_batch=32, max_global_batch=256, adapt_interval=4,
                epochs=4, gamma=0.5, alpha=0.25, min_local_batch=8, seed=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_sample_once_per_epoch_and_gpu_seconds_and_cost_add_up(policy):
    run = simulate(make_policy(policy), JOB, CLUSTER, N, _model(), Noise(), placement_s=3.0, eval_s=0.5)
    hist = run.history
    price = {n.name: n.price_weight for n in CLUSTER.nodes}
    for e in hist.epochs:
        rows = [r for r in hist.intervals if r.epoch == e.epoch]
        # the epoch's samples are the ranges [cursor, cursor + samples), back to back over 0..N
        assert [r.cursor for r in rows] == [0] + list(itertools.accumulate(r.samples for r in rows))[:-1]
        assert sum(r.samples for r in rows) == N == e.samples and e.served_exactly_once
        assert all(0 < r.samples <= r.num_iterations * r.global_batch for r in rows)
        assert e.train_time_s == pytest.approx(sum(r.time_s for r in rows), rel=1e-12)
        assert e.time_s == pytest.approx((e.placement_s or 0.0) + e.train_time_s + e.eval_s, rel=1e-12)
        assert e.gpu_seconds == pytest.approx(e.time_s * sum(e.allocation.values()), rel=1e-12)
        assert len(e.gpu_types) == sum(e.allocation.values())
    assert run.gpu_seconds == pytest.approx(sum(e.gpu_seconds for e in hist.epochs), rel=1e-12)
    assert run.cost == pytest.approx(sum(e.time_s * sum(price[n] * g for n, g in e.allocation.items())
                                         for e in hist.epochs), rel=1e-12)
    assert run.time_s == pytest.approx(sum(e.time_s for e in hist.epochs), rel=1e-12)
    # placements: the first, then one per change of allocation
    changes = sum(a.allocation != b.allocation for a, b in zip(hist.epochs, hist.epochs[1:]))
    assert run.replacements == changes
    assert [e.placement_s is not None for e in hist.epochs] == \
        [True] + [a.allocation != b.allocation for a, b in zip(hist.epochs, hist.epochs[1:])]


@pytest.mark.parametrize("policy", POLICIES)
def test_one_seed_gives_one_result(policy):
    a = simulate(make_policy(policy), JOB, CLUSTER, N, _model(), Noise())
    b = simulate(make_policy(policy), JOB, CLUSTER, N, _model(), Noise())
    assert a.history.to_json() == b.history.to_json() and a.summary() == b.summary()


def test_the_progress_is_the_convergence_models_over_the_samples_served():
    conv = Noise()
    run = simulate(make_policy("simigrad"), JOB, CLUSTER, N, _model(), conv)
    progress = 0.0
    for r in run.history.intervals:
        assert r.phi == pytest.approx(conv.similarity(progress, r.global_batch), rel=1e-12)
        progress = conv.step(progress, r.global_batch, r.samples)
    assert run.final_metric == pytest.approx(conv.metric(progress), rel=1e-12)


def test_static_runs_its_batch_and_simigrad_moves_it_by_the_rule():
    static = simulate(make_policy("static"), JOB, CLUSTER, N, _model(), Noise())
    assert {r.requested_global_batch for r in static.history.intervals} == {JOB.initial_global_batch}
    simi = simulate(make_policy("simigrad"), JOB, CLUSTER, N, _model(), Noise(noise=1000.0))
    reqs = [r.requested_global_batch for r in simi.history.intervals]
    # Phi = 1 / (1 + 2000 / B) < gamma 0.5 while B < 2000: B_G grows by alpha every interval
    for a, b in zip(reqs, reqs[1:]):
        assert b == min(JOB.max_global_batch, math.floor(a * (1 + JOB.alpha) + 0.5))


def test_equal_batch_plan_is_the_smallest_equal_split_and_the_slowest_gpu_sets_the_pace():
    model = _model().for_allocation(6, True)
    units = ["fast", "slow", "slow"]                  # three pairs: 6 GPUs
    b_max = min(model.max_local_batch(g) for g in ("fast", "slow"))
    for bg, min_bl in itertools.product((1, 6, 7, 96, 100, 6 * b_max, 6 * b_max + 1, 1000), (1, 8)):
        plan = equal_batch_plan(bg, units, model, min_bl)
        # brute force: the fewest accumulation steps k, then the smallest b >= min B_L, with
        # 6 k b >= B_G
        k, b = min(((k, b) for k in range(1, 60) for b in range(min_bl, b_max + 1) if 6 * k * b >= bg))
        assert (plan.local_batch_size, plan.global_batch_size) == (b, 6 * k * b)
        assert {(w.num_vsw, w.num_ga) for w in plan.workers} == {(1, k - 1)}
        assert plan.iteration_time == max(model.iteration_time(g, b, 1, k - 1) for g in ("fast", "slow"))


def test_pollux_picks_the_grid_batch_of_greatest_goodput():
    conv = Noise(noise=300.0)
    planner = JobPlanner(JOB, N)
    planner.use_model(_model())
    state = SimState(JOB, CLUSTER, N, planner, conv, progress=123.0)
    alloc = {"f0": 2, "s0": 2, "s1": 2}
    model = planner.alloc_model(6, True)
    direct = []
    for m in batch_grid(JOB.min_global_batch, JOB.max_global_batch):
        plan = equal_batch_plan(m, ["fast", "slow", "slow"], model, JOB.min_local_batch)
        direct.append((plan.global_batch_size / plan.iteration_time * conv.efficiency(123.0, plan.global_batch_size), m))
    assert best_goodput(state, alloc) == (max(direct)[1], pytest.approx(max(direct)[0], rel=1e-12))
    assert batch_grid(32, 256)[:3] == [32, 35, 39] and batch_grid(32, 256)[-1] == 256
    assert goodput(equal_batch_plan(64, ["fast"], model), 0.5) == pytest.approx(
        0.5 * equal_batch_plan(64, ["fast"], model).throughput)


def test_pollux_as_scales_out_while_goodput_scales_and_not_when_communication_dominates():
    cluster = ClusterSpec([NodeSpec("a", "slow", 2, tflops=1.0), NodeSpec("b", "slow", 2, tflops=1.0),
                           NodeSpec("c", "fast", 2, tflops=2.0)])
    job = JobConfig(initial_global_batch=256, min_global_batch=256, max_global_batch=256,
                    adapt_interval=4, epochs=3, min_local_batch=8)
    # no all-reduce cost: goodput grows linearly -> from the slowest node, every node is added
    # at the first epoch end (one node after the other while each keeps L of the ideal)
    free = simulate(make_policy("pollux-as"), job, cluster, N,
                    _model(allreduce_alpha=0.0, allreduce_beta=0.0, inter_alpha=0.0, inter_beta=0.0,
                           optimizer_time=1e-6, copy_time=1e-6, max_num_vsw=1), Noise(noise=1e6))
    assert [e.allocation for e in free.history.epochs] == [{"a": 2}] + [{"a": 2, "b": 2, "c": 2}] * 2
    # a second of all-reduce per bucket across nodes: adding a node never keeps half the ideal
    slow = simulate(make_policy("pollux-as"), job, cluster, N,
                    _model(inter_alpha=1.0, inter_beta=1.0), Noise(noise=1e6))
    assert all(e.allocation == {"a": 2} for e in slow.history.epochs)


def test_jabas_in_the_simulator_decides_with_the_drivers_functions():
    """The initial allocation is the auto-scaler's over the initial phase; every later one the
    auto-scaler's on the forecast, as ``JabasDriver._decide_next_epoch`` computes it."""
    from jabasray.actors.placement import next_allocation
    from jabasray.adaptive.forecast import forecast_next_epoch

    run = simulate(make_policy("jabas"), JOB, CLUSTER, N, _model(), Noise(noise=500.0), placement_s=0.0)
    hist = run.history
    planner = JobPlanner(JOB, N)
    planner.use_model(_model())
    first = next_allocation(CLUSTER, planner.model, None, N, JOB)[0]
    assert hist.epochs[0].allocation == first
    trajectories = []
    for e, nxt in zip(hist.epochs, hist.epochs[1:]):
        trajectories.append(e.trajectory)
        forecast = forecast_next_epoch(trajectories, JOB, N)
        assert nxt.predicted_trajectory == pytest.approx(forecast, rel=1e-12)
        chosen = next_allocation(CLUSTER, planner.model, forecast, N, JOB, current=e.allocation,
                                 switch_cost_s=0.0)[0]
        assert nxt.allocation == chosen


def test_jabas_decides_the_same_with_the_plain_solver_and_no_solver_memo(monkeypatch):
    """The solver's shortcuts change no decision of a whole JABAS run: with the plain min-max
    computation (:func:`~jabasray.planners.config_solver.min_max_assignment_reference`) and no
    answers kept per (B_L, M) across candidates and decisions, every epoch's allocation,
    forecast and decision record (each candidate's epoch time) and every interval's B_G and plan
    are the same, to the last digit of the run's JSON; the memo did save solves."""
    from jabasray.planners import config_solver, plan_policy

    job = JobConfig(initial_global_batch=32, min_global_batch=32, max_global_batch=256, adapt_interval=4,
                    epochs=6, gamma=0.5, alpha=0.25, min_local_batch=8, seed=0)
    cluster = ClusterSpec(CLUSTER.nodes + [NodeSpec("f1", "fast", 3, tflops=2.0)])
    counted = []
    real = config_solver.solve_local_batch
    monkeypatch.setattr(plan_policy, "solve_local_batch", lambda *a, **kw: counted.append(1) or real(*a, **kw))

    def run():
        counted.clear()
        r = simulate(make_policy("jabas"), job, cluster, N, _model(), Noise(noise=150.0), placement_s=0.0)
        return json.dumps(r.history.to_dict()), len(counted)

    fast, fast_solves = run()
    monkeypatch.setattr(plan_policy, "solve_remembered", lambda bg, gpus, model, bl, tables=None, solutions=None:
                        plan_policy.solve_local_batch(bg, gpus, model, bl, tables=tables))
    monkeypatch.setattr(config_solver, "min_max_assignment", config_solver.min_max_assignment_reference)
    plain, plain_solves = run()
    assert fast == plain
    hist = json.loads(fast)
    assert len({json.dumps(e["allocation"]) for e in hist["epochs"]}) > 2       # it moved
    assert len({i["global_batch"] for i in hist["intervals"]}) > 3               # B_G adapted
    assert fast_solves < plain_solves


# ----------------------------------------------------------------------- auto-scaler shortcuts
def _random_cluster(rng, nodes):
    return ClusterSpec([NodeSpec(f"n{i}", rng.choice(["fast", "slow"]), int(rng.integers(1, 4)))
                        for i in range(nodes)])


@pytest.mark.parametrize("objective", ["time", "cost"])
def test_pruned_search_chooses_what_the_exhaustive_one_chooses(objective):
    import numpy as np
    rng = np.random.default_rng(7)
    model = _model()
    for trial in range(12):
        cluster = _random_cluster(rng, int(rng.integers(2, 4)))
        traj = [int(x) for x in rng.integers(16, 300, size=int(rng.integers(1, 5)))]
        current = enumerate_allocations(cluster)[int(rng.integers(0, 3))]
        kw = dict(objective=objective, current=current, switch_cost_s=float(rng.choice([0.0, 0.05])))
        fast = choose_allocation(cluster, model, traj, 2000, 4, 8, **kw)
        full = choose_allocation(cluster, model, traj, 2000, 4, 8, prune=False, **kw)
        assert fast.allocation.same_gpus(full.allocation), trial
        assert fast.epoch_time == full.epoch_time and fast.cost == full.cost
        assert (fast.uncharged_choice is None) == (full.uncharged_choice is None)
        # a pruned candidate's bound is a true lower bound of its epoch time
        for p, f in zip(fast.candidates, full.candidates):
            if p.reason.startswith("pruned"):
                size = (f.allocation.num_gpus, f.allocation.multi_node)
                peaks = peak_throughputs(model.for_allocation(*size), cluster.gpu_types, 8)
                assert f.epoch_time is None or epoch_lower_bound(f.allocation, cluster, peaks, 2000) <= f.epoch_time
            else:
                assert p.epoch_time == f.epoch_time


def test_class_candidates_of_interchangeable_nodes_lose_no_faster_allocation():
    """Identical nodes: the best over the class candidates (multisets of per-node counts) is the
    best over all prod(m_i + 1) - 1 allocations, whatever the trajectory; at the coarser GPU
    level each total is split pairs first (3 + 1 GPUs on 3-GPU nodes would leave two solos)."""
    cluster = ClusterSpec([NodeSpec(f"f{i}", "fast", 2) for i in range(3)] +
                          [NodeSpec(f"s{i}", "slow", 3) for i in range(2)])
    assert node_classes(cluster) == [[0, 1, 2], [3, 4]]
    model = _model()
    exact = class_allocations(cluster)
    assert len(exact) == math.comb(3 + 2, 2) * math.comb(2 + 3, 3) - 1
    assert len(enumerate_allocations(cluster, 10 ** 6)) == 3 ** 3 * 4 ** 2 - 1
    for traj in ([32], [64, 128, 256], [512]):
        everything = choose_allocation(cluster, model, traj, 2000, 4, 8, allocations=enumerate_allocations(cluster, 10 ** 6))
        reduced = choose_allocation(cluster, model, traj, 2000, 4, 8, allocations=exact)
        assert reduced.epoch_time == pytest.approx(everything.epoch_time, rel=1e-12), traj
    by_total = class_allocations(cluster, max_candidates=60)             # GPU totals: 7 x 7 - 1
    assert len(by_total) == 48
    assert {tuple(a.node_gpus.values())[3:] for a in by_total} == \
        {(0, 0), (1, 0), (2, 0), (3, 0), (2, 2), (3, 2), (3, 3)}


def test_large_clusters_get_coarser_class_candidates():
    a256 = paper_cluster("A", 256)
    assert sum(n.num_gpus for n in a256.nodes) == 256 and len(node_classes(a256)) == 4
    cands = enumerate_allocations(a256)
    # 16 nodes of 4 GPUs per type: whole nodes on the ladder 0, 1, 2, 4, 8, 16
    assert len(cands) == 6 ** 4 - 1
    assert {sum(a.node_gpus[n.name] for n in a256.nodes if n.gpu_type == "v100") for a in cands} == \
        {0, 4, 8, 16, 32, 64}
    small = paper_cluster("A")
    assert len(enumerate_allocations(small)) == 5 ** 4 - 1        # exact below the limit


def test_paper_clusters_and_derived_profiles():
    b16 = paper_cluster("B", 16)
    assert [(n.gpu_type, n.num_gpus) for n in b16.nodes] == [("rtx2060", 4), ("p4000", 4), ("titan-v", 4), ("titan-rtx", 4)]
    with pytest.raises(ValueError, match="num_gpus of cluster A must be a multiple of 16"):
        paper_cluster("A", 24)
    base = synthetic_profile("v100", num_batches=8, max_num_vsw=4)
    v100 = next(n for n in paper_cluster("A").nodes if n.gpu_type == "v100")
    rtx2060 = next(n for n in b16.nodes if n.gpu_type == "rtx2060")
    small = derived_profile(base, v100, rtx2060)
    ratio = rtx2060.memory_gb / v100.memory_gb                       # 0.37
    assert small.max_local_batch <= base.max_local_batch * ratio
    assert all(b.max_num_vsw == max(1, math.floor(4 * ratio)) for b in small.batches)
    b0, s0 = base.batches[0], small.batches[0]
    assert s0.compute_time_1 == pytest.approx(b0.compute_time_1 * v100.tflops / rtx2060.tflops, rel=1e-12)
    profiles, notes = type_profiles({"v100": base}, b16, reference="v100")
    assert sorted(profiles) == ["p4000", "rtx2060", "titan-rtx", "titan-v"] and len(notes) == 4


def test_the_simulator_imports_neither_ray_nor_torch():
    code = ("import sys, math; from jabasray.sim import loop, policies, compare, replay, clusters, "
            "convergence, jabas_profiles; print('torch' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"policy must be one of .*got 'ddp'"):
        make_policy("ddp")
    with pytest.raises(ValueError, match="convergence must be given"):
        simulate(make_policy("jabas"), JOB, CLUSTER, N, _model(), None)
    from jabasray.sim.compare import check_policies
    with pytest.raises(ValueError, match="policies must be a comma-separated list"):
        check_policies(["jabas", "ddp"])


def test_jabasray_simulate_writes_a_run_folder_per_policy_and_the_comparison(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(json.dumps({"nodes": [{"name": "f0", "gpu_type": "fast", "num_gpus": 2, "tflops": 2.0},
                                             {"name": "s0", "gpu_type": "slow", "num_gpus": 2, "tflops": 1.0}]}))
    prof = tmp_path / "profiles"
    prof.mkdir()
    for g, p in emulated_profiles(synthetic_profile("base"), {"fast": 2.0, "slow": 1.0}).items():
        p.save(prof / f"{g}.json")
    out = tmp_path / "out"
    from jabasray.cli import main
    rc = main(["simulate", "--cluster", str(cluster), "--profiles", str(prof), "--convergence", "digits",
               "--epochs", "3", "--initial-global-batch", "32", "--min-global-batch", "32",
               "--max-global-batch", "256", "--adapt-interval", "4", "--gamma", "0.5", "--target", "0.5",
               "--placement-s", "1", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "comparison.json").read_text())
    assert sorted(result["policies"]) == sorted(POLICIES)
    assert result["policies"]["jabas"]["time_vs_jabas"] == 1.0
    from jabasray.actors.metrics import MetricsHistory
    for name in POLICIES:
        hist = MetricsHistory.from_json((out / name / "metrics.json").read_text())
        assert hist.epochs and (out / name / "trajectory.png").stat().st_size > 0
    assert (out / "comparison.png").stat().st_size > 0
    assert main(["simulate", "--cluster", str(cluster)]) == 2   # one line: what is missing
