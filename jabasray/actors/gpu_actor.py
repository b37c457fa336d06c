"""The GPU actor: one per GPU; hosts the IIDP worker (or the SMA worker) of its device.

One Ray call trains up to p iterations (``run_interval``) and returns the interval's loss,
timings and the gradient similarity Phi of the two GPU groups (JABAS section 6.1):

* micro-batches come from the deterministic, communication-free sampler
  (:mod:`jabasray.engine.sampler`): the driver sends (epoch, cursor, B_L, layout); the actor
  computes its own indices for the whole interval and reads them (:mod:`jabasray.engine.loader`)
  from the in-memory dataset it got through the Ray object store, or through a DataLoader over
  the dataset it built itself with the user's ``dataset_fn`` (workers, prefetch, pinned memory);
* the LR of every update is the user's optimizer's LR (as the user's LR scheduler moves it,
  stepped per iteration or per epoch here) times the batch-size rule's factor
  (``JobConfig.lr_scaling`` for the plan's B_G*, and the warm-up), applied around the
  optimizer step only (``IIDPWorker.lr_factor``), so the optimizer and scheduler states stay
  the user's;
* ``evaluate`` runs the user's ``eval_fn`` on this rank's contiguous shard of the validation
  set (rank 0's BatchNorm statistics broadcast first), the driver reduces the shards;
* on the interval's last iteration every actor keeps its local gradient (the SUM over its
  decoupled workers, before the global all-reduce) and the actors build both group sums with ONE
  collective: an all-reduce of a ``[2, P]`` tensor in which each actor fills only its group's row;
  Phi = cosine(row 0, row 1) is then the same on every actor.

Each interval's reply also says what its terms took on this actor (``IntervalReply.terms``:
steps with the emulation's sleep, loader, similarity, read), and right after a placement
``probe_costs`` times the same terms and the step at every profiled point on a throwaway
worker, for the iteration-time model (:mod:`jabasray.planners.interval_model`).

CPU emulation of a GPU type (``speed`` < 1, :mod:`jabasray.actors.emulation`): after each step
the actor sleeps so that the step takes what the emulated device would take: ``"compute"``
(``compute_time * (1 / speed - 1)``, the measured wall compute time scaled) or ``"wait"`` (the
fair rule: until ``cpu_time / speed`` after the step began, so the host's shared cores do not
slow an emulated GPU down; the excess is reported as ``emulation_overrun``). The sleep comes
after the engine's step (which already contains the all-reduce), not between backward and
all-reduce; since every step synchronises all actors, a slow actor delays the next step's
all-reduce by the same amount, so the emulated iteration time is the same. While sleeping an
actor leaves the CPU free, which is what lets 8 emulated GPUs share 2 cores.

Background learners (DeepPool section 5, :mod:`jabasray.actors.background`): when this actor
hosts background jobs (its BackgroundRunner exists), every foreground iteration - the engine
step plus the emulation sleep, i.e. the step time the emulated GPU would take - is reported
through ``bg_foreground_step`` (the slowdown feedback loop), and the all-reduces are critical
sections: the IIDP worker's ``comm_guard`` is ``bg_foreground_critical`` (entered from the first
bucket all-reduce to the last wait of each step) and the similarity all-reduce runs inside it
too. Without background jobs nothing is wrapped (``comm_guard`` is None). The SMA worker's
``comm_guard`` wraps its one all-reduce per iteration the same way.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import JobConfig
from ..engine.iidp import read_losses
from ..engine.sampler import add_digests, sample_digest
from ..engine.train_metrics import merge_metric_sums
from ..serialization import JsonMixin
from .allreduce_fit import MEASURE_REPEATS, MEASURE_WARMUP, AllReduceTimes, time_allreduces
from .background import BackgroundHostMixin
from .emulation import StepTimer, check_emulation, wait_overrun, wait_sleep
from .emulation import compute_sleep as emulation_sleep
from .placement import Slot
from .rendezvous import Rendezvous, join_process_group, leave_process_group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IntervalRequest(JsonMixin):
    """What the driver sends for one interval (identical for every actor)."""

    epoch: int                  # epoch (seeds the sampler's permutation)
    cursor: int                 # samples of this epoch consumed before the interval
    num_iterations: int         # iterations to run (p, or fewer at the end of the epoch)
    local_batch: int            # B_L
    layout: list[int]           # decoupled workers per rank (sum * B_L = B_G*)
    iteration: int              # global index of the first iteration (LR warm-up)
    base_lr: float | None       # unused: the LR at base_batch is the user's optimizer's own
    base_batch: int             # JobConfig.initial_global_batch
    lr_scaling: str             # "linear" | "sqrt" | "none"
    warmup_iterations: int      # linear warm-up length
    similarity: bool = True     # compute Phi on the last iteration
    lr_batch: int | None = None  # B_G the LR rule follows; None: local_batch * sum(layout)
    record_samples: bool = False  # also return every index served (tests, debugging)

    @classmethod
    def for_job(cls, job: JobConfig, epoch: int, iteration: int, cursor: int, dataset_size: int,
                run_batch: int, **fields: Any) -> "IntervalRequest":
        """The request of the interval at ``cursor``: p = ``job.adapt_interval`` iterations of
        ``run_batch`` samples (fewer at the epoch end, ``ceil((n - cursor) / run_batch)``), the
        job's LR rule; ``fields``: B_L, layout and the mode's own fields."""
        return cls(epoch=epoch, cursor=cursor, iteration=iteration,
                   num_iterations=min(job.adapt_interval, math.ceil((dataset_size - cursor) / run_batch)),
                   base_lr=job.lr, base_batch=job.initial_global_batch, lr_scaling=job.lr_scaling,
                   warmup_iterations=job.warmup_iterations, **fields)


@dataclass
class IntervalReply(JsonMixin):
    """What each actor returns for one interval."""

    rank: int
    num_iterations: int
    samples: int                # samples this actor processed
    loss: float                 # mean over iterations of the global mean loss
    phi: float | None           # Phi of the two groups at the interval's last iteration
    lr: float                   # LR of the last iteration (user's LR x batch-size factor)
    compute_time: float         # seconds, summed over iterations (engine StepStats)
    comm_time: float
    update_time: float
    emulation_sleep: float      # seconds slept to emulate a slower GPU
    wall_time: float            # seconds of the whole call
    end_cursor: int
    losses: list[float] = field(default_factory=list)   # per iteration
    lrs: list[float] = field(default_factory=list)      # LR of each iteration's update
    served_digest: int | None = None   # engine.sampler.sample_digest of the indices served
    served: list[int] | None = None    # the indices served (only with record_samples)
    emulation_overrun: float = 0.0     # "wait" emulation: seconds the steps took beyond cpu / speed
    sma_restarts: list[int] = field(default_factory=list)  # SMA: iterations that restarted from z
    metric_sums: dict[str, float] = field(default_factory=dict)  # step_fn metrics: sum of mean x
                                                                 # samples over the interval (float64)
    metric_counts: dict[str, int] = field(default_factory=dict)  # samples behind each sum
    terms: dict[str, float] = field(default_factory=dict)  # seconds of this call by interval term
                                 # (planners.interval_model.TERMS: steps incl. the emulation's
                                 # sleep, the ragged last step apart, loader, similarity, read)


PROBE_REPEATS = 3   # timed repetitions per term in probe_costs (an interval's p at least, for steps)


def interval_read_time(waits: list[float], num_iterations: int) -> float:
    """Seconds per iteration an interval of ``num_iterations`` iterations waits for its batches,
    from the waits of a probe's reads through one batch source: the first read (which starts
    the source) once, the median later read for the others, over ``num_iterations``."""
    import statistics

    if not waits:
        return 0.0
    later = statistics.median(waits[1:]) if len(waits) > 1 else waits[0]
    n = max(1, int(num_iterations))
    return (waits[0] + (n - 1) * later) / n


def timed(items: Any, terms: dict[str, float], key: str) -> Any:
    """Yield from ``items``, adding the seconds spent waiting for each item to ``terms[key]``
    (the loader's share of an interval: reading and splitting each iteration's batch)."""
    it = iter(items)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            terms[key] += time.perf_counter() - t0
            return
        terms[key] += time.perf_counter() - t0
        yield item


SHARE_DEVICES_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"   # Ray leaves the variable alone


def visible_index(gpu_id: str, visible: str | None) -> int:
    """The CUDA device index of the GPU Ray assigned (``gpu_id``, from ``ray.get_gpu_ids()``) in a
    process that sees ``visible`` (its ``CUDA_VISIBLE_DEVICES``; None or empty: every GPU of the
    node, index = id). ValueError (one line) when ``visible`` does not list it."""
    if not visible:
        return int(gpu_id)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if str(gpu_id) not in ids:
        raise ValueError(f"GPU {gpu_id} assigned by Ray is not in CUDA_VISIBLE_DEVICES={visible!r}")
    return ids.index(str(gpu_id))


def cuda_device(environ: Any) -> str:
    """This actor's CUDA device. Ray's default sets ``CUDA_VISIBLE_DEVICES`` to the actor's own
    GPU: ``cuda:0``. With the node's devices shared (``DriverOptions.share_node_devices``, Ray
    Train's ``share_cuda_visible_devices``: the actor sees every GPU of its node, so NCCL can
    use NVLink/peer paths between the node's ranks), the device of the GPU Ray assigned it
    (:func:`visible_index`)."""
    if environ.get(SHARE_DEVICES_ENV) != "1":
        return "cuda:0"
    import ray
    return f"cuda:{visible_index(str(ray.get_gpu_ids()[0]), environ.get('CUDA_VISIBLE_DEVICES'))}"


def gather(dataset: Any, indices: Any) -> tuple:
    """Rows ``indices`` of an in-memory dataset as a tuple batch (:func:`engine.loader.gather_rows`)."""
    from ..engine.loader import gather_rows
    return tuple(gather_rows(dataset, np.asarray(list(indices), dtype=np.int64)))


class GPUActor(BackgroundHostMixin):
    """Host of one device's worker. Create it through Ray (``ray.remote(GPUActor)``, see
    :func:`jabasray.actors.placement.place_actors`); every public method is one Ray call.

    Args:
        slot: rank, node, GPU type, speed and similarity group of this actor.
        world_size: number of actors in the placement.
        job: the job configuration (sync method, weight sync, seed ...).
        model_fn, optimizer_fn, loss_fn: user callables (``optimizer_fn(params) -> Optimizer``).
        dataset: the in-memory training dataset (passed as an object-store ref, resolved by
            Ray), or None when ``hooks.dataset_fn`` builds it here.
        device: "cpu" (emulation) or "cuda".
        emulate: sleep to emulate ``slot.speed`` on CPU.
        emulation: the sleep's rule, "compute" or "wait" (:mod:`jabasray.actors.emulation`).
        torch_threads: intra-op threads of this process (1: many actors on few cores).
        hooks: :class:`~jabasray.actors.hooks.JobHooks` (dataset_fn, step_fn, eval_fn, LR
            scheduler, DataLoader options); None: the plain supervised job.
    """

    def __init__(self, slot: Slot, world_size: int, job: JobConfig, model_fn: Callable,
                 optimizer_fn: Callable, loss_fn: Callable, dataset: Any, device: str = "cpu",
                 emulate: bool = True, torch_threads: int = 1, bucket_cap_mb: float = 25.0,
                 hooks: Any = None, emulation: str = "compute") -> None:
        import torch

        from ..engine.loader import InMemoryBatches, LoaderBatches
        from ..engine.sampler import IIDPSampler
        from .hooks import JobHooks, named, named_hooks

        torch.set_num_threads(torch_threads)
        self.hooks = named_hooks(hooks if hooks is not None else JobHooks())   # errors name the hook
        loss_fn = named("loss_fn", loss_fn)
        _configure_logging(self.hooks.log_level)
        self.slot = slot
        self.world_size = world_size
        self.job = job
        self.model_fn, self.optimizer_fn = named("model_fn", model_fn), named("optimizer_fn", optimizer_fn)
        self.loss_fn = loss_fn
        if device == "cuda":
            device = cuda_device(os.environ)
        self.device = device
        h = self.hooks
        self._dataset_error: str | None = None   # raised by setup (a one-line DatasetMismatch)
        if h.dataset_fn is not None:
            from .hooks import build_dataset, check_same_dataset
            train = build_dataset(h.dataset_fn, "dataset_fn")
            self._dataset_error = check_same_dataset(train, h.dataset_fingerprint)
            self.data = LoaderBatches(train, h.num_data_workers, h.collate_fn,
                                      pin_memory=device.startswith("cuda"),
                                      prefetch_factor=h.prefetch_factor)
        else:
            self.data = InMemoryBatches(dataset, h.collate_fn)
        self.dataset = self.data.dataset
        self.dataset_size = len(self.data)
        self._val: Any = None            # validation batch source, built on first use
        self._sampler = IIDPSampler(self.dataset_size, seed=job.seed)
        self.lr_scheduler: Any = None
        self._lr_holder: Any = None      # SMA: the user's optimizer, only as the LR's carrier
        self._bg_factor: float | None = None      # SMA: the B_G factor of the previous iteration's LR
        self._user_lr_prev: float | None = None   # SMA: the user's LR at the previous iteration
        self._sma_restarts: list[int] = []        # SMA: iterations restarted in this interval
        self.emulate = emulate
        self.emulation = check_emulation(emulation)
        self.bucket_cap_mb = bucket_cap_mb
        self.worker: Any = None
        self.group: Any = None
        if emulate and slot.speed > 1.0:
            log.warning("GPU type %s has speed %.2f > 1: a CPU cannot emulate a faster device, "
                        "running at the CPU's speed", slot.gpu_type, slot.speed)

    # ------------------------------------------------------------------ lifecycle
    def ping(self) -> dict:
        import ray
        return {"rank": self.slot.rank, "pid": os.getpid(), "gpu_type": self.slot.gpu_type,
                "node_id": ray.get_runtime_context().get_node_id()}

    def setup(self, rdv: Rendezvous, slot: Slot | None = None,
              bucket_plan: list[list[str]] | None = None) -> int:
        """Join the process group and (re)build the worker (same seed on every rank, so every
        rank starts from the same weights; a restored state replaces them anyway). A kept actor
        of an earlier placement is set up again with its new ``slot`` (rank and group).
        ``bucket_plan``: the plan's gradient buckets (None: size-capped by bucket_cap_mb)."""
        import torch

        if self._dataset_error is not None:
            from ..errors import DatasetMismatch
            raise DatasetMismatch(self._dataset_error)
        if slot is not None:
            self.slot = slot
        self.world_size = rdv.world_size
        if self.worker is not None and hasattr(self.worker, "close"):
            self.worker.close()
        self.worker = None
        leave_process_group()
        self.group = None
        if rdv.world_size > 1:
            self.group = join_process_group(rdv, self.slot.rank,
                                            self.device if self.device.startswith("cuda") else None)
        torch.manual_seed(self.job.seed)
        model = self.model_fn()
        job, h = self.job, self.hooks
        # SMA: the user's previous LR (_user_lr_prev) is kept, so that a kept actor still sees
        # a scheduler step at the epoch boundary of a re-placement
        self._bg_factor = None
        if job.parallelism == "burst":
            from .burst_host import BurstWorker     # DeepPool: per-layer GPU counts (burst_host)
            self.worker = BurstWorker(model, self.optimizer_fn, self.loss_fn, self.device, self.group,
                                      self.dataset)
            optimizer = self.worker.optimizer
        elif job.sync == "sma":
            import warnings

            from ..engine.sma import SMAWorker
            from ..engine.step import autocast, supervised_step
            # Crossbow SMA has its own update rule; the user's optimizer only carries the LR
            # (its param_groups[0]["lr"], moved by the user's scheduler); alpha from the job.
            self._lr_holder = self.optimizer_fn([p for p in model.parameters() if p.requires_grad])
            self.worker = SMAWorker(model, self.loss_fn or _unused_loss, lr=self._lr_holder.param_groups[0]["lr"],
                                    device=self.device, process_group=self.group,
                                    alpha=job.sma_alpha, sma_sync=job.sma_sync)
            step, dev, precision = h.step_fn or supervised_step(self.loss_fn), self.worker.device, job.precision

            def sma_step(module: Any, batch: Any) -> Any:
                with autocast(dev, precision):
                    return step(module, batch)
            self.worker.step_fn = sma_step
            optimizer = self._lr_holder
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
        else:
            from ..engine.iidp import IIDPWorker
            self.worker = IIDPWorker(model, self.optimizer_fn, self.loss_fn, device=self.device,
                                     process_group=self.group, weight_sync=job.weight_sync,
                                     bucket_cap_mb=self.bucket_cap_mb, step_fn=h.step_fn,
                                     precision=job.precision, grad_clip_norm=job.grad_clip_norm,
                                     bucket_plan=bucket_plan, per_sample_loss=job.per_sample_loss,
                                     cuda_graphs=job.cuda_graphs)
            optimizer = self.worker.optimizer
        self.lr_scheduler = h.lr_scheduler_fn(optimizer) if h.lr_scheduler_fn is not None else None
        return self.slot.rank

    def allreduce_times(self, sizes: list[int], warmup: int = MEASURE_WARMUP,
                        repeats: int = MEASURE_REPEATS) -> AllReduceTimes:
        """The all-reduce micro-benchmark (:func:`.allreduce_fit.time_allreduces`) on the job's
        process group, background jobs paused meanwhile. Collective: every rank calls it with
        the same arguments. Returns this rank's median seconds per size; the collective's time
        is the slowest rank's (:func:`.allreduce_fit.collective_times`)."""
        import ray
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError(f"rank {self.slot.rank}: no process group (world size "
                               f"{self.world_size}) to time all-reduces on")
        with self.bg_foreground_critical("allreduce"):
            times = time_allreduces(sizes, self.device, self.group, warmup, repeats)
        return AllReduceTimes(rank=self.slot.rank, node_id=ray.get_runtime_context().get_node_id(),
                              backend=str(dist.get_backend(self.group)), times=times)

    def shutdown(self) -> None:
        leave_process_group()
        self.worker = None
        self.data.close()
        if self._val is not None:
            self._val.close()

    # ------------------------------------------------------------------ state
    def configure(self, num_vsw: int, num_ga: int, local_batch: int, weight_sync: str | None = None) -> None:
        """Apply this GPU's part of a plan in place (collective: call on all actors at once,
        even those whose own part did not change - the global worker count is exchanged).
        ``weight_sync``: "sws"/"ows" as the plan predicted it (None: keep the engine's rule)."""
        self.worker.configure(num_vsw, num_ga, local_batch)
        if weight_sync is not None:
            self.worker.set_weight_sync(weight_sync)

    def configure_burst(self, plan: dict, global_batch: int) -> None:
        """Burst mode: run the ``BurstPlan`` (as a dict) for B_G = ``global_batch`` (collective)."""
        from ..planners.burst import BurstPlan
        self.worker.configure(BurstPlan.from_dict(plan), global_batch)

    def state_dict(self) -> dict:
        """The worker's state (weights, optimizer state, configuration; burst mode: collective,
        call it on every actor) plus the user's LR
        scheduler (``"lr_scheduler"``) and, in SMA mode, the LR-carrying optimizer
        (``"lr_optimizer"``), on CPU."""
        state = dict(self.worker.state_dict())
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self._lr_holder is not None:
            state["lr_optimizer"] = self._lr_holder.state_dict()
        return _to_cpu(state)

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        sched, holder = state.pop("lr_scheduler", None), state.pop("lr_optimizer", None)
        self.worker.load_state_dict(state)
        if holder is not None and self._lr_holder is not None:
            self._lr_holder.load_state_dict(holder)
        if sched is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(sched)

    def evaluate(self, val_dataset: Any = None, batch_size: int | None = None
                 ) -> tuple[dict[str, float], int]:
        """(metrics, samples) of the user's ``eval_fn`` (default: loss and top-1 accuracy) on
        this rank's shard ``[r N / W, (r + 1) N / W)`` of the validation set: ``val_dataset``
        (in memory) or the one ``hooks.val_dataset_fn`` builds here. Collective when W > 1
        (rank 0's buffers, e.g. BatchNorm statistics, are broadcast first, so every shard is
        evaluated with the checkpointed model)."""
        from ..engine.evaluation import default_eval_fn, evaluate_shard
        from ..engine.loader import InMemoryBatches, LoaderBatches

        h = self.hooks
        if self._val is None or (val_dataset is not None and self._val.dataset is not val_dataset):
            if h.val_dataset_fn is not None:
                from .hooks import build_dataset
                val = build_dataset(h.val_dataset_fn, "val_dataset_fn")
                self._val = LoaderBatches(val, h.num_data_workers, h.collate_fn,
                                          pin_memory=self.device.startswith("cuda"),
                                          prefetch_factor=h.prefetch_factor)
            elif val_dataset is not None:
                self._val = InMemoryBatches(val_dataset, h.collate_fn)
            else:
                raise ValueError("evaluate needs a val_dataset or hooks.val_dataset_fn")
        self._broadcast_buffers()
        n, r, w = len(self._val), self.slot.rank, self.world_size
        shard = np.arange(r * n // w, (r + 1) * n // w)
        bs = batch_size or h.eval_batch_size
        chunks = [shard[i:i + bs] for i in range(0, len(shard), bs)]
        eval_fn = h.eval_fn or default_eval_fn(self.loss_fn)
        model = self.worker.model
        return evaluate_shard(model, self._val.batches(chunks), eval_fn,
                              next(model.parameters()).device, self.job.precision,
                              hook="eval_fn" if h.eval_fn is not None else "the default eval_fn")

    def _broadcast_buffers(self) -> None:
        """Rank 0's module buffers (BatchNorm statistics) to every rank (collective)."""
        import torch.distributed as dist

        if self.group is None or self.world_size <= 1:
            return
        for b in self.worker.model.buffers():
            if b.is_floating_point():
                dist.broadcast(b.data, src=0, group=self.group)

    # ------------------------------------------------------------------ training
    def micro_batches(self, epoch: int, cursor: int, local_batch: int, layout: list[int]
                      ) -> tuple[list, Any]:
        """This rank's micro-batches of the iteration that starts at ``cursor``."""
        return next(self.interval_batches(epoch, cursor, 1, local_batch, layout))

    def interval_batches(self, epoch: int, cursor: int, num_iterations: int, local_batch: int,
                         layout: list[int]):
        """``(micro_batches, IterationIndices)`` of up to ``num_iterations`` iterations from
        ``cursor`` (stopping at the epoch end): the sampler plans the whole interval, the data
        source reads one batch per iteration (concatenated micro-batch indices; a DataLoader
        prefetches them), each batch goes to the device once and is split per worker."""
        import torch

        from ..engine.loader import split_batch, to_device

        its = []
        for _ in range(num_iterations):
            if cursor >= self.dataset_size:
                break
            it = self._sampler.iteration(epoch, cursor, local_batch, layout, rank=self.slot.rank)
            its.append(it)
            cursor = it.next_cursor
        device = torch.device(self.device)
        for it, batch in zip(its, self.data.batches([np.concatenate(it.micro_batches) for it in its])):
            sizes = [len(idx) for idx in it.micro_batches]
            yield split_batch(to_device(batch, device), sizes), it

    def run_interval(self, req: IntervalRequest) -> IntervalReply:
        """Train ``req.num_iterations`` iterations from ``req.cursor``; see module docstring."""
        if self.job.parallelism == "burst":
            return self.worker.run_interval(req, self)
        t_start = time.perf_counter()
        global_batch = req.lr_batch if req.lr_batch is not None else req.local_batch * sum(req.layout)
        cursor = req.cursor
        losses: list = []                      # floats or 0-d device tensors until the end
        lrs: list[float] = []
        compute = comm = update = slept = overrun = 0.0
        samples = 0
        digest = 0
        msums: dict = {}                       # step_fn metrics (device tensors, float64)
        mcounts: dict[str, int] = {}
        served: list[int] | None = [] if req.record_samples else None
        phi = None
        lr = self._effective_lr()
        self._sma_restarts = []
        hosting = getattr(self, "_bg_runner_obj", None) is not None   # background jobs here
        if hasattr(self.worker, "comm_guard"):
            self.worker.comm_guard = self.bg_foreground_critical if hosting else None
        terms = dict.fromkeys(("steps", "ragged", "loader", "similarity", "read"), 0.0)
        batches_iter = timed(self.interval_batches(req.epoch, cursor, req.num_iterations,
                                                   req.local_batch, req.layout), terms, "loader")
        for k, (batches, it) in enumerate(batches_iter):
            lr = self._apply_lr(req, global_batch, req.iteration + k)
            lrs.append(lr)
            last = k == req.num_iterations - 1 or it.epoch_end
            keep = bool(req.similarity and last and (self.world_size > 1 or self.slot.solo))
            with self.bg_foreground_step():      # no-op unless background jobs are hosted
                with StepTimer(getattr(self.worker, "helper_cpu_s", None)) as timer:
                    stats = self.worker.train_step(batches, ragged=it.ragged,
                                                   keep_local_grad="split" if keep and self.slot.solo else keep)
                s, over = self._emulate(timer, stats)
                slept += s
                overrun += over
                terms["ragged" if it.ragged else "steps"] += timer.wall + s
            losses.append(stats.loss_raw if hasattr(stats, "loss_raw") else stats.loss)
            merge_metric_sums(msums, mcounts, getattr(stats, "metric_sums", {}),
                              getattr(stats, "metric_counts", {}))
            read = np.concatenate(it.micro_batches)      # what this iteration trained on
            samples += len(read)
            digest = add_digests(digest, sample_digest(read))
            if served is not None:
                served.extend(read.tolist())
            compute += stats.compute_time
            comm += stats.comm_time
            update += stats.update_time
            if keep:
                t_sim = time.perf_counter()
                phi = self._group_similarity(stats.local_grad)
                terms["similarity"] += time.perf_counter() - t_sim
            cursor = it.next_cursor
            self._step_scheduler(epoch_end=it.epoch_end)
        wall = time.perf_counter() - t_start
        if overrun > 0.1 * wall:
            log.warning("rank %d (%s, speed %.3g): the host's cores fell behind the \"wait\" "
                        "emulation by %.2fs of %.2fs this interval (sum of the placed speeds > "
                        "host cores?)", self.slot.rank, self.slot.gpu_type, self.slot.speed,
                        overrun, wall)
        t_read = time.perf_counter()
        losses = read_losses(losses)           # one device read per interval, not per step
        terms["read"] = time.perf_counter() - t_read
        return IntervalReply(rank=self.slot.rank, num_iterations=len(losses), samples=samples,
                             loss=sum(losses) / len(losses) if losses else math.nan, phi=phi, lr=lr,
                             compute_time=compute, comm_time=comm, update_time=update,
                             emulation_sleep=slept, wall_time=wall, emulation_overrun=overrun,
                             end_cursor=cursor, losses=losses, lrs=lrs, served_digest=digest,
                             served=served, sma_restarts=list(self._sma_restarts),
                             metric_sums={k: float(v) for k, v in msums.items()},  # one read per interval
                             metric_counts=mcounts, terms=terms)

    def _emulate(self, timer: StepTimer, stats: Any) -> tuple[float, float]:
        """The emulation's sleep after a step timed by ``timer`` (:mod:`.emulation`): ``(slept
        seconds, "wait" overrun seconds)``; (0, 0) on a real GPU."""
        if not self.emulate:
            return 0.0, 0.0
        if self.emulation == "wait":
            s = wait_sleep(timer.cpu, timer.wall, self.slot.speed)
            over = wait_overrun(timer.cpu, stats.compute_time, self.slot.speed)
        else:
            s, over = emulation_sleep(stats.compute_time, self.slot.speed), 0.0
        if s > 0:
            time.sleep(s)
        return s, over

    def _own_step_time(self, timer: StepTimer, slept: float) -> float:
        """This GPU's own iteration time for a step: under the "wait" emulation the rule's
        target ``cpu / speed`` (its wall time also holds the wait for slower peers in the
        all-reduce), else wall + sleep."""
        if self.emulate and self.emulation == "wait" and self.slot.speed < 1.0:
            return max(timer.cpu, 0.0) / self.slot.speed
        return timer.wall + slept

    def probe_costs(self, points: list[tuple[int, int, int]], num_iterations: int,
                    repeats: int = PROBE_REPEATS) -> dict:
        """Collective (every rank, same arguments): time this actor's host terms of an interval
        (:mod:`jabasray.planners.interval_model`) and, for each ``(B_L, n_vsw, n_GA)`` of ``points``,
        its own iteration time as training runs it (:meth:`_own_step_time`, ``repeats`` steps
        after one untimed step), on a throwaway worker over the job's process group, so the
        job's model, optimizer, data order and LR are untouched. ``points`` is empty where no
        step is probed (real GPUs, SMA, burst). Returns a dict: ``rank``, ``gpu_type``,
        ``work_s`` (this call's own seconds), ``loader`` ([samples, seconds] of reading one
        iteration's batch: at each point, between its steps as in an interval, else alone),
        ``similarity_s`` (after a step where steps are probed, as in an interval), ``read_s``,
        ``configure_s``, ``steps`` (per point, ``[own seconds, pace seconds]`` of each timed
        step, :meth:`_probe_steps`) and ``ragged`` (``[VSWs, size, pace seconds, own seconds]`` of each
        probed ragged step, :meth:`_probe_ragged`)."""
        import torch

        t_call = time.perf_counter()
        out: dict = {"rank": self.slot.rank, "gpu_type": self.slot.gpu_type, "loader": [],
                     "steps": [], "ragged": [], "similarity_s": 0.0, "read_s": 0.0, "configure_s": 0.0}
        device = torch.device(self.device)
        n_iter = max(1, int(num_iterations))
        model = getattr(self.worker, "model", None)
        numel = sum(p.numel() for p in (model if model is not None else self.model_fn()).parameters()
                    if p.requires_grad)
        grad = torch.ones((2, numel) if self.slot.solo else numel, device=device)
        self._group_similarity(grad)                # untimed: connections warm
        t0 = time.perf_counter()
        for _ in range(repeats):
            self._group_similarity(grad)
        out["similarity_s"] = (time.perf_counter() - t0) / repeats
        scalars = [torch.zeros((), device=device) for _ in range(n_iter)]
        t0 = time.perf_counter()
        read_losses(scalars)
        out["read_s"] = time.perf_counter() - t0
        if points:
            out["steps"], out["loader"], out["configure_s"], out["similarity_s"], out["ragged"] = \
                self._probe_steps(points, repeats, n_iter, device, grad)
        else:                                       # the loader alone, at the smallest batch
            waits = [w for w, _ in self._probe_reads(self.job.min_local_batch, 1, n_iter, device)]
            out["loader"] = [[self.job.min_local_batch, interval_read_time(waits, n_iter)]]
        out["work_s"] = time.perf_counter() - t_call
        return out

    def _probe_reads(self, local_batch: int, num_vsw: int, count: int, device: Any,
                     sizes: list[int] | None = None) -> Any:
        """Yield ``(seconds waited, micro-batches)`` for ``count`` probe iterations of
        ``num_vsw`` micro-batches of ``local_batch`` samples (or of ``sizes``), read as an
        interval reads them (:meth:`interval_batches`: the sampler's plan, one batch source for
        the whole interval, so a DataLoader's workers prefetch the later batches while the
        caller steps; each batch moved and split); the wait for each is timed."""
        from ..engine.loader import split_batch, to_device

        sizes = list(sizes) if sizes is not None else [local_batch] * num_vsw
        size = sum(sizes)
        t0 = time.perf_counter()
        for _ in range(count):   # the sampler's share (its indices unused: a probe reads its own)
            self._sampler.iteration(0, 0, local_batch, [num_vsw] * self.world_size, rank=self.slot.rank)
        index_lists = [np.arange(k * size, (k + 1) * size, dtype=np.int64) % self.dataset_size
                       for k in range(count)]
        source = iter(self.data.batches(index_lists))
        for _ in range(count):
            batch = split_batch(to_device(next(source), device), sizes)
            yield time.perf_counter() - t0, batch
            t0 = time.perf_counter()

    def _probe_steps(self, points: list[tuple[int, int, int]], repeats: int, num_iterations: int,
                     device: Any, grad: Any
                     ) -> tuple[list[list[list[float]]], list[list[float]], float, float, list[list[float]]]:
        """:meth:`probe_costs`' steps: a throwaway IIDP worker (the job's engine options, the
        job's process group) configured at each point in turn, one untimed iteration, then
        at least ``repeats`` timed ones (an interval's ``num_iterations`` at least), each as an
        interval runs it: read the batch (:meth:`_probe_reads`, timed: the loader), step, the
        emulation's sleep; at the first point each timed step is followed by
        a timed similarity collective, as an interval's last step is (its wait for the ranks
        still sleeping included). Then the ragged steps (:meth:`_probe_ragged`) and, once the
        ranks are level again (a barrier: a configure is a call of its own), configured back to
        the first point, timed. Returns (own iteration time of each timed step per point,
        [samples, loader seconds] per point, the configure's seconds, the similarity's median
        seconds, the ragged steps); a step's times are its own
        (:meth:`_own_step_time`) and its pace (wall + sleep: the own time or the wait for a
        slower rank, as an interval measures its steps)."""
        import statistics

        import torch
        import torch.distributed as dist

        from ..engine.iidp import IIDPWorker

        torch.manual_seed(self.job.seed)
        probe = IIDPWorker(self.model_fn(), self.optimizer_fn, self.loss_fn, device=self.device,
                           process_group=self.group, weight_sync=self.job.weight_sync,
                           bucket_cap_mb=self.bucket_cap_mb, step_fn=self.hooks.step_fn,
                           precision=self.job.precision, grad_clip_norm=self.job.grad_clip_norm,
                           per_sample_loss=self.job.per_sample_loss, cuda_graphs=self.job.cuda_graphs)
        steps, loader, similarity = [], [], []
        try:
            for i, (bl, n, ga) in enumerate(points):
                probe.configure(n, ga, bl)
                times, paces, reads = [], [], []
                count = max(1 + repeats, num_iterations)
                for r, (wait, batches) in enumerate(self._probe_reads(bl, n * (ga + 1), count, device)):
                    reads.append(wait)
                    with StepTimer(probe.helper_cpu_s) as timer:
                        stats = probe.train_step(batches)
                    slept, _ = self._emulate(timer, stats)
                    if r:
                        times.append(self._own_step_time(timer, slept))
                        paces.append(timer.wall + slept)
                        if i == 0:
                            t0 = time.perf_counter()
                            self._group_similarity(grad)
                            similarity.append(time.perf_counter() - t0)
                steps.append([times, paces])
                loader.append([bl * n * (ga + 1), interval_read_time(reads, num_iterations)])
            ragged = self._probe_ragged(probe, points, device)
            if self.group is not None:
                dist.barrier(group=self.group)
            t0 = time.perf_counter()
            probe.configure(points[0][1], 0, points[0][0])
            configure_s = time.perf_counter() - t0
        finally:
            if hasattr(probe, "close"):
                probe.close()
        return steps, loader, configure_s, statistics.median(similarity), ragged

    def _probe_ragged(self, probe: Any, points: list[tuple[int, int, int]], device: Any) -> list[list[float]]:
        """:meth:`_probe_steps`' ragged steps (collective: every rank runs the same ones): at
        the first profiled B_L with one VSW and with its most VSWs, each configured and one
        untimed full step run first (an epoch's ragged step follows full ones), then three
        ragged steps as an epoch's last iteration runs them (``ragged=True``: per VSW, the
        emulation's sleep), each at its own micro-batch size below that B_L and not profiled
        (an epoch's remainder is a new input shape); ``[VSWs, size, pace seconds, own seconds]``
        per step (the own time as :meth:`_own_step_time` has it)
        ([] when the first B_L leaves no such size)."""
        first = points[0][0]
        counts = sorted({n for bl, n, ga in points if bl == first and not ga})
        counts = [counts[0], counts[-1]] if len(counts) > 1 else counts
        profiled = {bl for bl, _, _ in points}
        sizes = [s for s in range(first - 1, 0, -1) if s not in profiled]
        out: list[list[float]] = []
        for k, n in enumerate(counts):
            mine = sizes[3 * k:3 * (k + 1)]
            if not mine:
                break
            probe.configure(n, 0, first)
            _, batches = next(self._probe_reads(first, n, 1, device))
            probe.train_step(batches)
            for size in mine:
                _, batches = next(self._probe_reads(first, n, 1, device, sizes=[size] * n))
                with StepTimer(probe.helper_cpu_s) as timer:
                    stats = probe.train_step(batches, ragged=True)
                slept, _ = self._emulate(timer, stats)
                out.append([n, size, timer.wall + slept, self._own_step_time(timer, slept)])
        return out

    # ------------------------------------------------------------------ learning rate
    def _user_lr(self) -> float:
        """The user's LR now: their optimizer's first param group (as their scheduler set it)."""
        opt = self._lr_holder if self._lr_holder is not None else self.worker.optimizer
        return float(opt.param_groups[0]["lr"])

    def _effective_lr(self) -> float:
        if self._lr_holder is not None:
            return self.worker.get_lr()
        return self.worker.effective_lr()

    def _apply_lr(self, req: IntervalRequest, global_batch: int, iteration: int) -> float:
        """Set this iteration's LR = user's LR x ``lr_factor`` (B_G rule and warm-up)."""
        from ..adaptive import lr_factor

        f = lr_factor(req.base_batch, global_batch, req.lr_scaling, iteration=iteration,
                      warmup_iterations=req.warmup_iterations)
        if self._lr_holder is None:
            self.worker.lr_factor = f
            return self.worker.effective_lr()
        # SMA: when to restart from z is JobConfig.sma_restart (engine.sma.sma_restart_due,
        # Crossbow section 3.2 restarts on step-wise LR schedule changes; sections 3.4/4.4
        # change the learner count, hence the batch, without restarting).
        from ..engine.sma import sma_restart_due

        bg = lr_factor(req.base_batch, global_batch, req.lr_scaling)
        user = self._user_lr()
        lr = user * f
        restart = sma_restart_due(
            self.job.sma_restart, user_lr_prev=self._user_lr_prev, user_lr=user,
            stepwise_schedule=self.lr_scheduler is not None and self.hooks.lr_scheduler_interval == "epoch",
            batch_factor_prev=self._bg_factor, batch_factor=bg,
            warmup_done=iteration >= req.warmup_iterations)
        self.worker.set_lr(lr, restart=False)
        if restart:
            self.worker.restart()
            self._sma_restarts.append(iteration)
        self._bg_factor = bg
        self._user_lr_prev = user
        return lr

    def _step_scheduler(self, epoch_end: bool) -> None:
        """The user's scheduler: ``step()`` after every iteration, or after the epoch's last
        one (``hooks.lr_scheduler_interval``)."""
        if self.lr_scheduler is None:
            return
        if self.hooks.lr_scheduler_interval == "iteration" or epoch_end:
            self.lr_scheduler.step()

    def _group_similarity(self, local_grad: Any) -> float:
        """ONE all-reduce of a [2, P] buffer: this rank fills row ``group`` (a solo GPU, which
        forms both groups by its two VSW halves, fills both rows from its ``[2, P]`` local
        gradient); rows end up as the two group sums; Phi = cosine(row 0, row 1) (identical on
        every rank)."""
        import torch
        import torch.distributed as dist

        from ..adaptive import cosine_similarity

        if local_grad.dim() == 2:
            buf = local_grad.detach().clone()
        else:
            flat = local_grad.detach().reshape(-1)
            buf = torch.zeros(2, flat.numel(), dtype=flat.dtype, device=flat.device)
            buf[self.slot.group].copy_(flat)
        if self.group is not None:
            with self.bg_foreground_critical("allreduce"):
                dist.all_reduce(buf, group=self.group)
        return float(cosine_similarity(buf[0], buf[1]))


def _unused_loss(outputs: Any, targets: Any) -> Any:
    raise RuntimeError("loss_fn is not used when a step_fn is given")


def _configure_logging(level: str) -> None:
    """This actor process's ``jabasray`` log level (its lines reach the driver's console
    through Ray's ``log_to_driver``)."""
    logger = logging.getLogger("jabasray")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
