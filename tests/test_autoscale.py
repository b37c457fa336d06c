"""Auto-scaling over GPU allocations (JABAS section 6.3) and the Eq. 8 cost model."""
from __future__ import annotations

import math

import pytest

from jabasray.planners import autoscale as asc
from jabasray.planners import NoPlanError, solve_for_batch
from jabasray.planners.autoscale import (Allocation, AutoscaleDecision, choose_allocation,
                                         enumerate_allocations, epoch_time)
from jabasray.planners.perf_model import PerfModel
from jabasray.profiler.profile import synthetic_profile
from jabasray.types import ClusterSpec, NodeSpec


def two_node_cluster(**kw) -> ClusterSpec:
    return ClusterSpec(nodes=[NodeSpec("N1", "gA", 4, tflops=kw.get("ta", 14.13)),
                              NodeSpec("N2", "gB", 2, tflops=kw.get("tb", 9.52))])


def model() -> PerfModel:
    base = synthetic_profile("gA", min_local_batch=8, num_batches=4)
    return PerfModel({"gA": base, "gB": base.scaled(0.5, "gB")})


def test_paper_two_node_example():
    """Section 6.3: N1 = 4 x g_A, N2 = 2 x g_B. The paper allocates pairs only: prod(m_i/2 + 1) - 1
    = 5 allocations, (gA, gA), (gB, gB), (gA x 4), (gA, gA, gB, gB), (gA x 4, gB, gB); we consider
    every GPU count (5 * 3 - 1 = 14), whose even-count candidates are the paper's list in its order."""
    cl = two_node_cluster()
    allocs = enumerate_allocations(cl)
    assert len(allocs) == 14
    paired = [a for a in allocs if all(g % 2 == 0 for g in a.node_gpus.values())]
    assert [tuple(a.gpus(cl)) for a in paired] == [
        ("gA", "gA"), ("gB", "gB"), ("gA",) * 4, ("gA", "gA", "gB", "gB"),
        ("gA",) * 4 + ("gB", "gB")]
    assert paired[3].group_gpus(cl) == ["gA", "gB"]
    assert [a.multi_node for a in paired] == [False, False, False, True, True]
    assert [tuple(a.gpus(cl)) for a in allocs[:2]] == [("gA",), ("gB",)]   # one GPU first
    assert allocs[0].group_gpus(cl) == ["gA/solo"]


@pytest.mark.parametrize("gpus_per_node", [[1], [2], [3, 1], [4, 2], [1, 1, 1], [2, 3, 5]])
def test_enumeration_equals_brute_force(gpus_per_node):
    """Every GPU count of every node, each exactly once, sorted by GPU count (then earlier nodes
    first), checked against nested loops; the units are pairs plus one solo GPU per odd count."""
    cl = ClusterSpec(nodes=[NodeSpec(f"n{i}", f"t{i % 2}", m) for i, m in enumerate(gpus_per_node)])
    allocs = enumerate_allocations(cl)
    combos = [()]
    for m in gpus_per_node:
        combos = [c + (g,) for c in combos for g in range(m + 1)]
    expected = sorted((c for c in combos if sum(c)), key=lambda c: (sum(c), [-g for g in c]))
    assert [tuple(a.node_gpus.values()) for a in allocs] == expected
    assert len(allocs) == math.prod(m + 1 for m in gpus_per_node) - 1
    for a in allocs:
        units = a.group_gpus(cl)
        for i, (name, g) in enumerate(a.node_gpus.items()):
            t = cl.node(name).gpu_type
            assert units.count(t) >= g // 2
        assert sum(1 if u.endswith("/solo") else 2 for u in units) == a.num_gpus
        assert sum(u.endswith("/solo") for u in units) == sum(g % 2 for g in a.node_gpus.values())


def test_odd_gpu_counts_are_units_with_a_solo_gpu():
    cl = ClusterSpec(nodes=[NodeSpec("N1", "gA", 3), NodeSpec("N2", "gB", 1)])
    assert Allocation({"N1": 3, "N2": 1}).group_gpus(cl) == ["gA", "gA/solo", "gB/solo"]
    assert Allocation({"N1": 2, "N2": 0}).group_gpus(cl) == ["gA"]
    d = choose_allocation(cl, model(), [64, 128], 2048, 4, 8)
    assert d.epoch_time > 0


def test_epoch_time_bookkeeping_and_memo(monkeypatch):
    """trajectory [64, 128], 1000 samples, p = 3: chunks of 3 iterations at 64 (192 samples),
    then 128 for the rest: 3 + 3 (768 samples) + 1 final ragged iteration of 40 samples -> 10
    iterations, time = 3 t(64) + 6 t(128) + the ragged iteration run per VSW."""
    m = model().for_allocation(2, False)
    calls = []
    real = asc.solve_for_batch
    monkeypatch.setattr(asc, "solve_for_batch",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    est = epoch_time(["gA"], m, [64, 128], 1000, 3, 8)
    p64, p128 = solve_for_batch(64, ["gA"], m, 8), solve_for_batch(128, ["gA"], m, 8)
    assert p64.global_batch_size == 64 and p128.global_batch_size == 128
    assert est.iterations == 10
    ragged = ragged_by_hand(p128, 40, m)
    assert ragged != pytest.approx(p128.iteration_time)
    assert est.epoch_time == pytest.approx(3 * p64.iteration_time + 6 * p128.iteration_time + ragged)
    assert est.plans == {64: p64, 128: p128}
    assert sorted(calls) == [64, 128]            # each distinct B_G solved once
    # the trajectory is longer than the epoch: only what is used counts
    est2 = epoch_time(["gA"], m, [128] * 50, 256, 3, 8)
    assert est2.iterations == 2 and est2.epoch_time == pytest.approx(2 * p128.iteration_time)
    # infeasible: B_G too small for the group
    bad = epoch_time(["gA", "gA"], m, [16], 100, 3, 8)
    assert bad.epoch_time is None and "too small" in bad.reason


def _policy_plan(bg, gpus, m, mbl):
    """The driver's plan for B_G, or None where the auto-scaler counts the group infeasible
    (no plan, or B_G below what the group runs: the policy would raise it to the floor)."""
    try:
        plan = solve_for_batch(bg, gpus, m, mbl)
    except NoPlanError:
        return None
    return plan if plan.requested_global_batch_size == bg else None


def ragged_by_hand(plan, remainder, m):
    """The epoch's ragged last iteration of ``remainder`` samples (no measured extra): every GPU
    runs its VSWs and GA steps at ceil(R / W) samples, the slowest sets the pace; a solo GPU
    runs both groups' VSWs."""
    size = -(-remainder // (plan.global_batch_size // plan.local_batch_size))
    return max(m.iteration_time(w.gpu.split("/")[0], size, w.num_vsw * (2 if w.gpu.endswith("/solo") else 1),
                                w.num_ga)
               for w in plan.workers)


def brute_force(cl, m, traj, n, p, mbl):
    """Epoch time and cost of every allocation, computed without memo or the chooser, on the
    plans the driver runs (the plan policy)."""
    out = []
    for a in enumerate_allocations(cl):
        mm = m.for_allocation(a.num_gpus, a.multi_node)
        remaining, t, c = n, 0.0, 0
        ok = True
        while remaining > 0:
            plan = _policy_plan(traj[min(c, len(traj) - 1)], a.group_gpus(cl), mm, mbl)
            if plan is None:
                ok = False
                break
            k = min(p, -(-remaining // plan.global_batch_size))
            last = remaining - (k - 1) * plan.global_batch_size
            if last < plan.global_batch_size:     # the epoch's ragged last iteration
                t += (k - 1) * plan.iteration_time + ragged_by_hand(plan, last, mm)
            else:
                t += k * plan.iteration_time
            remaining -= k * plan.global_batch_size
            c += 1
        if ok:
            price = sum(g * cl.node(name).price_weight for name, g in a.node_gpus.items())
            out.append((a, t, t * price))
    return out


@pytest.mark.parametrize("odd", [False, True])
@pytest.mark.parametrize("traj", [[32], [64, 128, 256, 512], [512, 256]])
def test_choice_is_best_of_all_candidates(traj, odd):
    cl = two_node_cluster() if not odd else ClusterSpec(
        nodes=[NodeSpec("N1", "gA", 3, tflops=14.13), NodeSpec("N2", "gB", 1, tflops=9.52)])
    m = model()
    ref = brute_force(cl, m, traj, 4096, 4, 8)
    d = choose_allocation(cl, m, traj, 4096, 4, 8)
    best_t = min(t for _, t, _ in ref)
    assert d.epoch_time == pytest.approx(best_t, rel=1e-12)
    assert d.allocation in [a for a, t, _ in ref if t == pytest.approx(best_t, rel=1e-12)]
    assert d.group_gpus == d.allocation.group_gpus(cl)
    assert set(d.plans) == set(traj)              # a plan for every B_G of the trajectory
    dc = choose_allocation(cl, m, traj, 4096, 4, 8, objective="cost")
    assert dc.cost == pytest.approx(min(c for _, _, c in ref), rel=1e-12)
    # cost is Eq. 8: epoch time x sum of TFLOPS-proportional prices
    a = dc.allocation
    assert dc.cost == pytest.approx(dc.epoch_time * a.price_rate(cl))
    assert len(d.candidates) == len(enumerate_allocations(cl))


def test_time_under_budget():
    cl = two_node_cluster()
    m = model()
    traj = [256]
    ref = brute_force(cl, m, traj, 4096, 4, 8)
    costs = sorted(c for _, _, c in ref)
    budget = (costs[0] + costs[1]) / 2          # only the cheapest fits
    d = choose_allocation(cl, m, traj, 4096, 4, 8, objective="time_under_budget", cost_budget=budget)
    assert d.within_budget and d.cost == pytest.approx(costs[0])
    budget = costs[-1] * 2                       # everything fits -> fastest
    d = choose_allocation(cl, m, traj, 4096, 4, 8, objective="time_under_budget", cost_budget=budget)
    assert d.epoch_time == pytest.approx(min(t for _, t, _ in ref))
    d = choose_allocation(cl, m, traj, 4096, 4, 8, objective="time_under_budget", cost_budget=costs[0] / 10)
    assert not d.within_budget and d.cost == pytest.approx(costs[0])


def _key(a: Allocation) -> tuple:
    return tuple(sorted(a.node_gpus.items()))


@pytest.mark.parametrize("objective", ["time", "cost"])
@pytest.mark.parametrize("traj", [[32], [64, 128, 256, 512]])
def test_a_move_is_charged_the_re_placement_on_top_of_its_epoch(traj, objective):
    """With a ``current`` allocation every other candidate is weighed at its epoch time plus
    ``switch_cost_s`` (its cost: plus its GPUs' price for those seconds); the choice is the best
    candidate so weighed, checked against the brute-force epoch times for every current
    allocation and a range of charges; ``uncharged_choice`` names the uncharged choice when
    the charge changed it."""
    cl = two_node_cluster()
    m = model()
    ref = brute_force(cl, m, traj, 4096, 4, 8)
    rate = {_key(a): c / t for a, t, c in ref}
    spread = max(t for _, t, _ in ref) - min(t for _, t, _ in ref)
    free = choose_allocation(cl, m, traj, 4096, 4, 8, objective=objective)
    for current, _, _ in ref[::2]:
        for s in (0.0, spread / 20, spread / 3, 10 * spread):
            d = choose_allocation(cl, m, traj, 4096, 4, 8, objective=objective, current=current,
                                  switch_cost_s=s)

            def weighed(a, t, c):
                extra = 0.0 if a == current else s
                return t + extra if objective == "time" else c + extra * rate[_key(a)]
            best = min(weighed(*r) for r in ref)
            chosen = next(r for r in ref if r[0] == d.allocation)
            assert weighed(*chosen) == pytest.approx(best, rel=1e-12), (current, s)
            if s == 0.0:                          # uncharged: the paper's rule, as without current
                assert (d.allocation, d.uncharged_choice) == (free.allocation, None)
            else:
                assert d.uncharged_choice == (free.allocation if free.allocation != d.allocation else None)
            assert d.epoch_time == pytest.approx(chosen[1], rel=1e-12)   # the epoch's, not charged
        # the driver's allocations leave out nodes with no GPU: the same allocation
        used = Allocation({n: g for n, g in current.node_gpus.items() if g})
        assert choose_allocation(cl, m, traj, 4096, 4, 8, objective=objective, current=used,
                                 switch_cost_s=s).allocation == d.allocation
        if current != free.allocation and objective == "time":
            # the threshold: a move that the next epoch repays is made, one it does not is not
            gain = next(t for a, t, _ in ref if a == current) - free.epoch_time
            if gain > 0:
                moved = choose_allocation(cl, m, traj, 4096, 4, 8, current=current, switch_cost_s=0.99 * gain)
                kept = choose_allocation(cl, m, traj, 4096, 4, 8, current=current, switch_cost_s=1.01 * gain)
                assert moved.allocation == free.allocation and moved.uncharged_choice is None
                assert kept.allocation == current and kept.uncharged_choice == free.allocation


def test_the_switch_charge_counts_against_the_budget():
    """"time_under_budget": the re-placement's price is part of a move's cost, so a move that fits
    the budget uncharged may not fit it charged."""
    cl = two_node_cluster()
    m = model()
    ref = sorted(brute_force(cl, m, [256], 4096, 4, 8), key=lambda r: r[2])
    cheapest, _, c0 = ref[0]
    current = max(ref, key=lambda r: r[2])[0]              # the dearest runs now
    budget = c0 * 1.001
    d = choose_allocation(cl, m, [256], 4096, 4, 8, objective="time_under_budget", cost_budget=budget,
                          current=current, switch_cost_s=0.0)
    assert d.allocation == cheapest and d.within_budget
    big = 1e3 * max(t for _, t, _ in ref)
    d = choose_allocation(cl, m, [256], 4096, 4, 8, objective="time_under_budget", cost_budget=budget,
                          current=current, switch_cost_s=big)
    assert not d.within_budget and d.allocation == current   # nothing fits: the least charged cost


def test_decision_json_round_trip():
    cl = two_node_cluster()
    d = choose_allocation(cl, model(), [64, 128], 2048, 4, 8)
    again = AutoscaleDecision.from_json(d.to_json())
    assert again == d
    assert isinstance(next(iter(again.plans)), int)
    other = next(c.allocation for c in d.candidates if c.epoch_time and not c.allocation.same_gpus(d.allocation))
    kept = choose_allocation(cl, model(), [64, 128], 2048, 4, 8, current=other, switch_cost_s=1e9)
    assert kept.allocation == other and kept.uncharged_choice == d.allocation
    assert AutoscaleDecision.from_json(kept.to_json()) == kept


@pytest.mark.parametrize("kw, field", [
    (dict(objective="fastest"), "objective"),
    (dict(objective="time_under_budget"), "cost_budget"),
    (dict(cost_budget=-1.0), "cost_budget"),
    (dict(trajectory=[]), "trajectory"),
    (dict(trajectory=[64, 0]), r"trajectory\[1\]"),
    (dict(dataset_size=0), "dataset_size"),
    (dict(adapt_interval=0), "adapt_interval"),
    (dict(switch_cost_s=-1.0), "switch_cost_s"),
])
def test_bad_input(kw, field):
    args = dict(cluster=two_node_cluster(), model=model(), trajectory=[64], dataset_size=100,
                adapt_interval=2, min_local_batch=8)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        choose_allocation(**args)


def test_no_feasible_allocation_is_a_clear_error():
    cl = two_node_cluster()
    with pytest.raises(ValueError, match="no allocation can run it"):
        choose_allocation(cl, model(), [4], 100, 2, 8)
    with pytest.raises(ValueError, match="node_gpus"):
        Allocation({"N1": 0})
    with pytest.raises(ValueError, match=r"node_gpus\[N2\] must be <= 2"):
        Allocation({"N1": 1, "N2": 3}).group_gpus(cl)


def test_epoch_time_and_breakdown_json_round_trip():
    from jabasray.planners.autoscale import EpochTime
    from jabasray.planners.perf_model import IterationBreakdown
    m = model().for_allocation(2, False)
    est = epoch_time(["gA"], m, [64, 128], 1000, 3, 8)
    assert EpochTime.from_json(est.to_json()) == est
    b = m.breakdown("gA", 16, 2, 3)
    assert IterationBreakdown.from_json(b.to_json()) == b
    bad = epoch_time(["gA", "gA"], m, [16], 100, 3, 8)
    assert EpochTime.from_json(bad.to_json()) == bad


@pytest.mark.parametrize("value", [-1.0, "x", float("nan")])
def test_job_config_replacement_cost_names_the_field(value):
    from jabasray.config import JobConfig
    with pytest.raises(ValueError, match=r"^replacement_cost_s must be a number in \[0, inf\], got"):
        JobConfig(replacement_cost_s=value)
