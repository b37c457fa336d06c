"""The gradient bucket plan a job's actors run: LIBRA's fusion (``bucket_planner="libra"``) or
the engine's default size-capped buckets (``"size"``, DDP-like; then no plan is sent).

LIBRA (Algorithm 2) on what this machine measures:

* layers: :func:`jabasray.profiler.contention.layer_profiles` on the user's model and one
  micro-batch of B_L = min B_L (standalone backward time and gradient bytes per layer, in
  gradient-ready order);
* contention model (Eq. 3-6): the transmission term from the profile's measured all-reduce fit
  (Eq. 3 of JABAS: t = alpha * d 4 (N-1)/N / K + beta), mapped onto LIBRA's ring form
  a + c_hat / rate with rate = K / (2 alpha) and startup a = beta (hop latency beta / 2(N-1));
  gloo exposes no communication-thread knob, so there is one thread choice and Eq. 6's thread
  dependence is flat (gamma2 = 0);
* NOT measured here: the compute slowdown under a concurrent all-reduce (Eq. 5). The driver
  process has no peer to all-reduce with, so g(b) = b (alpha1 = 1, alpha2 = 0). The DP then
  trades each bucket's startup cost against overlap with the remaining backward - LIBRA's fusion
  part - but not the contention part. Fitting Eq. 5 needs a measurement inside the actors'
  process group (:func:`jabasray.profiler.contention.measure_contention_rows` with a gloo
  ``comm_fn``), which is left for later.

The plan is the engine's bucket plan (parameter names per bucket, backward order); the driver
records it in every :class:`~jabasray.types.Plan` and the actors build their worker with it
(``GPUActor.setup(..., bucket_plan=...)``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..planners.libra import group_params_by_layer, plan_buckets, to_engine_bucket_plan
from ..planners.libra_model import CommParams, ComputeParams, ContentionModel
from ..profiles import Profile

log = logging.getLogger(__name__)

BUCKET_PLANNERS = ("size", "libra")
GLOO_THREADS = [1]   # gloo has no thread/CTA setting: one nominal choice


def contention_from_profile(profile: Profile, num_workers: int) -> ContentionModel:
    """LIBRA's model from the profile's Eq. 3 fit, without compute contention (module notes)."""
    fit = profile.allreduce_intra
    n = max(2, int(num_workers))
    rate = fit.bandwidth / (2.0 * fit.alpha) if fit.alpha > 0 else 1e12
    hop = max(0.0, fit.beta) / (2 * (n - 1))
    return ContentionModel(compute=ComputeParams(1.0, 0.0), overlapped=CommParams(rate, 0.0, 1.0),
                           alone=CommParams(rate, 0.0, 1.0), num_workers=n, hop_latency=hop)


def libra_bucket_plan(model_fn: Callable, sample: Callable[[int], tuple[Any, Any]], loss_fn: Callable,
                      profile: Profile, num_workers: int, bucket_cap_mb: float) -> list[list[str]]:
    """LIBRA's fusion for ``model_fn()`` as the engine's bucket plan (module notes)."""
    from .contention import layer_profiles

    net = model_fn()
    x, y = sample(profile.min_local_batch)
    layers = layer_profiles(net, x, y, loss_fn)
    plan = plan_buckets(contention_from_profile(profile, num_workers), layers, GLOO_THREADS,
                        bucket_cap_mb=bucket_cap_mb)
    log.info("LIBRA bucket plan: %s, %d buckets, predicted backward %.4gs (size-capped %.4gs)",
             plan.method, plan.num_buckets, plan.backward_time, plan.baseline_time or 0.0)
    from ..engine.buckets import trainable_parameters
    return to_engine_bucket_plan(plan, group_params_by_layer(n for n, _ in trainable_parameters(net)))


__all__ = ["BUCKET_PLANNERS", "contention_from_profile", "libra_bucket_plan"]
