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
on the remaining GPUs and redoes the epoch; no completed epoch is lost.

SMA (``JobConfig.sync == "sma"``, Crossbow section 3.4 / Alg. 2): the driver keeps one
:class:`~jabasray.planners.learner_tuner.LearnerTuner` with one entry per rank (``"rank<r>"``:
per GPU, as the paper tunes every GPU independently; per GPU *type* would force one count on
GPUs that are straggling differently). The plan still gives B_L and n_GA per pair, but the
number of learners of each rank (its ``num_vsw``) is the tuner's: it starts at
``JobConfig.sma_learners`` (Alg. 2 line 1 starts at 1; ``sma_learners=1`` is exactly that),
and after every interval each rank's throughput t = samples / wall_time of its reply (wall time
INCLUDING the emulation sleep, so an emulated slower GPU measures slower) is fed to the tuner,
whose answer is that rank's learner count for the next interval. Every interval's layout (and
so the sampler's partition, exactly-once per epoch) is built from these per-rank counts:
``layout[r] = m_r * (n_GA + 1)``, B_G* = B_L * sum(layout); ``configure`` is called on ALL
actors whenever any count changes (it is collective: k, the total learner count, is summed).
The LR rule (``JobConfig.lr_scaling``) follows the plan's B_G* (what adaptive batching chose),
not the tuned learner count: Crossbow does not rescale the LR with the number of learners (each
learner steps its own replica), and an LR change restarts SMA (section 3.2), which would happen
at every probe otherwise. Intervals that reach the epoch end are not fed to the tuner (their last iteration is ragged
and would look slower). The tuner restarts probing after every (re-)placement (new ranks/GPUs);
it is not checkpointed, so a resumed run probes again. ``DriverOptions.sma_autotune=False``
keeps ``sma_learners`` fixed. ``IntervalRecord.learners``/``layout`` record the counts.

Deviation (documented): the adaptive controller keeps the *requested* B_G (rule output) rather
than the solver's rounded B_G*. Alg. 1 rounds B_G to a multiple of 2*B_L; with small batches a
10% step is often rounded back (64 -> 70 -> 64 with B_L=8), which would freeze adaptation. The
requested value accumulates the steps; B_G* (what actually runs, and what the LR follows) is
recorded per interval in the metrics.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import JobConfig
from ..serialization import JsonMixin
from ..types import ClusterSpec, Plan
from .checkpoint import Checkpoint, DriverState, latest_checkpoint, save_checkpoint
from .gpu_actor import GPUActor, IntervalReply, IntervalRequest
from .metrics import EpochRecord, IntervalRecord, MetricsHistory, save_metrics
from .placement import (Placement, Slot, drop_pair, full_allocation, group_gpus,
                        normalize_allocation, place_actors, release, slots_for)
from .rendezvous import RendezvousServer, backend_for

log = logging.getLogger(__name__)


class ActorFailure(RuntimeError):
    """One or more GPU actors died during a call."""

    def __init__(self, dead_ranks: list[int], cause: BaseException) -> None:
        super().__init__(f"GPU actor(s) of rank {dead_ranks} died: {type(cause).__name__}")
        self.dead_ranks = dead_ranks
        self.cause = cause


@dataclass
class DriverOptions(JsonMixin):
    """Advanced knobs of the driver (defaults suit CPU emulation)."""

    device: str = "cpu"                 # "cpu" (emulated GPU types) or "cuda"
    emulate: bool | None = None         # gpu_<type> resources + speed emulation; None: device == "cpu"
    force_replacement: bool = False     # re-place all actors at every epoch boundary (tests/advanced)
    keep_checkpoints: int = 2           # newest epoch checkpoints kept on disk
    placement_timeout_s: float = 120.0  # wait for placement-group resources
    collective_timeout_s: float = 300.0 # process-group timeout
    failure_grace_s: float = 20.0       # after one actor fails, wait this long for the others
    max_restarts: int = 3               # actor failures tolerated per run
    torch_threads: int = 1              # torch threads inside each actor
    bucket_cap_mb: float = 25.0         # engine gradient bucket cap
    evaluate: bool = True               # validation accuracy at every epoch end
    profile_cache_dir: str | None = None  # where profiles are cached (default: <storage>/.profiles)
    sma_autotune: bool = True           # sync="sma": tune learners per rank (Crossbow Alg. 2)
    sma_tuner_tau: float = 0.05         # tuner tolerance: a gain must exceed it to add a learner
    sma_tuner_relative: bool = True     # tau as a fraction of the previous throughput
    sma_max_learners: int = 8           # upper bound of learners per GPU (memory)

    def __post_init__(self) -> None:
        from ..validation import check_choice, check_float, check_int
        check_choice("device", self.device, ("cpu", "cuda"))
        if self.emulate is None:
            self.emulate = self.device == "cpu"
        check_int("keep_checkpoints", self.keep_checkpoints, min_value=1)
        check_int("max_restarts", self.max_restarts, min_value=0)
        check_int("torch_threads", self.torch_threads, min_value=1)
        check_float("sma_tuner_tau", self.sma_tuner_tau, min_value=0)
        check_int("sma_max_learners", self.sma_max_learners, min_value=1)
        for f in ("sma_autotune", "sma_tuner_relative"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be True or False, got {getattr(self, f)!r}")
        for f in ("placement_timeout_s", "collective_timeout_s", "failure_grace_s", "bucket_cap_mb"):
            check_float(f, getattr(self, f), min_value=0, min_exclusive=True)


class DriverCallback:
    """Hooks the driver calls (override what you need). Progress bars and test fault injection
    use them; they run in the driver's process between Ray calls."""

    def on_interval(self, driver: "JabasDriver", record: IntervalRecord) -> None:  # noqa: D401
        pass

    def on_epoch(self, driver: "JabasDriver", record: EpochRecord) -> None:
        pass

    def on_event(self, driver: "JabasDriver", message: str) -> None:
        pass


class JabasDriver:
    """Runs one JABAS job on Ray actors (in-process, or itself as a Ray actor via
    ``ray.remote(JabasDriver)``). ``run()`` returns the :class:`MetricsHistory`.

    Args:
        model_fn, dataset, optimizer_fn, loss_fn: the user's job (``optimizer_fn(params)``).
        job: :class:`JobConfig`.
        cluster: the GPUs the job may use.
        run_dir: folder of this run (checkpoints, metrics.json).
        val_dataset: optional validation set (accuracy at every epoch end).
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
                 background: Any = None) -> None:
        if not isinstance(job, JobConfig):
            raise ValueError(f"job_config must be a JobConfig, got {type(job).__name__}")
        if not isinstance(cluster, ClusterSpec):
            raise ValueError(f"cluster must be a ClusterSpec, got {type(cluster).__name__}")
        if len(dataset) < 1:
            raise ValueError("dataset must hold at least one sample, got an empty dataset")
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
        self._model: Any = perf_model  # built in run() when not given
        from ..planners import solve_configuration
        self._solve = solve_configuration
        self._placement: Placement | None = None
        self._placed_epoch = -1
        self._rdv: RendezvousServer | None = None
        self._generation = 0
        self._applied: tuple | None = None
        self._plan_cache: dict[tuple, Plan] = {}
        self._alloc_models: dict[tuple[int, bool], Any] = {}   # of self._model
        self._data_ref: Any = None
        self._val_ref: Any = None
        self.metrics = MetricsHistory()
        self.last_checkpoint: Checkpoint | None = None
        # SMA: learners per rank of the current placement and their tuner (Crossbow Alg. 2)
        self._learners: list[int] | None = None
        self.learner_tuner: Any = None
        if job.sync == "sma" and job.sma_learners > self.options.sma_max_learners:
            raise ValueError(f"sma_learners must be <= DriverOptions.sma_max_learners "
                             f"({self.options.sma_max_learners}), got {job.sma_learners}")

    # ------------------------------------------------------------------ public
    def gpu_actors(self) -> list:
        """Handles of the current GPU actors, rank order (empty when none are placed)."""
        return list(self._placement.actors) if self._placement else []

    def slots(self) -> list[Slot]:
        return list(self._placement.slots) if self._placement else []

    def attach_background(self, scheduler: Any) -> None:
        """Attach a background scheduler; it is rebalanced after every (re-)placement."""
        self.background = scheduler
        if self._placement:
            scheduler.rebalance(self.gpu_actors())

    def run(self) -> MetricsHistory:
        """Train until ``job.epochs`` epochs are complete (resuming from the run's checkpoint)."""
        import ray

        from ..adaptive import AdaptiveBatchController

        job = self.job
        self._data_ref = ray.put(self.dataset)
        self._val_ref = ray.put(self.val_dataset) if self.val_dataset is not None else None
        self._model = self._build_model()
        self._alloc_models.clear()   # both derive from self._model
        self._plan_cache.clear()
        self._check_min_local_batch()
        ctl = AdaptiveBatchController(job)
        state, worker_state = self._restore_or_start(ctl)
        restarts = 0
        try:
            while state.epochs_done < job.epochs:
                try:
                    state, worker_state = self._run_epoch(state, worker_state, ctl)
                except ActorFailure as failure:
                    restarts += 1
                    if restarts > self.options.max_restarts:
                        raise RuntimeError(f"giving up after {restarts - 1} restarts: {failure}") from failure
                    state, worker_state = self._recover(failure, ctl)
        finally:
            self.shutdown()
        return self.metrics

    def shutdown(self) -> None:
        """Release all actors and placement groups."""
        release(self._placement)
        self._placement = None
        self._applied = None
        if self._rdv:
            self._rdv.close()
            self._rdv = None

    # ------------------------------------------------------------------ setup
    def _build_model(self) -> Any:
        """The iteration-time model: given, from given profiles, or profiled (cached)."""
        if self._given_model is not None:
            return self._given_model
        from ..planners.perf_model import PerfModel

        profiles = self._profiles or self._profile()
        missing = [t for t in self.cluster.gpu_types if t not in profiles]
        if missing:
            raise ValueError(f"profiles must cover every GPU type of the cluster; missing {missing}")
        return PerfModel(profiles, weight_sync=self.job.weight_sync)

    def _profile(self) -> dict:
        """Profile the model on this machine once (cached on disk) and derive every GPU type.

        Emulated cluster: the CPU profile scaled by each type's speed (``Profile.scaled``). Real
        GPUs: the local device's profile is used for every type (a real heterogeneous cluster
        should pass per-type profiles measured on each type, e.g. with ``jabasray profile``).
        """
        from ..planners.perf_model import emulated_profiles
        from ..profiler import profile_model

        cache = Path(self.options.profile_cache_dir or (self.run_dir.parent / ".profiles"))
        base = profile_model(self.model_fn, self.dataset, loss_fn=self.loss_fn,
                             optimizer_fn=self.optimizer_fn, device=self.options.device,
                             gpu_type="cpu" if self.options.emulate else None,
                             min_local_batch=self.job.min_local_batch,
                             weight_sync=self.job.weight_sync,
                             bucket_cap_mb=self.options.bucket_cap_mb, cache_dir=cache,
                             warmup=2, repeats=5)
        if self.options.emulate:
            # emulated "nodes" share this machine: the inter-node all-reduce is the intra one
            if base.allreduce_inter is None:
                base = replace(base, allreduce_inter=base.allreduce_intra)
            return emulated_profiles(base, {n.gpu_type: n.speed for n in self.cluster.nodes})
        return {t: base.scaled(1.0, t) for t in self.cluster.gpu_types}

    def _check_min_local_batch(self) -> None:
        maxes = {t: int(self._model.max_local_batch(t)) for t in self.cluster.gpu_types}
        if self.job.min_local_batch > max(maxes.values()):
            raise ValueError(f"min_local_batch must be <= the largest local batch a GPU can run "
                             f"({max(maxes.values())}; per type {maxes}), got {self.job.min_local_batch}")

    def _restore_or_start(self, ctl: Any) -> tuple[DriverState, dict | None]:
        cp = latest_checkpoint(self.run_dir)
        if cp is None:
            allocation = self._choose_allocation(self.cluster, None)
            state = DriverState(epochs_done=0, iteration=0, cluster=self.cluster,
                                allocation=allocation, adaptive=ctl.state_dict(),
                                job_config=self.job.to_dict())
            self.metrics = MetricsHistory()
            return state, None
        state = cp.load_driver_state()
        self._check_resumable(state)
        ctl.load_state_dict(state.adaptive)
        self.metrics = state.metrics
        self.last_checkpoint = cp
        self._event(f"resumed from {cp.path} after {state.epochs_done} epoch(s)")
        return state, cp.load_worker_state()

    def _check_resumable(self, state: DriverState) -> None:
        """Everything but ``epochs`` must match the checkpointed job (else results would mix)."""
        old = dict(state.job_config)
        new = self.job.to_dict()
        old.pop("epochs", None)
        new.pop("epochs", None)
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if diff:
            raise ValueError(f"job_config differs from the checkpointed run in {diff}; "
                             f"use another run name or the same configuration to resume")

    # ------------------------------------------------------------------ allocation
    def _alloc_model(self, num_gpus: int, multi_node: bool) -> Any:
        """The iteration-time model retargeted to an allocation (``for_allocation``, if any),
        built once per (num_gpus, multi_node) so its caches survive across plans."""
        key = (num_gpus, multi_node)
        if key not in self._alloc_models:
            fa = getattr(self._model, "for_allocation", None)
            self._alloc_models[key] = fa(num_gpus, multi_node) if callable(fa) else self._model
        return self._alloc_models[key]

    def _choose_allocation(self, cluster: ClusterSpec, forecast: Sequence[float] | None
                           ) -> dict[str, int]:
        """Auto-scaling (JABAS 6.3) over all candidate allocations of ``cluster``; without
        ``job.autoscale`` every pair is used. ``forecast=None``: initial phase, B_G^init for
        every interval of the epoch."""
        if not self.job.autoscale:
            return full_allocation(cluster)
        if not forecast:
            n = max(1, math.ceil(len(self.dataset) /
                                 (self.job.adapt_interval * self.job.initial_global_batch)))
            forecast = [float(self.job.initial_global_batch)] * n
        return autoscale_allocation(cluster, self._model, list(forecast), len(self.dataset), self.job)

    # ------------------------------------------------------------------ placement
    def _ensure_placement(self, state: DriverState, worker_state: dict | None, epoch: int) -> bool:
        """Place actors for ``state.allocation`` unless they already run it. Returns True when
        actors were re-placed (not for the first placement of this process). Pairs that stay allocated keep their actors (they re-join the new process
        group and reload the state); ``force_replacement`` starts every actor afresh."""
        current = self._placement
        slots = slots_for(state.cluster, state.allocation)
        same = (current is not None and
                [(s.pair_key, s.rank) for s in current.slots] == [(s.pair_key, s.rank) for s in slots])
        force = self.options.force_replacement and self._placed_epoch != epoch
        if same and not force:
            return False
        import ray

        if current is not None:
            self._event(f"epoch {epoch}: re-placing actors for allocation {state.allocation}")
        if force:
            self.shutdown()
        elif self._rdv:
            self._rdv.close()
        remote_cls = ray.remote(GPUActor)
        job, opts = self.job, self.options

        def make(slot: Slot, ray_opts: dict) -> Any:
            return remote_cls.options(**ray_opts).remote(
                slot, len(slots), job, self.model_fn, self.optimizer_fn, self.loss_fn,
                self._data_ref, opts.device, opts.emulate, opts.torch_threads, opts.bucket_cap_mb)

        self._placement, new = place_actors(slots, make, emulate=opts.emulate,
                                            timeout_s=opts.placement_timeout_s, reuse=self._placement)
        log.debug("placement: %d actors, %d new", len(slots), len(new))
        self._generation += 1
        self._rdv = RendezvousServer(len(slots), backend_for(opts.device), self._generation,
                                     timeout_s=opts.collective_timeout_s)
        self._call_all("setup", per_rank=[(self._rdv.info, s) for s in slots])
        if worker_state is not None:
            ref = ray.put(worker_state)
            self._call_all("load_state_dict", ref)
        self._placed_epoch = epoch
        self._applied = None
        self._reset_learners(len(slots))
        if self.background is not None:
            self.background.rebalance(self.gpu_actors())
        return current is not None

    def _call_all(self, method: str, *args: Any, per_rank: list[tuple] | None = None,
                  ranks: list[int] | None = None) -> list:
        """Call ``method`` on every actor at once and gather the results in rank order.

        A dead actor surfaces as ``RayActorError``; the others may then fail in their collective
        (peer gone) or hang in it. On the first ``RayActorError`` we stop waiting (every actor is
        released by the recovery anyway); after another error the rest get ``failure_grace_s``
        to reveal a dead actor behind it. Raises :class:`ActorFailure` naming the dead ranks
        (those known by then); other errors are re-raised.
        """
        import ray
        from ray.exceptions import RayActorError

        ranks = list(range(len(self._placement.actors))) if ranks is None else ranks
        refs = [getattr(self._placement.actors[i], method).remote(*(per_rank[i] if per_rank else args))
                for i in ranks]
        index = {r: rank for r, rank in zip(refs, ranks)}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        pending = list(refs)
        while pending:
            timeout = self.options.failure_grace_s if errors else None
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                break  # grace period over: the rest hang in a collective with a dead peer
            for r in ready:
                try:
                    results[index[r]] = ray.get(r)
                except RayActorError as e:
                    errors[index[r]] = e
                except Exception as e:  # noqa: BLE001 - classified below
                    errors[index[r]] = e
            if any(isinstance(e, RayActorError) for e in errors.values()):
                done, _ = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
                for r in done:       # other actors already known dead
                    try:
                        ray.get(r)
                    except RayActorError as e:
                        errors[index[r]] = e
                    except Exception:  # noqa: BLE001 - survivors failing in the collective
                        pass
                break
        if errors:
            dead = sorted(i for i, e in errors.items() if isinstance(e, RayActorError))
            if dead:
                raise ActorFailure(dead, errors[dead[0]])
            raise next(iter(errors.values()))
        return [results[i] for i in ranks]

    # ------------------------------------------------------------------ plans
    def _plan(self, slots: list[Slot], global_batch: int) -> Plan:
        """Alg. 1 on the GPUs of ``slots`` for B_G (cached). If B_G is below what the allocation
        can run (M < N_H for every B_L), the smallest runnable B_G (2 * N_H * min B_L) is used."""
        gg = group_gpus(slots)
        multi_node = len({s.node for s in slots}) > 1   # the model depends on it (all-reduce)
        key = (global_batch, tuple(gg), multi_node)
        if key in self._plan_cache:
            return self._plan_cache[key]
        model = self._alloc_model(len(slots), multi_node)
        mlb = self.job.min_local_batch
        plan = self._solve_near(global_batch, gg, model)
        if plan is None:
            floor = 2 * len(gg) * mlb
            if global_batch < floor:
                log.info("B_G %d is too small for %d GPU pairs; running B_G %d", global_batch,
                         len(gg), floor)
                plan = self._solve_near(floor, gg, model)
        if plan is None:
            raise RuntimeError(f"no configuration for B_G={global_batch} on GPUs {gg} "
                               f"(min_local_batch={mlb})")
        self._plan_cache[key] = plan
        return plan

    def _solve_near(self, global_batch: int, gg: list[str], model: Any) -> Plan | None:
        """Alg. 1 per local batch size, then the best plan whose B_G* stays near B_G.

        Deviation from Alg. 1 (documented): the algorithm keeps the B_L of maximum throughput
        F = B_G*/t, but B_G* = 2 B_L round(B_G / 2 B_L) can be far from B_G when B_G is a small
        multiple of 2 B_L (B_G=64 on one pair runs as 128 with B_L=64), and a larger B_G* always
        looks faster. That silently doubles the batch and the LR. We therefore solve Alg. 1 once
        per B_L (the solver itself, restricted to that B_L) and take the fastest plan with
        |B_G* - B_G| <= (alpha/2) B_G - half an adaptation step; if no B_L is that close, the
        plan with the closest B_G* (ties: faster).
        """
        from ..planners.config_solver import num_workers_per_group

        mlb = self.job.min_local_batch
        max_bl = min(int(model.max_local_batch(g)) for g in set(gg))
        plans = []
        for bl in range(mlb, max_bl + 1, mlb):
            if num_workers_per_group(global_batch, bl) < len(gg):
                break                       # Alg. 1 line 9: larger B_L cannot work either
            p = self._solve(global_batch, gg, _LocalBatchCap(model, bl), bl)
            if p is not None:
                plans.append(p)
        if not plans:
            return None
        tol = self.job.alpha / 2 * global_batch
        near = [p for p in plans if abs(p.global_batch_size - global_batch) <= tol]
        if near:
            return max(near, key=lambda p: (p.throughput, -p.local_batch_size))
        return min(plans, key=lambda p: (abs(p.global_batch_size - global_batch), -p.throughput))

    def _rank_configs(self, plan: Plan) -> list[tuple[int, int, int]]:
        """(num_vsw, num_ga, B_L) of every rank: its pair's WorkerConfig; in SMA mode num_vsw is
        the rank's learner count (tuner) instead of the plan's."""
        if len(plan.workers) != len(self._placement.slots) // 2:
            raise ValueError(f"plan.workers must have one entry per GPU pair "
                             f"({len(self._placement.slots) // 2}), got {len(plan.workers)}")
        out = []
        for slot in self._placement.slots:
            w = plan.workers[slot.pair]
            m = self._learners[slot.rank] if self._learners is not None else w.num_vsw
            out.append((int(m), int(w.num_ga), int(plan.local_batch_size)))
        return out

    def _apply(self, configs: list[tuple[int, int, int]]) -> None:
        """Configure every actor (in place, one collective call) unless nothing changed."""
        key = tuple(configs)
        if key == self._applied:
            return
        self._call_all("configure", per_rank=list(configs))
        self._applied = key

    # ------------------------------------------------------------------ SMA learner tuning
    def _reset_learners(self, world_size: int) -> None:
        """New placement: every rank starts at ``sma_learners`` with a fresh tuner (SMA only)."""
        if self.job.sync != "sma":
            self._learners, self.learner_tuner = None, None
            return
        from ..planners.learner_tuner import GPULearnerState, LearnerTuner

        m0 = self.job.sma_learners
        self._learners = [m0] * world_size
        if not self.options.sma_autotune:
            self.learner_tuner = None
            return
        self.learner_tuner = LearnerTuner(
            tau=self.options.sma_tuner_tau, max_learners=self.options.sma_max_learners,
            relative=self.options.sma_tuner_relative,
            gpus={_tuner_key(r): GPULearnerState(learners=m0) for r in range(world_size)})

    def learner_throughput(self, rank: int, learners: int, reply: IntervalReply) -> float:
        """Alg. 2's t for ``rank`` after an interval run with ``learners`` learners: samples per
        second of wall time, emulation sleep included (a slower emulated GPU measures slower).
        Subclasses may override it (e.g. tests inject a deterministic throughput curve)."""
        return reply.samples / reply.wall_time if reply.wall_time > 0 else 0.0

    def _tune_learners(self, replies: list[IntervalReply], used: list[int]) -> None:
        """Feed each rank's throughput to the tuner; its answers are the next interval's counts."""
        tuner = self.learner_tuner
        for r, reply in enumerate(replies):
            t = float(self.learner_throughput(r, used[r], reply))
            m = tuner.observe(_tuner_key(r), t)
            if m != used[r]:
                log.info("SMA learner tuner: rank %d %d -> %d learners (%.1f samples/s)",
                         r, used[r], m, t)
            elif tuner.is_settled(_tuner_key(r)):
                log.debug("SMA learner tuner: rank %d settled at %d learners", r, m)
            self._learners[r] = m

    # ------------------------------------------------------------------ epochs
    def _run_epoch(self, state: DriverState, worker_state: dict | None, ctl: Any
                   ) -> tuple[DriverState, dict]:
        job, epoch = self.job, state.epochs_done
        t_epoch = time.perf_counter()
        replaced = self._ensure_placement(state, worker_state, epoch)
        if self.last_checkpoint is None:   # fresh run: checkpoint the initial state (epoch 0)
            worker_state = self._call_all("state_dict", ranks=[0])[0]
            self.last_checkpoint = save_checkpoint(self.run_dir, replace(
                state, adaptive=ctl.state_dict(), metrics=self.metrics), worker_state,
                keep=self.options.keep_checkpoints)
        slots = self._placement.slots
        n = len(self.dataset)
        cursor, interval, iters, samples, loss_sum, train_time = 0, 0, 0, 0, 0.0, 0.0
        while cursor < n:
            target = ctl.global_batch
            plan = self._plan(slots, target)
            t0 = time.perf_counter()
            configs = self._rank_configs(plan)
            self._apply(configs)
            layout = [m * (ga + 1) for m, ga, _ in configs]   # = layout_for(...) without SMA
            run_batch = plan.local_batch_size * sum(layout)   # B_G* that runs (SMA: tuned m)
            n_iter = min(job.adapt_interval, math.ceil((n - cursor) / run_batch))
            req = IntervalRequest(epoch=epoch, cursor=cursor, num_iterations=n_iter,
                                  local_batch=plan.local_batch_size, layout=layout,
                                  iteration=state.iteration, base_lr=job.lr,
                                  base_batch=job.initial_global_batch, lr_scaling=job.lr_scaling,
                                  warmup_iterations=job.warmup_iterations, similarity=True,
                                  lr_batch=plan.global_batch_size if self._learners else None)
            replies: list[IntervalReply] = self._call_all("run_interval", req)
            dt = time.perf_counter() - t0
            end = {r.end_cursor for r in replies}
            if len(end) != 1:
                raise RuntimeError(f"actors disagree on the epoch cursor: {sorted(end)}")
            done = sum(r.samples for r in replies)
            phi = replies[0].phi
            rec = IntervalRecord(epoch=epoch, interval=interval, iteration=state.iteration,
                                 num_iterations=replies[0].num_iterations, cursor=cursor,
                                 requested_global_batch=target,
                                 global_batch=run_batch,
                                 local_batch=plan.local_batch_size, plan=plan,
                                 loss=replies[0].loss, throughput=done / dt if dt > 0 else 0.0,
                                 phi=phi, lr=replies[0].lr, time_s=dt, samples=done,
                                 learners=[m for m, _, _ in configs] if self._learners else [],
                                 layout=list(layout))
            self.metrics.intervals.append(rec)
            if self.learner_tuner is not None and min(end) < n:
                # not at the epoch end: the ragged last iteration would look slower
                self._tune_learners(replies, rec.learners)
            for cb in self.callbacks:
                cb.on_interval(self, rec)
            ctl.update(phi if phi is not None else job.gamma)
            state.iteration += replies[0].num_iterations
            iters += replies[0].num_iterations
            samples += done
            loss_sum += replies[0].loss * replies[0].num_iterations
            train_time += dt
            cursor = end.pop()
            interval += 1
        acc = None
        if self.options.evaluate and self._val_ref is not None:
            acc = float(self._call_all("evaluate", self._val_ref, ranks=[0])[0])
        trajectory = ctl.end_epoch()
        forecast = self._forecast(ctl.completed_trajectories)
        allocation = self._choose_allocation(state.cluster, forecast) if job.autoscale \
            else full_allocation(state.cluster)
        if allocation != state.allocation:
            self._event(f"epoch {epoch}: auto-scaling {state.allocation} -> {allocation}")
        worker_state = self._call_all("state_dict", ranks=[0])[0]
        record = EpochRecord(epoch=epoch, allocation=dict(state.allocation),
                             gpu_types=[s.gpu_type for s in slots], trajectory=trajectory,
                             predicted_trajectory=list(state.forecast),
                             train_loss=loss_sum / max(1, iters), val_accuracy=acc, time_s=0.0,
                             gpu_seconds=0.0, samples=samples,
                             throughput=samples / train_time if train_time > 0 else 0.0,
                             replaced=replaced)
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

    def _forecast(self, trajectories: list[list[int]]) -> list[float]:
        """GBS forecast of the next epoch (JABAS 6.2): GPR + ESM ensemble on all trajectories."""
        from ..adaptive import GBSForecaster

        if not trajectories:
            return []
        f = GBSForecaster("ensemble", min_batch=self.job.min_global_batch,
                          max_batch=self.job.max_global_batch, random_state=self.job.seed)
        f.fit(trajectories)
        return [float(x) for x in f.predict_epoch(len(self.dataset), self.job.adapt_interval)]

    # ------------------------------------------------------------------ faults
    def _recover(self, failure: ActorFailure, ctl: Any) -> tuple[DriverState, dict]:
        """Drop the dead GPUs' pairs, reload the last checkpoint, re-choose the allocation."""
        slots = self.slots()
        cluster = None
        dropped = []
        for rank in failure.dead_ranks:
            if 0 <= rank < len(slots):
                dropped.append(slots[rank])
        self.shutdown()
        cp = self.last_checkpoint or latest_checkpoint(self.run_dir)
        if cp is None:
            raise RuntimeError(f"{failure} before the first checkpoint") from failure.cause
        state = cp.load_driver_state()
        cluster = state.cluster
        seen = set()
        for s in dropped:  # one pair per dead GPU pair (both GPUs of a pair share the node)
            if (s.node, s.pair) in seen:
                continue
            seen.add((s.node, s.pair))
            cluster = drop_pair(cluster, s.node)
            if cluster is None:
                raise RuntimeError(f"{failure}: no GPU pair left") from failure.cause
        ctl.load_state_dict(state.adaptive)
        self.metrics = state.metrics
        allocation = self._choose_allocation(cluster, state.forecast or None)
        state = replace(state, cluster=cluster, allocation=allocation)
        what = ", ".join(f"rank {s.rank} ({s.gpu_type} on {s.node})" for s in dropped) or "unknown"
        self._event(f"GPU actor failure: {what}; restarting epoch {state.epochs_done} from "
                    f"{cp.path.name} without that pair, allocation {allocation}")
        return state, cp.load_worker_state()

    def _event(self, message: str) -> None:
        log.warning(message) if "failure" in message else log.info(message)
        self.metrics.events.append(message)
        for cb in self.callbacks:
            cb.on_event(self, message)


def start_remote_driver(*args: Any, **kwargs: Any) -> Any:
    """The driver as a Ray actor (no CPU reserved): ``ray.get(handle.run.remote())`` returns the
    MetricsHistory. Arguments as for :class:`JabasDriver`; callbacks then run inside the actor."""
    import ray
    return ray.remote(num_cpus=0)(JabasDriver).remote(*args, **kwargs)


# ---------------------------------------------------------------------- adapters
def _tuner_key(rank: int) -> str:
    """The learner tuner's key of a rank (one tuned GPU)."""
    return f"rank{rank}"


class _LocalBatchCap:
    """An iteration-time model whose max B_L is capped (restricts Alg. 1 to one B_L)."""

    def __init__(self, model: Any, cap: int) -> None:
        self._model, self._cap = model, cap

    def max_local_batch(self, gpu: str) -> int:
        return min(int(self._model.max_local_batch(gpu)), self._cap)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def autoscale_allocation(cluster: ClusterSpec, model: Any, trajectory: list[float],
                         dataset_size: int, job: JobConfig) -> dict[str, int]:
    """``planners.autoscale.choose_allocation`` -> ``{node name: GPU pairs}``."""
    from ..planners.autoscale import choose_allocation

    trajectory = [max(1, int(round(b))) for b in trajectory]
    decision = choose_allocation(cluster, model, trajectory, dataset_size, job.adapt_interval,
                                 job.min_local_batch, objective=job.autoscale_objective,
                                 cost_budget=job.cost_budget)
    return normalize_allocation(cluster, decision.allocation.node_pairs)
