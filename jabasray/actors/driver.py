"""The JABAS driver: the loop of the JABAS paper (section 3, "Workflow"; section 6) over Ray actors.

Initial phase (paper steps 1-3): build the iteration-time model (a given one, given profiles,
or profile the model once - on an emulated cluster the CPU is profiled once and every GPU type
is that profile scaled by its speed factor), pick the initial allocation with the auto-scaler
assuming B_G = B_G^init for the whole epoch, place one GPU actor per allocated GPU.

Runtime phase, per epoch (steps 4-9):

* intervals of p iterations (one Ray call per actor per interval): the configuration solver
  (Alg. 1) plans B_G on the current GPUs, the actors apply it in place (``configure``), train p
  iterations with the LR rescaled for the plan's B_G* (``JobConfig.lr_scaling`` + warm-up, done
  per iteration inside the actor), and return Phi; the adaptive rule moves B_G by alpha
  (:class:`jabasray.adaptive.AdaptiveBatchController`);
* at the epoch end: validation accuracy, the epoch's B_G trajectory goes to the forecaster
  (GPR + ESM ensemble) which predicts the next epoch, the auto-scaler picks the allocation with the
  minimum predicted epoch time (or cost) on that trajectory, and a checkpoint is written;
* when the allocation changes (or ``force_replacement``): release the actors, place new ones
  (placement groups, GPU types as Ray resources), restore the checkpointed worker state, continue.

Faults: when a GPU actor dies (``RayActorError``), the driver drops that GPU's pair from the
cluster, reloads the last checkpoint (the start of the failed epoch), re-chooses the allocation
on the remaining GPUs and redoes the epoch; no completed epoch is lost (:mod:`.recovery`).

SMA (``JobConfig.sync == "sma"``): the number of Crossbow learners of each rank is tuned per
pair of GPUs (Alg. 2), see :mod:`.sma_learners`. ``IntervalRecord.learners``/``layout`` record
the counts. Every rank's SMA state (its own learners) is checkpointed and each rank gets its
own back on restore (:mod:`.sma_state`), not rank 0's as in IIDP mode.

Online correction (``DriverOptions.online_correction``, beyond the paper): every interval's
measured iteration time corrects the model the next plans and decisions use
(:mod:`jabasray.planners.correction`); a model off by more than ``reprofile_threshold`` is
re-profiled (at most ``max_reprofiles`` times).

Structure: this module only orchestrates, one small method per step. The job's plan policy
(plans, per-allocation models, epoch-time estimate, correction) is
:class:`jabasray.planners.job_planner.JobPlanner`; the model is built by
:func:`jabasray.profiler.cluster.job_perf_model`, LIBRA bucket plans by
:class:`jabasray.profiler.buckets.LibraBucketPlans`; the fault-tolerant fan-out is
:func:`.fanout.call_all` (through :class:`.pool.ActorPool`), recovery :mod:`.recovery`, burst
intervals :mod:`.burst_host`, SMA learner counts :mod:`.sma_learners`, placement :mod:`.placement`.

Deviation (documented): the adaptive controller keeps the *requested* B_G (rule output) rather
than the solver's rounded B_G*. Alg. 1 rounds B_G to a multiple of 2*B_L; with small batches a
10% step is often rounded back (64 -> 70 -> 64 with B_L=8), which would freeze adaptation. The
requested value accumulates the steps; B_G* (what actually runs, and what the LR follows) is
recorded per interval in the metrics.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import JobConfig
from ..types import ClusterSpec, Plan
from ..planners.correction import OnlineCorrection
from ..planners.job_planner import JobPlanner, choose_for_job, initial_trajectory, rank_configs
from ..profiler.buckets import LibraBucketPlans
from .burst_host import BurstIntervals, BurstPlans, check_burst_job
from .checkpoint import Checkpoint, DriverState, save_checkpoint
from .driver_options import DriverCallback, DriverOptions
from .fanout import ActorFailure
from .gpu_actor import GPUActor, IntervalReply, IntervalRequest
from .metrics import EpochRecord, EpochTally, IntervalRecord, MetricsHistory, save_metrics
from .placement import Slot, full_allocation, group_gpus, normalize_allocation, slots_for
from .pool import ActorPool
from .recovery import check_resumable, dead_slots, describe_failure, give_up, latest_intact_checkpoint, restart_point
from .sma_learners import RankLearners
from .sma_state import pack_sma, restore_sma

log = logging.getLogger(__name__)


class JabasDriver:
    """Runs one JABAS job on Ray actors from this process (the driver actor of
    :mod:`.driver_actor` hosts it to run it remotely). ``run()`` returns the :class:`MetricsHistory`.

    Args:
        model_fn, dataset, optimizer_fn, loss_fn: the user's job (``optimizer_fn(params)``).
        job: :class:`JobConfig`.
        cluster: the GPUs the job may use.
        run_dir: folder of this run (checkpoints, metrics.json).
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
        callbacks: :class:`DriverCallback` objects.
        background: optional scheduler with ``rebalance(actor_handles)`` (multiplexing).
    """

    def __init__(self, model_fn: Callable, dataset: Any, optimizer_fn: Callable, loss_fn: Callable,
                 job: JobConfig, cluster: ClusterSpec, run_dir: str | Path,
                 val_dataset: Any = None, perf_model: Any = None, profiles: dict | None = None,
                 options: DriverOptions | None = None, callbacks: Sequence[DriverCallback] = (),
                 background: Any = None, hooks: Any = None, dataset_size: int | None = None,
                 profile_data: Any = None) -> None:
        if not isinstance(job, JobConfig):
            raise ValueError(f"job_config must be a JobConfig, got {type(job).__name__}")
        if not isinstance(cluster, ClusterSpec):
            raise ValueError(f"cluster must be a ClusterSpec, got {type(cluster).__name__}")
        # dataset=None: every actor builds it (hooks.dataset_fn); its size comes from the
        # trainer's probe (jabasray.actors.hooks), the driver never reads a sample
        self.dataset_size = int(dataset_size if dataset_size is not None else len(dataset))
        if self.dataset_size < 1:
            raise ValueError("dataset must hold at least one sample, got an empty dataset")
        self.hooks = hooks
        self._profile_data = profile_data if profile_data is not None else dataset
        self.model_fn, self.dataset = model_fn, dataset
        self.optimizer_fn, self.loss_fn = optimizer_fn, loss_fn
        self.job = job
        self.cluster = cluster.validated_pairs(drop_odd_gpu=True)
        self.run_dir = Path(run_dir)
        self.val_dataset = val_dataset
        self.options = options or DriverOptions()
        self.callbacks = list(callbacks)
        self.background = background
        self._given_model = perf_model
        self._profiles = profiles
        opts = self.options
        # the plan policy over the iteration-time model (given here; built in run() otherwise)
        correction = OnlineCorrection(opts.correction_smoothing, opts.reprofile_threshold)
        self.planner = JobPlanner(job, self.dataset_size, perf_model,
                                  correction if opts.online_correction else None)
        self.pool = ActorPool(self._make_actor, opts.device, opts.emulate, opts.placement_timeout_s,
                              opts.collective_timeout_s, opts.failure_grace_s,
                              label=self.run_dir.name)
        self._placed_epoch = -1
        self._buckets = LibraBucketPlans(model_fn, self._profile_data, loss_fn, opts.bucket_cap_mb) \
            if opts.bucket_planner == "libra" and job.sync != "sma" else None   # None: size-capped
        self._data_ref: Any = None
        self._val_ref: Any = None
        self.metrics = MetricsHistory()
        self.last_checkpoint: Checkpoint | None = None
        self._learners: RankLearners | None = None    # SMA: learners per rank (Crossbow Alg. 2)
        self._reprofiles = 0
        self._burst = None                            # DeepPool burst parallelism (burst_host)
        if job.parallelism == "burst":
            check_burst_job(dataset, hooks, job)
            self._burst = BurstIntervals(BurstPlans(model_fn, dataset, job.amp_limit, self.options.device))
        if job.sync == "sma" and job.sma_learners > self.options.sma_max_learners:
            raise ValueError(f"sma_learners must be <= DriverOptions.sma_max_learners "
                             f"({self.options.sma_max_learners}), got {job.sma_learners}")

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

    def attach_background(self, scheduler: Any) -> None:
        """Attach a background scheduler; it is rebalanced after every (re-)placement."""
        self.background = scheduler
        if self.pool.placement:
            scheduler.rebalance(self.gpu_actors())

    def run(self) -> MetricsHistory:
        """Train until ``job.epochs`` epochs are complete (resuming from the run's checkpoint)."""
        import ray

        from ..adaptive import AdaptiveBatchController

        self._data_ref = ray.put(self.dataset) if self.dataset is not None else None
        self._val_ref = ray.put(self.val_dataset) if self.val_dataset is not None else None
        self.planner.use_model(None if self._burst else self._build_model(refresh=self.options.reprofile))
        ctl = AdaptiveBatchController(self.job)
        state, worker_state = self._restore_or_start(ctl)
        restarts = 0
        try:
            while state.epochs_done < self.job.epochs:
                try:
                    state, worker_state = self._run_epoch(state, worker_state, ctl)
                except ActorFailure as failure:
                    restarts += 1
                    if restarts > self.options.max_restarts:
                        raise give_up(failure, self.slots(), restarts, self.options.max_restarts,
                                      self.run_dir) from failure
                    state, worker_state = self._recover(failure, ctl)
        finally:
            self.shutdown()
        return self.metrics

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
        from ..profiler.cluster import job_perf_model

        opts = self.options
        return job_perf_model(
            self.model_fn, self._profile_data, self.cluster, self.job, loss_fn=self.loss_fn,
            optimizer_fn=self.optimizer_fn, device=opts.device, emulate=opts.emulate,
            torch_threads=opts.torch_threads, bucket_cap_mb=opts.bucket_cap_mb,
            cache_dir=opts.profile_cache_dir or (self.run_dir.parent / ".profiles"),
            host_cpus=_ray_cpus() if opts.emulate else None, perf_model=self._given_model,
            profiles=self._profiles, refresh=refresh)

    def _restore_or_start(self, ctl: Any) -> tuple[DriverState, dict | None]:
        """The newest intact checkpoint (corrupt newer ones are reported), or a fresh start. A
        fresh start is checkpointed at once (worker state None: actors build the model from
        ``model_fn`` with the job's seed), so a GPU actor lost during start-up, placement or the
        first epoch is recovered like a later loss."""
        cp, skipped = latest_intact_checkpoint(self.run_dir)
        if cp is None:
            allocation = self._choose_allocation(self.cluster, None)
            state = DriverState(epochs_done=0, iteration=0, cluster=self.cluster,
                                allocation=allocation, adaptive=ctl.state_dict(),
                                job_config=self.job.to_dict())
            self.metrics = MetricsHistory()
            for line in skipped:
                self._event(line)
            self.last_checkpoint = save_checkpoint(self.run_dir, state, None,
                                                   keep=self.options.keep_checkpoints)
            return state, None
        state = cp.load_driver_state()
        check_resumable(state, self.job.to_dict())
        ctl.load_state_dict(state.adaptive)
        self.metrics = state.metrics
        self.last_checkpoint = cp
        for line in skipped:
            self._event(line)
        self._event(f"resumed from {cp.path} after {state.epochs_done} epoch(s)")
        return state, cp.load_worker_state()

    # ------------------------------------------------------------------ allocation and plans
    def _choose_allocation(self, cluster: ClusterSpec, forecast: Sequence[float] | None
                           ) -> dict[str, int]:
        """Auto-scaling (JABAS 6.3) over all candidate allocations of ``cluster``; without
        ``job.autoscale`` every pair is used. ``forecast=None``: initial phase, B_G^init for
        every interval of the epoch."""
        if not self.job.autoscale or self._burst:   # burst: DeepPool's fixed G (all GPUs)
            return full_allocation(cluster)
        return autoscale_allocation(cluster, self.planner.model, forecast or initial_trajectory(
            self.job, self.dataset_size), self.dataset_size, self.job)

    def _plan(self, slots: list[Slot], global_batch: int) -> Plan:
        """The plan policy (:meth:`jabasray.planners.job_planner.JobPlanner.plan`) on the GPUs of
        ``slots`` for B_G, with the LIBRA bucket plan of that world size (if any)."""
        plan = self.planner.plan(global_batch, group_gpus(slots), _multi_node(slots))
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
        return ray.remote(GPUActor).options(**ray_opts).remote(
            slot, world_size, job, self.model_fn, self.optimizer_fn, self.loss_fn,
            self._data_ref, opts.device, opts.emulate, opts.torch_threads, opts.bucket_cap_mb,
            self.hooks)

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
        if placed_before:
            self._event(f"epoch {epoch + 1}: re-placing actors for allocation {state.allocation}")
        job, opts = self.job, self.options
        sma = None
        if job.sync == "sma" and worker_state is not None:
            # every rank gets its own learners back (sma_state), not rank 0's
            sma = restore_sma(worker_state, [s.gpu_type for s in slots], job.sma_learners)
        shared = worker_state if worker_state is not None and sma is None else None
        self.pool.place(slots, ray.put(shared) if shared is not None else None, fresh=force,
                        bucket_plan=self._buckets.plan(len(slots), getattr(self.planner.model, "profiles", None))
                        if self._buckets else None)
        if sma is not None:
            self._call_all("load_state_dict", per_rank=[(ray.put(st),) for st in sma.states])
        self._placed_epoch = epoch
        if self._burst:
            self._burst.placed()
        self._learners = None if job.sync != "sma" else RankLearners(
            [s.pair for s in slots], job.sma_learners, opts.sma_autotune, opts.sma_tuner_tau,
            opts.sma_max_learners, opts.sma_tuner_relative,
            counts=sma.learners if sma is not None else None,
            tuner_json=sma.tuner_json if sma is not None else "")
        if self.background is not None:
            self.background.rebalance(self.gpu_actors())
        return placed_before

    def _worker_state(self) -> dict:
        """What a checkpoint keeps of the actors: rank 0's state (IIDP: every rank holds the
        same; burst: rank 0's after the consolidating collective), or in SMA mode every rank's own state, the learner counts and the tuner."""
        if self._burst:           # a collective call: completes every rank's model
            return self._call_all("state_dict")[0]
        if self._learners is None:
            return self._call_all("state_dict", ranks=[0])[0]
        return pack_sma(self._call_all("state_dict"), self._learners.counts,
                        [s.gpu_type for s in self.pool.slots], self._learners.tuner_json())

    def _call_all(self, method: str, *args: Any, per_rank: list[tuple] | None = None,
                  ranks: list[int] | None = None) -> list:
        return self.pool.call_all(method, *args, per_rank=per_rank, ranks=ranks)

    # ------------------------------------------------------------------ epochs
    def _run_epoch(self, state: DriverState, worker_state: dict | None, ctl: Any
                   ) -> tuple[DriverState, dict]:
        t_epoch = time.perf_counter()
        replaced = self._ensure_placement(state, worker_state, state.epochs_done)
        if worker_state is None:   # fresh actors: checkpoint their initial weights (epoch 0)
            worker_state = self._worker_state()
            self.last_checkpoint = save_checkpoint(self.run_dir, replace(
                state, adaptive=ctl.state_dict(), metrics=self.metrics), worker_state,
                keep=self.options.keep_checkpoints)
        predicted = None if self._burst else self._predict_epoch(state.forecast)   # burst: no IIDP model
        tally, cursor, interval = EpochTally(), 0, 0
        while cursor < self.dataset_size:
            cursor = self._run_interval(state, ctl, interval, cursor, tally)
            interval += 1
        return self._end_epoch(state, ctl, tally, replaced, t_epoch, predicted)

    def _predict_epoch(self, forecast: Sequence[float]) -> float | None:
        """The auto-scaler's epoch-time estimate for the placed allocation on the forecast (the
        same function and plans it chose the allocation with); None when it has no plan."""
        slots = self.pool.slots
        return self.planner.epoch_time(group_gpus(slots), _multi_node(slots), forecast)

    def _run_interval(self, state: DriverState, ctl: Any, interval: int, cursor: int,
                      tally: EpochTally) -> int:
        """Plan B_G, apply it, train p iterations, feed Phi to the adaptive rule. Returns the
        new epoch cursor."""
        job, n = self.job, self.dataset_size
        target = ctl.global_batch
        if self._burst:
            rec, end = self._burst.run(job, n, state.epochs_done, state.iteration, interval, cursor,
                                       target, self.pool, self._train)
            self.metrics.intervals.append(rec)
            self._finish_interval(state, ctl, rec, tally)
            return end
        plan = self._plan(self.pool.slots, target)
        t0 = time.perf_counter()
        configs = self._rank_configs(plan)
        self.pool.configure(configs)
        layout = [m * (ga + 1) for m, ga, *_ in configs]   # = layout_for(...) without SMA
        run_batch = plan.local_batch_size * sum(layout)   # B_G* that runs (SMA: tuned m)
        req = IntervalRequest.for_job(job, state.epochs_done, state.iteration, cursor, n, run_batch,
                                      local_batch=plan.local_batch_size, layout=layout, similarity=True,
                                      lr_batch=plan.global_batch_size if self._learners else None)
        replies, end = self._train(req)
        dt = time.perf_counter() - t0
        done, first = sum(r.samples for r in replies), replies[0]
        rec = IntervalRecord(epoch=state.epochs_done, interval=interval, iteration=state.iteration,
                             num_iterations=first.num_iterations, cursor=cursor,
                             requested_global_batch=target, global_batch=run_batch,
                             local_batch=plan.local_batch_size, plan=plan,
                             loss=first.loss, throughput=done / dt if dt > 0 else 0.0,
                             phi=first.phi, lr=first.lr, time_s=dt, samples=done,
                             learners=[m for m, *_ in configs] if self._learners else [],
                             layout=list(layout),
                             predicted_time_s=plan.iteration_time * first.num_iterations)
        self.metrics.intervals.append(rec)
        if first.num_iterations > 0:   # online correction (if on): measured vs predicted
            self.planner.observe([s.gpu_type for s in self.pool.slots], plan.iteration_time,
                                 dt / first.num_iterations)
        if self._learners is not None and end < n:
            # not at the epoch end: the ragged last iteration would look slower
            self._learners.observe(replies, rec.learners, self.learner_throughput)
        self._finish_interval(state, ctl, rec, tally)
        return end

    def _train(self, req: IntervalRequest) -> tuple[list[IntervalReply], int]:
        """``run_interval`` on every actor; returns the replies and the common end cursor."""
        replies: list[IntervalReply] = self._call_all("run_interval", req)
        end = {r.end_cursor for r in replies}
        if len(end) != 1:
            raise RuntimeError(f"actors disagree on the epoch cursor: {sorted(end)}")
        return replies, end.pop()

    def _finish_interval(self, state: DriverState, ctl: Any, rec: IntervalRecord,
                         tally: EpochTally) -> None:
        """Callbacks, Phi to the adaptive rule, iteration count and the epoch's tally."""
        for cb in self.callbacks:
            cb.on_interval(self, rec)
        ctl.update(rec.phi if rec.phi is not None else self.job.gamma)
        state.iteration += rec.num_iterations
        tally.add(rec)

    def _end_epoch(self, state: DriverState, ctl: Any, tally: EpochTally, replaced: bool,
                   t_epoch: float, predicted: float | None) -> tuple[DriverState, dict]:
        """Validation, forecast, re-profiling check, auto-scaling decision, checkpoint and
        metrics of the epoch."""
        epoch, slots = state.epochs_done, self.pool.slots
        worker_state = self._worker_state()   # burst: also completes every rank's model
        val_metrics = self._evaluate()
        trajectory = ctl.end_epoch()
        forecast = self._forecast(ctl.completed_trajectories)
        self._maybe_reprofile()
        allocation = self._choose_allocation(state.cluster, forecast)
        if allocation != state.allocation:
            self._event(f"after epoch {epoch + 1}: auto-scaling {state.allocation} -> {allocation}")
        record = EpochRecord(epoch=epoch, allocation=dict(state.allocation),
                             gpu_types=[s.gpu_type for s in slots], trajectory=trajectory,
                             predicted_trajectory=list(state.forecast),
                             train_loss=tally.train_loss, val_accuracy=val_metrics.get("accuracy"),
                             time_s=0.0, gpu_seconds=0.0, samples=tally.samples, throughput=tally.throughput,
                             replaced=replaced, train_time_s=tally.train_time,
                             predicted_train_time_s=tally.predicted_time, predicted_time_s=predicted,
                             val_metrics=val_metrics,
                             lr=self.metrics.intervals[-1].lr if self.metrics.intervals else None)
        self.metrics.epochs.append(record)
        state = replace(state, epochs_done=epoch + 1, allocation=allocation,
                        adaptive=ctl.state_dict(), forecast=[float(x) for x in forecast],
                        metrics=self.metrics)
        record.time_s = time.perf_counter() - t_epoch
        record.gpu_seconds = record.time_s * len(slots)
        self.last_checkpoint = save_checkpoint(self.run_dir, state, worker_state,
                                               keep=self.options.keep_checkpoints)
        save_metrics(self.metrics, self.run_dir / "metrics.json")
        for cb in self.callbacks:
            cb.on_epoch(self, record)
        return state, worker_state

    def _maybe_reprofile(self) -> None:
        """Re-measure a profile the measurements contradict (correction factor beyond
        ``reprofile_threshold``), at most ``max_reprofiles`` times; given models/profiles are kept."""
        note = self.planner.reprofile_note()
        if note is None or self._given_model is not None or self._profiles or \
                self._reprofiles >= self.options.max_reprofiles:
            return
        self._reprofiles += 1
        self._event(note)
        self.planner.use_model(self._build_model(refresh=True))

    def _evaluate(self) -> dict[str, float]:
        """Validation after an epoch: every actor evaluates its shard (the user's eval_fn), the
        shards' means are combined weighted by their sample counts (exact for per-sample
        means). ``{}`` without a validation set or with ``options.evaluate`` off."""
        has_val_fn = self.hooks is not None and self.hooks.val_dataset_fn is not None
        if not self.options.evaluate or (self._val_ref is None and not has_val_fn):
            return {}
        from .metrics import reduce_metrics
        return reduce_metrics(self._call_all("evaluate", self._val_ref))

    def _forecast(self, trajectories: list[list[int]]) -> list[float]:
        """GBS forecast of the next epoch (JABAS 6.2): GPR + ESM ensemble on all trajectories."""
        from ..adaptive import GBSForecaster

        if not trajectories:
            return []
        f = GBSForecaster("ensemble", min_batch=self.job.min_global_batch,
                          max_batch=self.job.max_global_batch, random_state=self.job.seed)
        f.fit(trajectories)
        return [float(x) for x in f.predict_epoch(self.dataset_size, self.job.adapt_interval)]

    # ------------------------------------------------------------------ faults
    def _recover(self, failure: ActorFailure, ctl: Any) -> tuple[DriverState, dict]:
        """Release the actors, restart from the last intact checkpoint without the dead GPUs'
        pairs (:func:`.recovery.restart_point`), re-choose the allocation."""
        dropped = dead_slots(self.slots(), failure)
        self.shutdown()
        cp, state, skipped = restart_point(self.run_dir, failure, dropped)
        ctl.load_state_dict(state.adaptive)
        self.metrics = state.metrics
        for line in skipped:
            self._event(line)
        allocation = self._choose_allocation(state.cluster, state.forecast or None)
        state = replace(state, allocation=allocation)
        self._event(f"{describe_failure(failure, dropped)}; restarting epoch {state.epochs_done + 1} "
                    f"from {cp.path.name} without that pair, allocation {allocation}")
        self.last_checkpoint = cp
        return state, cp.load_worker_state()

    def _event(self, message: str) -> None:
        log.warning(message) if "failure" in message else log.info(message)
        self.metrics.events.append(message)
        for cb in self.callbacks:
            cb.on_event(self, message)


def _ray_cpus() -> float | None:
    """CPUs of the running Ray cluster (None without Ray)."""
    import ray
    return ray.cluster_resources().get("CPU") if ray.is_initialized() else None


def _multi_node(slots: list[Slot]) -> bool:
    """Whether ``slots`` span several nodes (the model's all-reduce depends on it)."""
    return len({s.node for s in slots}) > 1


def autoscale_allocation(cluster: ClusterSpec, model: Any, trajectory: Sequence[float],
                         dataset_size: int, job: JobConfig) -> dict[str, int]:
    """:func:`jabasray.planners.job_planner.choose_for_job` -> ``{node: pairs}``."""
    return normalize_allocation(cluster, choose_for_job(cluster, model, trajectory, dataset_size,
                                                        job).allocation.node_pairs)


__all__ = ["JabasDriver", "DriverOptions", "DriverCallback", "ActorFailure",
           "autoscale_allocation"]
