"""LIBRA's bucket plan reaches the engine: the contention model the driver derives from a profile
reproduces the profile's measured all-reduce times (Eq. 3 -> LIBRA's ring form, exact), the
plan is a valid engine plan for the user's model, and a GPU actor set up with it runs exactly
those buckets (in-process actor, no Ray)."""
from __future__ import annotations

import numpy as np
import pytest

from jabasray.profiles import AllReduceFit, synthetic_profile


@pytest.mark.parametrize("n", [2, 4, 8])
def test_contention_model_reproduces_the_profiled_allreduce(n):
    from dataclasses import replace

    from jabasray.profiler.buckets import contention_from_profile

    prof = replace(synthetic_profile("cpu"), allreduce_intra=AllReduceFit(alpha=1.7, beta=3e-4))
    model = contention_from_profile(prof, n)
    sizes = np.array([4096.0, 1e5, 2.5e6, 4e7])
    want = [prof.allreduce_intra.time(s, n) for s in sizes]
    assert np.allclose(model.allreduce_time(sizes, 1), want, rtol=1e-12)
    # no compute contention is claimed (Eq. 5 not fitted in the driver): g(b) = b
    assert model.g(0.25, 1) == pytest.approx(0.25)


def test_libra_plan_is_applied_by_the_actor():
    from actors_helpers import loss_fn, model_fn, optimizer_fn, tiny_data
    from jabasray.actors.gpu_actor import GPUActor
    from jabasray.actors.placement import Slot
    from jabasray.actors.rendezvous import Rendezvous
    from jabasray.config import JobConfig
    from jabasray.engine.buckets import default_bucket_plan, validate_bucket_plan
    from jabasray.profiler.buckets import libra_bucket_plan
    from jabasray.profiler.measure import _batch_fn

    ds, _ = tiny_data(64)
    prof = replace_fit(synthetic_profile("cpu", min_local_batch=4))
    plan = libra_bucket_plan(model_fn, _batch_fn(ds), loss_fn, prof, 2, bucket_cap_mb=25.0)
    net = model_fn()
    assert validate_bucket_plan(net, plan) == plan
    # a large startup cost per all-reduce: LIBRA fuses everything into one bucket, as the cap does
    assert plan == default_bucket_plan(net, 25.0)
    # a tiny startup and a slow link: several buckets overlap the backward
    split = libra_bucket_plan(model_fn, _batch_fn(ds), loss_fn,
                              replace_fit(prof, alpha=2e4, beta=0.0), 2, bucket_cap_mb=25.0)
    assert validate_bucket_plan(net, split) == split and len(split) == 2   # one bucket per layer
    slot = Slot(rank=0, node="n0", gpu_type="cpu", speed=1.0, group=0, pair=0)
    actor = GPUActor(slot, 1, JobConfig(seed=1), model_fn, optimizer_fn, loss_fn, ds, "cpu", True)
    actor.setup(Rendezvous("127.0.0.1", 29500, 1), slot, split)
    assert actor.worker.bucket_plan == split
    actor.setup(Rendezvous("127.0.0.1", 29500, 1), slot, None)
    assert actor.worker.bucket_plan == default_bucket_plan(net, 25.0)


def replace_fit(prof, alpha=1.0, beta=1e-2):
    from dataclasses import replace
    return replace(prof, allreduce_intra=AllReduceFit(alpha=alpha, beta=beta))
