"""Iteration-time model (JABAS Eq. 1-6) against hand computations, and the Profile data."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jabasray.planners.perf_model import PerfModel, throughput_fit, vsw_time_at
from jabasray.profiler.profile import (PROFILE_VERSION, AllReduceFit, BatchProfile, Profile,
                                       load_profiles, save_profiles, synthetic_profile)

K = 1.25e9


def hand_profile(**kw) -> Profile:
    base = dict(
        model_signature="sig", gpu_type="g", min_local_batch=8,
        batches=[BatchProfile(8, 4, 0.010, 0.024, 0.4), BatchProfile(16, 2, 0.018, 0.030, 0.3)],
        optimizer_time=0.002, copy_time=0.0005,
        bucket_sizes=[6_000_000, 3_000_000, 1_000_000], param_bytes=10_000_000,
        allreduce_intra=AllReduceFit(alpha=2.0, beta=0.001, bandwidth=K),
        allreduce_inter=AllReduceFit(alpha=5.0, beta=0.003, bandwidth=K),
        bucket_cap_mb=25.0)
    base.update(kw)
    return Profile(**base)


def test_eq1_eq2_fit_through_both_points_and_log_shape():
    p = BatchProfile(8, 4, 0.010, 0.024, 0.4)
    alpha, beta = throughput_fit(p)
    assert beta == pytest.approx(8 / 0.010)
    assert alpha == pytest.approx((8 * 4 / 0.024 - 8 / 0.010) / math.log(4))
    assert vsw_time_at(p, 1) == pytest.approx(0.010)
    assert vsw_time_at(p, 4) == pytest.approx(0.024)
    # n = 2, 3: Eq. 2 with the Eq. 1 throughput
    for n in (2, 3):
        assert vsw_time_at(p, n) == pytest.approx(8 * n / (alpha * math.log(n) + beta))
    # n_max = 1: constant throughput
    assert throughput_fit(BatchProfile(8, 1, 0.01, 0.01)) == (0.0, pytest.approx(800.0))


def expected_eq6(t_vsw, zeta, n_ga, buckets, fit, n_gpus, tau, t_opt, t_copy, n_vsw):
    t_comm = sum(fit.alpha * (b * 4 * (n_gpus - 1) / n_gpus) / fit.bandwidth + fit.beta for b in buckets)
    t_update = tau * (t_opt + t_copy * (n_vsw - 1))
    return t_vsw * n_ga + zeta * t_vsw + max((1 - zeta) * t_vsw, t_comm) + t_update


@pytest.mark.parametrize("num_gpus, multi_node", [(2, False), (4, False), (8, True)])
@pytest.mark.parametrize("n_vsw, n_ga", [(1, 0), (2, 3), (4, 1)])
def test_eq6_matches_hand_computation(num_gpus, multi_node, n_vsw, n_ga):
    prof = hand_profile()
    model = PerfModel({"g": prof}, num_gpus=num_gpus, multi_node=multi_node)
    fit = prof.allreduce_inter if multi_node else prof.allreduce_intra
    # mean bucket = 3.33 MB / 25 MB cap < 0.5 -> OWS, tau = last bucket / W = 0.1
    assert model.weight_sync_method("g") == "ows" and model.tau("g") == pytest.approx(0.1)
    t_vsw = vsw_time_at(prof.batches[0], n_vsw)
    want = expected_eq6(t_vsw, 0.4, n_ga, prof.bucket_sizes, fit, num_gpus, 0.1, 0.002, 0.0005, n_vsw)
    assert model.iteration_time("g", 8, n_vsw, n_ga) == pytest.approx(want, rel=1e-12)
    vec = model.iteration_times("g", 8, n_vsw, np.arange(5))
    assert vec == pytest.approx([model.iteration_time("g", 8, n_vsw, k) for k in range(5)], rel=1e-12)


def test_comm_bound_and_compute_bound_branches_of_eq6():
    prof = hand_profile()
    slow_net = PerfModel({"g": prof}, num_gpus=16, multi_node=True)
    b = slow_net.breakdown("g", 8, 1, 0)
    assert b.t_comm > b.t_bwd and b.total == pytest.approx(b.t_fwd + b.t_comm + b.t_update)
    fast = hand_profile(allreduce_intra=AllReduceFit(alpha=0.0, beta=1e-6, bandwidth=K))
    b = PerfModel({"g": fast}, num_gpus=2).breakdown("g", 8, 1, 2)
    assert b.t_comm < b.t_bwd and b.total == pytest.approx(3 * b.t_vsw + b.t_update)


def test_weight_sync_tau_rules():
    prof = hand_profile()
    assert PerfModel({"g": prof}, weight_sync="sws").tau("g") == 1.0
    assert PerfModel({"g": prof}, weight_sync="ows").tau("g") == pytest.approx(1_000_000 / 10_000_000)
    # mean bucket 3.33 MB with a 5 MB cap: ratio 0.67 > R_buffer 0.5 -> SWS under "auto"
    small_cap = hand_profile(bucket_cap_mb=5.0)
    assert PerfModel({"g": small_cap}).weight_sync_method("g") == "sws"
    assert PerfModel({"g": small_cap}).tau("g") == 1.0
    with pytest.raises(ValueError, match="weight_sync"):
        PerfModel({"g": prof}, weight_sync="both")


def test_inter_node_falls_back_to_intra_when_missing():
    prof = hand_profile(allreduce_inter=None)
    a = PerfModel({"g": prof}, num_gpus=4, multi_node=True).comm_time("g")
    b = PerfModel({"g": prof}, num_gpus=4, multi_node=False).comm_time("g")
    assert a == b > 0
    assert PerfModel({"g": prof}, num_gpus=1).breakdown("g", 8, 1, 0).t_comm == 0.0


def test_interpolation_between_profiled_batch_sizes():
    prof = hand_profile(batches=[BatchProfile(8, 4, 0.010, 0.024, 0.4),
                                 BatchProfile(24, 2, 0.026, 0.040, 0.2)])
    m = PerfModel({"g": prof})
    # B_L = 16: halfway -> average of both points' Eq. 2 at the same n; zeta halfway too
    for n in (1, 2):
        want = 0.5 * vsw_time_at(prof.batches[0], n) + 0.5 * vsw_time_at(prof.batches[1], n)
        assert m.vsw_time("g", 16, n) == pytest.approx(want)
    assert m.breakdown("g", 16, 1, 0).t_fwd == pytest.approx(0.3 * m.vsw_time("g", 16, 1))
    assert m.max_num_vsw("g", 16) == 2          # the larger neighbour's n_max
    assert m.max_num_vsw("g", 8) == 4 and m.max_num_vsw("g", 24) == 2
    # below the smallest profiled size: the line through B_L 8 and 24 (slope 1 ms per sample,
    # 2 ms fixed), not the smallest size's throughput (5 ms)
    assert m.vsw_time("g", 4, 1) == pytest.approx(0.010 - 4 * 0.001)
    # a line with a negative intercept (the time grows faster than B_L): proportional to B_L
    steep = PerfModel({"g": hand_profile(batches=[BatchProfile(8, 1, 0.010, 0.010, 0.4),
                                                  BatchProfile(24, 1, 0.040, 0.040, 0.2)])})
    assert steep.vsw_time("g", 4, 1) == pytest.approx(0.010 / 2)
    # above max B_L: nothing fits
    assert m.max_num_vsw("g", 32) == 0
    with pytest.raises(ValueError, match="local_batch must be <= max local batch 24"):
        m.iteration_time("g", 32, 1, 0)
    assert m.max_local_batch("g") == 24
    with pytest.raises(ValueError, match="gpu must be one of"):
        m.iteration_time("h", 8, 1, 0)


def test_for_allocation_changes_comm_only():
    prof = hand_profile()
    m = PerfModel({"g": prof}, num_gpus=2)
    m8 = m.for_allocation(8, True)
    assert m8.num_gpus == 8 and m8.multi_node
    assert m8.vsw_time("g", 8, 2) == m.vsw_time("g", 8, 2)
    assert m8.comm_time("g") > m.comm_time("g")


def test_profile_scaled_json_and_files(tmp_path):
    prof = hand_profile()
    fast = prof.scaled(2.0, "fast")
    assert fast.gpu_type == "fast" and fast.speed == 2.0
    assert fast.batches[0].compute_time_1 == pytest.approx(0.005)
    assert fast.batches[1].compute_time_max == pytest.approx(0.015)
    assert fast.optimizer_time == pytest.approx(0.001) and fast.copy_time == pytest.approx(0.00025)
    assert fast.bucket_sizes == prof.bucket_sizes and fast.allreduce_intra == prof.allreduce_intra
    assert Profile.from_json(fast.to_json()) == fast
    # Eq. 2 scales exactly with the speed
    assert PerfModel({"fast": fast}).vsw_time("fast", 8, 3) == pytest.approx(
        PerfModel({"g": prof}).vsw_time("g", 8, 3) / 2)
    one = tmp_path / "one.json"
    prof.save(one)
    many = tmp_path / "many.json"
    save_profiles([fast, prof.scaled(0.5, "slow")], many)
    got = load_profiles([one, many])
    assert sorted(got) == ["fast", "g", "slow"] and got["g"] == prof
    with pytest.raises(ValueError, match="given twice"):
        load_profiles([one, one])
    bad = tmp_path / "bad.json"
    d = prof.to_dict()
    d["version"] = PROFILE_VERSION + 1
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="profile version"):
        load_profiles([bad])
    with pytest.raises(ValueError, match="not valid JSON"):
        (tmp_path / "x.json").write_text("{")
        load_profiles([tmp_path / "x.json"])


def test_allreduce_fit_recovers_parameters():
    sizes = [2 ** k * 1000 for k in range(10)]
    true = AllReduceFit(alpha=1.7, beta=3e-4, bandwidth=K, num_gpus=2)
    times = [true.time(s, 2) for s in sizes]
    fit = AllReduceFit.fit(sizes, times, num_gpus=2, bandwidth=K)
    assert fit.alpha == pytest.approx(1.7) and fit.beta == pytest.approx(3e-4)
    with pytest.raises(ValueError, match="two different tensor sizes"):
        AllReduceFit.fit([5, 5], [1.0, 1.0], 2)


@pytest.mark.parametrize("kw, field", [
    (dict(batches=[]), "batches"),
    (dict(batches=[BatchProfile(16, 1, 0.1, 0.1), BatchProfile(8, 1, 0.1, 0.1)]), "increasing"),
    (dict(bucket_sizes=[]), "bucket_sizes"),
    (dict(optimizer_time=-1), "optimizer_time"),
    (dict(gpu_type=""), "gpu_type"),
])
def test_profile_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        hand_profile(**kw)
    with pytest.raises(ValueError, match="zeta"):
        BatchProfile(8, 1, 0.1, 0.1, 1.5)
    with pytest.raises(ValueError, match="profiles"):
        PerfModel({})


def test_synthetic_profile_is_consistent():
    p = synthetic_profile("x", min_local_batch=4, num_batches=5, max_num_vsw=4)
    assert p.local_batches == [4, 8, 12, 16, 20]
    assert [b.max_num_vsw for b in p.batches] == [4, 4, 3, 3, 2]


def test_step_overhead_is_added_once_per_iteration():
    """Our documented deviation: t = Eq. 6 + the profile's per-step host overhead."""
    plain = PerfModel({"g": hand_profile()})
    over = PerfModel({"g": hand_profile(step_overhead=0.003)})
    for n_vsw, n_ga in [(1, 0), (2, 3)]:
        assert over.iteration_time("g", 8, n_vsw, n_ga) == pytest.approx(
            plain.iteration_time("g", 8, n_vsw, n_ga) + 0.003)
    assert hand_profile(step_overhead=0.003).scaled(2.0).step_overhead == pytest.approx(0.0015)
    with pytest.raises(ValueError, match="step_overhead"):
        hand_profile(step_overhead=-1.0)
