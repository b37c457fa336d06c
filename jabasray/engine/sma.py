"""Crossbow's Synchronous Model Averaging (SMA) with many learners per device.

Implementation notes
--------------------
Paper: Crossbow (``papers/crossbow-sma-learners.txt``), section 3.2 Algorithm 1, section 3.3
(hierarchical synchronisation), section 3.2 last paragraphs (restart on a learning-rate change),
section 3.4 / 4.4 (auto-tuning the number of learners).

Algorithm 1, one iteration, k learners with replicas ``w_j``, central average model ``z``::

    g_j = lr * grad l_{B_j}(w_j)                     (line 8)
    c_j = alpha * (w_j - z)                          (line 9)
    w_j = w_j - g_j - c_j                            (line 10)
    z'  = z                                          (line 11)
    z   = z + sum_j c_j + mu * (z - z_prev)          (line 12)
    z_prev = z'                                      (line 13)

We keep the Polyak term in *velocity* form, ``v = z - z_prev``:
``v <- sum_j c_j + mu * v; z <- z + v`` which is line 12 exactly (``z_new - z = C + mu v``).
A fresh start (line 2, ``z_prev = {}``) is ``v = 0``. ``weight_decay`` adds the L2 term to the
gradient (``g_j = lr * (grad + wd * w_j)``), as ``torch.optim.SGD`` does; 0 by default.

Hierarchical synchronisation (section 3.3, Fig. 5/7). Every device keeps one *reference
model*: its copy of ``z``. Its local learners compute their corrections against it (line 9,
a read-only use of z, all learners concurrently); the device sums its corrections (intra-GPU
step), and one ``all_reduce(SUM)`` over the process group (inter-GPU step) gives ``sum_j c_j``
over all k learners, which every device applies to its reference model (line 12). All
reference models therefore stay bit-identical up to float summation order, and the result
equals the flat algorithm over all learners (tested with a 2-process gloo group). Float
buffers (e.g. BatchNorm running stats) of ``z`` are the average over all learners' buffers,
piggy-backed on the same all-reduce (one collective per iteration).

On CUDA every learner issues its learning task on its own stream; its local sync (line 9-10)
waits (event) for the previous iteration's global sync only, and the global sync (sum of
corrections, all-reduce, update of z) runs on a separate sync stream, so it overlaps the next
iteration's learning tasks (Fig. 7). To keep that overlap, ``train_step`` on CUDA only waits
for the learner streams, so ``StepStats.loss`` is this device's mean loss (``overlap_sync``;
pass ``overlap_sync=False`` for the exact global loss). On CPU the same steps run in order.

Restart on learning-rate change (section 3.2): ``set_lr(lr)`` with a value different from the
current one restarts Alg. 1 from the latest ``z``: every replica is reset to ``z`` and the
momentum history is dropped (``v = 0``). ``set_lr(lr, restart=False)`` only changes the rate
(useful for per-iteration warm-up).

Auto-tuning (section 3.4, Alg. 2): ``set_num_learners(m)`` adds/removes learners without
restarting; a new learner starts from the current ``z`` (section 4.4). ``autotune(tuner)`` feeds
the tuner this device's measured throughput and applies the learner count it returns.

Note on one learner: with k = 1 and alpha = 1 (the default alpha = 1/k), Alg. 1 as printed does
NOT reduce to momentum SGD on z: lines 8-12 give ``w_{i+1} = z_i - lr grad(w_i)`` and
``z_{i+1} = w_i + mu (z_i - z_{i-1})`` - the replica restarts from the previous centre, the
centre trails the replica by one iteration (tests check this closed form). With mu = 0 this
recursion is unstable on a quadratic (an eigenvalue below -1); the default mu = 0.9 damps it.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..validation import check_float, check_int
from .iidp import StepStats

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------------------------
# Functional form of Algorithm 1 (pure tensor arithmetic, in place).
# --------------------------------------------------------------------------------------------

def sma_learner_update_(w: torch.Tensor, grad: torch.Tensor, z: torch.Tensor, lr: float,
                        alpha: float, weight_decay: float = 0.0,
                        out_correction: torch.Tensor | None = None) -> torch.Tensor:
    """Lines 8-10 of Alg. 1 for one learner, in place on ``w``; returns ``c_j``.

    ``c_j = alpha * (w - z)`` (line 9, with the replica *before* its update) and
    ``w <- w - lr * (grad + weight_decay * w) - c_j`` (lines 8 and 10).
    ``alpha = 0`` is allowed here (independent learners); the worker validates (0, 1].
    """
    c = torch.sub(w, z, out=out_correction) if out_correction is not None else w - z
    c.mul_(alpha)
    if weight_decay:
        w.mul_(1.0 - lr * weight_decay)
    w.add_(grad, alpha=-lr).sub_(c)
    return c


def sma_center_update_(z: torch.Tensor, velocity: torch.Tensor, correction_sum: torch.Tensor,
                       momentum: float) -> None:
    """Lines 11-13 of Alg. 1, in place: ``v <- C + mu v``; ``z <- z + v`` with ``v = z - z_prev``."""
    velocity.mul_(momentum).add_(correction_sum)
    z.add_(velocity)


def sma_iteration_(replicas: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   z: torch.Tensor, velocity: torch.Tensor, lr: float, alpha: float,
                   momentum: float, weight_decay: float = 0.0) -> torch.Tensor:
    """One full iteration of Alg. 1 on flat tensors (single device); returns ``sum_j c_j``."""
    total = torch.zeros_like(z)
    for w, g in zip(replicas, grads):
        total += sma_learner_update_(w, g, z, lr, alpha, weight_decay)
    sma_center_update_(z, velocity, total, momentum)
    return total


# --------------------------------------------------------------------------------------------
# Flat parameter storage for one module.
# --------------------------------------------------------------------------------------------

class FlatModule:
    """A module whose trainable parameters (and their grads) are views of two flat tensors,
    so that Alg. 1 is a handful of vector operations per learner."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model must have at least one trainable parameter, got none")
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"model parameters must share one dtype and device, got "
                             f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}")
        numel = sum(p.numel() for p in self.params)
        p0 = self.params[0]
        self.flat = torch.empty(numel, dtype=p0.dtype, device=p0.device)
        self.grad = torch.zeros(numel, dtype=p0.dtype, device=p0.device)
        off = 0
        for p in self.params:
            n = p.numel()
            self.flat[off:off + n].copy_(p.data.reshape(-1))
            p.data = self.flat[off:off + n].view_as(p)
            p.grad = self.grad[off:off + n].view_as(p)
            off += n
        self.float_buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.buffer_numel = sum(b.numel() for b in self.float_buffers)

    def buffers_flat(self) -> torch.Tensor:
        if not self.float_buffers:
            return self.flat.new_zeros(0)
        return torch.cat([b.reshape(-1).to(self.flat.dtype) for b in self.float_buffers])

    def set_buffers_flat(self, flat: torch.Tensor) -> None:
        off = 0
        for b in self.float_buffers:
            n = b.numel()
            b.copy_(flat[off:off + n].view_as(b))
            off += n

    def copy_from(self, other: "FlatModule") -> None:
        """Make this replica equal to ``other`` (parameters, all buffers)."""
        self.flat.copy_(other.flat)
        for b, ob in zip(self.module.buffers(), other.module.buffers()):
            b.copy_(ob)


def _clone_flat(src: FlatModule) -> FlatModule:
    """A new replica initialised from ``src`` (section 4.4: new learners start from z)."""
    module = copy.deepcopy(src.module)
    fm = FlatModule(module)
    fm.copy_from(src)
    fm.grad.zero_()
    return fm


# --------------------------------------------------------------------------------------------
# Step statistics (the engine's StepStats plus SMA extras).
# --------------------------------------------------------------------------------------------

@dataclass
class SMAStepStats(StepStats):
    """Result of one SMA iteration: the IIDP engine's ``StepStats`` plus SMA extras.

    ``loss`` is the mean loss (see module notes for CUDA overlap); ``num_workers`` counts the
    micro-batches consumed on this device, m * (num_ga + 1); ``comm_time`` is the all-reduce of
    corrections, ``update_time`` the local + global synchronisation.
    """

    num_learners: int = 1                # m on this device
    total_learners: int = 1              # k over all devices
    alpha: float = 1.0                   # correction rate used


# --------------------------------------------------------------------------------------------
# The worker.
# --------------------------------------------------------------------------------------------

class SMAWorker:
    """m Crossbow learners on one device, synchronised by SMA (Alg. 1) across the process group.

    Same surface as ``IIDPWorker`` (``configure``/``train_step``/``set_lr``/``get_lr``/``model``/
    ``state_dict``) so a GPU actor can host either. ``model`` is the central average model z.

    Args:
        model: the initial model w_0 (becomes z; learners are copies of it).
        loss_fn: ``loss_fn(outputs, targets) -> scalar mean loss``.
        lr: learning rate gamma (> 0).
        momentum: Polyak momentum mu on z, in [0, 1).
        weight_decay: L2 coefficient added to each learner's gradient (>= 0).
        device: where learners and z live.
        process_group: ``torch.distributed`` group over the devices (None: this device only).
        alpha: correction rate in (0, 1]; None -> 1/k with k the total number of learners.
        overlap_sync: CUDA only - do not wait for the global sync at the end of ``train_step``.
    """

    step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None   # (module, (x, y)) -> loss; set by the GPU actor (user's step, autocast)

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 device: str | torch.device = "cpu", process_group: Any = None,
                 alpha: float | None = None, overlap_sync: bool = True,
                 comm_guard: Callable[[str], Any] | None = None) -> None:
        if comm_guard is not None and not callable(comm_guard):
            raise ValueError(f"comm_guard must be None or a callable op_name -> context manager, "
                             f"got {comm_guard!r}")
        # comm_guard("allreduce") wraps each iteration's global all-reduce (as in IIDPWorker):
        # a background runner pauses low-priority work while it is in flight (DeepPool 5).
        self.comm_guard = comm_guard
        self._lr = check_float("lr", lr, min_value=0, min_exclusive=True)
        self.momentum = check_float("momentum", momentum, min_value=0, max_value=1, max_exclusive=True)
        self.weight_decay = check_float("weight_decay", weight_decay, min_value=0)
        self._alpha_user = None if alpha is None else check_float(
            "alpha", alpha, min_value=0, max_value=1, min_exclusive=True)
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.process_group = process_group
        self.overlap_sync = bool(overlap_sync)
        self._z = FlatModule(model.to(self.device))
        self._velocity = torch.zeros_like(self._z.flat)
        self._learners: list[FlatModule] = []
        self._corrections: list[torch.Tensor] = []
        self._num_ga = 0
        self._local_batch_size = 1
        self._total_learners = 1
        self.iteration = 0
        self._lanes: Any = None
        self._z_ready: Any = None          # CUDA event: reference model updated (prev. iteration)
        self._tp_samples = 0               # throughput window for autotune
        self._tp_time = 0.0
        self._set_learners(1, collective=False)   # construction is not collective; configure is

    # ---------------------------------------------------------------- configuration
    @property
    def model(self) -> nn.Module:
        """The central average model z (this device's reference model); on CUDA it waits
        for an in-flight global sync first, so the caller never reads a half-updated z."""
        self._sync_pending()
        return self._z.module

    @property
    def num_vsw(self) -> int:
        """Learners on this device (m); named like the IIDP worker's VSW count."""
        return len(self._learners)

    num_learners = num_vsw

    @property
    def num_ga(self) -> int:
        return self._num_ga

    @property
    def local_batch_size(self) -> int:
        return self._local_batch_size

    @property
    def num_workers(self) -> int:
        """Micro-batches per iteration on this device: m * (num_ga + 1)."""
        return self.num_vsw * (self._num_ga + 1)

    @property
    def total_learners(self) -> int:
        """k: learners over all devices of the process group."""
        return self._total_learners

    @property
    def alpha(self) -> float:
        """The correction rate in use: the user's, else 1/k (section 3.2, alpha ~ 1/k)."""
        return self._alpha_user if self._alpha_user is not None else 1.0 / self._total_learners

    @property
    def weight_sync_method(self) -> str:
        return "sma"

    def configure(self, num_vsw: int, num_ga: int, local_batch_size: int) -> None:
        """Set m = ``num_vsw`` learners, ``num_ga`` accumulation steps per learner and B_L.

        Collective when a process group is set (k is summed over devices). Learners beyond the
        current count start from z; surplus learners are dropped (no restart).
        """
        check_int("num_vsw", num_vsw, min_value=1)
        check_int("num_ga", num_ga, min_value=0)
        check_int("local_batch_size", local_batch_size, min_value=1)
        self._num_ga = num_ga
        self._local_batch_size = local_batch_size
        self.set_num_learners(num_vsw)

    def set_num_learners(self, m: int) -> None:
        """Add or remove learners in place (section 4.4); collective when a group is set."""
        self._set_learners(m, collective=True)

    def _set_learners(self, m: int, collective: bool) -> None:
        check_int("num_vsw", m, min_value=1)
        self._sync_pending()
        while len(self._learners) < m:
            self._learners.append(_clone_flat(self._z))
            self._corrections.append(torch.zeros_like(self._z.flat))
        del self._learners[m:]
        del self._corrections[m:]
        self._total_learners = self._all_reduce_int(m) if collective else m
        if self._lanes is not None:
            self._lanes.resize(m)
        log.debug("SMA: %d learners here, %d in total, alpha=%.4g", m, self._total_learners, self.alpha)

    def _all_reduce_int(self, value: int) -> int:
        if self.process_group is None:
            return value
        import torch.distributed as dist
        t = torch.tensor([float(value)], device=self.device)   # gloo: CPU, NCCL: CUDA tensors
        dist.all_reduce(t, group=self.process_group)
        return int(round(float(t.item())))

    # ---------------------------------------------------------------- learning rate
    def get_lr(self) -> float:
        return self._lr

    def set_lr(self, lr: float, restart: bool = True) -> None:
        """Set gamma. A *changed* value restarts SMA from z (section 3.2): replicas <- z, v <- 0.

        ``restart=False`` changes the rate only (e.g. during a per-iteration warm-up).
        """
        lr = check_float("lr", lr, min_value=0, min_exclusive=True)
        changed = lr != self._lr
        self._lr = lr
        if changed and restart:
            self.restart()

    def restart(self) -> None:
        """Run Alg. 1 again with the latest z as w_0: every replica = z, no momentum history."""
        self._sync_pending()
        for learner in self._learners:
            learner.copy_from(self._z)
        self._velocity.zero_()
        log.info("SMA restarted from the central average model at iteration %d", self.iteration)

    # ---------------------------------------------------------------- training
    def train_step(self, micro_batches: Sequence[Batch], keep_local_grad: bool = False,
                   ragged: bool = False) -> Any:
        """One SMA iteration: learner j trains on ``micro_batches[j*(g+1):(j+1)*(g+1)]``.

        Each learner's gradient is the mean of its micro-batches' mean-loss gradients
        (``ragged=True``: weighted by sample counts; a learner without samples has g = 0 and
        only applies its correction). Returns :class:`SMAStepStats` (an engine ``StepStats``).
        """
        m, per = self.num_vsw, self._num_ga + 1
        if len(micro_batches) != m * per:
            raise ValueError(f"micro_batches must hold num_vsw*(num_ga+1) = {m * per} "
                             f"(inputs, targets) pairs, got {len(micro_batches)}")
        if self.device.type == "cuda":
            return self._train_step_cuda(micro_batches, keep_local_grad, ragged)
        t0 = time.perf_counter()
        loss_sum = 0.0
        samples = 0
        for j, learner in enumerate(self._learners):
            ls, n = self._learning_task(learner, micro_batches[j * per:(j + 1) * per], ragged)
            ls = float(ls)
            loss_sum += ls
            samples += n
        local_grad = self._local_grad() if keep_local_grad else None
        t1 = time.perf_counter()
        # Local synchronisation tasks (lines 8-10), then the intra-device sum of corrections.
        total = self._local_sync()
        t2 = time.perf_counter()
        comm = torch.cat([total, self._buffer_sum(),
                          total.new_tensor([loss_sum, float(samples), float(self.num_workers)])])
        if self.process_group is not None:
            self._all_reduce_guarded(comm)
        t3 = time.perf_counter()
        self._global_sync(comm)
        loss, global_workers = self._comm_stats(comm)
        t4 = time.perf_counter()
        return self._finish_step(t4 - t0, loss=loss, global_num_workers=global_workers,
                                 local_grad=local_grad, compute_time=t1 - t0, comm_time=t3 - t2,
                                 update_time=(t2 - t1) + (t4 - t3), num_samples=samples)

    def _finish_step(self, elapsed: float, **fields: Any) -> SMAStepStats:
        """Count the iteration (and the autotune throughput window); build its stats."""
        self.iteration += 1
        self._tp_samples += fields["num_samples"]
        self._tp_time += elapsed
        return SMAStepStats(num_workers=self.num_workers, weight_sync="sma",
                            num_learners=self.num_vsw, total_learners=self._total_learners,
                            alpha=self.alpha, **fields)

    def _learning_task(self, learner: FlatModule, batches: Sequence[Batch], ragged: bool
                       ) -> tuple[torch.Tensor, int]:
        """Forward/backward of one learner over its micro-batches; grad left in ``learner.grad``.

        The learner's gradient is the mean of its micro-batches' mean-loss gradients
        (``ragged``: weighted by sample counts). Returns (sum over samples of the loss as a 0-d
        tensor on the device, so CUDA callers need not synchronise; number of samples)."""
        learner.grad.zero_()
        sizes = [int(len(t)) for _, t in batches]
        total = sum(sizes)
        loss_acc = torch.zeros((), device=self.device)
        for (x, y), n in zip(batches, sizes):
            if n == 0:
                continue
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            loss = (self.step_fn(learner.module, (x, y)) if self.step_fn is not None
                    else self.loss_fn(learner.module(x), y))
            weight = n / total if ragged else 1.0 / len(batches)
            (loss * weight).backward()
            loss_acc += loss.detach() * n
        return loss_acc, total

    def _local_grad(self) -> torch.Tensor:
        """Sum over this device's micro-batches of their mean-loss gradients (before sync)."""
        per = self._num_ga + 1
        out = torch.zeros_like(self._z.flat)
        for learner in self._learners:
            out.add_(learner.grad, alpha=float(per))
        return out

    def _local_sync(self) -> torch.Tensor:
        z = self._z.flat
        total = torch.zeros_like(z)
        for learner, c in zip(self._learners, self._corrections):
            sma_learner_update_(learner.flat, learner.grad, z, self._lr, self.alpha,
                                self.weight_decay, out_correction=c)
            total.add_(c)
        return total

    def _buffer_sum(self) -> torch.Tensor:
        if not self._z.buffer_numel:
            return self._z.flat.new_zeros(0)
        return torch.stack([learner.buffers_flat() for learner in self._learners]).sum(0)

    def _all_reduce_guarded(self, comm: torch.Tensor) -> None:
        """SUM-all-reduce ``comm`` over the process group inside ``comm_guard("allreduce")``."""
        import torch.distributed as dist
        guard = self.comm_guard("allreduce") if self.comm_guard is not None else contextlib.nullcontext()
        with guard:
            dist.all_reduce(comm, group=self.process_group)

    def _global_sync(self, comm: torch.Tensor) -> None:
        """Apply the all-reduced corrections ``comm`` (laid out as [sum_j c_j, buffer sums,
        loss sum, samples, workers]) to z (line 12) and average the float buffers."""
        n = self._z.flat.numel()
        nb = self._z.buffer_numel
        sma_center_update_(self._z.flat, self._velocity, comm[:n], self.momentum)
        if nb:
            self._z.set_buffers_flat(comm[n:n + nb] / self._total_learners)

    def _comm_stats(self, comm: torch.Tensor) -> tuple[float, int]:
        """(global mean loss, global micro-batch count) from the tail of ``comm`` (host sync)."""
        loss_sum, samples, workers = comm[-3:].tolist()
        return (loss_sum / samples if samples else 0.0), int(round(workers))

    # ---------------------------------------------------------------- CUDA path
    def _train_step_cuda(self, micro_batches: Sequence[Batch], keep_local_grad: bool,
                         ragged: bool) -> Any:
        """Learners on their own streams; global sync on a sync stream overlapping the next
        iteration (Fig. 7). Same arithmetic as the CPU path."""
        from .streams import Lanes  # CUDA-only dependency

        if self._lanes is None:
            self._lanes = Lanes(self.device)
            self._lanes.resize(self.num_vsw)
        lanes = self._lanes
        per = self._num_ga + 1
        z = self._z.flat
        issuer = torch.cuda.current_stream(self.device)
        t0 = time.perf_counter()
        done_events = []
        losses: list[torch.Tensor] = []
        counts: list[int] = []
        has_buffers = self._z.buffer_numel > 0
        for j, learner in enumerate(self._learners):
            stream = lanes.vsw[j]
            stream.wait_stream(issuer)
            if has_buffers and self._z_ready is not None:
                # the previous global sync still reads this learner's buffers (BatchNorm stats)
                stream.wait_event(self._z_ready)
            with torch.cuda.stream(stream):
                loss_acc, total = self._learning_task(learner, micro_batches[j * per:(j + 1) * per],
                                                      ragged)
                # Local sync task: needs z of the previous global sync (read-only).
                if self._z_ready is not None:
                    stream.wait_event(self._z_ready)
                sma_learner_update_(learner.flat, learner.grad, z, self._lr, self.alpha,
                                    self.weight_decay, out_correction=self._corrections[j])
                loss_acc.record_stream(lanes.comm)   # read by the sync stream below
                losses.append(loss_acc)
                counts.append(total)
                done_events.append(lanes.record(stream))
        local_grad = None
        if keep_local_grad:
            for ev in done_events:
                issuer.wait_event(ev)
            local_grad = self._local_grad()
        t1 = time.perf_counter()
        sync = lanes.comm
        for ev in done_events:
            sync.wait_event(ev)
        with torch.cuda.stream(sync):
            total_c = torch.stack(self._corrections).sum(0)
            loss_sum = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
            samples = float(sum(counts))
            comm = torch.cat([total_c, self._buffer_sum(),
                              torch.stack([loss_sum, loss_sum.new_tensor(samples),
                                           loss_sum.new_tensor(float(self.num_workers))])])
            if self.process_group is not None:
                self._all_reduce_guarded(comm)
            self._global_sync(comm)
            self._z_ready = lanes.record(sync)
        if self.overlap_sync:
            # Wait for the learners only; the global sync keeps running on the sync stream.
            for ev in done_events:
                ev.synchronize()
            loss = float(sum(float(v) for v in losses)) / samples if samples else 0.0
            global_workers = self._total_learners * per
        else:
            self._z_ready.synchronize()
            loss, global_workers = self._comm_stats(comm)
        t2 = time.perf_counter()
        return self._finish_step(t2 - t0, loss=loss, global_num_workers=global_workers,
                                 local_grad=local_grad, compute_time=t1 - t0, comm_time=0.0,
                                 update_time=t2 - t1, num_samples=int(samples))

    def _sync_pending(self) -> None:
        """Wait for an in-flight global sync (CUDA) before touching z or the replicas."""
        if self._z_ready is not None:
            self._z_ready.synchronize()

    # ---------------------------------------------------------------- auto-tuning
    def measured_throughput(self, reset: bool = True) -> float:
        """Samples per second over the iterations since the last call (Alg. 2's t)."""
        tp = self._tp_samples / self._tp_time if self._tp_time > 0 else 0.0
        if reset:
            self._tp_samples, self._tp_time = 0, 0.0
        return tp

    def autotune(self, tuner: Any, throughput: float | None = None, gpu: str | None = None) -> int:
        """Feed the learner tuner (Crossbow Alg. 2) and apply its learner count; collective.

        ``tuner`` is a ``jabasray.planners.learner_tuner.LearnerTuner`` (anything with
        ``observe(gpu, throughput) -> learners``) or a callable ``throughput -> learners``;
        ``throughput`` defaults to this device's measured samples/s since the previous call;
        ``gpu`` is the tuner's key for this device (default: ``rank<r>`` in a process group,
        else the device name). Learners are added (from z) or removed in place, without a
        restart. Returns the new m. Call on every device every p iterations (the total k is
        exchanged, which is a collective when a process group is set).
        """
        tp = self.measured_throughput() if throughput is None else float(throughput)
        if gpu is None:
            gpu = str(self.device)
            if self.process_group is not None:
                import torch.distributed as dist
                gpu = f"rank{dist.get_rank(self.process_group)}"
        observe = getattr(tuner, "observe", None)
        if callable(observe):
            m = observe(gpu, tp)
        elif callable(tuner):
            m = tuner(tp)
        else:
            raise ValueError(f"tuner must have observe(gpu, throughput) or be callable, "
                             f"got {type(tuner).__name__}")
        m = check_int("num_vsw (from the learner tuner)", m, min_value=1)
        if m != self.num_vsw or self.process_group is not None:
            self.set_num_learners(m)     # collective: every device calls it
        return m

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """z, momentum history, all replicas, hyper-parameters and configuration."""
        self._sync_pending()
        return {
            "z": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "velocity": self._velocity.detach().clone(),
            "replicas": [{"flat": fm.flat.detach().clone(),
                          "buffers": [b.detach().clone() for b in fm.module.buffers()]}
                         for fm in self._learners],
            "lr": self._lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
            "alpha": self._alpha_user, "num_vsw": self.num_vsw, "num_ga": self._num_ga,
            "local_batch_size": self._local_batch_size, "iteration": self.iteration,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore what ``state_dict`` saved (the learner count is re-configured collectively)."""
        self._sync_pending()
        self.model.load_state_dict(sd["z"])
        self._velocity.copy_(sd["velocity"])
        self._lr = float(sd["lr"])
        self.momentum = float(sd["momentum"])
        self.weight_decay = float(sd["weight_decay"])
        self._alpha_user = sd["alpha"]
        self.configure(int(sd["num_vsw"]), int(sd["num_ga"]), int(sd["local_batch_size"]))
        for fm, rep in zip(self._learners, sd["replicas"]):
            fm.flat.copy_(rep["flat"])
            for b, sb in zip(fm.module.buffers(), rep["buffers"]):
                b.copy_(sb)
        self.iteration = int(sd["iteration"])
