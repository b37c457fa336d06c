"""The GPU actor: one per GPU; hosts the IIDP worker (or the SMA worker) of its device.

One Ray call trains up to p iterations (``run_interval``) and returns the interval's loss,
timings and the gradient similarity Phi of the two GPU groups (JABAS section 6.1):

* micro-batches come from the deterministic, communication-free sampler
  (:mod:`jabasray.engine.sampler`): the driver sends (epoch, cursor, B_L, layout); the actor
  computes its own indices and reads them from the dataset it got through the Ray object store;
* on the interval's last iteration every actor keeps its local gradient (the SUM over its
  decoupled workers, before the global all-reduce) and the actors build both group sums with ONE
  collective: an all-reduce of a ``[2, P]`` tensor in which each actor fills only its group's row;
  Phi = cosine(row 0, row 1) is then the same on every actor.

CPU emulation of a GPU type (``speed`` < 1): after each step the actor sleeps
``compute_time * (1 / speed - 1)`` so that its compute takes ``compute_time / speed`` in total,
the time the scaled profile (``Profile.scaled``) predicts. The sleep comes after the engine's
step (which already contains the all-reduce), not between backward and all-reduce; since every
step synchronises all actors, a slow actor delays the next step's all-reduce by the same amount,
so the emulated iteration time is the same. Speeds >= 1 cannot be emulated (no sleep; a warning).
While sleeping an actor leaves the CPU free, which is what lets 8 emulated GPUs share 2 cores.

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
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import JobConfig
from ..serialization import JsonMixin
from .background import BackgroundHostMixin
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
    base_lr: float              # LR at base_batch
    base_batch: int             # JobConfig.initial_global_batch
    lr_scaling: str             # "linear" | "sqrt" | "none"
    warmup_iterations: int      # linear warm-up length
    similarity: bool = True     # compute Phi on the last iteration
    lr_batch: int | None = None  # B_G the LR rule follows; None: local_batch * sum(layout)


@dataclass
class IntervalReply(JsonMixin):
    """What each actor returns for one interval."""

    rank: int
    num_iterations: int
    samples: int                # samples this actor processed
    loss: float                 # mean over iterations of the global mean loss
    phi: float | None           # Phi of the two groups at the interval's last iteration
    lr: float                   # LR of the last iteration
    compute_time: float         # seconds, summed over iterations (engine StepStats)
    comm_time: float
    update_time: float
    emulation_sleep: float      # seconds slept to emulate a slower GPU
    wall_time: float            # seconds of the whole call
    end_cursor: int
    losses: list[float] = field(default_factory=list)   # per iteration


def gather(dataset: Any, indices: Any) -> tuple:
    """Rows ``indices`` of ``dataset`` as a batch: TensorDatasets are indexed directly, other
    map-style datasets go through ``default_collate`` (an empty index list gives empty tensors)."""
    import torch
    from torch.utils.data import TensorDataset, default_collate

    idx = torch.as_tensor(list(indices) if not hasattr(indices, "dtype") else indices,
                          dtype=torch.long)
    if isinstance(dataset, TensorDataset):
        return tuple(t[idx] for t in dataset.tensors)
    if len(idx) == 0:
        first = default_collate([dataset[0]])
        return tuple(t[:0] for t in first)
    return tuple(default_collate([dataset[int(i)] for i in idx]))


def emulation_sleep(compute_time: float, speed: float) -> float:
    """Seconds to sleep after ``compute_time`` of real compute to emulate ``speed`` (< 1)."""
    if speed >= 1.0 or compute_time <= 0:
        return 0.0
    return compute_time * (1.0 / speed - 1.0)


class GPUActor(BackgroundHostMixin):
    """Host of one device's worker. Create it through Ray (``ray.remote(GPUActor)``, see
    :func:`jabasray.actors.placement.place_actors`); every public method is one Ray call.

    Args:
        slot: rank, node, GPU type, speed and similarity group of this actor.
        world_size: number of actors in the placement.
        job: the job configuration (sync method, weight sync, seed ...).
        model_fn, optimizer_fn, loss_fn: user callables (``optimizer_fn(params) -> Optimizer``).
        dataset: the training dataset (passed as an object-store ref, resolved by Ray).
        device: "cpu" (emulation) or "cuda".
        emulate: sleep to emulate ``slot.speed`` on CPU.
        torch_threads: intra-op threads of this process (1: many actors on few cores).
    """

    def __init__(self, slot: Slot, world_size: int, job: JobConfig, model_fn: Callable,
                 optimizer_fn: Callable, loss_fn: Callable, dataset: Any, device: str = "cpu",
                 emulate: bool = True, torch_threads: int = 1, bucket_cap_mb: float = 25.0) -> None:
        import torch

        torch.set_num_threads(torch_threads)
        self.slot = slot
        self.world_size = world_size
        self.job = job
        self.model_fn, self.optimizer_fn, self.loss_fn = model_fn, optimizer_fn, loss_fn
        self.dataset = dataset
        self.dataset_size = len(dataset)
        from ..engine.sampler import IIDPSampler
        self._sampler = IIDPSampler(self.dataset_size, seed=job.seed)
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"  # Ray sets CUDA_VISIBLE_DEVICES
        self.device = device
        self.emulate = emulate
        self.bucket_cap_mb = bucket_cap_mb
        self.worker: Any = None
        self.group: Any = None
        if emulate and slot.speed > 1.0:
            log.warning("GPU type %s has speed %.2f > 1: a CPU cannot emulate a faster device, "
                        "running at the CPU's speed", slot.gpu_type, slot.speed)

    # ------------------------------------------------------------------ lifecycle
    def ping(self) -> dict:
        return {"rank": self.slot.rank, "pid": os.getpid(), "gpu_type": self.slot.gpu_type}

    def setup(self, rdv: Rendezvous, slot: Slot | None = None,
              bucket_plan: list[list[str]] | None = None) -> int:
        """Join the process group and (re)build the worker (same seed on every rank, so every
        rank starts from the same weights; a restored state replaces them anyway). A kept actor
        of an earlier placement is set up again with its new ``slot`` (rank and group).
        ``bucket_plan``: the plan's gradient buckets (None: size-capped by bucket_cap_mb)."""
        import torch

        if slot is not None:
            self.slot = slot
        self.world_size = rdv.world_size
        if self.worker is not None and hasattr(self.worker, "close"):
            self.worker.close()
        self.worker = None
        leave_process_group()
        self.group = None
        if rdv.world_size > 1:
            self.group = join_process_group(rdv, self.slot.rank)
        torch.manual_seed(self.job.seed)
        model = self.model_fn()
        if self.job.sync == "sma":
            from ..engine.sma import SMAWorker
            # Crossbow SMA has its own update rule (no user optimizer): lr and alpha from the job.
            self.worker = SMAWorker(model, self.loss_fn, lr=self.job.lr, device=self.device,
                                    process_group=self.group, alpha=self.job.sma_alpha)
        else:
            from ..engine.iidp import IIDPWorker
            self.worker = IIDPWorker(model, self.optimizer_fn, self.loss_fn, device=self.device,
                                     process_group=self.group, weight_sync=self.job.weight_sync,
                                     bucket_cap_mb=self.bucket_cap_mb, bucket_plan=bucket_plan)
        return self.slot.rank

    def shutdown(self) -> None:
        leave_process_group()
        self.worker = None

    # ------------------------------------------------------------------ state
    def configure(self, num_vsw: int, num_ga: int, local_batch: int, weight_sync: str | None = None) -> None:
        """Apply this GPU's part of a plan in place (collective: call on all actors at once,
        even those whose own part did not change - the global worker count is exchanged).
        ``weight_sync``: "sws"/"ows" as the plan predicted it (None: keep the engine's rule)."""
        self.worker.configure(num_vsw, num_ga, local_batch)
        if weight_sync is not None:
            self.worker.set_weight_sync(weight_sync)

    def state_dict(self) -> dict:
        """The worker's state (weights, optimizer state, configuration), on CPU."""
        return _to_cpu(self.worker.state_dict())

    def load_state_dict(self, state: dict) -> None:
        self.worker.load_state_dict(state)

    def evaluate(self, val_dataset: Any, batch_size: int = 512) -> float:
        """Top-1 accuracy of the worker's model on ``val_dataset``."""
        from torch.utils.data import TensorDataset

        from ..data import accuracy
        if not isinstance(val_dataset, TensorDataset):
            idx = list(range(len(val_dataset)))
            val_dataset = TensorDataset(*gather(val_dataset, idx))
        return accuracy(self.worker.model, val_dataset, batch_size=batch_size, device=self.device)

    # ------------------------------------------------------------------ training
    def micro_batches(self, epoch: int, cursor: int, local_batch: int, layout: list[int]
                      ) -> tuple[list, Any]:
        """This rank's micro-batches of the iteration that starts at ``cursor``: one gather and
        one device copy for all of them, then split into per-worker views."""
        import numpy as np

        it = self._sampler.iteration(epoch, cursor, local_batch, layout, rank=self.slot.rank)
        sizes = [len(idx) for idx in it.micro_batches]
        rows = gather(self.dataset, np.concatenate(it.micro_batches))
        batches = list(zip(*(t.to(self.device).split(sizes) for t in rows)))
        return batches, it

    def run_interval(self, req: IntervalRequest) -> IntervalReply:
        """Train ``req.num_iterations`` iterations from ``req.cursor``; see module docstring."""
        from ..adaptive import scaled_lr

        t_start = time.perf_counter()
        global_batch = req.lr_batch if req.lr_batch is not None else req.local_batch * sum(req.layout)
        cursor = req.cursor
        losses: list[float] = []
        compute = comm = update = slept = 0.0
        samples = 0
        phi = None
        lr = self.worker.get_lr()
        hosting = getattr(self, "_bg_runner_obj", None) is not None   # background jobs here
        if hasattr(self.worker, "comm_guard"):
            self.worker.comm_guard = self.bg_foreground_critical if hosting else None
        for k in range(req.num_iterations):
            if cursor >= self.dataset_size:
                break
            lr = scaled_lr(req.base_lr, req.base_batch, global_batch, req.lr_scaling,
                           iteration=req.iteration + k, warmup_iterations=req.warmup_iterations)
            if lr != self.worker.get_lr():
                if self.job.sync == "sma":
                    # Crossbow 3.2: restart SMA from z when the LR schedule changes (a new B_G
                    # rescales the LR); the per-iteration ramp of a warm-up is no such change.
                    warming_up = req.iteration + k < req.warmup_iterations
                    self.worker.set_lr(lr, restart=not warming_up)
                else:
                    self.worker.set_lr(lr)
            batches, it = self.micro_batches(req.epoch, cursor, req.local_batch, req.layout)
            last = k == req.num_iterations - 1 or it.epoch_end
            keep = bool(req.similarity and last and self.world_size > 1)
            with self.bg_foreground_step():      # no-op unless background jobs are hosted
                stats = self.worker.train_step(batches, keep_local_grad=keep, ragged=it.ragged)
                if self.emulate:
                    s = emulation_sleep(stats.compute_time, self.slot.speed)
                    if s > 0:
                        time.sleep(s)
                        slept += s
            losses.append(float(stats.loss))
            samples += sum(len(idx) for idx in it.micro_batches)
            compute += stats.compute_time
            comm += stats.comm_time
            update += stats.update_time
            if keep:
                phi = self._group_similarity(stats.local_grad)
            cursor = it.next_cursor
        return IntervalReply(rank=self.slot.rank, num_iterations=len(losses), samples=samples,
                             loss=sum(losses) / len(losses) if losses else math.nan, phi=phi, lr=lr,
                             compute_time=compute, comm_time=comm, update_time=update,
                             emulation_sleep=slept, wall_time=time.perf_counter() - t_start,
                             end_cursor=cursor, losses=losses)

    def _group_similarity(self, local_grad: Any) -> float:
        """ONE all-reduce of a [2, P] buffer: this rank fills row ``group``; rows end up as the
        two group sums; Phi = cosine(row 0, row 1) (identical on every rank)."""
        import torch
        import torch.distributed as dist

        from ..adaptive import cosine_similarity

        flat = local_grad.detach().reshape(-1)
        buf = torch.zeros(2, flat.numel(), dtype=flat.dtype, device=flat.device)
        buf[self.slot.group].copy_(flat)
        with self.bg_foreground_critical("allreduce"):
            dist.all_reduce(buf, group=self.group)
        return float(cosine_similarity(buf[0], buf[1]))


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
