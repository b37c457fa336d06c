"""The gradient bucket plan a job's actors run: LIBRA's fusion (``bucket_planner="libra"``) or
the engine's default size-capped buckets (``"size"``, DDP-like; then no plan is sent).

LIBRA (Algorithm 2) on what this machine measures:

* layers: :func:`jabasray.profiler.contention.layer_profiles` on the user's model and one
  micro-batch of B_L = min B_L (standalone backward time and gradient bytes per layer, in
  gradient-ready order);
* contention model (Eq. 3-6): the transmission term from the profile's measured all-reduce fit
  (Eq. 3 of JABAS: t = alpha * d 4 (N-1)/N / K + beta), mapped onto LIBRA's ring form
  a + c_hat / rate with rate = K / (2 alpha) and startup a = beta (hop latency beta / 2(N-1));
  that is q (the all-reduce alone). With a contention measurement (``Profile.contention``, the
  driver measures it on a gloo group for CPU actors, :mod:`jabasray.profiler.contention`) the
  overlapped terms come from it: p = q slowed by sigma_c (overlapped rate = rate / sigma_c) and
  Eq. 5's g(b) = sigma_u b, with (sigma_c, sigma_u) from
  :func:`jabasray.planners.libra_model.measured_slowdowns`. Without one, g(b) = b and p = q
  (no contention claimed), as before.
* thread/CTA allocation: not applicable on gloo (no per-collective thread setting; one nominal
  thread choice, the thread terms of Eq. 5-6 are flat), so the DP plans fusion only. On NCCL the
  choice would be the communicator's CTA/channel count; that is not wired (no communicator per
  choice) and not measured here.

The plan is the engine's bucket plan (parameter names per bucket, backward order); the driver
records it in every :class:`~jabasray.types.Plan` and the actors build their worker with it
(``GPUActor.setup(..., bucket_plan=...)``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..planners.libra import group_params_by_layer, plan_buckets, to_engine_bucket_plan
from ..planners.libra_model import CommParams, ComputeParams, ContentionModel, measured_slowdowns
from ..profiles import Profile

log = logging.getLogger(__name__)

BUCKET_PLANNERS = ("size", "libra")
GLOO_THREADS = [1]   # gloo has no thread/CTA setting: one nominal choice


def contention_from_profile(profile: Profile, num_workers: int) -> ContentionModel:
    """LIBRA's model for ``num_workers`` ranks from the profile's Eq. 3 fit and, if measured,
    its contention (module notes)."""
    fit = profile.allreduce_intra
    n = max(2, int(num_workers))
    rate = fit.bandwidth / (2.0 * fit.alpha) if fit.alpha > 0 else 1e12
    hop = max(0.0, fit.beta) / (2 * (n - 1))
    sigma_c, sigma_u = (1.0, 1.0) if profile.contention is None else measured_slowdowns(profile.contention)
    return ContentionModel(compute=ComputeParams(1.0 / sigma_u, 0.0),
                           overlapped=CommParams(rate / sigma_c, 0.0, 1.0),
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


class LibraBucketPlans:
    """A job's LIBRA bucket plans, one per world size, each measured and planned once
    (:func:`libra_bucket_plan` on the first of the model's profiles; the profiling rows are
    ``rows``, (inputs, targets) pairs)."""

    def __init__(self, model_fn: Callable, rows: Any, loss_fn: Callable, bucket_cap_mb: float) -> None:
        self.model_fn, self.rows, self.loss_fn = model_fn, rows, loss_fn
        self.bucket_cap_mb = bucket_cap_mb
        self._plans: dict[int, list[list[str]]] = {}

    def plan(self, world_size: int, profiles: dict[str, Profile] | None) -> list[list[str]]:
        """The bucket plan for ``world_size`` ranks (``profiles``: the model's; ValueError if none)."""
        if world_size not in self._plans:
            from .measure import _batch_fn

            if not profiles:
                raise ValueError("bucket_planner 'libra' needs profiles (the model has none); "
                                 "pass profiles or let the driver profile")
            self._plans[world_size] = libra_bucket_plan(
                self.model_fn, _batch_fn(self.rows), self.loss_fn, next(iter(profiles.values())),
                world_size, self.bucket_cap_mb)
        return self._plans[world_size]

    def planned(self, world_size: int) -> list[list[str]] | None:
        """The plan made for ``world_size`` (None if none yet)."""
        return self._plans.get(world_size)


__all__ = ["BUCKET_PLANNERS", "contention_from_profile", "libra_bucket_plan", "LibraBucketPlans"]
