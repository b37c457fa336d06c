"""n_max probing of the profiler: up to the memory limit on CUDA, by doubling and
bisection, an out-of-memory step meaning "does not fit". Checked on CPU with an injected step
that runs out of memory above a fake limit; tests/test_cuda.py probes a real GPU."""
from __future__ import annotations

import pytest
import torch

from jabasray.profiler.measure import (CPU_NUM_VSW_CAP, CUDA_NUM_VSW_BOUND, oom_probe,
                                       probe_max_fitting)


def _fake_device(limit: int):
    """A step function over n that raises the CUDA OOM error above ``limit`` VSWs, and a log
    of the n it ran with and of the recoveries."""
    ran: list[int] = []
    recovered: list[int] = []

    def fits(n: int) -> bool:
        def step():
            ran.append(n)
            if n > limit:
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (fake limit {limit}, asked {n})")
        return oom_probe(step, lambda: recovered.append(n))
    return fits, ran, recovered


@pytest.mark.parametrize("limit", range(1, 36))
@pytest.mark.parametrize("upper", [1, 2, 7, 32])
def test_probe_stops_at_the_memory_limit_or_the_bound(limit, upper):
    """Exhaustive over small limits and bounds: the result is min(limit, upper); no probe above
    the first failing n; every OOM is recovered from; O(log) probes."""
    fits, ran, recovered = _fake_device(limit)
    assert probe_max_fitting(fits, upper) == min(limit, upper)
    assert all(1 < n <= upper for n in ran)
    failing = [n for n in ran if n > limit]
    assert recovered == failing
    if failing:
        assert max(ran) == failing[0]                     # nothing probed beyond the first failure
    bound = 2 * max(1, (upper - 1).bit_length())
    assert len(ran) <= bound


def test_probe_never_asks_again_for_a_known_size():
    fits, ran, _ = _fake_device(13)
    assert probe_max_fitting(fits, 64) == 13
    assert len(ran) == len(set(ran))
    assert ran == [2, 4, 8, 16, 12, 14, 13]


def test_oom_probe_recognises_oom_only():
    recovered = []
    assert oom_probe(lambda: None, lambda: recovered.append(1)) is True
    assert recovered == []

    def message_oom():
        raise RuntimeError("CUDA error: out of memory")
    assert oom_probe(message_oom, lambda: recovered.append(2)) is False
    assert recovered == [2]

    def other():
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        oom_probe(other, lambda: recovered.append(3))
    assert recovered == [2]
    with pytest.raises(ValueError, match=r"^upper must be"):
        probe_max_fitting(lambda n: True, 0)


def test_cpu_keeps_a_cap_without_a_budget():
    """CPU has no memory limit to probe: by default n_max is the cap CPU_NUM_VSW_CAP (no probe
    steps), an explicit max_num_vsw replaces it."""
    from torch import nn
    from jabasray.profiler.measure import profile_model

    def data(n):
        g = torch.Generator().manual_seed(n)
        return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    kw = dict(min_local_batch=2, max_local_batch=2, warmup=0, repeats=1, allreduce=False)
    prof = profile_model(nn.Linear(4, 3), data, **kw)
    assert [b.max_num_vsw for b in prof.batches] == [CPU_NUM_VSW_CAP]
    prof = profile_model(nn.Linear(4, 3), data, max_num_vsw=2, **kw)
    assert [b.max_num_vsw for b in prof.batches] == [2]
    assert CUDA_NUM_VSW_BOUND > CPU_NUM_VSW_CAP
