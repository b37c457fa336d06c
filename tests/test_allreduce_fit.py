"""The all-reduce fit measured on the placed actors, without Ray: the sizes timed, the
collective's time (slowest rank), the fit against an independent least-squares reference, the
choice of a measured fit per allocation (exhaustive over small cases), the model that plans with
it (Eq. 4 over that fit, caches renewed), the driver's book of measurements (what is due, what
a checkpoint keeps) and the option's validation."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from actors_helpers import profile
from jabasray.actors.allreduce_fit import (AllReduceTimes, MeasuredFits, collective_times,
                                           fit_description, fit_key, fits_for_model,
                                           measurement_record, measurement_sizes, parse_key,
                                           record_fit, span_bandwidth)
from jabasray.actors.checkpoint import DriverState
from jabasray.actors.driver_options import DriverOptions
from jabasray.planners.perf_model import PerfModel, measured_fit
from jabasray.profiles import AllReduceFit
from jabasray.types import ClusterSpec


def test_sizes_span_the_buckets_geometrically():
    assert measurement_sizes([20000]) == [2500, 5000, 10000, 20000]
    assert measurement_sizes([400_000, 300_000, 100_000]) == [50_000, 100_000, 200_000, 400_000]
    assert measurement_sizes([1000, 64_000]) == [1000, 4000, 16_000, 64_000]
    assert measurement_sizes([4]) == [4, 8]          # one float: still two sizes
    for buckets in ([4], [12], [20000], [7, 9_999_999], [26_214_400, 3_000_000, 1_234_567]):
        sizes = measurement_sizes(buckets)
        assert len(set(sizes)) == len(sizes) >= 2 and sizes == sorted(sizes)
        assert all(s % 4 == 0 and s >= 4 for s in sizes)
        if max(buckets) >= 8:
            assert sizes[-1] == max(buckets) // 4 * 4
            assert sizes[0] <= max(min(buckets), 4) and sizes[0] <= max(4, max(buckets) / 8)
    with pytest.raises(ValueError, match="^bucket_sizes must be positive"):
        measurement_sizes([])


def test_the_collective_takes_the_slowest_rank_per_size():
    assert collective_times([[1.0, 5.0, 2.0], [3.0, 4.0, 2.5]]) == [3.0, 5.0, 2.5]
    with pytest.raises(ValueError, match="same number of sizes"):
        collective_times([[1.0, 2.0], [1.0]])


def reference_fit(sizes, times, n, bandwidth):
    """Eq. 3 by numpy's least squares on the regressor d 4 (N - 1) / N / K."""
    x = np.array([s * 4 * (n - 1) / n / bandwidth for s in sizes])
    alpha, beta = np.polyfit(x, np.array(times), 1)
    return alpha, beta


def test_record_fits_eq3_to_the_slowest_ranks_times():
    sizes = [2500, 5000, 10000, 20000]
    ranks = [[1.1e-4, 1.9e-4, 3.2e-4, 6.5e-4], [1.3e-4, 1.7e-4, 3.6e-4, 6.1e-4],
             [1.0e-4, 2.0e-4, 3.0e-4, 6.0e-4]]
    replies = [AllReduceTimes(r, f"node{r % 2}", "gloo", t) for r, t in enumerate(ranks)]
    rec = measurement_record("gloo/3/inter", sizes, replies, bandwidth=2e9)
    fit = record_fit(rec)
    alpha, beta = reference_fit(sizes, np.max(ranks, axis=0), 3, 2e9)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9) and fit.beta == pytest.approx(beta, rel=1e-9)
    assert (fit.num_gpus, fit.bandwidth) == (3, 2e9)
    assert rec["nodes"] == ["node0", "node1", "node0"] and rec["rank_times"] == ranks
    assert json.loads(json.dumps(rec)) == rec                           # plain JSON
    with pytest.raises(ValueError, match=r"^all-reduce measurement nccl/3/inter: 3 ranks over "
                                         r"backend\(s\) \['gloo'\], expected 3 over nccl$"):
        measurement_record("nccl/3/inter", sizes, replies, 2e9)
    with pytest.raises(ValueError, match="expected 2 over gloo"):
        measurement_record("gloo/2/inter", sizes, replies, 2e9)
    bad = [AllReduceTimes(0, "n", "gloo", [1e-4, math.nan, 1e-4, 1e-4])] + replies[1:]
    with pytest.raises(ValueError, match="finite and > 0"):
        measurement_record("gloo/3/inter", sizes, bad, 2e9)


def test_keys_round_trip():
    for b, n, m in (("gloo", 2, False), ("nccl", 16, True)):
        assert parse_key(fit_key(b, n, m)) == (b, n, m)
    assert fit_key("gloo", 4, True) == "gloo/4/inter"
    for bad in ("gloo/4", "gloo/x/intra", "gloo/4/cross"):
        with pytest.raises(ValueError, match="^allreduce fit key must be"):
            parse_key(bad)


def test_a_measured_fit_is_chosen_by_span_then_nearest_world_size():
    f = {(2, False): AllReduceFit(1, 0), (4, False): AllReduceFit(2, 0), (4, True): AllReduceFit(3, 0),
         (8, True): AllReduceFit(4, 0)}
    want = {(1, False): (2, False), (2, False): (2, False), (3, False): (4, False),  # tie: larger
            (4, False): (4, False), (7, False): (4, False), (2, True): (4, True),
            (5, True): (4, True), (6, True): (8, True), (9, True): (8, True)}
    for (n, m), key in want.items():
        assert measured_fit(f, n, m) is f[key], (n, m)
    assert measured_fit({(2, False): AllReduceFit(1, 0)}, 2, True) is None    # never across spans
    assert measured_fit({}, 2, False) is None


def test_the_model_plans_with_the_measured_fit_and_renews_its_comm_cache():
    profiles = {"fast": profile("fast", 1.0), "slow": profile("slow", 0.5)}
    base = PerfModel(profiles)
    inter = AllReduceFit(alpha=3.0, beta=2e-3, bandwidth=1e9, num_gpus=4)
    profiled = base.for_allocation(4, True)
    before = profiled.comm_time("fast")                                      # cached
    measured = base.with_measured_fits({(4, True): inter})
    m = measured.for_allocation(4, True)
    for g in ("fast", "slow"):
        assert m.comm_time(g) == sum(inter.time(b, 4) for b in profiles[g].bucket_sizes)
        assert m.allreduce_fit_used(g) == ("measured", inter)
    assert m.comm_time("fast") != before and profiled.comm_time("fast") == before
    assert m.breakdown("fast", 8, 1, 0).t_comm == m.comm_time("fast")
    intra = measured.for_allocation(4, False)                                # other span: profiled
    assert intra.allreduce_fit_used("fast") == ("profiled", profiles["fast"].allreduce_intra)
    assert measured.profiles == profiles and measured.for_allocation(2, True).comm_time("slow") == \
        sum(inter.time(b, 2) for b in profiles["slow"].bucket_sizes)        # nearest N_G, Eq. 3 at 2
    assert measured.with_profiles(profiles).measured_fits == {(4, True): inter}


def fake_pool(times_per_rank, backend="gloo", calls=None):
    def call_all(method, sizes, warmup, repeats):
        if calls is not None:
            calls.append((method, list(sizes), warmup, repeats))
        return [AllReduceTimes(r, "n", backend, t[:len(sizes)]) for r, t in enumerate(times_per_rank)]
    return call_all


def test_the_drivers_book_measures_each_key_once_and_survives_a_checkpoint():
    profiles = {"fast": profile("fast", 1.0)}
    model = PerfModel(profiles)
    book = MeasuredFits("gloo")
    assert book.due(model, 1, False) is None                     # no all-reduce on one rank
    assert book.due(None, 2, False) is None                      # a given model: used as given
    assert MeasuredFits("gloo", enabled=False).due(model, 2, False) is None
    key = book.due(model, 2, False)
    assert key == "gloo/2/intra"
    calls = []
    rec = book.measure(key, model, fake_pool([[1e-4, 2e-4, 3e-4, 5e-4], [2e-4, 2e-4, 4e-4, 4e-4]],
                                             calls=calls))
    assert calls == [("allreduce_times", [2500, 5000, 10000, 20000], 1, 3)]
    assert book.measured == [key] and book.due(model, 2, False) is None
    assert book.due(model, 2, True) == "gloo/2/inter" and book.due(model, 3, False) == "gloo/3/intra"
    fit = AllReduceFit.fit(rec["sizes"], [2e-4, 2e-4, 4e-4, 5e-4], num_gpus=2,
                           bandwidth=span_bandwidth(profiles, False))
    assert record_fit(rec) == fit
    assert book.fitted(model).for_allocation(2, False).comm_time("fast") == \
        sum(fit.time(b, 2) for b in profiles["fast"].bucket_sizes)
    assert MeasuredFits("gloo", enabled=False).fitted(model) is model
    nccl = MeasuredFits("nccl")                                  # ranks not on the job's backend
    assert nccl.measure("nccl/2/intra", model, fake_pool([[1e-4] * 4] * 2)) is None
    assert nccl.records == {} and nccl.measured == [] and nccl.due(model, 2, False) == "nccl/2/intra"
    assert fits_for_model(book.records, "nccl") == {}            # another backend's fits: none

    state = DriverState(epochs_done=1, iteration=3, cluster=ClusterSpec.emulated({"fast": (1, 2, 1.0)}),
                        allocation={}, allreduce_fits=book.records)
    again = MeasuredFits("gloo")
    assert again.adopt(DriverState.from_json(state.to_json()).allreduce_fits) is True
    assert again.records == book.records and again.due(model, 2, False) is None
    assert again.adopt(book.records) is False and again.measured == []
    assert fit_description("measured", fit, 2, False) == {"source": "measured", "span": "intra",
                                                          "world_size": 2, **fit.to_dict()}


def test_the_option_is_validated():
    assert DriverOptions().measure_allreduce is True
    with pytest.raises(ValueError, match=r"^measure_allreduce must be True or False, got 'yes'$"):
        DriverOptions(measure_allreduce="yes")


def test_the_timing_loop_times_each_size_after_a_barrier_and_takes_the_median(monkeypatch):
    """Fake collectives on a fake clock: each all-reduce of n floats takes n us plus a jitter
    that changes per repeat; the result is the median of the timed (non-warm-up) repeats."""
    import torch.distributed as dist

    from jabasray.actors.allreduce_fit import time_allreduces

    clock, calls = [0.0], []
    jitter = iter([5e-3, 1e-3, 2e-3, 9e-3] * 2)                 # warm-up, then 3 timed repeats

    def all_reduce(buf, group=None):
        calls.append(("all_reduce", buf.numel(), str(buf.dtype), group))
        clock[0] += buf.numel() * 1e-6 + next(jitter)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "barrier", lambda group=None: calls.append(("barrier", group)))
    monkeypatch.setattr("time.perf_counter", lambda: clock[0])
    out = time_allreduces([400, 4000], "cpu", group="G", warmup=1, repeats=3)
    assert out == pytest.approx([100e-6 + 2e-3, 1000e-6 + 2e-3], abs=1e-12)
    per_size = [("barrier", "G"), ("all_reduce", 100, "torch.float32", "G")] * 4
    assert calls == per_size + [(c[0], 1000, *c[2:]) if c[0] == "all_reduce" else c for c in per_size]


def _one_rank_group(backend: str):
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_timing_loop_runs_on_a_real_group(device):
    """A one-rank group of the device's backend (gloo on CPU, NCCL on CUDA): the barrier and
    all-reduce calls run on it and every size gets a finite, positive time."""
    from jabasray.actors.allreduce_fit import time_allreduces
    from jabasray.actors.rendezvous import backend_for

    dist = _one_rank_group(backend_for(device))
    try:
        sizes = measurement_sizes([20000])
        times = time_allreduces(sizes, device, None, warmup=1, repeats=2)
        assert len(times) == len(sizes) and all(t > 0 and math.isfinite(t) for t in times)
        assert dist.get_backend() == backend_for(device)
    finally:
        dist.destroy_process_group()


def test_a_mid_epoch_checkpoint_brings_the_fits_measured_since_the_epoch_boundary(tmp_path):
    """A placement at an epoch's start measures after the boundary checkpoint: resuming from
    the mid-epoch checkpoint keeps that measurement (and the boundary's)."""
    from jabasray.actors.checkpoint import MID_EPOCH, latest_checkpoint, save_checkpoint
    from jabasray.actors.recovery import adopt_mid_epoch

    class Ctl:
        def load_state_dict(self, state):
            self.state = state

    a, b = {"key": "gloo/2/intra", "x": 1}, {"key": "gloo/4/inter", "x": 2}
    cluster = ClusterSpec.emulated({"fast": (1, 2, 1.0)})
    boundary = DriverState(epochs_done=1, iteration=3, cluster=cluster, allocation={},
                           allreduce_fits={"gloo/2/intra": a})
    save_checkpoint(tmp_path, boundary, {})
    save_checkpoint(tmp_path, DriverState(epochs_done=1, iteration=5, cluster=cluster, allocation={},
                                          mid_epoch={"cursor": 8, "interval": 1, "tally": {}},
                                          allreduce_fits={"gloo/2/intra": a, "gloo/4/inter": b}),
                    {}, folder=MID_EPOCH)
    cp = latest_checkpoint(tmp_path)
    _, state, note = adopt_mid_epoch(tmp_path, cp, cp.load_driver_state(), Ctl())
    assert note is not None and state.iteration == 5
    assert state.allreduce_fits == {"gloo/2/intra": a, "gloo/4/inter": b}
