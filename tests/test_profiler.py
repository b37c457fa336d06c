"""Profiler: measurements with the IIDP engine on CPU, memory-bounded B_L / n_max search,
bucket sizes, the Eq. 3 all-reduce fit from a 2-process gloo group, and the on-disk cache."""
from __future__ import annotations

import pytest
import torch

from jabasray.data import load_digits_split
from jabasray.engine.buckets import bucket_nbytes, default_bucket_plan, make_bucket_specs
from jabasray.models import MLP, DigitsCNN
from jabasray.planners import PerfModel, solve_configuration
from jabasray.profiler import Profile, measure, profile_model
from jabasray.profiler.measure import estimate_memory, measure_allreduce, model_signature


@pytest.fixture(scope="module")
def digits():
    train, _ = load_digits_split()
    return train


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.01, momentum=0.9)


def test_estimate_memory_matches_hand_computation(digits):
    """MLP 64 -> 32 -> 10: W = (64*32 + 32 + 32*10 + 10) * 4 bytes; activations per sample are
    the leaf outputs 32 (Linear) + 32 (ReLU) + 10 (Linear) floats; input 64 floats; SGD with
    momentum keeps one buffer of W bytes."""
    model = MLP(64, (32,), 10)
    mem = estimate_memory(model, measure._batch_fn(digits), sgd, torch.nn.functional.cross_entropy)
    W = (64 * 32 + 32 + 32 * 10 + 10) * 4
    act, inp = (32 + 32 + 10) * 4, 64 * 4
    for bl, n in [(8, 1), (16, 3), (40, 2)]:
        assert mem(bl, n) == n * (2 * W + bl * (2 * act + inp)) + W


def test_profile_respects_memory_budget_and_caches(digits, tmp_path, monkeypatch):
    model = DigitsCNN(channels=4, hidden=16)
    mem = estimate_memory(model, measure._batch_fn(digits), sgd, torch.nn.functional.cross_entropy)
    budget_bytes = mem(24, 3)                # B_L 24 fits 3 VSWs, 32 fits fewer, ...
    budget_gb = budget_bytes / 2 ** 30
    prof = profile_model(model, digits, optimizer_fn=sgd, min_local_batch=8, max_local_batch=48,
                         memory_budget_gb=budget_gb, max_num_vsw=3, warmup=0, repeats=1,
                         allreduce=False, cache_dir=tmp_path, gpu_type="cpu-test")
    want_bl = [b for b in range(8, 49, 8) if mem(b, 1) <= budget_bytes]
    assert prof.local_batches == want_bl
    for b in prof.batches:
        want_n = max(n for n in range(1, 4) if mem(b.local_batch, n) <= budget_bytes)
        assert b.max_num_vsw == want_n
        assert b.compute_time_1 > 0 and b.compute_time_max > 0 and 0 < b.zeta < 1
    assert prof.batch(24).max_num_vsw == 3
    # bucket sizes are the engine's (default plan, backward order); they cover W
    specs = make_bucket_specs(model, default_bucket_plan(model, 25.0))
    assert prof.bucket_sizes == bucket_nbytes(specs)
    assert sum(prof.bucket_sizes) == prof.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert prof.optimizer_time > 0 and prof.copy_time > 0
    assert prof.model_signature == model_signature(model) and prof.gpu_type == "cpu-test"
    # cached: a second call does not touch the engine
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and prof.model_signature in files[0].name
    import jabasray.engine as engine

    class Boom:
        def __init__(self, *a, **k):
            raise AssertionError("engine used despite the cache")
    monkeypatch.setattr(engine, "IIDPWorker", Boom)
    again = profile_model(model, digits, optimizer_fn=sgd, min_local_batch=8, max_local_batch=48,
                          memory_budget_gb=budget_gb, max_num_vsw=3, warmup=0, repeats=1,
                          allreduce=False, cache_dir=tmp_path, gpu_type="cpu-test")
    assert again == prof == Profile.load(files[0])
    with pytest.raises(AssertionError, match="despite the cache"):
        profile_model(model, digits, min_local_batch=8, memory_budget_gb=budget_gb, allreduce=False,
                      cache_dir=tmp_path, gpu_type="cpu-test", refresh=True)
    for other in (dict(memory_budget_gb=2 * budget_gb), dict(repeats=2), dict(statistic="min"),
                  dict(max_num_vsw=2)):      # any other measurement setting: re-profile
        kw = dict(min_local_batch=8, max_local_batch=48, memory_budget_gb=budget_gb, max_num_vsw=3,
                  warmup=0, repeats=1, allreduce=False, cache_dir=tmp_path, gpu_type="cpu-test")
        kw.update(other)
        with pytest.raises(AssertionError, match="despite the cache"):
            profile_model(model, digits, **kw)
    # the profile drives the planner
    plan = solve_configuration(64, ["cpu-test"], PerfModel({"cpu-test": prof}), 8)
    assert plan is not None and plan.requested_global_batch_size == 64
    assert plan.global_batch_size == 2 * plan.local_batch_size * round(64 / plan.local_batch_size / 2 + 1e-9)


def test_model_signature():
    assert model_signature(DigitsCNN()) == model_signature(DigitsCNN())
    assert model_signature(DigitsCNN(hidden=32)) != model_signature(DigitsCNN())
    assert model_signature(MLP()) != model_signature(DigitsCNN())


def test_allreduce_fit_from_gloo_group():
    sizes = [4096 * 2 ** k for k in range(10)]
    fit, times = measure_allreduce(sizes, world_size=2, repeats=2, warmup=1)
    assert len(times) == 10 and all(t > 0 for t in times)
    assert fit.num_gpus == 2
    # the fit is the least-squares line through the measured points
    from jabasray.profiler.profile import AllReduceFit
    assert fit == AllReduceFit.fit(sizes, times, num_gpus=2, bandwidth=fit.bandwidth)


@pytest.mark.parametrize("kw, field", [
    (dict(min_local_batch=0), "min_local_batch"),
    (dict(max_local_batch=4), "max_local_batch"),
    (dict(memory_budget_gb=0), "memory_budget_gb"),
    (dict(device="cuda"), "device"),
    (dict(device="nonsense"), "device"),
])
def test_bad_arguments(digits, kw, field):
    if kw.get("device") == "cuda" and torch.cuda.is_available():
        kw = dict(device="nonsense")          # 'cuda' is valid where CUDA exists
    args = dict(min_local_batch=8, allreduce=False)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        profile_model(MLP(), digits, **args)


def test_monotonicity_check_remeasures_then_clips():
    """A point slower than the next B_L (noise inflated it) is re-measured; a measurement that
    stays non-monotone is clipped up to the running maximum. Fake try_step: deterministic times."""
    from jabasray.profiler.measure import _make_monotone, lower_median, monotone_violations

    assert monotone_violations([1.0, 2.0, 1.5, 2.5]) == [2]
    assert monotone_violations([1.0, 2.0, 1.85, 2.5]) == []          # within 10 %
    assert lower_median([5.0, 1.0, 1.2, 9.0, 1.1]) == 1.1            # median of the faster half
    calls = []
    truth = {8: 1.0, 16: 2.0, 24: 3.0}

    def try_step(bl, n, reps):
        calls.append((bl, n, reps))
        return (truth[bl] * n, 0.1, 0.01)
    noisy = [(8, 2, (1.0, .1, .01), (2.0, .1, .01)), (16, 2, (9.0, .1, .01), (18.0, .1, .01)),
             (24, 2, (3.0, .1, .01), (6.0, .1, .01))]
    fixed = _make_monotone(noisy, try_step, repeats=3)
    assert [p[2][0] for p in fixed] == [1.0, 2.0, 3.0] and [p[3][0] for p in fixed] == [2.0, 4.0, 6.0]
    assert {(bl, reps) for bl, _, reps in calls} == {(16, 6), (24, 6)}   # the pair, twice the repeats

    def stuck(bl, n, reps):       # the re-measurement keeps the anomaly
        return {8: (1.0,), 16: (3.0,), 24: (2.0,)}[bl] + (0.1, 0.01)
    clipped = _make_monotone([(bl, 1, stuck(bl, 1, 1), stuck(bl, 1, 1)) for bl in (8, 16, 24)], stuck, 3)
    assert [p[2][0] for p in clipped] == [1.0, 3.0, 3.0]


def _named(src: str, name: str = "step"):
    """A function called ``name`` (same module and qualname every time) from source ``src``."""
    ns: dict = {"F": torch.nn.functional}
    exec(src, ns)                                         # noqa: S102 - test-made source
    fn = ns[name]
    fn.__module__, fn.__qualname__ = __name__, name
    return fn


STEP_A = "def step(m, b):\n    return F.cross_entropy(m(b[0]), b[1])\n"
STEP_B = "def step(m, b):\n    return F.cross_entropy(m(b[0]), b[1]) * 2.0\n"


def test_callable_fingerprint_follows_code_closure_and_partial():
    import functools

    from jabasray.profiler.measure import callable_fingerprint

    a, a2, b = _named(STEP_A), _named(STEP_A), _named(STEP_B)
    assert callable_fingerprint(None) is None
    assert callable_fingerprint(a) == callable_fingerprint(a2)          # same code: same key
    assert callable_fingerprint(a) != callable_fingerprint(b)           # edited body, same name

    def scaled(k):
        def step(m, batch):
            return k * F.cross_entropy(m(batch[0]), batch[1])
        return step
    F = torch.nn.functional
    assert callable_fingerprint(scaled(1.0)) == callable_fingerprint(scaled(1.0))
    assert callable_fingerprint(scaled(1.0)) != callable_fingerprint(scaled(3.0))   # closure value
    assert callable_fingerprint(functools.partial(a, 1)) != callable_fingerprint(functools.partial(a, 2))
    from jabasray.profiler.cluster import driver_cache_key
    keys = {driver_cache_key("sig", device="cpu", emulate=True, min_local_batch=8, weight_sync="auto",
                             bucket_cap_mb=25.0, **kw)
            for kw in ({}, {"step_fn": a}, {"step_fn": a2}, {"step_fn": b}, {"collate_fn": a})}
    assert len(keys) == 4                                  # a and a2 share one, the rest differ


def test_profile_cache_key_holds_step_fn_and_collate_fn(digits, tmp_path, monkeypatch):
    """A profile measured with one step_fn / collate_fn is reused for the same callables only:
    a changed step_fn (same name, another body) or another collate_fn measures again."""
    import jabasray.engine as engine

    model = MLP(64, (32,), 10)
    kw = dict(optimizer_fn=sgd, min_local_batch=8, max_local_batch=16, max_num_vsw=1, warmup=0,
              repeats=1, allreduce=False, cache_dir=tmp_path, gpu_type="cpu-test")
    rows = [digits[i] for i in range(32)]

    def collate(samples):
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    def collate2(samples):
        return collate(samples)[0] * 1.0, collate(samples)[1]

    first = profile_model(model, rows, step_fn=_named(STEP_A), collate_fn=collate, **kw)
    assert len(list(tmp_path.glob("*.json"))) == 1

    class Boom:
        def __init__(self, *a, **k):
            raise AssertionError("engine used")
    monkeypatch.setattr(engine, "IIDPWorker", Boom)
    # the same callables (rebuilt from the same source): a cache hit, the engine is not used
    assert profile_model(model, rows, step_fn=_named(STEP_A), collate_fn=collate, **kw) == first
    for step, coll in ((_named(STEP_B), collate), (_named(STEP_A), collate2), (None, None)):
        with pytest.raises(AssertionError, match="engine used"):
            profile_model(model, rows if coll else digits, step_fn=step, collate_fn=coll, **kw)
