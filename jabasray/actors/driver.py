"""The JABAS driver: the loop of the JABAS paper (section 3, "Workflow"; section 6) over Ray actors.

:meth:`JabasDriver.run`, step by step (this module only orchestrates, one method per step):

1. the iteration-time model (steps 1-3, :func:`jabasray.profiler.cluster.job_perf_model`), which
   the job's plan policy plans with (:class:`jabasray.planners.job_planner.JobPlanner`);
2. the given cluster reconciled with the live Ray nodes (:mod:`.reconcile`: node ids of a spec
   detected before a cluster or driver restart name dead raylets; nodes are matched by GPU type
   and count), then resume from the newest intact checkpoint - its cluster mapped onto the live
   one, its allocation kept under the new names when the cluster has the same shape, else chosen
   again - or start on the auto-scaler's initial allocation (B_G^init over the whole epoch):
   :func:`.recovery.restore_or_start`;
3. per epoch (steps 4-9): place one GPU actor per allocated GPU unless they run the allocation
   (:class:`.pool.ActorPool`; SMA learners :mod:`.sma_learners`; a pinned node found gone
   re-plans on the live cluster; after a placement of a new (backend, world size, span) the
   all-reduce fit of Eq. 3 is measured on the placed actors, :mod:`.allreduce_fit`), then
   intervals of p iterations:
   plan B_G (Alg. 1), ``configure`` the actors in place, train p iterations at the plan's B_G*
   (one Ray call per actor; burst parallelism :mod:`.burst_host`), feed Phi to the adaptive rule
   (:mod:`jabasray.adaptive.batch_rule`; the driver keeps the requested B_G);
4. at the epoch end: validation, forecast of the next epoch's B_G (GPR + ESM), re-profiling
   check, auto-scaling decision over what the cluster can provide now (:mod:`.cluster_view`:
   the live nodes, joined ones included, and the nodes Ray's autoscaler can launch; the chosen
   allocation's bundles are requested from Ray's autoscaler before they are placed, the request
   cleared when the run ends), the epoch record (:mod:`.metrics`), a checkpoint;
5. a dead GPU actor: redo the epoch from the last checkpoint without its pair (:mod:`.recovery`);
6. at the run's end: the GPU-seconds held over the whole run, before, inside, between and after
   the epochs (``MetricsHistory.held``, :mod:`.cluster_view` rule 6).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from ..adaptive import AdaptiveBatchController
from ..adaptive.forecast import forecast_next_epoch
from ..config import CheckpointConfig, FailureConfig, JobConfig
from ..types import ClusterSpec, Plan
from ..planners.correction import OnlineCorrection
from ..planners.interval_model import EmulationCost, HostCosts, plan_interval_terms, ragged_remainder
from ..planners.job_planner import JobPlanner, rank_configs
from ..profiler.buckets import LibraBucketPlans
from ..profiler.cluster import job_perf_model
from ..storage import StoragePath, as_storage_path
from .allreduce_fit import MeasuredFits, fit_description
from .burst_host import BurstIntervals
from .cluster_view import ClusterView
from .checkpoint import MID_EPOCH, Checkpoint, DriverState, drop_mid_epoch, save_checkpoint
from .driver_options import TRAINING_PHASE, DriverCallback, DriverOptions, check_driver_inputs
from .fanout import ActorFailure
from . import interval_costs
from ..errors import JobFailed, NodesGone, PlacementTimeout
from .gpu_actor import SHARE_DEVICES_ENV, GPUActor, IntervalReply, IntervalRequest
from .hooks import named, named_hooks
from .model_record import ModelRecord, resumed_record
from .metrics import (EpochTally, IntervalRecord, MetricsHistory, RunHeld, decision_record,
                      epoch_record, held_line, interval_record, save_metrics)
from .placement import (Slot, autoscale_allocation, gpu_ray_nodes, group_gpus, job_cluster,
                        multi_node, next_allocation, ray_cpus, slots_for)
from .pool import ActorPool
from .rendezvous import backend_for, preflight
from .reconcile import reconcile, reconcile_with_ray, remap_allocation, same_shape
from .recovery import adopt_mid_epoch, dead_slots, give_up, restart, restore_or_start
from .run_record import RunRecord
from .sma_learners import RankLearners, placement_learners

log = logging.getLogger(__name__)

MAX_REPLANS = 3   # placements tried in a row while pinned nodes keep leaving the cluster


def interval_deadline(options: DriverOptions, predicted_s: float) -> float:
    """How long a training interval predicted to take ``predicted_s`` may run before its
    actors count as hung: ``max(call_timeout_s, interval_timeout_factor * predicted_s)``."""
    return max(options.call_timeout_s, options.interval_timeout_factor * max(0.0, predicted_s))


def loader_cpus(hooks: Any) -> float:
    """CPUs a GPU actor's placement bundle reserves for its DataLoader worker processes
    (``hooks.num_data_workers``; 0 without hooks)."""
    return float(getattr(hooks, "num_data_workers", 0) or 0)


class JabasDriver:
    """Runs one JABAS job on Ray actors from this process (the driver actor of
    :mod:`.driver_actor` hosts it to run it remotely). ``run()`` returns the :class:`MetricsHistory`.

    Args:
        model_fn, dataset, optimizer_fn, loss_fn: the user's job (``optimizer_fn(params)``).
        job: :class:`JobConfig`.
        cluster: the GPUs the job may use.
        run_dir: folder of this run (checkpoints, metrics.json): a local path, a URI or a
            :class:`~jabasray.storage.StoragePath`; its name is the run's name. Its storage
            marker and Ray's record of it (:mod:`.run_record`) are checked at every start and
            restart.
        val_dataset: optional in-memory validation set (evaluated after every epoch, sharded
            over the actors, ``hooks.eval_fn`` or loss + top-1 accuracy).
        hooks: :class:`~jabasray.actors.hooks.JobHooks` for the actors (dataset_fn, step_fn,
            eval_fn, LR scheduler, DataLoader options); None: the plain supervised job.
        dataset_size: ``len`` of the training set (required when ``dataset`` is None: the
            actors build it, the trainer's probe measured it).
        profile_data: a few (inputs, targets) rows to profile with when ``dataset`` is None.
        perf_model: a ready iteration-time model (skips profiling); any object with the solver's
            protocol, optionally ``for_allocation(num_gpus, multi_node)``.
        profiles: ``{gpu_type: Profile}`` (skips profiling; a PerfModel is built from them).
        options: :class:`DriverOptions`.
        failure: :class:`jabasray.config.FailureConfig` (``RunConfig.failure_config``; None: the
            default) - how many GPU-actor failures the run survives.
        checkpoint: :class:`jabasray.config.CheckpointConfig` (``RunConfig.checkpoint_config``):
            every how many epochs a checkpoint is committed and how many are kept.
        force_resume: resume a checkpoint written with another ``JobConfig``
            (``RunConfig(resume="force")``); the checkpoint then records this job.
        callbacks: :class:`DriverCallback` objects.
        background: optional scheduler with ``rebalance(actor_handles)`` (multiplexing).
    """

    def __init__(self, model_fn: Callable, dataset: Any, optimizer_fn: Callable, loss_fn: Callable,
                 job: JobConfig, cluster: ClusterSpec, run_dir: str | Path | StoragePath,
                 val_dataset: Any = None, perf_model: Any = None, profiles: dict | None = None,
                 options: DriverOptions | None = None, callbacks: Sequence[DriverCallback] = (),
                 background: Any = None, hooks: Any = None, dataset_size: int | None = None,
                 profile_data: Any = None, failure: FailureConfig | None = None,
                 force_resume: bool = False, checkpoint: CheckpointConfig | None = None) -> None:
        self.dataset_size = check_driver_inputs(job, cluster, dataset, dataset_size)
        # the user's callables, named: wherever they raise (probe, profiling, the actors), the
        # error names the hook and shows the user's frames (jabasray.errors.HookError)
        self.hooks = named_hooks(hooks) if hooks is not None else None
        self._profile_data = profile_data if profile_data is not None else dataset
        self.model_fn, self.dataset = named("model_fn", model_fn), dataset
        self.optimizer_fn, self.loss_fn = named("optimizer_fn", optimizer_fn), named("loss_fn", loss_fn)
        self.job = job
        self.cluster = job_cluster(cluster, job)
        self.run_dir = as_storage_path(run_dir)
        self.record = RunRecord(self.run_dir.name, self.run_dir)
        self.lock: Any = None   # the run's lock, set by whoever holds it (a lost lease stops saves)
        self.val_dataset = val_dataset
        self.options = options or DriverOptions()
        # what the cluster can provide (live and launchable nodes) and what the job asks Ray for
        self.view = ClusterView(cluster, self.options.emulate, loader_cpus(hooks))
        self._drains_seen: set[str] = set()   # draining nodes already acted on
        self.failure = failure or FailureConfig()
        self._gpu_strikes: dict[str, int] = {}   # GPU key -> single failures (recovery.failed_gpus)
        self.force_resume = force_resume   # resume a checkpoint of a different JobConfig
        self.checkpoint = checkpoint or CheckpointConfig()
        self._last_save = time.monotonic()   # the last checkpoint (mid-epoch checkpoints' clock)
        self.callbacks = list(callbacks)
        self.background = background
        self._bg_deadline(background)
        self._given_model, self._profiles = perf_model, profiles
        self._base_model: Any = None   # the model before the measured all-reduce fits (_use_model)
        # Eq. 3 fits measured on the placed actors (a given perf_model is used as given)
        self.allreduce = MeasuredFits(backend_for(self.options.device), self.options.measure_allreduce)
        opts = self.options
        # the plan policy over the iteration-time model (given here; built in run() otherwise)
        correction = OnlineCorrection(opts.correction_smoothing, opts.reprofile_threshold)
        self.planner = JobPlanner(job, self.dataset_size, perf_model,
                                  correction if opts.online_correction else None,
                                  0 if perf_model is not None or profiles else opts.max_reprofiles)
        self.pool = ActorPool(self._make_actor, opts.device, opts.emulate, opts.placement_timeout_s,
                              opts.collective_timeout_s, opts.failure_grace_s,
                              label=self.run_dir.name, call_timeout_s=opts.call_timeout_s,
                              rendezvous_ports=opts.rendezvous_ports,
                              bundle_cpus=loader_cpus(hooks))
        self._placed_epoch = -1
        self._placement_s: float | None = None   # seconds the last placement took (the re-placement charge)
        self._placed_now_s: float | None = None  # ... when it was this epoch's (EpochRecord.placement_s)
        self._model_record: ModelRecord | None = None   # model.json: what the plans were made with
        self._model_used: Any = None   # the model the planner was last given (_use_model)
        # host terms of an interval and the emulation's cost, measured on the placed actors
        self._host_costs: HostCosts | None = None
        self._emulation_fits: dict[str, EmulationCost] = {}
        self._start_notes: list[str] = []   # what the reconciliation at start changed (events)
        self._profile_notes: list[str] = []  # where the last profiling measured each GPU type
        self._buckets = LibraBucketPlans(model_fn, self._profile_data, loss_fn, opts.bucket_cap_mb) \
            if opts.bucket_planner == "libra" and job.sync != "sma" else None   # None: size-capped
        self._data_ref: Any = None   # Ray objects of the training and validation sets (run())
        self._val_ref: Any = None
        self.metrics = MetricsHistory()
        self.last_checkpoint: Checkpoint | None = None
        self._learners: RankLearners | None = None    # SMA: learners per rank (Crossbow Alg. 2)
        # DeepPool burst parallelism (None: data parallelism)
        self._burst = BurstIntervals.for_job(job, model_fn, dataset, hooks, opts.device)
        self.options.check_job(job)
        # validation after every epoch: with a validation set (or hooks.val_dataset_fn), unless off
        self._evaluates = self.options.evaluate and (val_dataset is not None or (
            hooks is not None and hooks.val_dataset_fn is not None))

    # ------------------------------------------------------------------ public
    def gpu_actors(self) -> list:
        """Handles of the current GPU actors, rank order (empty when none are placed)."""
        return self.pool.actors

    def slots(self) -> list[Slot]:
        return self.pool.slots

    @property
    def learner_tuner(self) -> Any:
        """SMA: the per-pair Crossbow learner tuner of the current placement (else None)."""
        return self._learners.tuner if self._learners else None

    def _bg_deadline(self, scheduler: Any) -> None:
        """A background scheduler's Ray calls get the deadline of the driver's other calls."""
        if scheduler is not None and hasattr(scheduler, "call_timeout_s"):
            scheduler.call_timeout_s = self.options.call_timeout_s

    def run(self) -> MetricsHistory:
        """Train until ``job.epochs`` epochs are complete (resuming from the run's checkpoint)."""
        import ray

        start_s = time.time()   # GPU-hours held over the run count from here (cluster_view rule 6)
        self._reconcile_start()
        self._model_record = resumed_record(self.run_dir, self.job, self.cluster, self.dataset_size)
        if self.options.preflight:   # every GPU node reaches the rendezvous port (one line if not)
            self._phase("checking that the GPU nodes reach the rendezvous ports")
            self._start_notes.append(preflight(gpu_ray_nodes(self.cluster, self.options.emulate),
                                               ports=self.options.rendezvous_ports,
                                               timeout_s=self.options.preflight_timeout_s))
        self._data_ref = ray.put(self.dataset) if self.dataset is not None else None
        self._val_ref = ray.put(self.val_dataset) if self.val_dataset is not None else None
        if not self._burst:
            self._phase("profiling the model" if self._given_model is None and not self._profiles
                        else "building the iteration-time model")
        self._use_model(None if self._burst else self._build_model(refresh=self.options.reprofile))
        self._start_notes += self._profile_notes
        self._model_record.note_initial(self._model_used)
        ctl = AdaptiveBatchController(self.job)
        state, worker_state = self._restore_or_start(ctl)
        restarts = 0
        try:
            while state.epochs_done < self.job.epochs:
                try:
                    state, worker_state = self._run_epoch(state, worker_state, ctl)
                except ActorFailure as failure:
                    restarts += 1
                    if self.failure.exhausted(restarts):
                        raise give_up(failure, self.slots(), restarts, self.failure.max_failures,
                                      self.run_dir) from failure
                    state, worker_state = self._recover(failure, ctl)
        finally:
            self.shutdown()
            self.view.release()   # the autoscaler may let this run's nodes go
        self._note_held(start_s, time.time())
        return self.metrics

    def _note_held(self, start_s: float, end_s: float) -> None:
        """The GPU-seconds held over this run, from unix time ``start_s`` to ``end_s``, split at
        the windows of the epochs it ran (:meth:`.cluster_view.ClusterView.held_in_run`), into
        the metrics (``held``; None when the GCS cannot say) and ``metrics.json``."""
        ran = [e for e in self.metrics.epochs if e.start_s is not None and e.start_s >= start_s]
        got = self.view.held_in_run(self.cluster, start_s, end_s,
                                    [(e.start_s, e.start_s + e.time_s, e.held_gpu_seconds) for e in ran])
        self.metrics.held = None
        if got is not None:
            parts, alive = got
            self.metrics.held = RunHeld(start_s=start_s, end_s=end_s, **parts,
                                        epochs_counted=[e.epoch for e in ran],
                                        launched_gpus_at_end=alive)
            log.info("%s", held_line(self.metrics.held))
        save_metrics(self.metrics, self.run_dir / "metrics.json")

    def shutdown(self) -> None:
        """Release all actors and placement groups."""
        self.pool.shutdown()

    def learner_throughput(self, rank: int, learners: int, reply: IntervalReply) -> float:
        """Alg. 2's t for ``rank`` after an interval run with ``learners`` learners: samples per
        second of wall time, emulation sleep included (a slower emulated GPU measures slower).
        Subclasses may override it (e.g. tests inject a deterministic throughput curve)."""
        return reply.samples / reply.wall_time if reply.wall_time > 0 else 0.0

    # ------------------------------------------------------------------ setup
    def _build_model(self, refresh: bool = False) -> Any:
        """The iteration-time model (:func:`jabasray.profiler.cluster.job_perf_model`): given,
        from given profiles, or profiled (cached; ``refresh`` re-measures)."""
        opts = self.options
        cache_dir = opts.profile_cache_dir or (self.run_dir.parent / ".profiles")
        measure, notes = None, []
        if opts.profile_in_tasks and self._given_model is None and not self._profiles:
            from ..profiler.cluster import cluster_devices
            from ..profiler.measure import job_engine_options
            from .profiling import profile_in_tasks
            self.pool.shutdown()   # re-profiling: the actors hold the GPUs a task needs
            measure = partial(profile_in_tasks, self.model_fn, self._profile_data, self.cluster,
                              loss_fn=self.loss_fn, optimizer_fn=self.optimizer_fn,
                              device=opts.device, emulate=opts.emulate,
                              min_local_batch=self.job.min_local_batch,
                              max_local_batch=self.job.max_local_batch,
                              weight_sync=self.job.weight_sync, bucket_cap_mb=opts.bucket_cap_mb,
                              cache_dir=cache_dir, refresh=refresh, torch_threads=opts.torch_threads,
                              timeout_s=opts.placement_timeout_s + opts.call_timeout_s, notes=notes,
                              step_fn=getattr(self.hooks, "step_fn", None),
                              collate_fn=getattr(self.hooks, "collate_fn", None),
                              engine_options=job_engine_options(self.job, cluster_devices(self.cluster),
                                                                opts.device))
        model = job_perf_model(
            self.model_fn, self._profile_data, self.cluster, self.job, loss_fn=self.loss_fn,
            optimizer_fn=self.optimizer_fn, device=opts.device, emulate=opts.emulate,
            torch_threads=opts.torch_threads, bucket_cap_mb=opts.bucket_cap_mb,
            cache_dir=cache_dir, host_cpus=ray_cpus() if opts.emulate else None,
            perf_model=self._given_model, shared_host=opts.emulation != "wait",
            profiles=self._profiles, refresh=refresh, measure=measure,
            step_fn=getattr(self.hooks, "step_fn", None), collate_fn=getattr(self.hooks, "collate_fn", None))
        self._profile_notes = notes
        return model

    def _use_model(self, model: Any) -> None:
        """Plan with ``model`` (profiled, re-profiled or given), with the all-reduce fits this
        run measured on its actors (:class:`.allreduce_fit.MeasuredFits`; not for a given
        ``perf_model``); the planner's caches and correction start again."""
        self._base_model = model
        target = self._fit_target()
        if target is not None:
            model = self.allreduce.fitted(target)
            if self._host_costs is not None and hasattr(model, "with_measured_costs"):
                model = model.with_measured_costs(self._host_costs, self._emulation_fits)
        self.planner.use_model(model)
        self._model_used = model

    def _note_model(self, epoch: int) -> None:
        """The run's ``model.json`` (:mod:`.model_record`): the model that plans ``epoch``
        (written when it differs from the previous epoch's)."""
        rec = self._model_record
        if rec is not None and rec.note(self._model_used, epoch):
            rec.save(self.run_dir)

    def _fit_target(self) -> Any:
        """The model measured fits apply to: the profiled one (None for a given perf_model)."""
        return None if self._base_model is self._given_model else self._base_model

    def _measure_allreduce(self, slots: list[Slot]) -> None:
        """After a placement: the all-reduce micro-benchmark on the placed actors when their
        (backend, world size, span) has no fit yet in this run (:meth:`.allreduce_fit.
        MeasuredFits.due`), through the fan-out with ``call_timeout_s`` (a hang is an actor
        failure); the next plans use the fit."""
        target = self._fit_target()
        key = self.allreduce.due(target, len(slots), multi_node(slots))
        if key is not None and self.allreduce.measure(key, target, self.pool.call_all) is not None:
            self._use_model(self._base_model)

    def _measure_costs(self, slots: list[Slot]) -> None:
        """After a placement: the host terms of an interval and, on emulated GPUs running IIDP,
        the emulation's cost, timed by the placed actors (:mod:`.interval_costs`, one collective
        call within ``call_timeout_s``); the next plans and predictions use them. Not for a
        given ``perf_model`` or burst parallelism (no IIDP model to carry them)."""
        if self._fit_target() is None or self._burst:
            return
        model = self.planner.alloc_model(len(slots), multi_node(slots))
        points = interval_costs.probe_points(model, slots[0].gpu_type) \
            if self.options.emulate and self.job.sync != "sma" else []
        t0 = time.perf_counter()
        replies = self.pool.call_all("probe_costs", points, self.job.adapt_interval)
        costs = interval_costs.host_costs(replies, time.perf_counter() - t0)
        fits = interval_costs.emulation_fits(replies, points, model)
        if hasattr(model, "with_measured_costs"):   # the ragged step beyond what the model says
            costs = replace(costs, **interval_costs.ragged_extra(replies, model.with_measured_costs(costs, fits)))
        self._host_costs, self._emulation_fits = costs, fits
        self._event(interval_costs.describe(costs, fits))
        self._use_model(self._base_model)

    def _adopt_fits(self, state: DriverState) -> None:
        """The all-reduce fits a checkpoint's ``state`` holds (measured before a resume or a
        driver restart) join this run's; the model plans with them."""
        if self.allreduce.adopt(state.allreduce_fits):
            self._use_model(self._base_model)

    def _fit_used(self, slots: list[Slot]) -> dict:
        """Which Eq. 3 fit the plans on ``slots`` use (:func:`.allreduce_fit.fit_description`;
        {} for one GPU, burst parallelism or a model that does not say)."""
        if len(slots) < 2 or self.planner.model is None:
            return {}
        used = getattr(self.planner.alloc_model(len(slots), multi_node(slots)), "allreduce_fit_used", None)
        if used is None:
            return {}
        source, fit = used(slots[0].gpu_type)
        return fit_description(source, fit, len(slots), multi_node(slots))

    def _restore_or_start(self, ctl: Any) -> tuple[DriverState, dict | None]:
        """:func:`.recovery.restore_or_start`: resume, or a fresh start (checkpointed at once),
        once the run's storage proved visible from here (:class:`.run_record.RunRecord`). A
        finished run resumed with more epochs plans its next epoch first."""
        self.record.check_marker()
        cp, state, events = restore_or_start(self.run_dir, self.job, self.cluster, ctl,
                                             self._choose_allocation, force=self.force_resume)
        events = self._start_notes + events
        if cp is not None:
            self._adopt_fits(state)
            state, note = self._onto_live(state, self.cluster, *reconcile(state.cluster, self.cluster)[1:])
            if note:
                events.append(f"resumed on the live cluster: {note}")
        self._check_checkpoint(cp)
        cp, state, within = adopt_mid_epoch(self.run_dir, cp, state, ctl)   # a newer mid-epoch slot
        events += [within] if within else []
        self._adopt_fits(state)
        state, worker_state = self._continue(cp, state, events)
        if 0 < state.epochs_done < self.job.epochs and not state.forecast:
            state = self._decide_next_epoch(state, ctl)
        return state, worker_state

    def _check_checkpoint(self, cp: Checkpoint | None) -> None:
        """The checkpoint Ray's record names must be visible; then the record names ``cp``
        (before a redone epoch removes a newer manifest)."""
        self.record.check_checkpoint(cp.epochs_done if cp is not None else None)
        if cp is not None:
            self.record.committed(cp.epochs_done)

    def _continue(self, cp: Checkpoint | None, state: DriverState, events: list[str]
                  ) -> tuple[DriverState, dict | None]:
        """Continue from checkpoint ``cp`` (its metrics history, then ``events``) with ``state``;
        ``cp`` None: a fresh start, checkpointed now. Returns the state and the worker state."""
        self.metrics = state.metrics if cp is not None else MetricsHistory()
        self.last_checkpoint = cp
        for line in events:
            self._event(line)
        if cp is None:
            self._save(state, None)
        return state, cp.load_worker_state() if cp is not None else None

    # ------------------------------------------------------------------ the live cluster
    def _reconcile_start(self) -> None:
        """The given cluster mapped onto the live Ray nodes (:mod:`.reconcile`; a spec that pins
        no node stays as it is): ids of a spec detected before a cluster or driver restart name
        dead raylets. ValueError (one line) when none of its nodes is alive."""
        cluster, notes = None, []
        if self.cluster.nodes:
            cluster, _, notes = reconcile_with_ray(self.cluster)
        if self.view.follows_ray:   # the live nodes and the launchable ones (:mod:`.cluster_view`)
            cluster = self.view.candidates() or cluster
        if cluster is None:
            raise ValueError(f"cluster: none of its nodes {[n.name for n in self.cluster.nodes]} "
                             f"is in the live Ray cluster ({'; '.join(notes)})")
        self.cluster = job_cluster(cluster, self.job)
        self._start_notes = [f"cluster reconciled with the live Ray nodes: {n}" for n in notes]

    def _onto_live(self, state: DriverState, cluster: ClusterSpec, rename: dict[str, str],
                   notes: list[str]) -> tuple[DriverState, str]:
        """``state`` continued on the live ``cluster``: its allocation renamed when ``cluster``
        is its cluster with nodes renamed (``rename``, :func:`.reconcile.same_shape`; the plan
        holds), else chosen again on ``cluster`` for the state's forecast. Returns the state and
        a line saying what changed (empty: nothing)."""
        alloc = remap_allocation(state.allocation, rename, cluster) \
            if same_shape(state.cluster, cluster, rename) else None
        kept = alloc is not None
        if not kept:
            alloc = self._choose_allocation(cluster, state.forecast or None)
        changed = not kept or alloc != state.allocation or notes
        note = "; ".join(notes + [f"allocation {'kept' if kept else 're-chosen'}: {alloc}"]) \
            if changed else ""
        return replace(state, cluster=cluster, allocation=alloc), note

    def _place_live(self, state: DriverState, worker_state: dict | None) -> tuple[DriverState, bool]:
        """:meth:`_ensure_placement`; when a pinned node is gone (:class:`~jabasray.errors.NodesGone`,
        raised before any actor changed) the state's cluster is reconciled with the live Ray
        nodes, the allocation re-planned and the placement tried again; when the placement is
        not met within ``placement_timeout_s`` (:class:`~jabasray.errors.PlacementTimeout`)
        the allocation is re-planned over the GPUs free now (:meth:`_replan_free`). Returns
        the state placed and whether actors were re-placed."""
        for _ in range(MAX_REPLANS):
            try:
                self.view.request(state.cluster, state.allocation)   # Ray's autoscaler provisions it
                return state, self._ensure_placement(state, worker_state, state.epochs_done)
            except NodesGone as gone:
                cluster, rename, notes = reconcile_with_ray(state.cluster)
                if cluster is None:
                    raise JobFailed(f"{gone}; no GPU node of the run is left in the live Ray "
                                    f"cluster") from None
                state, note = self._onto_live(state, job_cluster(cluster, self.job),
                                              rename, notes)
                self._event(f"epoch {state.epochs_done + 1}: {gone}; re-planned on the live "
                            f"cluster: {note}")
            except PlacementTimeout as timeout:
                state = self._replan_free(state, timeout)
        raise JobFailed(f"epoch {state.epochs_done + 1}: nodes kept leaving the Ray cluster or "
                        f"resources kept being taken during {MAX_REPLANS} placements")

    def _replan_free(self, state: DriverState, timeout: PlacementTimeout) -> DriverState:
        """A placement not met in time: every actor released, the allocation chosen again over
        the GPUs of ``state.cluster`` that are free now (:func:`.placement.free_cluster`), said
        in one event. ``state.cluster`` stays: the next epoch's plan asks for all of it again.
        Re-raises ``timeout`` when nothing smaller is free."""
        from .placement import free_cluster, free_resources_per_node
        import ray

        self.pool.shutdown()
        free = free_cluster(state.cluster, free_resources_per_node(), self.options.emulate,
                            self.pool.bundle_cpus, ray.cluster_resources())
        try:
            alloc = self._choose_allocation(free, state.forecast or None) if free else None
        except ValueError:   # e.g. SMA/burst and no free pair
            alloc = None
        if alloc is None or alloc == state.allocation:
            raise timeout
        self._event(f"epoch {state.epochs_done + 1}: {timeout}; re-planned over the free GPUs "
                    f"{ {n.name: n.num_gpus for n in free.nodes} }: allocation {alloc}")
        return replace(state, allocation=alloc)

    # ------------------------------------------------------------------ allocation and plans
    def _choose_allocation(self, cluster: ClusterSpec, forecast: Sequence[float] | None) -> dict[str, int]:
        """The allocation to place on ``cluster``, with nothing to move from (:meth:`_next_allocation`)."""
        return self._next_allocation(cluster, forecast)[0]

    def _next_allocation(self, cluster: ClusterSpec, forecast: Sequence[float] | None,
                         current: dict[str, int] | None = None, switch_cost_s: float = 0.0
                         ) -> tuple[dict[str, int], dict[str, int] | None, Any]:
        """:func:`.placement.next_allocation` for this job: SMA and burst on pairs only, burst on
        DeepPool's fixed G (all GPUs), as is a job without auto-scaling."""
        return next_allocation(job_cluster(cluster, self.job), self.planner.model, forecast, self.dataset_size,
                               self.job, fixed=not self.job.autoscale or self._burst is not None,
                               current=current, switch_cost_s=switch_cost_s,
                               plan_cache=self.planner.plan_cache)

    def _replacement_cost(self) -> float:
        """Seconds the auto-scaler charges a move to another allocation: ``job.replacement_cost_s``,
        else what the last placement of the actors took (0 before any)."""
        if self.job.replacement_cost_s is not None:
            return float(self.job.replacement_cost_s)
        return self._placement_s or 0.0

    def _plan(self, slots: list[Slot], global_batch: int) -> Plan:
        """The plan policy (:meth:`jabasray.planners.job_planner.JobPlanner.plan`) on the GPUs of
        ``slots`` for B_G, with the LIBRA bucket plan of that world size (if any)."""
        plan = self.planner.plan(global_batch, group_gpus(slots), multi_node(slots))
        return replace(plan, bucket_plan=self._buckets.planned(len(slots)) if self._buckets else None)

    def _rank_configs(self, plan: Plan) -> list[tuple[int, int, int, str | None]]:
        """:func:`jabasray.planners.job_planner.rank_configs` of the placed ranks (SMA: with
        their learner counts)."""
        return rank_configs(plan, [s.pair for s in self.pool.slots],
                            self._learners.counts if self._learners is not None else None)

    # ------------------------------------------------------------------ placement
    def _make_actor(self, slot: Slot, world_size: int, ray_opts: dict) -> Any:
        import ray

        job, opts = self.job, self.options
        env = dict(opts.actor_env or {})   # NCCL/gloo interface, debug level ...
        if opts.share_node_devices and opts.device == "cuda":
            env[SHARE_DEVICES_ENV] = "1"      # gpu_actor.cuda_device picks Ray's GPU among all
        if env:   # Ray merges them into the job's runtime_env
            ray_opts = dict(ray_opts, runtime_env={"env_vars": env})
        actor_class = getattr(self.hooks, "actor_class", None) or GPUActor
        return ray.remote(actor_class).options(**ray_opts).remote(
            slot, world_size, job, self.model_fn, self.optimizer_fn, self.loss_fn,
            self._data_ref, opts.device, opts.emulate, opts.torch_threads, opts.bucket_cap_mb,
            self.hooks, opts.emulation)

    def _ensure_placement(self, state: DriverState, worker_state: dict | None, epoch: int) -> bool:
        """Place actors for ``state.allocation`` unless they already run it. Returns True when
        actors were re-placed (not for the first placement of this process). Pairs that stay
        allocated keep their actors (they re-join the new process group and reload the state);
        ``force_replacement`` starts every actor afresh."""
        import ray

        slots = slots_for(state.cluster, state.allocation)
        force = self.options.force_replacement and self._placed_epoch != epoch
        if self.pool.runs(slots) and not force:
            return False
        placed_before = self.pool.placement is not None
        t_place = time.perf_counter()
        self._phase(f"placing {len(slots)} GPU actor{'s' if len(slots) != 1 else ''}")
        if placed_before:
            self._event(f"epoch {epoch + 1}: re-placing actors for allocation {state.allocation}")
        if self.options.emulate and self.options.emulation == "wait":
            from .emulation import host_keeps_up
            cpus = ray_cpus()
            if cpus is not None and not host_keeps_up([s.speed for s in slots], cpus):
                log.warning("the \"wait\" emulation is not fair on allocation %s: the placed "
                            "speeds sum to %.2f > %s host CPUs (emulated GPUs will run slower "
                            "than their speed)", state.allocation,
                            sum(min(s.speed, 1.0) for s in slots), cpus)
        sma, learners = placement_learners(self.job, self.options, slots, worker_state)
        shared = worker_state if sma is None else None   # SMA: every rank its own state
        self.pool.place(slots, ray.put(shared) if shared is not None else None, fresh=force,
                        bucket_plan=self._buckets.plan(len(slots), getattr(self.planner.model, "profiles", None))
                        if self._buckets else None,
                        rank_state_refs=[ray.put(st) for st in sma.states] if sma is not None else None)
        self._placed_epoch, self._learners = epoch, learners
        self._measure_allreduce(slots)
        self._measure_costs(slots)
        if self._burst:
            self._burst.placed()
        if self.background is not None:
            self.background.rebalance(self.gpu_actors())
        self._placement_s = self._placed_now_s = time.perf_counter() - t_place
        self._phase(TRAINING_PHASE)
        return placed_before

    def _worker_state(self) -> dict:
        """What a checkpoint keeps of the actors: rank 0's state (IIDP: every rank holds the
        same; burst: rank 0's after the consolidating collective), or in SMA mode every rank's
        own state, the learner counts and the tuner."""
        if self._learners is not None:
            return self._learners.pack(self.pool.call_all("state_dict"), [s.gpu_type for s in self.pool.slots])
        # burst: a collective call on every rank (completes every rank's model)
        return self.pool.call_all("state_dict", ranks=None if self._burst else [0])[0]

    def _save(self, state: DriverState, worker_state: dict | None) -> None:
        """Checkpoint ``state`` with ``worker_state`` (``checkpoint.num_to_keep`` newest are kept),
        unless the run's lease was taken over by another run meanwhile."""
        if getattr(self.lock, "lost", False):
            from .run_folder import RunLockedError
            raise RunLockedError(f"run folder {self.run_dir}: another run took over its lease "
                                 f"while this one did not renew it; stopping before checkpoint "
                                 f"epoch_{state.epochs_done:04d} (the last one this run wrote is kept)")
        state = replace(state, allreduce_fits=dict(self.allreduce.records))
        self.last_checkpoint = save_checkpoint(self.run_dir, state, worker_state,
                                               keep=self.checkpoint.num_to_keep or 0)
        self._last_save = time.monotonic()
        self.record.committed(state.epochs_done)

    # ------------------------------------------------------------------ epochs
    def _run_epoch(self, state: DriverState, worker_state: dict | None, ctl: Any) -> tuple[DriverState, dict]:
        t_epoch, t_wall = time.perf_counter(), time.time()   # the epoch's window (GPU-hours held)
        self._placed_now_s = None
        state, replaced = self._place_live(state, worker_state)
        self._note_model(state.epochs_done)
        if worker_state is None:   # fresh actors: checkpoint their initial weights (epoch 0)
            worker_state = self._worker_state()
            self._save(replace(state, adaptive=ctl.state_dict(), metrics=self.metrics), worker_state)
        # the auto-scaler's estimate for the placed allocation (None: no plan; burst: no IIDP model)
        slots = self.pool.slots
        predicted = None if self._burst else \
            self.planner.epoch_time(group_gpus(slots), multi_node(slots), state.forecast)
        tally, cursor, interval = EpochTally(), 0, 0
        if state.mid_epoch:           # resumed from a mid-epoch checkpoint: continue its epoch
            mid = state.mid_epoch
            tally, cursor, interval = EpochTally(**mid["tally"]), int(mid["cursor"]), int(mid["interval"])
            state = replace(state, mid_epoch={})
        while cursor < self.dataset_size:
            cursor = self._run_interval(state, ctl, interval, cursor, tally)
            interval += 1
            if cursor < self.dataset_size:
                going = {n: t for n, t in self.view.draining(self.pool.placement).items()
                         if n not in self._drains_seen}
                if going:
                    self._drains_seen.update(going)
                    state = self._leave_draining(state, ctl, tally, cursor, interval, going)
                    replaced = True
                elif self._mid_epoch_due():
                    self._save_mid_epoch(state, ctl, tally, cursor, interval)
        return self._end_epoch(state, ctl, tally, replaced, (t_epoch, t_wall), predicted)

    def _leave_draining(self, state: DriverState, ctl: Any, tally: EpochTally, cursor: int,
                        interval: int, going: dict[str, float | None]) -> DriverState:
        """Nodes of the allocation drain (:meth:`.cluster_view.ClusterView.draining`): before
        they go, a mid-epoch checkpoint (what the epoch has done stays done), the allocation
        chosen again on the cluster without them, the actors re-placed from the live actors'
        state; the epoch goes on from ``cursor``. Without another node the job stays where it
        is (a node that then goes is an actor failure, recovered from this checkpoint)."""
        worker_state = self._worker_state()
        self._save_mid_epoch(state, ctl, tally, cursor, interval, worker_state)
        when = {n: (f"in {max(0.0, t - time.time()):.0f} s" if t else "no deadline") for n, t in going.items()}
        cluster = replace(state.cluster, nodes=[n for n in state.cluster.nodes if n.name not in going])
        if not cluster.nodes:
            self._event(f"epoch {state.epochs_done + 1}: node(s) {when} drain and no other node is "
                        f"left; training goes on until they go (mid-epoch checkpoint written)")
            return state
        allocation = self._choose_allocation(cluster, state.forecast or None)
        self._event(f"epoch {state.epochs_done + 1}: node(s) {when} drain: mid-epoch checkpoint at "
                    f"sample {cursor}, re-planned without them: allocation {allocation}")
        state, _ = self._place_live(replace(state, cluster=cluster, allocation=allocation), worker_state)
        return state

    def _mid_epoch_due(self) -> bool:
        minutes = self.checkpoint.interval_minutes
        return minutes is not None and time.monotonic() - self._last_save >= 60.0 * minutes

    def _save_mid_epoch(self, state: DriverState, ctl: Any, tally: EpochTally, cursor: int,
                        interval: int, worker_state: dict | None = None) -> None:
        """The mid-epoch checkpoint (``CheckpointConfig.interval_minutes``) at an interval
        boundary: the epoch's cursor, interval index and tally, the adaptive controller and the
        metrics so far, and the actors' state; one slot, replaced each time (manifest-last)."""
        if getattr(self.lock, "lost", False):
            return                    # the next epoch-boundary save reports the lost lease
        mid = {"cursor": cursor, "interval": interval, "tally": dataclasses.asdict(tally)}
        save_checkpoint(self.run_dir, replace(state, adaptive=ctl.state_dict(), metrics=self.metrics,
                                              mid_epoch=mid, allreduce_fits=dict(self.allreduce.records)),
                        worker_state if worker_state is not None else self._worker_state(),
                        folder=MID_EPOCH)
        self._last_save = time.monotonic()

    def _run_interval(self, state: DriverState, ctl: Any, interval: int, cursor: int,
                      tally: EpochTally) -> int:
        """One interval (IIDP, or burst: :mod:`.burst_host`), then callbacks, Phi to the adaptive
        rule, the iteration count and the epoch's tally. Returns the new epoch cursor."""
        if self._burst:
            rec, end = self._burst.run(self.job, self.dataset_size, state.epochs_done, state.iteration,
                                       interval, cursor, ctl.global_batch, self.pool, self.pool.train,
                                       record_samples=self.options.record_samples)
        else:
            rec, end = self._iidp_interval(state, interval, cursor, ctl.global_batch)
        self.metrics.intervals.append(rec)
        for cb in self.callbacks:
            cb.on_interval(self, rec)
        ctl.update(rec.phi if rec.phi is not None else self.job.gamma)
        state.iteration += rec.num_iterations
        tally.add(rec)
        return end

    def _iidp_interval(self, state: DriverState, interval: int, cursor: int, target: int
                       ) -> tuple[IntervalRecord, int]:
        """One IIDP (or SMA) interval at B_G = ``target``: its record and the new cursor. The
        measured time feeds the online correction and (SMA) the learner tuner."""
        job, n = self.job, self.dataset_size
        plan = self._plan(self.pool.slots, target)
        t0 = time.perf_counter()
        configs = self._rank_configs(plan)
        reconfigured = self.pool.configure(configs)
        t_train = time.perf_counter()
        layout = [m * (ga + 1) for m, ga, *_ in configs]   # = layout_for(...) without SMA
        run_batch = plan.local_batch_size * sum(layout)   # B_G* that runs (SMA: tuned m)
        req = IntervalRequest.for_job(job, state.epochs_done, state.iteration, cursor, n, run_batch,
                                      local_batch=plan.local_batch_size, layout=layout, similarity=True,
                                      lr_batch=plan.global_batch_size if self._learners else None,
                                      record_samples=self.options.record_samples)
        replies, end = self.pool.train(req, deadline_s=interval_deadline(
            self.options, plan.iteration_time * req.num_iterations))
        t_end = time.perf_counter()
        dt, iterations = t_end - t0, replies[0].num_iterations
        # no host costs (a given model, burst): Eq. 6 alone
        remainder = ragged_remainder(n - cursor, iterations, run_batch)
        predicted = plan_interval_terms(plan, iterations, self._host_costs, configure=reconfigured,
                                        remainder=remainder,
                                        model=self.planner.alloc_model(len(self.pool.slots),
                                                                       multi_node(self.pool.slots)))
        rec = interval_record(replies, dt, epoch=state.epochs_done, interval=interval,
                              iteration=state.iteration, cursor=cursor, requested_global_batch=target,
                              global_batch=run_batch, local_batch=plan.local_batch_size, plan=plan,
                              learners=[m for m, *_ in configs] if self._learners else [],
                              layout=list(layout), predicted_time_s=sum(predicted.values()),
                              predicted_terms=predicted,
                              measured_terms=interval_costs.measured_terms(
                                  replies, t_end - t_train, t_train - t0))
        full = iterations - (remainder > 0)
        if full > 0:   # online correction (if on): the full iterations' time, measured vs predicted
            steps = rec.measured_terms.get("steps", 0.0)
            self.planner.observe([s.gpu_type for s in self.pool.slots], plan.iteration_time,
                                 (steps if steps > 0 else dt) / full)
        if self._learners is not None and end < n:
            # not at the epoch end: the ragged last iteration would look slower
            self._learners.observe(replies, rec.learners, self.learner_throughput)
        return rec, end

    def _end_epoch(self, state: DriverState, ctl: Any, tally: EpochTally, replaced: bool,
                   started: tuple[float, float], predicted: float | None) -> tuple[DriverState, dict]:
        """Validation, forecast, re-profiling check, auto-scaling decision, checkpoint and
        metrics of the epoch (``started``: its start on ``time.perf_counter`` and on the wall
        clock, the clock of the nodes' lifetimes its GPU-hours held are counted from)."""
        t_epoch, t_wall = started
        epoch, slots = state.epochs_done, self.pool.slots
        t_end = time.perf_counter()
        worker_state = self._worker_state()   # burst: also completes every rank's model
        val_metrics = self.pool.evaluate(self._val_ref) if self._evaluates else {}
        eval_s = time.perf_counter() - t_end
        trajectory = ctl.end_epoch()
        t_done = time.perf_counter()
        # the window [t_wall, t_wall + time_s]: one duration for the epoch's time and its GPUs held
        held = self.view.held_seconds(state.cluster, t_wall, t_wall + (t_done - t_epoch))
        record = epoch_record(tally, epoch=epoch, allocation=state.allocation,
                              gpu_types=[s.gpu_type for s in slots], trajectory=trajectory,
                              forecast=state.forecast, val_metrics=val_metrics, replaced=replaced,
                              predicted_time_s=predicted, time_s=t_done - t_epoch,
                              dataset_size=self.dataset_size, allreduce_fit=self._fit_used(slots),
                              placement_s=self._placed_now_s, eval_s=eval_s,
                              held_gpu_seconds=held, start_s=t_wall)
        if record.served_exactly_once is False:
            self._event(f"epoch {epoch + 1}: exactly-once failure: the actors served "
                        f"{tally.samples} samples whose digest is not that of the dataset's "
                        f"{self.dataset_size} samples, each once (a sampler or data-source fault)")
        self.metrics.epochs.append(record)
        # the next epoch's plan (none after the final epoch: no forecast, no auto-scaling)
        state = replace(state, epochs_done=epoch + 1, adaptive=ctl.state_dict(), forecast=[],
                        metrics=self.metrics)
        if state.epochs_done < self.job.epochs:
            state = self._decide_next_epoch(state, ctl)
        if self.checkpoint.due(state.epochs_done, self.job.epochs):   # RunConfig.checkpoint_config
            self._save(state, worker_state)
        drop_mid_epoch(self.run_dir)      # an epoch boundary supersedes a mid-epoch checkpoint
        save_metrics(self.metrics, self.run_dir / "metrics.json")
        if self.background is not None and hasattr(self.background, "checkpoint"):
            # background jobs' states to the driver and the run's storage (actors.background)
            self.background.checkpoint(self.run_dir / "background")
        for cb in self.callbacks:
            cb.on_epoch(self, record)
        return state, worker_state

    def _decide_next_epoch(self, state: DriverState, ctl: Any) -> DriverState:
        """The epoch-end planning for epoch ``state.epochs_done + 1`` (JABAS section 6.2-6.3):
        forecast its B_G trajectory from the completed ones, re-profile if the measurements
        contradict the model, and choose its allocation. Runs only when that epoch will run:
        at the end of an epoch that is not the job's last, or when a finished run is resumed
        with more epochs (its final epoch planned nothing)."""
        forecast = forecast_next_epoch(ctl.completed_trajectories, self.job, self.dataset_size)
        self._maybe_reprofile()
        switch_s = self._replacement_cost()
        state = self._refresh_cluster(state)
        allocation, uncharged, decision = self._next_allocation(state.cluster, forecast,
                                                                state.allocation, switch_s)
        if decision is not None and self.metrics.epochs:   # beside the epoch that ends here
            self.metrics.epochs[-1].decision = decision_record(decision, state.allocation, switch_s)
        if allocation != state.allocation:
            self._event(f"after epoch {state.epochs_done}: auto-scaling {state.allocation} -> {allocation}")
        elif uncharged is not None:
            self._event(f"after epoch {state.epochs_done}: keeping {allocation}: the next epoch on {uncharged} "
                        f"would not repay re-placing the actors ({switch_s:.1f} s)")
        return replace(state, allocation=allocation, forecast=[float(x) for x in forecast])

    def _refresh_cluster(self, state: DriverState) -> DriverState:
        """``state`` on what the cluster can provide now, of the GPU types the model knows
        (:meth:`.cluster_view.ClusterView.refresh`), what changed said in events; unchanged for
        a cluster that does not follow Ray."""
        profiles = getattr(self.planner.model, "profiles", None)   # the types the model can plan
        cluster, notes = self.view.refresh(state.cluster, self.pool.placement,
                                           set(profiles) if isinstance(profiles, dict) else None)
        for note in notes:
            self._event(f"after epoch {state.epochs_done}: {note}")
        return replace(state, cluster=job_cluster(cluster, self.job)) if cluster is not None else state

    def _maybe_reprofile(self) -> None:
        """Re-measure a profile the measurements contradict (correction factor beyond
        ``reprofile_threshold``), at most ``max_reprofiles`` times; given models/profiles are kept."""
        note = self.planner.take_reprofile()
        if note is not None:
            self._event(note)
            self._use_model(self._build_model(refresh=True))
            for line in self._profile_notes:
                self._event(line)

    # ------------------------------------------------------------------ faults
    def _recover(self, failure: ActorFailure, ctl: Any) -> tuple[DriverState, dict]:
        """Release the actors, restart from the last intact checkpoint without the dead actors'
        GPUs on a re-chosen allocation (:func:`.recovery.restart`)."""
        failure = self._all_dead(failure)
        dropped = dead_slots(self.slots(), failure)
        self.shutdown()
        self.record.check_marker()
        cp, state, events = restart(self.run_dir, failure, dropped, ctl, self._choose_allocation,
                                    policy=self.failure, strikes=self._gpu_strikes)
        self._check_checkpoint(cp)
        cp, state, within = adopt_mid_epoch(self.run_dir, cp, state, ctl)   # a newer mid-epoch slot
        return self._continue(cp, state, events + ([within] if within else []))

    def _all_dead(self, failure: ActorFailure) -> ActorFailure:
        """``failure`` with every rank that is dead by now: the fan-out stops at the first dead
        actor, so actors killed together (a collective abort) surface one at a time; each other
        actor is asked for a ``ping`` (``failure_grace_s``): a dead one answers RayActorError,
        a survivor its ping, one still stuck in a collective nothing (alive)."""
        import ray

        actors = self.gpu_actors()
        others = {r: a for r, a in enumerate(actors) if r not in failure.dead_ranks}
        if not failure.dead_ranks or not others:
            return failure
        refs = {a.ping.remote(): r for r, a in others.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.options.failure_grace_s)
        dead = set(failure.dead_ranks)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.add(refs[ref])
            except Exception:  # noqa: BLE001 - alive, its call failed
                pass
        if dead == set(failure.dead_ranks):
            return failure
        return ActorFailure(sorted(dead), failure.cause, failure.failed_ranks)

    def _phase(self, phase: str) -> None:
        """Tell the callbacks what the driver does until its next interval (``on_phase``; a
        callback without it is skipped)."""
        log.info("%s", phase)
        for cb in self.callbacks:
            on_phase = getattr(cb, "on_phase", None)
            if on_phase is not None:
                on_phase(self, phase)

    def _event(self, message: str) -> None:
        log.warning(message) if "failure" in message else log.info(message)
        self.metrics.events.append(message)
        for cb in self.callbacks:
            cb.on_event(self, message)


__all__ = ["JabasDriver", "DriverOptions", "DriverCallback", "ActorFailure",
           "autoscale_allocation"]
