"""LIBRA planner: contention fit (Eq. 5-6), backward-time model (Eq. 8-15), DPs (Eq. 17, 23).

Random instances draw contention models that satisfy the paper's Assumptions 1-3 (one compute
speed for all layers; overlapped transmission no faster than alone, q <= p; computation keeps
>= 40% of its speed), under which Theorem 1 promises T_hat <= (1 + (K-1)/Z) T*.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from jabasray.planners.libra import (BackwardTime, LayerProfile, LibraPlan, allocate_threads,
                                     backward_time, co_optimize, cta_counts, default_plan,
                                     evaluate_plan, exhaustive_plan, group_params_by_layer, plan_buckets,
                                     size_capped_fusion, theorem1_bound, to_engine_bucket_plan)
from jabasray.planners.libra_model import (CommParams, CommRow, ComputeParams, ComputeRow,
                                           ContentionModel, fit_contention_model, synthetic_rows)

MiB = 1024 * 1024
THREADS = [128, 512, 2048, 4096]
THREADS3 = [128, 1024, 4096]          # exhaustive references enumerate J^K allocations


def reference_model() -> ContentionModel:
    return ContentionModel(compute=ComputeParams(1.0, 1.2e-4),
                           overlapped=CommParams(6.0e9, 5.5e9, 0.05),
                           alone=CommParams(6.25e9, 5.8e9, 0.06), num_workers=8, hop_latency=5e-6)


def random_model(rng: np.random.Generator) -> ContentionModel:
    a1 = rng.uniform(0.8, 1.0)
    a2 = rng.uniform(0.2, 0.6) * a1 / 4096
    g1 = rng.uniform(2e9, 1e10)
    p = CommParams(g1, g1 * rng.uniform(0.5, 0.95), rng.uniform(0.01, 0.2))
    q = CommParams(p.gamma1 * rng.uniform(1.0, 1.2), p.gamma2, p.gamma3)
    return ContentionModel(ComputeParams(a1, a2), p, q, num_workers=int(rng.integers(2, 64)),
                           hop_latency=float(rng.uniform(0, 1e-4)))


def random_layers(rng: np.random.Generator, n: int, zeros: bool = True) -> list[LayerProfile]:
    """Layers in backward order; with ``zeros`` some have no computation or no gradient."""
    out = []
    for i in range(n):
        b = float(rng.uniform(1e-3, 1e-2)) * (not zeros or rng.random() > 0.1)
        c = float(rng.uniform(1e5, 5e7)) * (not zeros or rng.random() > 0.15)
        out.append(LayerProfile(f"layer{i}", b, c))
    if sum(x.backward_time for x in out) == 0:
        out[0] = LayerProfile("layer0", 1e-3, out[0].grad_bytes)
    return out


# --------------------------------------------------------------------------- contention fit
def test_fit_recovers_known_parameters_from_noiseless_rows():
    true = reference_model()
    compute_rows, comm_rows = synthetic_rows(true, THREADS + [256, 1024], [1e6, 1e7, 1e8], [0.01, 0.05])
    fit = fit_contention_model(compute_rows, comm_rows, num_workers=8, hop_latency=5e-6)
    pairs = ((fit.compute, true.compute), (fit.overlapped, true.overlapped), (fit.alone, true.alone))
    for got, want in pairs:
        for name, value in vars(want).items():
            assert getattr(got, name) == pytest.approx(value, rel=1e-7), name
    assert set(fit.fit_errors) == {"g", "p", "q"}
    for err in fit.fit_errors.values():
        assert err.rel_rmse < 1e-9 and err.mape < 1e-9
    assert fit.fit_errors["g"].num_rows == len(compute_rows)
    assert fit.fit_errors["p"].num_rows + fit.fit_errors["q"].num_rows == len(comm_rows)


def test_fit_with_noise_is_close_and_reports_its_error():
    true = reference_model()
    noise = 0.01
    compute_rows, comm_rows = synthetic_rows(true, [128, 256, 512, 1024, 2048, 4096],
                                             [1e6, 3e6, 1e7, 3e7, 1e8], [0.01, 0.02, 0.05],
                                             noise=noise, seed=3)
    fit = fit_contention_model(compute_rows, comm_rows, num_workers=8, hop_latency=5e-6)
    # The reported error is the noise level it saw (relative RMSE of N(0, 1%) is ~1%).
    for err in fit.fit_errors.values():
        assert 0.4 * noise < err.rel_rmse < 2.0 * noise
    # The fitted functions predict the true g, p, q within a few noise levels over the range.
    r = np.array([128, 300, 1000, 4096])
    np.testing.assert_allclose(fit.g(0.03, r), true.g(0.03, r), rtol=3 * noise)
    np.testing.assert_allclose(fit.p(5e7, r), true.p(5e7, r), rtol=3 * noise)
    np.testing.assert_allclose(fit.q(5e7, r), true.q(5e7, r), rtol=3 * noise)
    # ... and so the backward time of a plan (cf. Sec. V-B: 2.7% average error).
    layers = random_layers(np.random.default_rng(0), 6, zeros=False)
    buckets = [[x.name] for x in layers]
    threads = [128, 512, 2048, 4096, 512, 128]
    assert evaluate_plan(fit, layers, buckets, threads).total == pytest.approx(
        evaluate_plan(true, layers, buckets, threads).total, rel=3 * noise)


def test_fit_rejects_too_few_rows_and_bad_rows():
    true = reference_model()
    compute_rows, comm_rows = synthetic_rows(true, THREADS, [1e6, 1e7], [0.01])
    over = [row for row in comm_rows if row.overlapped]
    alone = [row for row in comm_rows if not row.overlapped]
    with pytest.raises(ValueError, match="compute_rows must hold at least 2 rows"):
        fit_contention_model(compute_rows[:1], comm_rows, num_workers=8, hop_latency=5e-6)
    with pytest.raises(ValueError, match=r"comm_rows \(overlapped\) must hold at least 3 rows"):
        fit_contention_model(compute_rows, over[:2] + alone, num_workers=8, hop_latency=5e-6)
    with pytest.raises(ValueError, match=r"comm_rows \(non-overlapped\) must hold at least 3 rows"):
        fit_contention_model(compute_rows, over, num_workers=8, hop_latency=5e-6)
    same_r = [ComputeRow(0.01, 128, 0.012), ComputeRow(0.02, 128, 0.024)]
    with pytest.raises(ValueError, match="compute_rows must cover at least 2 distinct thread counts"):
        fit_contention_model(same_r, comm_rows, num_workers=8, hop_latency=5e-6)
    with pytest.raises(ValueError, match=r"compute_rows\[0\].time"):
        fit_contention_model([ComputeRow(0.01, 128, -1.0)] + compute_rows, comm_rows, num_workers=8,
                             hop_latency=5e-6)
    with pytest.raises(ValueError, match=r"comm_rows \(overlapped\)\[0\].time"):   # time <= startup a
        fit_contention_model(compute_rows, [CommRow(1e6, 128, 1e-6, True)] + comm_rows, num_workers=8,
                             hop_latency=5e-6)
    with pytest.raises(ValueError, match="num_workers"):
        fit_contention_model(compute_rows, comm_rows, num_workers=1, hop_latency=5e-6)
    with pytest.raises(ValueError, match="hop_latency"):
        fit_contention_model(compute_rows, comm_rows, num_workers=8, hop_latency=-1.0)


def test_model_json_round_trip_and_thread_validity():
    true = reference_model()
    compute_rows, comm_rows = synthetic_rows(true, THREADS, [1e6, 1e7], [0.01], noise=0.01)
    fit = fit_contention_model(compute_rows, comm_rows, num_workers=8, hop_latency=5e-6)
    assert ContentionModel.from_json(fit.to_json()) == fit
    assert ComputeRow.from_json(compute_rows[0].to_json()) == compute_rows[0]
    assert CommRow.from_json(comm_rows[-1].to_json()) == comm_rows[-1]
    # alpha1 - alpha2 * r <= 0 at r = 10000: the model is not valid there.
    with pytest.raises(ValueError, match=r"thread_choices \[10000\] give a non-positive computation speed"):
        true.check_threads([128, 10000])


# --------------------------------------------------------------------------- Eq. 8-15
def test_overlap_worked_example():
    """g = b / (1 - 1e-4 r); rate = 1e9 - 5e8 exp(-0.1 r^0.6) for p, 1e9 for q; N = 2, a = 2 alpha."""
    m = ContentionModel(ComputeParams(1.0, 1e-4), CommParams(1e9, 5e8, 0.1), CommParams(1e9, 0.0, 1.0),
                        num_workers=2, hop_latency=1e-3)
    r = 1000
    rate_p = 1e9 - 5e8 * math.exp(-0.1 * r ** 0.6)
    p = 1e7 / rate_p                      # c_hat = 2(N-1)/N c = c for N = 2
    assert m.startup == pytest.approx(2e-3)
    # communication shorter than the computation: residual computation only (Eq. 9, 11)
    f_o, f_b, f_c = (float(x) for x in m.overlap(1e7, 0.1, r))
    g = 0.1 / 0.9
    assert f_o == pytest.approx(p + 2e-3)
    assert f_b == pytest.approx(0.1 * (1 - (p + 2e-3) / g))
    assert f_c == 0.0
    # computation shorter: residual communication at the non-overlapped rate (Eq. 10, 11)
    f_o, f_b, f_c = (float(x) for x in m.overlap(1e8, 0.01, r))
    p = 1e8 / rate_p
    assert f_o == pytest.approx(0.01 / 0.9)
    assert f_b == 0.0
    assert f_c == pytest.approx((1e8 / 1e9 + 2e-3) * (1 - (0.01 / 0.9) / (p + 2e-3)))
    # empty tasks (Eq. 8-10 first cases)
    assert tuple(float(x) for x in m.overlap(0.0, 0.1, r)) == (0.0, 0.1, 0.0)
    assert tuple(float(x) for x in m.overlap(1e7, 0.0, r)) == pytest.approx((0.0, 0.0, 1e7 / 1e9 + 2e-3))


def simulate(model: ContentionModel, b, c, r) -> float:
    """Independent event simulation of the backward pass under the same assumptions.

    Computation of the groups runs back to back at speed 1, or at speed alpha1 - alpha2 r while
    an all-reduce with r threads is active; an all-reduce progresses at 1/(p + a) per second
    while computation remains and at 1/(q + a) afterwards; all-reduces run one at a time, each
    starting when its group's gradients exist and the previous one finished.
    """
    remaining = list(map(float, b))           # computation left per group
    t, g, frac = 0.0, 0, 0.0                  # time, group whose all-reduce is next/active, its progress
    active = False
    K = len(b)
    while g < K:
        k = next((i for i, x in enumerate(remaining) if x > 1e-15), K)   # group being computed
        if not active and k > g:              # gradients of group g ready: start its all-reduce
            if c[g] == 0:
                g += 1
                continue
            active, frac = True, 0.0
        speed = model.compute.speed(r[g]) if active else 1.0
        comm_rate = 0.0
        if active:
            comm_rate = 1.0 / (float(model.p(c[g], r[g])) + model.startup) if k < K else \
                1.0 / (float(model.q(c[g], r[g])) + model.startup)
        dt_comp = remaining[k] / speed if k < K else math.inf
        dt_comm = (1.0 - frac) / comm_rate if active else math.inf
        dt = min(dt_comp, dt_comm)
        t += dt
        if k < K:
            remaining[k] = 0.0 if dt == dt_comp else remaining[k] - dt * speed
        if active:
            frac = 1.0 if dt == dt_comm else frac + dt * comm_rate
            if frac >= 1.0 - 1e-15:
                active, g = False, g + 1
    return t


def test_backward_time_matches_event_simulation():
    rng = np.random.default_rng(7)
    for _ in range(60):
        model = random_model(rng)
        K = int(rng.integers(1, 7))
        b = [float(x) * (rng.random() > 0.1) for x in rng.uniform(1e-3, 2e-2, K)]
        b[-1] = max(b[-1], 1e-4)
        c = [float(x) * (rng.random() > 0.1) for x in rng.uniform(1e5, 5e7, K)]
        r = [int(x) for x in rng.choice(THREADS, K)]
        bt = backward_time(model, b, c, r)
        assert bt.total == pytest.approx(simulate(model, b, c, r), rel=1e-9)
        assert len(bt.stages) == K + 1
        assert bt.stages[0] == type(bt.stages[0])(0.0, b[0], 0.0)       # stage 0: group 1 alone
        assert bt.stages[-1].overlap == 0.0                              # stage K: comm only
        for st in bt.stages:
            assert st.compute == 0.0 or st.comm == 0.0                   # never both residuals
        assert bt.total >= sum(b) - 1e-15                                # T >= sum b (Sec. IV-C)
        assert BackwardTime.from_json(bt.to_json()) == bt


def test_backward_time_rejects_bad_input():
    m = reference_model()
    with pytest.raises(ValueError, match=r"comp\[1\]"):
        backward_time(m, [0.1, -0.1], [1e6, 1e6], [128, 128])
    with pytest.raises(ValueError, match="threads must hold one thread count per bucket"):
        backward_time(m, [0.1, 0.1], [1e6, 1e6], [128])
    with pytest.raises(ValueError, match=r"threads\[0\]"):
        backward_time(m, [0.1], [1e6], [0])


# --------------------------------------------------------------------------- DPs
def test_thread_dp_within_theorem1_bound_of_exhaustive_optimum():
    """Eq. 17 for a fixed fusion: T* <= T_hat <= T(K, Z) and T_hat <= (1 + (K-1)/Z) T*."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        model = random_model(rng)
        layers = random_layers(rng, int(rng.integers(1, 8)))
        num_cuts = min(int(rng.integers(0, 4)), len(layers) - 1)
        cuts = sorted(rng.choice(np.arange(1, len(layers)), size=num_cuts, replace=False).tolist())
        edges = [0, *cuts, len(layers)]
        buckets = [[x.name for x in layers[s:e]] for s, e in zip(edges[:-1], edges[1:])]
        Z = int(rng.integers(1, 30))
        plan = allocate_threads(model, layers, buckets, THREADS, num_chunks=Z)
        best = exhaustive_plan(model, layers, THREADS, buckets=buckets)
        assert plan.buckets == buckets and len(plan.threads) == len(buckets)
        assert set(plan.threads) <= set(THREADS)
        assert plan.backward_time == pytest.approx(evaluate_plan(model, layers, buckets, plan.threads).total)
        assert best.backward_time <= plan.backward_time * (1 + 1e-12)
        assert plan.backward_time <= plan.dp_time * (1 + 1e-12)                      # Eq. 28
        assert plan.backward_time <= theorem1_bound(len(buckets), Z) * best.backward_time * (1 + 1e-12)


def test_coopt_dp_within_theorem1_bound_of_exhaustive_optimum():
    """Eq. 23 / Alg. 1 vs all fusions into <= K consecutive groups x all allocations."""
    rng = np.random.default_rng(12)
    for _ in range(40):
        model = random_model(rng)
        layers = random_layers(rng, int(rng.integers(1, 7)))
        K = int(rng.integers(1, len(layers) + 1))
        Z = int(rng.integers(1, 30))
        plan = co_optimize(model, layers, THREADS3, max_groups=K, num_chunks=Z)
        best = exhaustive_plan(model, layers, THREADS3, max_groups=K)
        assert 1 <= plan.num_buckets <= K
        assert [x for bk in plan.buckets for x in bk] == [x.name for x in layers]
        evaluated = evaluate_plan(model, layers, plan.buckets, plan.threads).total
        assert plan.backward_time == pytest.approx(evaluated)
        assert best.backward_time <= plan.backward_time * (1 + 1e-12)
        assert plan.backward_time <= plan.dp_time * (1 + 1e-12)
        assert plan.backward_time <= theorem1_bound(K, Z) * best.backward_time * (1 + 1e-12)
        if K == 1:                                        # bound factor 1: exact
            assert plan.backward_time == pytest.approx(best.backward_time, rel=1e-12)


def test_coopt_matches_thread_dp_when_fusion_is_forced():
    """With K = L = 1 layer per group forced, both DPs search the same space."""
    rng = np.random.default_rng(5)
    for _ in range(10):
        model = random_model(rng)
        layers = random_layers(rng, 3, zeros=False)
        one_each = [[x.name] for x in layers]
        a = allocate_threads(model, layers, one_each, THREADS, num_chunks=20)
        b = co_optimize(model, layers, THREADS, max_groups=3, num_chunks=20)
        assert b.dp_time <= a.dp_time * (1 + 1e-12)       # more fusion choices, never worse on the grid


def test_plan_never_worse_than_default_and_usually_better():
    rng = np.random.default_rng(21)
    strictly_better = 0
    trials = 25
    for _ in range(trials):
        model = random_model(rng)
        layers = random_layers(rng, int(rng.integers(3, 12)), zeros=False)
        K = int(rng.integers(1, 6))
        Z = int(rng.integers(5, 40))
        cap = float(rng.uniform(10, 60))
        for fixed in (THREADS[0], THREADS[-1]):
            base = default_plan(model, layers, fixed, bucket_cap_mb=cap)
            plan = plan_buckets(model, layers, THREADS, max_groups=K, num_chunks=Z, bucket_cap_mb=cap,
                                default_threads=fixed)
            assert plan.backward_time <= base.backward_time
            assert plan.baseline_time == base.backward_time
            raw = co_optimize(model, layers, THREADS, max_groups=K, num_chunks=Z)
            if base.num_buckets <= K:                     # the default is a candidate of Eq. 23
                assert raw.backward_time <= theorem1_bound(K, Z) * base.backward_time * (1 + 1e-12)
            strictly_better += plan.backward_time < base.backward_time * (1 - 1e-6)
    assert strictly_better >= 0.8 * 2 * trials           # LIBRA beats the fixed policy in most cases


def test_plan_balances_contention_worked_case():
    """Strong contention (4096 threads halve computation speed) and small gradients: LIBRA
    gives the all-reduces fewer threads than the fixed 4096 policy and is predicted faster."""
    model = ContentionModel(ComputeParams(1.0, 1.2e-4), CommParams(6e9, 5.5e9, 0.05),
                            CommParams(6.25e9, 5.8e9, 0.06), num_workers=8, hop_latency=5e-6)
    layers = [LayerProfile(f"l{i}", 0.004, 8 * MiB) for i in range(8)]
    plan = plan_buckets(model, layers, THREADS, max_groups=4, num_chunks=60, bucket_cap_mb=25.0,
                        default_threads=4096)
    base = default_plan(model, layers, 4096, bucket_cap_mb=25.0)
    assert plan.method in ("coopt", "threads")
    assert plan.backward_time < base.backward_time
    assert min(plan.threads[:-1]) < 4096


def test_size_capped_fusion_worked_example():
    layers = [LayerProfile(n, 0.01, s * MiB) for n, s in zip("abcde", [10, 10, 10, 30, 5])]
    # a bucket closes once it holds >= 25 MiB: [a b c]=30, [d]=30, [e]
    assert size_capped_fusion(layers, 25.0) == [["a", "b", "c"], ["d"], ["e"]]
    # exactly at the cap closes too: [a b]=20, [c d]=40, [e]
    assert size_capped_fusion(layers, 20.0) == [["a", "b"], ["c", "d"], ["e"]]
    assert size_capped_fusion(layers, 1000.0) == [["a", "b", "c", "d", "e"]]


def test_plan_json_round_trip():
    rng = np.random.default_rng(2)
    model = random_model(rng)
    layers = random_layers(rng, 5)
    plan = plan_buckets(model, layers, THREADS, max_groups=3, num_chunks=20)
    again = LibraPlan.from_json(plan.to_json())
    assert again == plan
    assert LayerProfile.from_json(layers[0].to_json()) == layers[0]
    manual = LibraPlan(buckets=[["a"], ["b"], ["c"]], threads=[128, 512, 4096], backward_time=1.0,
                       method="default")
    assert cta_counts(manual) == [1, 1, 8] and cta_counts(manual, 256) == [1, 2, 16]


def test_planner_rejects_bad_input():
    m = reference_model()
    layers = [LayerProfile("a", 0.01, 1e6), LayerProfile("b", 0.01, 1e6)]
    with pytest.raises(ValueError, match="layers must be a non-empty list"):
        co_optimize(m, [], THREADS)
    with pytest.raises(ValueError, match=r"layers\[1\].backward_time"):
        co_optimize(m, [layers[0], LayerProfile("b", -0.01, 1e6)], THREADS)
    with pytest.raises(ValueError, match=r"layers\[0\].grad_bytes"):
        co_optimize(m, [LayerProfile("a", 0.01, -1.0)], THREADS)
    with pytest.raises(ValueError, match="max_groups"):
        co_optimize(m, layers, THREADS, max_groups=0)
    with pytest.raises(ValueError, match="num_chunks"):
        co_optimize(m, layers, THREADS, num_chunks=0)
    with pytest.raises(ValueError, match="thread_choices must be a non-empty list"):
        plan_buckets(m, layers, [])
    with pytest.raises(ValueError, match=r"thread_choices\[0\]"):
        allocate_threads(m, layers, [["a", "b"]], [0])
    with pytest.raises(ValueError, match="layers names must be unique"):
        co_optimize(m, [layers[0], layers[0]], THREADS)
    with pytest.raises(ValueError, match="sum to > 0"):
        co_optimize(m, [LayerProfile("a", 0.0, 1e6)], THREADS)
    with pytest.raises(ValueError, match="buckets must list every layer exactly once"):
        allocate_threads(m, layers, [["b"], ["a"]], THREADS)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        plan_buckets(m, layers, THREADS, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="default_threads"):
        plan_buckets(m, layers, THREADS, default_threads=0)


# --------------------------------------------------------------------------- engine bridge
def test_engine_bucket_plan_from_digits_cnn():
    from jabasray.engine.buckets import default_bucket_plan, validate_bucket_plan
    from jabasray.models import DigitsCNN

    model = DigitsCNN()
    names = [n for n, _ in model.named_parameters()]
    numel = {n: p.numel() for n, p in model.named_parameters()}
    layer_params = group_params_by_layer(names)
    by_module = {m: [f"{m}.{p}" for p, _ in mod.named_parameters(recurse=False)]
                 for m, mod in model.named_modules() if any(True for _ in mod.parameters(recurse=False))}
    assert layer_params == by_module
    assert list(layer_params) == ["features.0", "features.3", "classifier.1", "classifier.3"]
    backward_layers = list(reversed(layer_params))
    layers = [LayerProfile(name, 1e-4 * (1 + i), float(4 * sum(numel[p] for p in layer_params[name])))
              for i, name in enumerate(backward_layers)]
    model_c = reference_model()
    for K in (1, 2, 3, 4):
        plan = plan_buckets(model_c, layers, THREADS, max_groups=K, num_chunks=30)
        engine_plan = to_engine_bucket_plan(plan, layer_params)
        flat = [p for bucket in engine_plan for p in bucket]
        assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))   # each exactly once
        assert flat == list(reversed(names))                                    # backward order
        assert len(engine_plan) == plan.num_buckets == len(plan.threads)
        for bucket, layer_bucket in zip(engine_plan, plan.buckets):
            assert {p.rsplit(".", 1)[0] for p in bucket} == set(layer_bucket)
        assert validate_bucket_plan(model, engine_plan) == engine_plan        # the engine accepts it
    # one bucket == the engine's own default plan with an unbounded cap (same order convention)
    assert to_engine_bucket_plan([backward_layers], layer_params) == default_bucket_plan(model, 1e6)


def test_engine_bucket_plan_rejects_mismatch():
    layer_params = {"a": ["a.weight", "a.bias"], "b": ["b.weight"]}
    with pytest.raises(ValueError, match="layer_params has no entry for layer 'c'"):
        to_engine_bucket_plan([["b", "c"]], layer_params)
    with pytest.raises(ValueError, match=r"plan misses layers \['a'\]"):
        to_engine_bucket_plan([["b"]], layer_params)
    with pytest.raises(ValueError, match="plan lists layer 'b' twice"):
        to_engine_bucket_plan([["b"], ["b", "a"]], layer_params)
    assert to_engine_bucket_plan([["b"], ["a"]], layer_params) == [["b.weight"], ["a.bias", "a.weight"]]
    with_relu = {**layer_params, "relu": []}
    assert to_engine_bucket_plan([["relu", "b"], ["a"]], with_relu) == [["b.weight"], ["a.bias", "a.weight"]]
    with pytest.raises(ValueError, match="bucket 0 .* holds no parameter"):
        to_engine_bucket_plan([["relu"], ["b", "a"]], with_relu)
    assert group_params_by_layer(["w", "a.b.weight", "a.b.bias"]) == {"w": ["w"],
                                                                      "a.b": ["a.b.weight", "a.b.bias"]}


def test_exhaustive_counts_all_fusions():
    """Sanity of the reference: it sees every fusion into <= K groups (sum_k C(L-1, k-1))."""
    m = reference_model()
    layers = [LayerProfile(f"l{i}", 0.001 * (i + 1), 1e6 * (5 - i)) for i in range(5)]
    seen = []
    for k in range(1, 4):
        for cuts in itertools.combinations(range(1, 5), k - 1):
            edges = (0, *cuts, 5)
            buckets = [[x.name for x in layers[s:e]] for s, e in zip(edges[:-1], edges[1:])]
            seen.append(exhaustive_plan(m, layers, [128, 4096], buckets=buckets).backward_time)
    assert len(seen) == 1 + 4 + 6
    assert exhaustive_plan(m, layers, [128, 4096], max_groups=3).backward_time == pytest.approx(min(seen))


# --------------------------------------------------------------------------- measurement helpers
def test_measure_contention_rows_structure():
    import time as _time

    from jabasray.profiler.contention import measure_contention_rows, measure_hop_latency

    calls: list[tuple[float, int]] = []
    lock = __import__("threading").Lock()

    def compute() -> None:
        _time.sleep(0.0005)

    def comm(size: float, threads: int) -> None:
        with lock:
            calls.append((size, threads))
        _time.sleep(0.0002)

    sizes, threads = [1e6, 4e6], [128, 512, 2048]
    compute_rows, comm_rows = measure_contention_rows(compute, comm, sizes, threads, repeats=2, warmup=0)
    assert [(row.threads) for row in compute_rows] == [r for r in threads for _ in sizes]
    assert [(row.size, row.threads, row.overlapped) for row in comm_rows] == [
        (c, r, flag) for r in threads for c in sizes for flag in (True, False)]
    assert all(row.time > 0 and row.standalone_time > 0 for row in compute_rows)
    assert all(row.time > 0 for row in comm_rows)
    assert set(calls) == {(c, r) for c in sizes for r in threads}
    assert measure_hop_latency(comm, num_workers=3, threads=128, repeats=2) > 0
    with pytest.raises(ValueError, match="repeats"):
        measure_contention_rows(compute, comm, sizes, threads, repeats=0)


def test_layer_profiles_of_digits_cnn_feed_the_engine():
    import torch
    from jabasray.engine.buckets import validate_bucket_plan
    from jabasray.models import DigitsCNN
    from jabasray.profiler.contention import layer_profiles

    torch.manual_seed(0)
    model = DigitsCNN()
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    layers = layer_profiles(model, x, y, torch.nn.functional.cross_entropy, repeats=2)
    assert [layer.name for layer in layers] == ["classifier.3", "classifier.1", "features.3", "features.0"]
    numel = {n: p.numel() for n, p in model.named_parameters()}
    for layer in layers:
        assert layer.grad_bytes == 4 * (numel[f"{layer.name}.weight"] + numel[f"{layer.name}.bias"])
        assert layer.backward_time >= 0
    assert all(p.grad is None for p in model.parameters())
    plan = plan_buckets(reference_model(), layers, THREADS, max_groups=2, num_chunks=20)
    layer_params = group_params_by_layer(n for n, _ in model.named_parameters())
    engine_plan = to_engine_bucket_plan(plan, layer_params)
    assert validate_bucket_plan(model, engine_plan) == engine_plan
