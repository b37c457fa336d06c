"""Crossbow's Synchronous Model Averaging (SMA) with many learners per device.

Implementation notes
--------------------
Paper: Crossbow (Crossbow: Scaling Deep Learning with Small Batch Sizes on Multi-GPU Servers), section 3.2 Algorithm 1, section 3.3
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

Synchronisation across devices (``sma_sync``), two algorithms:

* ``"flat"`` - Alg. 1 over all k learners of all devices. Every device keeps a copy of the
  central model z; its learners correct against it (line 9); the device sums its corrections
  and one ``all_reduce(SUM)`` gives ``sum_j c_j`` over all k learners, applied by every device
  to its copy of z (line 12). The copies stay identical up to float summation order, and the
  result equals Alg. 1 over k learners in one process (tested with a 2-process gloo group).
  alpha = 1/k. (Crossbow's released code synchronises this way: one base model per GPU, the
  replicas' differences summed per GPU and accumulated across GPUs.)

* ``"hierarchical"`` - the two levels of section 3.3 / Fig. 5. GPU g keeps a *local reference
  model* r_g beside its copy of z. Intra-GPU level: its m_g learners correct against r_g
  (lines 8-10 with r_g in place of z; alpha_l = 1/m_g), and r_g incorporates their differences.
  Inter-GPU level: "the SMA algorithm is executed ... all reference models (one per GPU) are
  the replicas w_j in Alg. 1" - Alg. 1 over the G reference models, where the move of r_g
  caused by its learners plays the role of the replica's learning step (alpha_g = 1/G)::

      c_gj = alpha_l (w_gj - r_g);   w_gj <- w_gj - lr grad l(w_gj) - c_gj      (local 8-10)
      r_g^ = r_g + sum_j c_gj                               (r_g incorporates the differences)
      C_g  = alpha_g (r_g^ - z);     r_g  <- r_g^ - C_g                         (global 9-10)
      z    <- z + sum_g C_g + mu (z - z_prev)                                  (global 11-13)

  Order (our reading, explicit): the global correction reads r_g *after* its local step, as
  Fig. 7's data dependency has it (a global synchronisation task starts once the local ones it
  depends on are done). Reading the iteration-start r_g instead (line 9's literal position
  relative to the replica's own step) makes the recursion unstable: on a quadratic with
  identical learners the iteration matrix has spectral radius 1.5 (m = 1, G = 2) and 1.2
  (m = 2) even without gradients and without momentum; with this order it is 1 (consensus)
  and < 1 with gradients. The paper says one reference model "is used as" z; we keep z as
  its own copy on every device (identical everywhere, like the flat variant) so that no rank
  is special and a re-placement cannot lose it. With one learner per GPU the replica restarts
  from r_g every iteration (the one-learner closed form of Alg. 1, see the note at the end).
  Float buffers (BatchNorm running stats): r_g's are the mean of its learners', z's the mean of
  the reference models' (piggy-backed on the same all-reduce).

On CUDA every learner issues its learning task on its own stream; its local sync (line 9-10)
waits (event) for the previous iteration's global sync only, and the global sync (sum of
corrections, all-reduce, update of z) runs on a separate sync stream, so it overlaps the next
iteration's learning tasks (Fig. 7). To keep that overlap, ``train_step`` on CUDA only waits
for the learner streams, so ``StepStats.loss`` is this device's mean loss (``overlap_sync``;
pass ``overlap_sync=False`` for the exact global loss). On CPU the same steps run in order.

Communication critical section (``comm_guard``, DeepPool section 5: background work pauses
while the foreground communicates): the guard must cover the collective's *execution*, not
only its launch. On CUDA a NCCL all-reduce returns once it is enqueued, so with a guard the
worker first waits (host) until the collective's inputs are ready, enters the guard, launches
the all-reduce (``async_op=True``), makes the sync stream wait for the work and blocks the host
on an event recorded after it, then leaves the guard. Without a guard nothing blocks (the
overlap above is kept). On CPU (gloo) ``work.wait()`` returns when the reduction is done.

Per-rank state and re-placement: every rank's ``state_dict`` holds its own learners'
replicas, its reference model (hierarchical) and the shared z and momentum; a checkpoint keeps
one per rank. :func:`redistribute_sma_states` maps them onto a new number of GPUs: learners
keep their identity - global learner id = position in rank order, the same numbering the
sampler uses for decoupled workers, so a learner keeps its data shard - and move to the rank
that now holds their id; reference models stay with their rank index; anything new starts
from z (section 4.4).

Restart on learning-rate change (section 3.2): ``set_lr(lr)`` with a value different from the
current one restarts Alg. 1 from the latest ``z``: every replica is reset to ``z`` and the
momentum history is dropped (``v = 0``). ``set_lr(lr, restart=False)`` only changes the rate
(useful for per-iteration warm-up).

When to restart under adaptive batching (:func:`sma_restart_due`, ``JobConfig.sma_restart``).
Section 3.2 restarts SMA when the LR is *reduced step-wise* (its example: ResNet-50's two
reductions at epochs 30 and 60), because the averaged model oscillates after such a step; it
also says gamma "can be realised by updating gamma directly in each iteration", i.e. a
changing LR by itself does not call for a restart. Crossbow has no adaptive batch size: the
global batch is the learners' count times b, and section 3.4 / 4.4 add and remove learners
(changing that batch) *without* restarting, new learners starting from z. Rules:

* ``"schedule"`` (default): restart when the user's LR scheduler, stepped per epoch
  (``JobHooks.lr_scheduler_interval == "epoch"``), changes the user's LR - the step-wise
  schedule change of section 3.2. A change of B_G (adaptive batching) only rescales gamma by the
  batch-size rule (replicas, reference models and the momentum history are kept), as a change of
  the learner count does in section 4.4; warm-up ramps and per-iteration schedules update gamma
  in each iteration without restarting.
* ``"batch"``: also restart at every change of the batch-size factor of gamma after the warm-up
  (each B_G change under ``lr_scaling`` "linear"/"sqrt"): treats adaptive batching's LR moves
  as schedule changes. With the defaults (``adapt_interval=10``) that is a restart about every
  10 iterations, which discards the momentum history each time.
* ``"never"``: no restart (the "SMA (No restart)" variant of section 5.5).

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

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..config import SMA_RESTART_RULES, SMA_SYNC_MODES
from ..validation import check_choice, check_float, check_int
from .iidp import StepStats
from .step import split_step_output
from .train_metrics import add_step_metrics, merge_metric_sums

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


def sma_restart_due(rule: str, *, user_lr_prev: float | None, user_lr: float,
                    stepwise_schedule: bool, batch_factor_prev: float | None,
                    batch_factor: float, warmup_done: bool) -> bool:
    """Whether SMA restarts before this iteration (module notes, "When to restart").

    ``user_lr_prev``/``user_lr``: the user's LR (their optimizer's, as their scheduler set it)
    at the previous and this iteration (None: first iteration of this worker);
    ``stepwise_schedule``: the user's scheduler is stepped per epoch; ``batch_factor_prev`` /
    ``batch_factor``: the batch-size rule's factor of gamma (without warm-up) then and now;
    ``warmup_done``: this iteration is past the warm-up.

    * "schedule": ``stepwise_schedule and user_lr != user_lr_prev``;
    * "batch": the "schedule" condition, or ``warmup_done and batch_factor != batch_factor_prev``;
    * "never": False.
    """
    check_choice("sma_restart", rule, SMA_RESTART_RULES)
    if rule == "never":
        return False
    schedule_step = stepwise_schedule and user_lr_prev is not None and user_lr != user_lr_prev
    if rule == "schedule":
        return schedule_step
    batch_step = warmup_done and batch_factor_prev is not None and batch_factor != batch_factor_prev
    return schedule_step or batch_step


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


def sma_hierarchical_iteration_(replicas: Sequence[Sequence[torch.Tensor]],
                                grads: Sequence[Sequence[torch.Tensor]],
                                refs: Sequence[torch.Tensor], z: torch.Tensor,
                                velocity: torch.Tensor, lr: float,
                                alpha_local: float | Sequence[float], alpha_global: float,
                                momentum: float, weight_decay: float = 0.0) -> torch.Tensor:
    """One iteration of the two-level scheme (module notes) over G devices in one process.

    ``replicas[g][j]``/``grads[g][j]`` are learner j of device g, ``refs[g]`` its reference
    model r_g; ``alpha_local`` is one rate or one per device. Returns ``sum_g C_g``.
    """
    if len(replicas) != len(refs) or len(grads) != len(refs):
        raise ValueError(f"replicas, grads and refs must list one entry per device, got "
                         f"{len(replicas)}, {len(grads)} and {len(refs)}")
    rates = ([float(alpha_local)] * len(refs) if isinstance(alpha_local, (int, float))
             else [float(a) for a in alpha_local])
    global_corrections = []
    for ws, gs, r, a in zip(replicas, grads, refs, rates):
        local = torch.zeros_like(r)
        for w, g in zip(ws, gs):                                            # local lines 8-10
            local += sma_learner_update_(w, g, r, lr, a, weight_decay)
        r.add_(local)                                          # r_g incorporates the differences
        c_g = ref_correction(r, z, alpha_global)                            # global line 9
        r.sub_(c_g)                                                         # global line 10
        global_corrections.append(c_g)
    total = torch.stack(global_corrections).sum(0)
    sma_center_update_(z, velocity, total, momentum)                       # global lines 11-13
    return total


def ref_correction(ref: torch.Tensor, z: torch.Tensor, alpha_global: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``C_g = alpha_global * (r_g - z)``: line 9 of Alg. 1 at the inter-GPU level."""
    c = torch.sub(ref, z, out=out) if out is not None else ref - z
    return c.mul_(alpha_global)


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
    alpha: float = 1.0                   # correction rate of the learners (flat: 1/k, hierarchical: 1/m)


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
        alpha: correction rate in (0, 1] of every level; None -> 1/(learners averaged at that
            level): flat 1/k; hierarchical 1/m on the device and 1/G across devices.
        overlap_sync: CUDA only - do not wait for the global sync at the end of ``train_step``.
        comm_guard: ``comm_guard("allreduce") -> context manager`` held around each iteration's
            all-reduce, from its launch to its completion (module notes); None: no guard.
        sma_sync: ``"flat"`` or ``"hierarchical"`` (module notes).
    """

    step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None   # (module, (x, y)) -> loss; set by the GPU actor (user's step, autocast)

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 device: str | torch.device = "cpu", process_group: Any = None,
                 alpha: float | None = None, overlap_sync: bool = True,
                 comm_guard: Callable[[str], Any] | None = None, sma_sync: str = "flat") -> None:
        if comm_guard is not None and not callable(comm_guard):
            raise ValueError(f"comm_guard must be None or a callable op_name -> context manager, "
                             f"got {comm_guard!r}")
        # comm_guard("allreduce") wraps each iteration's global all-reduce (as in IIDPWorker):
        # a background runner pauses low-priority work while it is in flight (DeepPool 5).
        self.comm_guard = comm_guard
        self.sma_sync = check_choice("sma_sync", sma_sync, SMA_SYNC_MODES)
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
        self._world_size, self._rank = 1, 0
        if process_group is not None:
            import torch.distributed as dist
            self._world_size = dist.get_world_size(process_group)
            self._rank = dist.get_rank(process_group)
        self._z = FlatModule(model.to(self.device))
        self._velocity = torch.zeros_like(self._z.flat)
        # hierarchical: this device's reference model r_g and its global correction C_g
        self._ref = _clone_flat(self._z) if self.sma_sync == "hierarchical" else None
        self._ref_correction = torch.zeros_like(self._z.flat) if self._ref is not None else None
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
        """The central average model z (this device's copy); on CUDA it waits for an in-flight
        global sync first, so the caller never reads a half-updated z."""
        self._sync_pending()
        return self._z.module

    @property
    def reference_model(self) -> nn.Module | None:
        """This device's local reference model r_g (hierarchical), else None."""
        self._sync_pending()
        return self._ref.module if self._ref is not None else None

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
        """The learners' correction rate: the user's, else 1/k (flat; section 3.2, alpha ~ 1/k)
        or 1/m (hierarchical: the learners average against this device's reference model)."""
        if self._alpha_user is not None:
            return self._alpha_user
        return 1.0 / (self.num_vsw if self._ref is not None else self._total_learners)

    @property
    def alpha_global(self) -> float:
        """Hierarchical: the reference models' correction rate (the user's alpha, else 1/G)."""
        return self._alpha_user if self._alpha_user is not None else 1.0 / self._world_size

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
        log.debug("SMA (%s): %d learners here, %d in total, alpha=%.4g", self.sma_sync, m,
                  self._total_learners, self.alpha)

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
        """Run Alg. 1 again with the latest z as w_0: every replica (and reference model) = z,
        no momentum history."""
        self._sync_pending()
        for fm in self._learners + ([self._ref] if self._ref is not None else []):
            fm.copy_from(self._z)
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
        msums: dict = {}
        mcounts: dict[str, int] = {}
        for j, learner in enumerate(self._learners):
            ls, n = self._learning_task(learner, micro_batches[j * per:(j + 1) * per], ragged,
                                        (msums, mcounts))
            ls = float(ls)
            loss_sum += ls
            samples += n
        local_grad = self._local_grad() if keep_local_grad else None
        t1 = time.perf_counter()
        # Local synchronisation tasks (lines 8-10), then what goes to the other devices.
        outgoing = self._local_sync()
        t2 = time.perf_counter()
        comm = torch.cat([outgoing, self._outgoing_buffers(),
                          outgoing.new_tensor([loss_sum, float(samples), float(self.num_workers)])])
        if self.process_group is not None:
            self._all_reduce_guarded(comm)
        t3 = time.perf_counter()
        self._global_sync(comm)
        loss, global_workers = self._comm_stats(comm)
        t4 = time.perf_counter()
        return self._finish_step(t4 - t0, loss=loss, global_num_workers=global_workers,
                                 local_grad=local_grad, compute_time=t1 - t0, comm_time=t3 - t2,
                                 update_time=(t2 - t1) + (t4 - t3), num_samples=samples,
                                 metric_sums=msums, metric_counts=mcounts)

    def _finish_step(self, elapsed: float, **fields: Any) -> SMAStepStats:
        """Count the iteration (and the autotune throughput window); build its stats."""
        self.iteration += 1
        self._tp_samples += fields["num_samples"]
        self._tp_time += elapsed
        return SMAStepStats(num_workers=self.num_workers, weight_sync="sma",
                            num_learners=self.num_vsw, total_learners=self._total_learners,
                            alpha=self.alpha, **fields)

    def _learning_task(self, learner: FlatModule, batches: Sequence[Batch], ragged: bool,
                       metrics: tuple[dict, dict] | None = None) -> tuple[torch.Tensor, int]:
        """Forward/backward of one learner over its micro-batches; grad left in ``learner.grad``.

        The learner's gradient is the mean of its micro-batches' mean-loss gradients
        (``ragged``: weighted by sample counts). A step returning ``(loss, {name: mean})`` adds
        its training metrics to ``metrics`` = (sums, counts) by sample counts
        (:mod:`.train_metrics`; device tensors, no synchronisation). Returns (sum over samples
        of the loss as a 0-d tensor on the device, so CUDA callers need not synchronise; number
        of samples)."""
        learner.grad.zero_()
        sizes = [int(len(t)) for _, t in batches]
        total = sum(sizes)
        loss_acc = torch.zeros((), device=self.device)
        for (x, y), n in zip(batches, sizes):
            if n == 0:
                continue
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            loss, step_metrics = split_step_output(
                self.step_fn(learner.module, (x, y)) if self.step_fn is not None
                else self.loss_fn(learner.module(x), y))
            if step_metrics and metrics is not None:
                add_step_metrics(metrics[0], metrics[1], step_metrics, n, self.device)
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

    def _center(self) -> torch.Tensor:
        """What the learners correct against: r_g (hierarchical) or z (flat)."""
        return self._ref.flat if self._ref is not None else self._z.flat

    def _learner_update(self, j: int) -> None:
        """Lines 8-10 for learner j against :meth:`_center`; c_j lands in ``_corrections[j]``."""
        learner = self._learners[j]
        sma_learner_update_(learner.flat, learner.grad, self._center(), self._lr, self.alpha,
                            self.weight_decay, out_correction=self._corrections[j])

    def _local_sync(self) -> torch.Tensor:
        """Every learner's update (lines 8-10); returns what this device sends to the others:
        flat: ``sum_j c_j``; hierarchical: ``C_g`` (r_g is updated here, module notes)."""
        for j in range(self.num_vsw):
            self._learner_update(j)
        return self._finish_local_sync()

    def _finish_local_sync(self) -> torch.Tensor:
        total = torch.stack(self._corrections).sum(0)
        if self._ref is None:
            return total
        ref = self._ref.flat
        ref.add_(total)                                   # r_g incorporates its learners' differences
        ref_correction(ref, self._z.flat, self.alpha_global, out=self._ref_correction)  # global 9
        ref.sub_(self._ref_correction)                                                 # global 10
        return self._ref_correction

    def _learner_buffer_sum(self) -> torch.Tensor:
        if not self._z.buffer_numel:
            return self._z.flat.new_zeros(0)
        return torch.stack([learner.buffers_flat() for learner in self._learners]).sum(0)

    def _outgoing_buffers(self) -> torch.Tensor:
        """Float buffers sent for z's average: the learners' sum (flat), or r_g's buffers set to
        the mean of its learners' (hierarchical)."""
        total = self._learner_buffer_sum()
        if self._ref is None or not total.numel():
            return total
        self._ref.set_buffers_flat(total / self.num_vsw)
        return self._ref.buffers_flat()

    def _all_reduce_guarded(self, comm: torch.Tensor, stream: Any = None) -> None:
        """SUM-all-reduce ``comm`` over the process group; with a ``comm_guard`` the guard is
        held from the launch to the collective's completion (module notes). ``stream``: the
        CUDA stream ``comm`` was produced on (the current one, on CUDA)."""
        import torch.distributed as dist
        if self.comm_guard is None:
            dist.all_reduce(comm, group=self.process_group)
            return
        if stream is not None:
            # the section starts at the launch: first let the inputs finish (host wait)
            stream.synchronize()
        with self.comm_guard("allreduce"):
            work = dist.all_reduce(comm, group=self.process_group, async_op=True)
            work.wait()            # gloo: done; NCCL: ``stream`` now waits for the collective
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
                done.synchronize()   # the collective has executed, not only been launched

    def _global_sync(self, comm: torch.Tensor) -> None:
        """Apply the all-reduced ``comm`` (laid out as [sum of corrections, buffer sums, loss
        sum, samples, workers]) to z (line 12) and average the float buffers."""
        n = self._z.flat.numel()
        nb = self._z.buffer_numel
        sma_center_update_(self._z.flat, self._velocity, comm[:n], self.momentum)
        if nb:
            divisor = self._world_size if self._ref is not None else self._total_learners
            self._z.set_buffers_flat(comm[n:n + nb] / divisor)

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
        issuer = torch.cuda.current_stream(self.device)
        t0 = time.perf_counter()
        done_events = []
        losses: list[torch.Tensor] = []
        counts: list[int] = []
        has_buffers = self._z.buffer_numel > 0
        sync = lanes.comm
        per_learner = [({}, {}) for _ in self._learners]   # training metrics: one (sums, counts)
                                                           # per learner stream, merged when done
        for j, learner in enumerate(self._learners):
            stream = lanes.vsw[j]
            stream.wait_stream(issuer)
            if has_buffers and self._z_ready is not None:
                # the previous global sync still reads this learner's buffers (BatchNorm stats)
                stream.wait_event(self._z_ready)
            with torch.cuda.stream(stream):
                loss_acc, total = self._learning_task(learner, micro_batches[j * per:(j + 1) * per],
                                                      ragged, per_learner[j])
                # Local sync task: needs z / r_g of the previous global sync (read-only).
                if self._z_ready is not None:
                    stream.wait_event(self._z_ready)
                self._learner_update(j)
                loss_acc.record_stream(sync)   # read by the sync stream below
                losses.append(loss_acc)
                counts.append(total)
                done_events.append(lanes.record(stream))
        local_grad = None
        if keep_local_grad:
            for ev in done_events:
                issuer.wait_event(ev)
            local_grad = self._local_grad()
        t1 = time.perf_counter()
        for ev in done_events:
            sync.wait_event(ev)
        with torch.cuda.stream(sync):
            outgoing = self._finish_local_sync()
            loss_sum = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
            samples = float(sum(counts))
            comm = torch.cat([outgoing, self._outgoing_buffers(),
                              torch.stack([loss_sum, loss_sum.new_tensor(samples),
                                           loss_sum.new_tensor(float(self.num_workers))])])
            if self.process_group is not None:
                self._all_reduce_guarded(comm, stream=sync)
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
        msums: dict = {}
        mcounts: dict[str, int] = {}
        for sums, counts in per_learner:       # every learner stream is done (synchronised above)
            merge_metric_sums(msums, mcounts, sums, counts)
        return self._finish_step(t2 - t0, loss=loss, global_num_workers=global_workers,
                                 local_grad=local_grad, compute_time=t1 - t0, comm_time=0.0,
                                 update_time=t2 - t1, num_samples=int(samples),
                                 metric_sums=msums, metric_counts=mcounts)

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
        """This rank's SMA state: z and its momentum history (the same on every rank), this
        rank's learners' replicas, its reference model (hierarchical, else None), the
        hyper-parameters and configuration. A checkpoint keeps one per rank
        (:func:`redistribute_sma_states` maps them onto another number of ranks)."""
        self._sync_pending()
        return {
            "z": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "velocity": self._velocity.detach().clone(),
            "replicas": [_flat_state(fm) for fm in self._learners],
            "ref": _flat_state(self._ref) if self._ref is not None else None,
            "sma_sync": self.sma_sync, "rank": self._rank, "world_size": self._world_size,
            "lr": self._lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
            "alpha": self._alpha_user, "num_vsw": self.num_vsw, "num_ga": self._num_ga,
            "local_batch_size": self._local_batch_size, "iteration": self.iteration,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore what ``state_dict`` saved (collective: the learner count is re-configured).

        Learners beyond the saved replicas start from z, as does a missing reference model
        (section 4.4; e.g. a rank added by :func:`redistribute_sma_states`)."""
        self._sync_pending()
        self.model.load_state_dict(sd["z"])
        self._velocity.copy_(sd["velocity"])
        self._lr = float(sd["lr"])
        self.momentum = float(sd["momentum"])
        self.weight_decay = float(sd["weight_decay"])
        self._alpha_user = sd["alpha"]
        replicas = list(sd["replicas"])
        if len(replicas) > int(sd["num_vsw"]):
            raise ValueError(f"state holds {len(replicas)} learner replicas for num_vsw = "
                             f"{sd['num_vsw']}; redistribute_sma_states maps states to ranks")
        # drop every learner first, so that those not restored below start from the new z
        self._learners.clear()
        self._corrections.clear()
        self.configure(int(sd["num_vsw"]), int(sd["num_ga"]), int(sd["local_batch_size"]))
        for fm, rep in zip(self._learners, replicas):
            _load_flat_state(fm, rep)
        if self._ref is not None:
            if sd.get("ref") is not None:
                _load_flat_state(self._ref, sd["ref"])
            else:
                self._ref.copy_from(self._z)
        self.iteration = int(sd["iteration"])


def _flat_state(fm: FlatModule) -> dict:
    return {"flat": fm.flat.detach().clone(), "buffers": [b.detach().clone() for b in fm.module.buffers()]}


def _load_flat_state(fm: FlatModule, state: dict) -> None:
    fm.flat.copy_(state["flat"])
    for b, sb in zip(fm.module.buffers(), state["buffers"]):
        b.copy_(sb)


def redistribute_sma_states(states: Sequence[dict], learners_per_rank: Sequence[int]) -> list[dict]:
    """Map the per-rank SMA states of one placement onto ``len(learners_per_rank)`` ranks.

    The rule (pure, deterministic; the identity when the counts are unchanged):

    * learners keep their identity: global learner id = position in rank order (rank 0's
      learners first), the numbering the sampler gives decoupled workers, so a learner keeps
      its place in the global micro-batch order (its data shard). New rank r gets the ids
      ``sum(learners_per_rank[:r]) ..`` + ``learners_per_rank[r]``; ids beyond the old total
      start from z (section 4.4), ids beyond the new total are dropped;
    * reference models (hierarchical) stay with their rank index; a new rank starts from z;
    * z, its momentum history, the learning rate and the iteration count are shared state, the
      same on every rank: taken from rank 0.

    ``states`` are :meth:`SMAWorker.state_dict` results in rank order; returns one state per
    new rank, to be loaded with :meth:`SMAWorker.load_state_dict` (which fills the learners
    and reference models not given from z).
    """
    if not states:
        raise ValueError("states must hold at least one rank's SMA state, got none")
    counts = [check_int(f"learners_per_rank[{r}]", m, min_value=1)
              for r, m in enumerate(learners_per_rank)]
    if not counts:
        raise ValueError("learners_per_rank must list at least one rank, got []")
    learners = [rep for st in states for rep in st["replicas"]]        # global learner ids
    out = []
    offset = 0
    for r, m in enumerate(counts):
        st = dict(states[0])
        st["replicas"] = learners[offset:offset + m]
        st["ref"] = states[r].get("ref") if r < len(states) else None
        st["num_vsw"] = m
        st["rank"], st["world_size"] = r, len(counts)
        out.append(st)
        offset += m
    return out
