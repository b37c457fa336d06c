"""The JABAS loop on a simulated clock: the driver's epochs and intervals, with the time of each
interval from the iteration-time model and the training's progress from a convergence model.

:func:`simulate` walks a job as :class:`jabasray.actors.driver.JabasDriver` does (its
``_run_epoch``, ``_iidp_interval``, ``_end_epoch`` and ``_decide_next_epoch``), asking the
policy (:mod:`.policies`) where the real driver asks its planners:

1. the first allocation (``policy.start``) is placed: ``placement_s`` seconds;
2. per epoch: the policy may set B_G (Pollux); then intervals of p iterations while samples of
   the epoch remain: the plan for the controller's B_G (``policy.plan``; every rank
   ``configure``-d when its configuration changed, as ``ActorPool.configure``), min(p,
   ceil(remaining / B_G*)) iterations, the samples [cursor, cursor + served) of the epoch;
   the interval lasts the sum of its predicted terms
   (:func:`jabasray.planners.interval_model.plan_interval_terms`: Eq. 6 for its iterations plus
   the host terms the model carries), the convergence model advances the progress by the
   samples served at B_G* and gives the two groups' similarity Phi at that batch, which the
   driver's :class:`~jabasray.adaptive.AdaptiveBatchController` turns into the next B_G
   (adaptive policies);
3. at the epoch end: ``eval_s`` seconds of validation and checkpoint, the metric at the
   progress reached, then (unless it was the last epoch, or the target is reached and
   ``stop_at_target``) the policy's next allocation; a different one is placed at the next
   epoch's start (``placement_s``).

What is simulated and what is not: only the clock and the executor. Every decision (plans,
allocations, forecasts, B_G) is the code the driver runs. The executor is the model itself:
an interval takes exactly what the driver would predict for it, so a simulated run is as right
as the iteration-time model (``jabasray simulate --replay`` measures that against a recorded
run). Each simulated interval's ``predicted_terms`` are its time by term; ``measured_terms``
stay empty (nothing was measured). Losses are not simulated (NaN).

A replay (:mod:`.replay`) passes a :class:`Recorded` run (its per-epoch models, its measured
placement and epoch-end seconds, its re-placement charges) and its similarities
(:class:`.convergence.ReplaySimilarity`), which any simulation may also take instead of the
convergence model's.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..actors.metrics import EpochRecord, IntervalRecord, MetricsHistory
from ..actors.placement import job_cluster, slots_for
from ..adaptive import AdaptiveBatchController
from ..config import JobConfig
from ..planners.interval_model import host_costs_of, plan_interval_terms, ragged_remainder
from ..planners.job_planner import JobPlanner, rank_configs
from ..types import ClusterSpec
from .policies import JabasPolicy, Policy, SimState

log = logging.getLogger(__name__)


class Recorded(Protocol):
    """What a replay takes from a recorded run instead of the simulator's own inputs."""

    def model(self, epochs_done: int | None) -> Any:
        """The iteration-time model that planned epoch ``epochs_done`` (None: the initial
        allocation's)."""

    def placement_s(self, epoch: int) -> float | None:
        """Seconds the placement before ``epoch`` took (None: the run placed nothing)."""

    def eval_s(self, epoch: int) -> float:
        """Seconds of the epoch's end (state read, validation)."""

    def switch_s(self, epoch: int) -> float | None:
        """The re-placement charge of the decision after ``epoch`` (None: not recorded)."""

    def val_metrics(self, epoch: int) -> dict[str, float]:
        """The epoch's recorded validation metrics."""


@dataclass
class SimRun:
    """A simulated run: its metrics (the real run's schema) and what it comes to."""

    policy: str
    history: MetricsHistory
    time_s: float                              # simulated seconds to the end
    time_to_target_s: float | None             # to the end of the first epoch at the target
    gpu_seconds: float                         # sum over epochs of GPUs x seconds
    cost: float                                # Eq. 8: sum over epochs of price rate x seconds
    replacements: int                          # placements after the first
    final_metric: float | None
    gpus_over_time: list[tuple[float, int]] = field(default_factory=list)   # (epoch start s, GPUs)

    def summary(self) -> dict:
        """The comparison's row (JSON)."""
        return {"policy": self.policy, "time_s": self.time_s, "time_to_target_s": self.time_to_target_s,
                "gpu_hours": self.gpu_seconds / 3600.0, "cost": self.cost,
                "replacements": self.replacements, "epochs": len(self.history.epochs),
                "final_metric": self.final_metric,
                "gpus_over_time": [[t, g] for t, g in self.gpus_over_time]}


def simulate(policy: Policy, job: JobConfig, cluster: ClusterSpec, dataset_size: int, model: Any,
             convergence: Any = None, *, placement_s: float = 30.0, eval_s: float = 0.0,
             target: float | None = None, stop_at_target: bool = False,
             recorded: Recorded | None = None, similarities: Any = None) -> SimRun:
    """Simulate ``job`` under ``policy`` on ``cluster`` (module notes).

    Args:
        policy: a :class:`.policies.Policy` (:func:`.policies.make_policy`).
        job: the job (epochs, B_G bounds, p, alpha, gamma, auto-scaling settings).
        cluster: the GPUs (:class:`jabasray.types.ClusterSpec`).
        dataset_size: N, samples per epoch.
        model: the iteration-time model (a :class:`~jabasray.planners.perf_model.PerfModel`,
            host costs included where measured); ignored with ``recorded``.
        convergence: progress, similarity and metric model (:mod:`.convergence`); required
            unless ``recorded`` gives the similarities (then no metric is simulated).
        placement_s: seconds a placement takes (first start and every re-placement).
        eval_s: seconds of every epoch's end (validation, checkpoint).
        target: the metric's target (time to target); None: none.
        stop_at_target: end the run at the first epoch that reaches ``target``.
        recorded: a recorded run to replay (:class:`Recorded`).
        similarities: recorded similarities per (epoch, interval)
            (:class:`.convergence.ReplaySimilarity`, its fallback answering intervals it does
            not hold) instead of the convergence model's; an interval neither answers keeps B_G.
    """
    if convergence is None and similarities is None:
        raise ValueError("convergence must be given (a convergence model) unless recorded "
                         "similarities are (--replay)")
    if placement_s < 0 or eval_s < 0:
        raise ValueError(f"placement_s and eval_s must be >= 0 seconds, got {placement_s} and {eval_s}")
    cluster = job_cluster(cluster, job)
    # the validation metric the target is for: the convergence model's (its name and direction)
    metric_name = getattr(convergence, "metric_name", "accuracy")
    higher = bool(getattr(convergence, "higher_is_better_", True))
    planner = JobPlanner(job, dataset_size)
    in_use = recorded.model(None) if recorded is not None else model
    planner.use_model(in_use)
    state = SimState(job, cluster, dataset_size, planner, convergence)
    ctl = AdaptiveBatchController(job)
    history = MetricsHistory()
    allocation = policy.start(state)
    running: dict[str, int] | None = None         # the allocation the actors run
    applied: list | None = None                   # the configuration every rank runs
    forecast: list[float] = []
    clock, reached, iteration, replacements = 0.0, None, 0, 0
    price = {n.name: n.price_weight for n in cluster.nodes}
    cost, gpus_over_time = 0.0, []
    for epoch in range(job.epochs):
        if recorded is not None and recorded.model(epoch) is not in_use:
            in_use = recorded.model(epoch)       # measured after this epoch's placement
            planner.use_model(in_use)
        t_epoch = clock
        placed_s, replaced = None, False
        if allocation != running:
            placed_s = recorded.placement_s(epoch) if recorded is not None else placement_s
            placed_s = placement_s if placed_s is None else placed_s
            replaced = running is not None
            replacements += replaced
            state.replacement_s = placed_s
            running, applied = dict(allocation), None
        slots = slots_for(cluster, allocation)
        pairs = [s.pair for s in slots]
        gpus_over_time.append((clock, len(slots)))
        clock += placed_s or 0.0
        batch = policy.epoch_batch(state, allocation)
        if batch is not None:
            ctl.set_global_batch(batch)
        units, multi = state.units(allocation)      # group H of the epoch's allocation
        epoch_model = planner.alloc_model(len(slots), multi)
        host_costs = host_costs_of(epoch_model)
        predicted_epoch = planner.epoch_time(units, multi, forecast) \
            if isinstance(policy, JabasPolicy) else None
        cursor, interval, train_s, covered = 0, 0, 0.0, True
        while cursor < dataset_size:
            target_bg = ctl.global_batch
            plan = policy.plan(state, allocation, target_bg)
            configs = rank_configs(plan, pairs)
            reconfigured, applied = configs != applied, configs
            layout = [m * (ga + 1) for m, ga, *_ in configs]
            run_batch = plan.local_batch_size * sum(layout)
            n = min(job.adapt_interval, math.ceil((dataset_size - cursor) / run_batch))
            served = min(dataset_size - cursor, n * run_batch)
            terms = plan_interval_terms(plan, n, host_costs, configure=reconfigured, model=epoch_model,
                                        remainder=ragged_remainder(dataset_size - cursor, n, run_batch))
            t = sum(terms.values())
            phi = _phi(similarities, convergence, epoch, interval, state.progress, run_batch)
            if convergence is not None:
                state.progress = convergence.step(state.progress, run_batch, served)
            history.intervals.append(IntervalRecord(
                epoch=epoch, interval=interval, iteration=iteration, num_iterations=n, cursor=cursor,
                requested_global_batch=target_bg, global_batch=run_batch,
                local_batch=plan.local_batch_size, plan=plan, loss=float("nan"),
                throughput=served / t if t > 0 else 0.0, phi=phi, lr=_lr(ctl, job, iteration + n - 1),
                time_s=t, samples=served, layout=layout, predicted_time_s=t, predicted_terms=terms))
            if policy.adaptive:
                ctl.update(phi if phi is not None else job.gamma)
            else:
                ctl.update(job.gamma)   # records the B_G of the interval; gamma moves nothing
            covered = covered and served > 0
            cursor, iteration, interval, train_s = cursor + served, iteration + n, interval + 1, train_s + t
        clock += train_s
        end_s = recorded.eval_s(epoch) if recorded is not None else eval_s
        clock += end_s
        state.epochs_done = epoch + 1
        trajectory = ctl.end_epoch()
        state.trajectories.append(list(trajectory))
        metrics = recorded.val_metrics(epoch) if recorded is not None else {}
        if convergence is not None:
            metrics = {metric_name: float(convergence.metric(state.progress))}
        epoch_s = clock - t_epoch
        cost += epoch_s * sum(price[name] * g for name, g in allocation.items())
        record = EpochRecord(
            epoch=epoch, allocation=dict(allocation), gpu_types=[s.gpu_type for s in slots],
            trajectory=trajectory, predicted_trajectory=list(forecast), train_loss=float("nan"),
            val_accuracy=metrics.get("accuracy"), time_s=epoch_s, gpu_seconds=epoch_s * len(slots),
            samples=cursor, throughput=cursor / train_s if train_s > 0 else 0.0,
            replaced=replaced, train_time_s=train_s,
            predicted_train_time_s=train_s, predicted_time_s=predicted_epoch,
            served_exactly_once=covered and cursor == dataset_size, val_metrics=metrics,
            lr=_lr(ctl, job, max(0, iteration - 1)), placement_s=placed_s, eval_s=end_s)
        history.epochs.append(record)
        if reached is None and reaches(metrics.get(metric_name), target, higher):
            reached = clock
        if epoch + 1 == job.epochs or (stop_at_target and reached is not None):
            break
        if recorded is not None and recorded.switch_s(epoch) is not None:
            state.replacement_s = float(recorded.switch_s(epoch))
        nxt = policy.next_epoch(state, allocation)
        record.decision = nxt.decision
        if nxt.allocation != allocation:
            history.events.append(f"after epoch {epoch + 1}: auto-scaling {allocation} -> {nxt.allocation}")
        allocation, forecast = dict(nxt.allocation), list(nxt.forecast)
    final_metric = history.epochs[-1].val_metrics.get(metric_name)
    return SimRun(policy=policy.name, history=history, time_s=clock, time_to_target_s=reached,
                  gpu_seconds=sum(e.gpu_seconds for e in history.epochs), cost=cost,
                  replacements=replacements, final_metric=final_metric, gpus_over_time=gpus_over_time)


def reaches(value: float | None, target: float | None, higher_is_better: bool = True) -> bool:
    """Whether a validation ``value`` is at ``target`` (at or above it; at or below it for a
    metric where lower is better, e.g. a loss)."""
    if value is None or target is None:
        return False
    return value >= target if higher_is_better else value <= target


def _phi(similarities: Any, convergence: Any, epoch: int, interval: int, progress: float,
         batch: int) -> float | None:
    """The interval's similarity: recorded (``similarities``), else the convergence model's;
    None where neither has one (the rule then keeps B_G, as the driver does without Phi)."""
    if similarities is not None:
        try:
            return similarities.similarity(epoch, interval, progress, batch)
        except ValueError:          # not recorded, and no fallback model
            return None
    return float(convergence.similarity(progress, batch))


def _lr(ctl: AdaptiveBatchController, job: JobConfig, iteration: int) -> float:
    """The LR the job's rule gives (NaN when the job does not state its base LR)."""
    return ctl.lr(iteration) if job.lr is not None else float("nan")


__all__ = ["simulate", "SimRun", "Recorded", "reaches"]
