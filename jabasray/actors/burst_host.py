"""Burst-parallel mode of a job (``JobConfig.parallelism == "burst"``, DeepPool): the driver's
plans per B_G and the GPU actor's host of :class:`jabasray.engine.burst.BurstExecutor`.

Driver side (:class:`BurstPlans`): the model's layer graph is profiled once per B_G in the
driver's process (``profiler.layer_graph.build_layer_graph``, per-GPU batch B_G / g for the
power-of-two counts up to G), planned with the job's ``amp_limit`` and cached per (B_G, G)
(``planners.burst.BurstPlanCache``).  The network model is ``DEFAULT_NETWORK`` unless given;
the plans' predicted iteration times are calibrated from the measured intervals (one factor,
:class:`BurstIntervals`), and every interval records both predictions (``burst_record``).
:class:`BurstIntervals` runs one interval for the driver: the plan for the current B_G on all
placed GPUs (sent with ``configure_burst`` only when B_G changed or the actors were re-placed),
p iterations, and the interval's record (with :func:`burst_record`). :func:`check_burst_job`
rejects what burst mode does not run before any actor starts.

Actor side (:class:`BurstWorker`, the actor's ``worker`` in burst mode): one executor per B_G
(process subgroups are made once per plan); switching plans first consolidates weights and
optimizer state on every rank (a rank may run layers it did not run before).  An interval walks
the epoch's permutation like IIDP's sampler (iteration k takes the next B_G entries, the last
iteration of an epoch the remainder): each rank reads the inputs of its input-layer rows and the
targets of its output-layer rows, so every sample is read once per epoch (the rows whose inputs
a rank read are the samples it reports served: their digest, and the indices themselves with
``DriverOptions.record_samples``, as in IIDP mode).  ``state_dict`` is
collective (every rank must call it) and leaves every rank with the full model.

Training metrics: burst mode runs the default supervised step (the layers are split over
ranks, a user's ``step_fn`` cannot run), so its metrics come from ``loss_fn(outputs, targets)``
returning ``(loss, {name: mean})`` on each output-layer shard, summed by row counts into the
reply (``engine.train_metrics``, the rule of every mode).

Deviations: the auto-scaler is not applied (it models IIDP iterations; DeepPool runs a fixed G),
CPU emulation of slower GPU types is off (no sleep), and Phi (adaptive batching) is the
two-group similarity over the parameters of the layers that run on 2 or more ranks (a layer on
one rank has no second group).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

from ..config import JobConfig
from ..planners.burst import BurstPlan, BurstPlanCache, NetworkModel, candidate_gpu_counts
from ..engine.sampler import add_digests, sample_digest
from ..engine.train_metrics import merge_metric_sums
from .metrics import IntervalRecord, interval_record

log = logging.getLogger(__name__)

# Per-GPU bandwidth and latency assumed when none is given: 1 GB/s and 100 us, the order of
# gloo on one host's loopback measured by benchmarks/burst_exec.py (see RESULTS.md).
DEFAULT_NETWORK = NetworkModel(bandwidth=1e9, latency=1e-4)


class BurstPlans:
    """Driver side: the burst plan for (B_G, G), profiled and planned once each."""

    def __init__(self, model_fn: Callable, dataset: Any, amp_limit: float, device: str = "cpu",
                 network: NetworkModel | None = None, repeats: int = 3) -> None:
        self.model_fn, self.dataset = model_fn, dataset
        self.amp_limit = amp_limit
        self.device = device
        self.network = network or DEFAULT_NETWORK
        self.repeats = repeats
        self._caches: dict[int, BurstPlanCache] = {}

    def plan(self, global_batch: int, total_gpus: int) -> BurstPlan:
        cache = self._caches.get(total_gpus)
        if cache is None:
            cache = self._caches[total_gpus] = BurstPlanCache(
                lambda b: self._graph(b, total_gpus), self.network, total_gpus, self.amp_limit)
        return cache.plan(global_batch)

    def _graph(self, global_batch: int, total_gpus: int) -> Any:
        import torch

        from ..profiler.layer_graph import build_layer_graph
        from .gpu_actor import gather

        torch.manual_seed(0)
        example = example_inputs(self.dataset, gather)
        counts = [g for g in candidate_gpu_counts(total_gpus) if g <= global_batch]
        t0 = time.perf_counter()
        graph = build_layer_graph(self.model_fn(), example, global_batch, counts, self.repeats,
                                  device=self.device)
        log.info("burst: profiled %d layers at B_G %d for G %d in %.1f s", len(graph.layers),
                 global_batch, total_gpus, time.perf_counter() - t0)
        return graph


def burst_record(plan: BurstPlan, measured_iteration_s: float, factor: float = 1.0) -> dict:
    """What metrics.json records of an interval in burst mode: the plan's per-layer GPU counts,
    the planner's (uncalibrated) predicted iteration time, the calibration ``factor`` in force
    before the interval and the calibrated prediction (``factor`` x the planner's), the measured
    time, and the relative errors (measured / predicted - 1) of both predictions."""
    predicted = plan.iteration_time
    calibrated = predicted * factor
    return {"gpu_counts": plan.gpu_counts, "amplification_limit": plan.amplification_limit,
            "parallel_blocks": [b.branch + "->" + b.join for b in plan.blocks if any(b.parallel)],
            "predicted_iteration_s": predicted, "measured_iteration_s": measured_iteration_s,
            "error": measured_iteration_s / predicted - 1.0 if predicted > 0 else None,
            "calibration_factor": factor, "calibrated_iteration_s": calibrated,
            "calibrated_error": measured_iteration_s / calibrated - 1.0 if calibrated > 0 else None}


BURST_KEY = "burst"   # the one entry of the burst calibration (all GPUs of the plan share it)


class BurstIntervals:
    """Driver side of a burst interval (module notes); ``placed()`` after every (re-)placement."""

    def __init__(self, plans: BurstPlans, smoothing: float = 0.5) -> None:
        from ..planners.correction import OnlineCorrection

        self.plans = plans
        self.applied: int | None = None        # B_G whose plan the placed actors run
        # Calibration of the planner's model from measurements (as the IIDP model's online
        # correction, planners.correction): one factor for the whole plan, the log-EWMA of
        # measured / predicted per-iteration time over the intervals so far; an interval's
        # predicted time is the planner's times the factor BEFORE the interval (so the error
        # reported is out of sample). A uniform factor changes no plan (every layer's cost and
        # the amplification limit scale alike), only what is predicted.
        self.calibration = OnlineCorrection(smoothing=smoothing)

    @classmethod
    def for_job(cls, job: JobConfig, model_fn: Callable, dataset: Any, hooks: Any, device: str
                ) -> "BurstIntervals | None":
        """The burst intervals of a ``parallelism="burst"`` job (checked first,
        :func:`check_burst_job`), else None."""
        if job.parallelism != "burst":
            return None
        check_burst_job(dataset, hooks, job)
        return cls(BurstPlans(model_fn, dataset, job.amp_limit, device))

    def placed(self) -> None:
        """New actors run no burst plan yet."""
        self.applied = None

    def run(self, job: JobConfig, dataset_size: int, epoch: int, iteration: int, interval: int,
            cursor: int, target: int, pool: Any, train: Callable, record_samples: bool = False
            ) -> tuple[IntervalRecord, int]:
        """The plan for B_G = ``target`` on ``pool``'s GPUs, p iterations from ``cursor``
        (``train(request) -> (replies, end cursor)``; ``record_samples``: the replies list the
        indices served). Returns the record and the end cursor."""
        from .gpu_actor import IntervalRequest

        plan = self.plans.plan(target, len(pool.slots))
        if self.applied != target:
            pool.call_all("configure_burst", plan.to_dict(), target)
            self.applied = target
        factor = self.calibration.factor(BURST_KEY)
        t0 = time.perf_counter()
        req = IntervalRequest.for_job(job, epoch, iteration, cursor, dataset_size, target,
                                      local_batch=target, layout=[1], similarity=job.adaptive,
                                      record_samples=record_samples)
        replies, end = train(req)
        dt = time.perf_counter() - t0
        iterations = replies[0].num_iterations
        # measured per iteration as the epoch line counts it: the driver's interval time
        measured = dt / max(1, iterations)
        rec = interval_record(replies, dt, epoch=epoch, interval=interval, iteration=iteration,
                              cursor=cursor, requested_global_batch=target, global_batch=target,
                              local_batch=0, plan=None, burst=burst_record(plan, measured, factor),
                              predicted_time_s=plan.iteration_time * factor * iterations)
        if iterations > 0:
            self.calibration.observe([BURST_KEY], plan.iteration_time * factor, measured)
        return rec, end


def check_burst_job(dataset: Any, hooks: Any, job: JobConfig) -> None:
    """Burst mode runs the planner's layer graph with the default supervised step on an
    in-memory dataset (the executor shards (inputs, targets) rows per layer); anything else
    fails here, before any actor starts."""
    unsupported = [name for name in ("dataset_fn", "step_fn", "lr_scheduler_fn")
                   if hooks is not None and getattr(hooks, name) is not None]
    if dataset is None and "dataset_fn" not in unsupported:
        unsupported.append("dataset_fn")
    if job.precision != "fp32":
        unsupported.append(f"precision={job.precision!r}")
    if job.grad_clip_norm is not None:
        unsupported.append("grad_clip_norm")
    if unsupported:
        raise ValueError(f"parallelism='burst' supports an in-memory dataset=, the default "
                         f"supervised step, fp32 and no clipping; got {', '.join(unsupported)}")


def example_inputs(dataset: Any, gather: Callable) -> Any:
    """The inputs of the dataset's first two samples (tracing and checks)."""
    return gather(dataset, list(range(min(2, len(dataset)))))[0]


class BurstWorker:
    """Actor side: burst-parallel training of this rank (hosted by ``GPUActor.worker``)."""

    def __init__(self, model: Any, optimizer_fn: Callable, loss_fn: Callable, device: str,
                 process_group: Any, dataset: Any) -> None:
        from .gpu_actor import gather

        self.model = model.to(device)
        self.optimizer = optimizer_fn(list(self.model.parameters()))
        self.base_lr = float(self.optimizer.param_groups[0]["lr"])   # the LR at B_G^init
        self.loss_fn = loss_fn
        self.device = device
        self.group = process_group
        self.example = example_inputs(dataset, gather)
        self.executors: dict[int, Any] = {}
        self.current: Any = None
        self.current_batch: int | None = None
        self._perm: tuple[int, Any] | None = None

    # ------------------------------------------------------------------ plans
    def configure(self, plan: BurstPlan, global_batch: int) -> None:
        """Run ``plan`` for B_G = ``global_batch`` from now on (collective on a change)."""
        from ..engine.burst import BurstExecutor

        if global_batch == self.current_batch:
            return
        if self.current is not None:
            self._load(self.current.consolidated_state())
        ex = self.executors.get(global_batch)
        if ex is None:
            ex = self.executors[global_batch] = BurstExecutor(
                self.model, plan, self.example.to(self.device), global_batch, self.loss_fn,
                self.optimizer, process_group=self.group)
        self.current, self.current_batch = ex, global_batch

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Weights and optimizer state of the whole model (collective in a placement)."""
        if self.current is None:
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        state = self.current.consolidated_state()
        self._load(state)
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._load(state)

    def _load(self, state: dict) -> None:
        own = self.model.state_dict()
        own.update({k: v for k, v in state["model"].items() if k in own})
        self.model.load_state_dict(own)
        self.optimizer.load_state_dict(state["optimizer"])

    def get_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def close(self) -> None:
        self.executors.clear()
        self.current = None

    # ------------------------------------------------------------------ training
    def run_interval(self, req: Any, actor: Any) -> Any:
        """``req.num_iterations`` iterations of B_G = ``req.local_batch`` from ``req.cursor``
        (burst requests carry B_G in ``local_batch``); returns the actor's IntervalReply."""
        from ..adaptive import lr_factor
        from .gpu_actor import IntervalReply, gather

        if self.current is None or self.current_batch != req.local_batch:
            raise RuntimeError(f"configure_burst for B_G {req.local_batch} must come before run_interval")
        t_start = time.perf_counter()
        ex, n_total, batch = self.current, actor.dataset_size, req.local_batch
        if self._perm is None or self._perm[0] != req.epoch:
            self._perm = (req.epoch, actor._sampler.permutation(req.epoch))
        perm = self._perm[1]
        hosting = getattr(actor, "_bg_runner_obj", None)
        ex.background = hosting
        cursor, losses, samples, phi, digest = req.cursor, [], 0, None, 0
        served: list[int] | None = [] if req.record_samples else None
        msums: dict = {}                       # loss_fn's training metrics (engine.train_metrics)
        mcounts: dict[str, int] = {}
        compute = comm = 0.0
        lr = self.get_lr()
        for k in range(req.num_iterations):
            if cursor >= n_total:
                break
            # the user's optimizer LR is the LR at B_G^init; the batch-size rule multiplies it
            lr = self.base_lr * lr_factor(req.base_batch, batch, req.lr_scaling,
                                          iteration=req.iteration + k,
                                          warmup_iterations=req.warmup_iterations)
            self.set_lr(lr)
            n = min(batch, n_total - cursor)
            idx = perm[cursor:cursor + n]
            (a, b), (c, d) = ex.shards(batch=n)
            x = gather(actor.dataset, idx[a:b])[0] if b > a else None
            y = gather(actor.dataset, idx[c:d])[1] if d > c else None
            last = k == req.num_iterations - 1 or cursor + n >= n_total
            keep = bool(req.similarity and last and actor.world_size > 1)
            st = ex.train_step(x, y, batch=n, keep_local_grad=keep)
            losses.append(st.loss)
            merge_metric_sums(msums, mcounts, st.metric_sums, st.metric_counts)
            samples += b - a
            digest = add_digests(digest, sample_digest(idx[a:b]))
            if served is not None:
                served.extend(idx[a:b].tolist())
            compute += st.compute_s
            comm += st.wait_s + st.allreduce_s
            if keep and st.local_grad is not None and st.local_grad.numel() > 0:
                phi = actor._group_similarity(st.local_grad)
            cursor += n
        ex.background = None
        return IntervalReply(rank=actor.slot.rank, num_iterations=len(losses), samples=samples,
                             loss=sum(losses) / len(losses) if losses else math.nan, phi=phi, lr=lr,
                             compute_time=compute, comm_time=comm, update_time=0.0,
                             emulation_sleep=0.0, wall_time=time.perf_counter() - t_start,
                             end_cursor=cursor, losses=losses, served_digest=digest, served=served,
                             metric_sums={k: float(v) for k, v in msums.items()},  # one read per interval
                             metric_counts=mcounts)
