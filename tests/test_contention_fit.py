"""LIBRA's contention model fitted from a gloo measurement and used by the driver's LIBRA path:
exact bookkeeping of contention_from_profile against the measured slowdowns, the host cache of
the measurement, the profile carrying it (and keying its cache on it), and one real
measurement on a 2-process gloo group (structure only: timings are never asserted)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from jabasray.planners.libra_model import fit_one_thread_count, measured_slowdowns
from jabasray.profiles import AllReduceFit, ContentionMeasurement, Profile, synthetic_profile

from test_weight_sync_choice import measurement


@pytest.mark.parametrize("n", [2, 4])
def test_driver_model_uses_the_measured_contention(n):
    from jabasray.profiler.buckets import contention_from_profile

    prof = replace(synthetic_profile("cpu"), allreduce_intra=AllReduceFit(alpha=1.7, beta=3e-4))
    plain = contention_from_profile(prof, n)
    model = contention_from_profile(replace(prof, contention=measurement(2.5, 1.6)), n)
    sizes = np.array([4096.0, 1e5, 2.5e6])
    want = [prof.allreduce_intra.time(s, n) for s in sizes]
    # q (alone) is still the profiled Eq. 3 fit; p is q's transmission slowed by sigma_c
    assert np.allclose(model.allreduce_time(sizes, 1), want, rtol=1e-12)
    assert np.allclose(model.p(sizes, 1), 2.5 * plain.q(sizes, 1), rtol=1e-12)
    # Eq. 5: computation overlapped with an all-reduce takes sigma_u times as long
    assert model.g(0.25, 1) == pytest.approx(1.6 * 0.25)
    assert plain.g(0.25, 1) == pytest.approx(0.25) and np.allclose(plain.p(sizes, 1), plain.q(sizes, 1))
    # noise (overlapped faster than alone) is no contention, not a gain
    fast = contention_from_profile(replace(prof, contention=measurement(0.7, 0.9)), n)
    assert fast.g(0.25, 1) == pytest.approx(0.25) and np.allclose(fast.p(sizes, 1), fast.q(sizes, 1))


def test_libra_plan_changes_with_contention_as_the_dp_optimum():
    """With the measured contention the DP's plan is the exhaustive optimum of THAT model (the
    driver plans on the contention it measured, not on g(b) = b)."""
    from jabasray.planners.libra import LayerProfile, evaluate_plan, exhaustive_plan, plan_buckets
    from jabasray.profiler.buckets import GLOO_THREADS, contention_from_profile

    layers = [LayerProfile(f"l{i}", t, c) for i, (t, c) in
              enumerate([(2e-3, 4e6), (1e-3, 8e5), (3e-3, 2e6), (5e-4, 6e6), (2e-3, 1e6)])]
    prof = replace(synthetic_profile("cpu"), allreduce_intra=AllReduceFit(alpha=2.0, beta=5e-4))
    plans = []
    for sig in [(1.0, 1.0), (3.0, 2.0)]:
        model = contention_from_profile(replace(prof, contention=measurement(*sig)), 2)
        plan = plan_buckets(model, layers, GLOO_THREADS, bucket_cap_mb=25.0)
        best = exhaustive_plan(model, layers, GLOO_THREADS)
        assert evaluate_plan(model, layers, plan.buckets, plan.threads).total == \
            pytest.approx(evaluate_plan(model, layers, best.buckets, best.threads).total, rel=1e-9)
        plans.append(plan.buckets)
    # no contention: the first layer's gradients overlap the rest of the backward; heavy
    # contention makes that overlap cost more than it hides, so everything is fused
    assert plans[0] == [["l0"], ["l1", "l2", "l3", "l4"]]
    assert plans[1] == [["l0", "l1", "l2", "l3", "l4"]]


def test_contention_is_cached_per_host(tmp_path, monkeypatch):
    import jabasray.profiler.contention as con

    calls = []

    def fake(world_size=2, sizes=con.CONTENTION_SIZES, **kw):
        calls.append(world_size)
        return measurement(1.5, 1.2)
    monkeypatch.setattr(con, "measure_gloo_contention", fake)
    a = con.cached_contention(tmp_path)
    b = con.cached_contention(tmp_path)
    assert a == b == measurement(1.5, 1.2) and calls == [2]
    con.cached_contention(tmp_path, refresh=True)
    assert calls == [2, 2]
    assert len(list(tmp_path.glob("contention-*.json"))) == 1


def test_profile_carries_the_contention_and_keys_its_cache_on_it(tmp_path, monkeypatch):
    import torch

    import jabasray.profiler.contention as con
    from jabasray.profiler.measure import profile_model

    monkeypatch.setattr(con, "measure_gloo_contention", lambda world_size=2, **kw: measurement(2.0, 1.5))
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    kw = dict(min_local_batch=8, max_local_batch=16, max_num_vsw=2, repeats=1, warmup=0,
              allreduce=False, cache_dir=tmp_path)
    with_c = profile_model(lambda: torch.nn.Linear(8, 3), lambda n: (x[:n], y[:n]),
                           contention=True, **kw)
    without = profile_model(lambda: torch.nn.Linear(8, 3), lambda n: (x[:n], y[:n]), **kw)
    assert with_c.contention == measurement(2.0, 1.5) and without.contention is None
    assert len(list(tmp_path.glob("*-v1.json"))) == 2           # two cache entries, two keys
    assert Profile.from_json(with_c.to_json()) == with_c
    assert with_c.scaled(2.0, "fast").contention == with_c.contention


def test_driver_cache_key_matches_what_the_driver_profiles():
    from jabasray.profiler.cluster import driver_cache_key, measures_contention

    assert measures_contention("cpu") and not measures_contention("cuda")
    cpu = driver_cache_key("sig", device="cpu", emulate=True, min_local_batch=8, weight_sync="auto",
                           bucket_cap_mb=25.0)
    assert cpu.startswith("sig-cpu-") and cpu.endswith("-v1")


def test_real_gloo_measurement_on_two_processes():
    from jabasray.profiler.contention import measure_gloo_contention

    meas = measure_gloo_contention(2, sizes=(65536, 262144), repeats=2, warmup=0)
    assert isinstance(meas, ContentionMeasurement) and meas.num_workers == 2 and meas.threads == 1
    assert meas.sizes == [65536.0, 262144.0] and len(meas.comm_alone) == len(meas.comm_overlapped) == 2
    assert ContentionMeasurement.from_json(meas.to_json()) == meas
    sc, su = measured_slowdowns(meas) if _shows_bandwidth(meas) else (1.0, 1.0)
    assert sc >= 1.0 and su >= 1.0
    with pytest.raises(ValueError, match="world_size"):
        measure_gloo_contention(1)


def _shows_bandwidth(meas: ContentionMeasurement) -> bool:
    try:
        fit_one_thread_count(meas)
        return True
    except ValueError:      # on a loaded machine small all-reduces may not show the bandwidth
        return False
