"""The plan policy of one running job: what the driver asks the planners every interval and every
epoch, over the job's iteration-time model (optionally corrected online), with its caches.

* :func:`plan_tolerance`: the policy's tolerance is half an adaptation step, alpha / 2
  (:mod:`.plan_policy` explains why).
* :func:`initial_trajectory`: the initial phase's B_G trajectory (JABAS section 3, step 2): no
  forecast yet, so B_G^init for each of the ceil(N / (p B_G^init)) intervals of the epoch.
* :func:`choose_for_job`: the auto-scaler (:func:`.autoscale.choose_allocation`, JABAS 6.3) with
  the job's interval, min B_L, objective, cost budget and tolerance, on a trajectory rounded to
  whole batches (>= 1).
* :func:`rank_configs`: what every rank of a placement runs of a plan.
* :class:`JobPlanner`: the model the job plans with (``use_model``: wrapped in the online
  correction when there is one, its factors reset), that model retargeted per allocation
  (``for_allocation(num_gpus, multi_node)``, once per key so its caches survive), the plan for a
  B_G on a group (:func:`.plan_policy.solve_for_batch`, cached per (B_G, group, multi-node)),
  the auto-scaler's epoch-time estimate for a placed group (:func:`.autoscale.epoch_time`, the
  same function and plans the allocation was chosen with), and the online correction's update
  from a measured interval (``observe``; plans made with the old factors are dropped) with its
  re-profiling verdict (``reprofile_note``).

Online correction in the driver (``DriverOptions.online_correction``, beyond the paper): every
interval's measured iteration time corrects the model the next plans and the auto-scaling
decisions use (:mod:`.correction`); at an epoch end, a model off by more than
``DriverOptions.reprofile_threshold`` is re-profiled (at most ``max_reprofiles`` times; a given
model or given profiles are kept), and the job plans with the new model.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..config import JobConfig
from ..types import ClusterSpec, Plan, unit_gpu, units_num_gpus
from .autoscale import Allocation, AutoscaleDecision, choose_allocation, epoch_time
from .correction import CorrectedModel, OnlineCorrection
from .config_solver import LocalBatchBound
from .plan_policy import solve_for_batch


def plan_tolerance(job: JobConfig) -> float:
    """Tolerance of the plan policy: half an adaptation step (alpha / 2), see plan_policy."""
    return job.alpha / 2


def initial_trajectory(job: JobConfig, dataset_size: int) -> list[float]:
    """Initial phase (no forecast yet): B_G^init for every interval of the epoch."""
    n = max(1, math.ceil(dataset_size / (job.adapt_interval * job.initial_global_batch)))
    return [float(job.initial_global_batch)] * n


def batch_trajectory(trajectory: Sequence[float]) -> list[int]:
    """A forecast B_G trajectory as whole batches (rounded, at least 1)."""
    return [max(1, int(round(b))) for b in trajectory]


def choose_for_job(cluster: ClusterSpec, model: Any, trajectory: Sequence[float], dataset_size: int,
                   job: JobConfig, current: dict[str, int] | None = None,
                   switch_cost_s: float = 0.0, plan_cache: dict | None = None) -> AutoscaleDecision:
    """:func:`.autoscale.choose_allocation` with the job's settings and plan policy (module notes);
    ``current`` (``{node: GPUs}``): the allocation the job runs, other candidates charged
    ``switch_cost_s`` seconds of re-placement; ``plan_cache``: :attr:`JobPlanner.plan_cache`."""
    return choose_allocation(cluster, model, batch_trajectory(trajectory), dataset_size, job.adapt_interval,
                             job.min_local_batch, objective=job.autoscale_objective,
                             cost_budget=job.cost_budget, tolerance=plan_tolerance(job),
                             current=Allocation(dict(current)) if current else None,
                             switch_cost_s=switch_cost_s, plan_cache=plan_cache)


def rank_configs(plan: Plan, pairs: Sequence[int], learners: Sequence[int] | None = None
                 ) -> list[tuple[int, int, int, str | None]]:
    """(num_vsw, num_ga, B_L, weight sync) of every rank, rank r in GPU unit ``pairs[r]``: its
    unit's WorkerConfig (a solo unit's GPU runs both groups: twice the VSWs) and the weight sync
    the plan's prediction assumed for it (None: the engine's own rule). SMA (``learners``: the
    learner count of every rank): num_vsw is the rank's learner count (tuner) instead of the
    plan's, and the weight sync is None."""
    units = len(set(pairs))
    if len(plan.workers) != units:
        raise ValueError(f"plan.workers must have one entry per GPU unit ({units}), got {len(plan.workers)}")
    out = []
    for rank, pair in enumerate(pairs):
        w = plan.workers[pair]
        m = learners[rank] if learners is not None else w.num_vsw * (2 if unit_gpu(w.gpu)[1] else 1)
        ws = plan.worker_weight_sync[pair] if plan.worker_weight_sync else "auto"
        ws = None if learners is not None or ws == "auto" else ws
        out.append((int(m), int(w.num_ga), int(plan.local_batch_size), ws))
    return out


class JobPlanner:
    """The plan policy of one job over its iteration-time model (module notes).

    Args:
        job: the job's settings (alpha, min B_L, p, auto-scaling objective).
        dataset_size: N, samples per epoch.
        model: the iteration-time model to start with, used as given (``use_model`` wraps).
        correction: the online correction (None: the model is used uncorrected).
        max_reprofiles: re-profilings :meth:`take_reprofile` allows (0: a given model or given
            profiles, which are kept).
    """

    def __init__(self, job: JobConfig, dataset_size: int, model: Any = None,
                 correction: OnlineCorrection | None = None, max_reprofiles: int = 0) -> None:
        self.job, self.dataset_size = job, dataset_size
        self.correction = correction
        self.max_reprofiles, self.reprofiles = max_reprofiles, 0
        self.model = model
        self._alloc_models: dict[tuple[int, bool], Any] = {}
        self._plans: dict[tuple, Plan] = {}
        # the auto-scaler's plans per (group H, N_G, multi-node) and B_G, across its decisions
        # (:func:`.autoscale.choose_allocation`); dropped with the model's other caches
        self.plan_cache: dict[tuple, dict] = {}

    def use_model(self, model: Any) -> None:
        """Plan with ``model`` from now on (profiled or re-profiled; None: no model, burst mode),
        corrected online when there is a correction (its factors start again at 1), its local
        batch capped at ``job.max_local_batch`` when set."""
        if model is not None and self.job.max_local_batch is not None:
            model = LocalBatchBound(model, self.job.max_local_batch)
        if self.correction is not None and model is not None:
            self.correction.reset()
            model = CorrectedModel(model, self.correction)
        self.model = model
        self._alloc_models.clear()
        self._plans.clear()
        self.plan_cache.clear()

    def alloc_model(self, num_gpus: int, multi_node: bool) -> Any:
        """The model retargeted to an allocation (``for_allocation``, if any), built once per
        (num_gpus, multi_node) so its caches survive across plans."""
        key = (num_gpus, multi_node)
        if key not in self._alloc_models:
            fa = getattr(self.model, "for_allocation", None)
            self._alloc_models[key] = fa(num_gpus, multi_node) if callable(fa) else self.model
        return self._alloc_models[key]

    def plan(self, global_batch: int, gpus: Sequence[str], multi_node: bool) -> Plan:
        """:func:`.plan_policy.solve_for_batch` for B_G on group H = ``gpus`` (one unit name per
        pair or solo GPU), cached per (B_G, group, multi-node)."""
        key = (global_batch, tuple(gpus), multi_node)
        if key not in self._plans:
            self._plans[key] = solve_for_batch(global_batch, list(gpus), self.alloc_model(units_num_gpus(list(gpus)), multi_node),
                                               self.job.min_local_batch, tolerance=plan_tolerance(self.job))
        return self._plans[key]

    def epoch_time(self, gpus: Sequence[str], multi_node: bool, forecast: Sequence[float] | None
                   ) -> float | None:
        """The auto-scaler's predicted epoch time of group ``gpus`` on ``forecast`` (None or
        empty: the initial trajectory); None when the group has no plan for it."""
        traj = batch_trajectory(forecast or initial_trajectory(self.job, self.dataset_size))
        return epoch_time(list(gpus), self.alloc_model(units_num_gpus(list(gpus)), multi_node), traj, self.dataset_size,
                          self.job.adapt_interval, self.job.min_local_batch,
                          tolerance=plan_tolerance(self.job)).epoch_time

    def observe(self, gpu_types: Sequence[str], predicted: float, measured: float) -> None:
        """An interval's per-iteration ``predicted`` vs ``measured`` time updates the online
        correction (:meth:`.correction.OnlineCorrection.observe`); the cached plans were made
        with the old factors and are dropped. Nothing without a correction."""
        if self.correction is None:
            return
        self.correction.observe(gpu_types, predicted, measured)
        self._plans.clear()
        self.plan_cache.clear()

    def reprofile_note(self) -> str | None:
        """Why the profile should be re-measured (some factor beyond the correction's threshold,
        :meth:`.correction.OnlineCorrection.needs_reprofile`), else None."""
        c = self.correction
        if c is None or not c.needs_reprofile():
            return None
        factors = ", ".join(f"{g} x{f:.2f}" for g, f in sorted(c.state_dict().items()))
        return f"model off by more than x{c.threshold:g} ({factors}): re-profiling"

    def take_reprofile(self) -> str | None:
        """:meth:`reprofile_note` while re-profilings are left (``max_reprofiles``; a returned
        note counts as one), else None."""
        note = self.reprofile_note()
        if note is None or self.reprofiles >= self.max_reprofiles:
            return None
        self.reprofiles += 1
        return note


__all__ = ["JobPlanner", "plan_tolerance", "initial_trajectory", "batch_trajectory", "choose_for_job",
           "rank_configs"]
