"""IIDP on one device: virtual stream workers, gradient buckets, one-way weight sync.

JABAS/IIDP section 4 (paper lines ~144-170). One :class:`IIDPWorker` owns one device and runs
``num_vsw`` virtual stream workers (VSWs) on it, each a replica of the model on its own CUDA
stream (CPU: its own persistent thread), each doing ``num_ga`` gradient-accumulation steps over
micro-batches of the SAME local batch size B_L, i.e. ``num_vsw * (num_ga + 1)`` *decoupled
workers* on this device.

How one ``train_step`` executes
-------------------------------
1. **Micro-batch assignment**: VSW ``v`` processes ``micro_batches[v*(num_ga+1) + j]`` for
   ``j = 0 .. num_ga`` in that order (VSW 0 is the main VSW).
2. **Backward into buckets**: with a process group, every replica's gradients live in flat
   bucket buffers (:class:`~jabasray.engine.buckets.FlatBuffers`): the first micro-batch's
   gradient of a parameter is copied into its bucket slot by a post-accumulate-grad hook,
   which then binds ``p.grad`` to that slot so the following GA steps accumulate in place.
   Without a process group nothing is all-reduced, so gradients stay autograd's tensors and
   bucket operations act on per-parameter lists (saves that copy; ``flat_grads=True`` forces
   the flat layout). The same hook counts, during the LAST micro-batch of each VSW, how many
   parameters of each bucket are final.
3. **Local aggregation + overlapped all-reduce**: when ALL VSWs have finished bucket ``b``,
   the thread that finished it last adds the other VSWs' bucket ``b`` into the main VSW's
   bucket ``b`` (on the ``comm`` stream on CUDA, after waiting the VSWs' events) and hands the
   bucket to the worker's **communication thread**, which starts an asynchronous all-reduce
   (SUM) of it on the process group, while the VSWs go on with the backward of earlier
   layers. Buckets are launched strictly in plan order (a bucket that becomes ready early
   waits for its predecessors), so every rank issues its collectives in the same order - the
   DDP reducer's rule. Why a communication thread: the hook runs INSIDE a backward pass (on
   CUDA on the device's single autograd thread), so it must never block; the all-reduce
   window's ``comm_guard`` (DeepPool's pause of the background job) may wait for a
   background step whose own ``backward()`` needs that same autograd thread - a deadlock if
   the guard were entered from the hook. The hook therefore only aggregates locally (non
   blocking: kernels queued on the ``comm`` stream) and enqueues; the guard and every
   collective are entered/issued on the communication thread, never within autograd. Parameters that received no gradient in the last
   micro-batch (unused parameters, empty micro-batches) are marked final when their VSW ends;
   a parameter with no gradient at all gets a ZERO gradient (a complete bucket, as in DDP),
   whereas plain PyTorch would leave ``grad=None`` and skip it - the same for SGD without
   momentum/weight decay, not for Adam or momentum.
4. **Global mean over decoupled workers**: the all-reduced sum is divided by the GLOBAL
   number of decoupled workers ``sum over devices of n_vsw*(n_GA+1)`` (agreed in
   :meth:`IIDPWorker.configure` by an all-reduce), not by the number of devices: the paper's
   "averaged by the sum of n_vsw*(n_GA+1) for every GPU". With ``ragged=True`` (last iteration
   of an epoch) each micro-batch's mean-loss gradient is weighted by ``n_i / B_L`` and the sum
   is divided by the all-reduced ``sum n_i / B_L``, so the step equals one step on the union.
5. **One-way weight sync** (:mod:`~jabasray.engine.weight_sync`): only the main VSW holds the
   optimizer. SWS: wait all buckets, full step, copy all buckets to the other VSWs. OWS: per
   bucket, wait its all-reduce, shard-step its parameters and copy that shard.

VSW execution
-------------
**Batched (the default wherever it is exact).** After one-way weight sync every VSW holds the
main VSW's weights, so GA round ``j`` of all ``n`` VSWs runs as ONE forward/backward of the
main VSW's module over the ``n`` micro-batches interleaved (:mod:`~jabasray.engine.batched`:
the loss, a per-sample mean, times ``n`` back-propagates the sum of the VSWs' mean-loss
gradients; GA rounds accumulate in place), with every BatchNorm normalising per VSW over its
``B_L`` samples and updating that VSW's own running statistics
(:mod:`~jabasray.engine.vsw_norm`). Only the main VSW's hooks fire (one per parameter, not
one per parameter per replica), there is no local aggregation, and the weight copy to the
replicas is deferred until a replica is used (a per-VSW step) or looked at (``replicas()``).
The step is the same arithmetic as per-VSW execution (tests: equal in float64).
Per-VSW execution remains where batching is not exact, with one log line naming the reason
(:func:`~jabasray.engine.batched.batch_fallback_reason`): a ragged step, a step whose loss is
not a per-sample mean (``per_sample_loss=False``), modules that couple a batch's samples
beyond BatchNorm (SyncBatchNorm, InstanceNorm with running statistics, ...), micro-batches
that cannot be concatenated, or ``vsw_execution`` forcing a per-VSW scheme.

**Per VSW.** Two schemes issue the VSWs' forward/backward, with the same arithmetic (each
VSW's micro-batches in order; bucket aggregation and launches from the hooks as above):

* ``"threads"`` (CPU default): one persistent dispatcher thread per VSW
  (:class:`~jabasray.engine.streams.VSWThreadPool`), VSW 0 on the caller's thread. On CPU the
  kernels run on the issuing thread and release the GIL, so the VSWs really compute in
  parallel.
* ``"one_thread"`` (CUDA default): the caller's thread issues all VSWs, each onto its own
  (foreground-priority) stream, GA round by GA round - the forwards of every VSW's k-th
  micro-batch, then their backwards in VSW order. Reason: on CUDA, threads buy no
  concurrency. Every ``backward()`` of a CUDA graph is executed by the device's ONE autograd
  worker thread, whichever thread calls it, so the VSW threads' backward launches were
  serialised there anyway, and their Python forwards contend for the GIL. What
  makes VSWs overlap on a GPU is that each VSW's kernels are queued on its own stream ahead
  of the device: launches are asynchronous, so while the device still executes VSW k's
  forward/backward kernels, the host is already issuing VSW k+1's onto another stream, and
  the device runs them side by side. Issuing from one thread does exactly that without
  cross-thread hand-offs, and holds all VSWs' activations of one round at once, as the
  concurrent VSWs of the paper do (which is what the profiler's n_max probe measures).
  Per-VSW CUDA graphs were rejected: the bucket hooks (aggregation, launching all-reduces)
  are host code inside backward and cannot be captured.

``vsw_execution="auto"`` runs batched where exact and otherwise picks the device's per-VSW
default; either per-VSW scheme can be forced (the CPU tests run both, proving they equal the
plain step and the batched step).

Parameters of every VSW are views into 64-byte-aligned flat parameter buffers (one per
bucket), so the weight copy of step 5 is one ``copy_`` per bucket; do not move ``model`` to
another device after handing it to the worker (that would re-allocate the parameters).

BatchNorm and other buffers: every VSW normalises over its own micro-batch and keeps its own
running statistics (no buffer broadcast, unlike DDP's default); the main VSW's buffers are the
model's, and :meth:`IIDPWorker.state_dict` holds them. With ``n > 1`` VSWs each BatchNorm
layer's statistics of all VSWs live in one ``[n, C]`` tensor, every VSW's buffers being views
of its row (so do not re-assign BatchNorm buffers of ``model`` while it is in the worker).

The step never reads the device (no ``.item()``): the loss is summed on the device and
:class:`StepStats` hands it over as a 0-d tensor that becomes a float when read
(:func:`read_losses` reads an interval's losses at once). A ragged step reads its
all-reduced sample count (the fallback path). New replicas start from a copy of the
main VSW (weights and buffers).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..validation import check_choice, check_float, check_int
from ..config import WEIGHT_SYNC_METHODS
from .loader import batch_size, to_device
from .step import PRECISIONS, autocast, check_loss, make_grad_scaler, split_step_output, supervised_step
from .train_metrics import add_step_metrics
from .buckets import (BucketPlan, FlatBuffers, bucket_nbytes, default_bucket_plan, make_bucket_specs,
                      trainable_parameters, validate_bucket_plan)
from .batched import batch_fallback_reason, join_batches
from .streams import DispatcherThread, Lanes, VSWThreadPool
from .vsw_norm import coupling_modules, ghost_norms, pack_norm_stats
from .weight_sync import ShardOptimizer, resolve_weight_sync

log = logging.getLogger(__name__)

MicroBatch = Any   # (inputs, targets) for the default step; any batch for a step_fn
VSW_EXECUTIONS = ("auto", "threads", "one_thread")


class _DeviceScalar:
    """Dataclass field descriptor: holds a float or a 0-d tensor; reading the attribute turns a
    tensor into a float once (a device synchronisation on CUDA) and keeps the float. No
    default (``__get__`` on the class raises AttributeError, the dataclass rule for that)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> float:
        if obj is None:
            raise AttributeError("no default")
        v = obj.__dict__[self._key]
        if isinstance(v, torch.Tensor):
            v = float(v)
            obj.__dict__[self._key] = v
        return v

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self._key] = value


def read_losses(values: Sequence[Any]) -> list[float]:
    """Floats of step losses (:attr:`StepStats.loss_raw`): device tensors are read with ONE
    transfer (one synchronisation per interval instead of one per step)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    it = iter(torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).tolist())
    return [next(it) if isinstance(v, torch.Tensor) else float(v) for v in values]


@dataclass
class StepStats:
    """What one :meth:`IIDPWorker.train_step` reports.

    ``loss`` reads as a float; the IIDP engine stores it as a 0-d device tensor so that a step
    never waits for the device: reading ``loss`` synchronises, :attr:`loss_raw` does not (read
    many steps' losses at once with :func:`read_losses`)."""

    loss: float = _DeviceScalar()    # mean loss over all decoupled workers of all devices
    num_workers: int                 # decoupled workers on this device: n_vsw * (n_GA + 1)
    global_num_workers: int          # decoupled workers on all devices
    num_samples: int                 # samples processed on this device
    compute_time: float              # s: forward + backward of all VSWs (launches overlapped comm)
    comm_time: float                 # s: waiting for all-reduces after compute (exposed comm)
    update_time: float               # s: optimizer + weight copy
    weight_sync: str                 # "sws" | "ows" as used
    local_grad: torch.Tensor | None = None  # keep_local_grad: 1-D, trainable-parameter order;
                                            # keep_local_grad="split": [2, P], the two VSW halves
    optimizer_time: float = 0.0      # s: part of update_time spent in the optimizer (t_optim)
    copy_time: float = 0.0           # s: part of update_time spent copying weights (t_copy)
    metric_sums: dict = field(default_factory=dict)    # step_fn's (loss, {name: mean}) metrics:
                                     # sum over this device's forwards of mean x samples (float64,
                                     # 0-d tensors on the device)
    metric_counts: dict = field(default_factory=dict)  # samples behind each metric sum
    batched: bool = False            # the VSWs ran as one batched pass (else per VSW)

    @property
    def loss_raw(self) -> Any:
        """``loss`` as stored: a float or a 0-d device tensor (no synchronisation)."""
        return self.__dict__["_loss"]


@dataclass
class _Timings:
    comm: float = 0.0
    optim: float = 0.0
    copy: float = 0.0


def _clone_state(sd: dict) -> dict:
    """A compact copy of a module's ``state_dict`` (BatchNorm statistics are views of packed
    ``[n, C]`` tensors, which ``deepcopy`` would copy whole); keeps its version metadata."""
    out = type(sd)((k, v.detach().clone()) for k, v in sd.items())
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        out._metadata = copy.deepcopy(meta)
    return out


class _VSW:
    """One virtual stream worker: a model replica, its flat buffers and its bucket counters."""

    def __init__(self, index: int, module: nn.Module, specs, owner: "IIDPWorker") -> None:
        self.index = index
        self.module = module
        self.buffers = FlatBuffers(module, specs, flat_grads=owner._flat_grads)
        self.in_step = False                        # True while train_step runs this VSW
        self.counting = False                       # True during this VSW's last backward
        self.remaining = [len(s.names) for s in specs]
        self.done = [False] * len(specs)
        self.events: list[Any] = [None] * len(specs)
        self.handles = []
        self.set_hooks(True, owner)

    def set_hooks(self, on: bool, owner: "IIDPWorker") -> None:
        """Register (``on``) or remove the per-parameter gradient hooks. A batched step on one
        device with autograd's own gradients needs none: nothing is copied into buckets or
        launched during backward (:meth:`FlatBuffers.finish` completes the buckets after it),
        and a Python call per parameter per step is host time a plain step does not pay."""
        if on == bool(self.handles):
            return
        if not on:
            self.remove_hooks()
            return
        for b, plist in enumerate(self.buffers.modules_params):
            for k, p in enumerate(plist):
                self.handles.append(p.register_post_accumulate_grad_hook(owner._make_hook(self, b, k)))

    def reset(self) -> None:
        self.remaining = [len(s.names) for s in self.buffers.specs]
        self.done = [False] * len(self.remaining)
        self.events = [None] * len(self.remaining)

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class IIDPWorker:
    """Independent and Identical Data Parallelism on one device (see the module notes).

    Args:
        model: the main VSW's module (used in place; moved to ``device``).
        optimizer_fn: ``optimizer_fn(params) -> torch.optim.Optimizer``, called once with the
            trainable parameters (registration order); per-parameter optimizers only for OWS.
        loss_fn: ``loss_fn(outputs, targets)`` -> mean loss of a micro-batch (the default
            step, :func:`~jabasray.engine.step.supervised_step`; unused with ``step_fn``).
        device: ``"cpu"`` or ``"cuda[:i]"``.
        process_group: a ``torch.distributed`` group over the devices of the job (gloo on CPU,
            NCCL on CUDA), or ``None`` for a single device.
        weight_sync: ``"auto"`` (paper rule, R_buffer = 0.5), ``"sws"`` or ``"ows"``.
        bucket_plan: ``list[list[str]]`` in backward order (interface 1); ``None`` -> DDP-like
            size-cap grouping with ``bucket_cap_mb``.
        bucket_cap_mb: the user's bucket size cap (MiB), also the denominator of the auto rule.
        flat_grads: keep gradients in flat bucket buffers (needed for the all-reduce);
            ``None`` -> only when ``process_group`` is set. Without a process group the
            gradients can stay autograd's own tensors, which saves one copy per step.
        comm_guard: optional ``comm_guard(op_name) -> context manager`` (e.g. a background
            runner's ``foreground_critical``, DeepPool section 5): entered ONCE per step, with
            ``"allreduce"``, just before the first bucket's all-reduce is launched and exited
            after the last all-reduce of the step has completed (bucket and loss all-reduces;
            the 8-byte sample-count all-reduce of a ragged step starts before compute and is
            not covered). Only steps that communicate (``process_group`` set) enter it. It is
            entered on the worker's communication thread (never inside a backward pass: it
            may block, e.g. until a background step finished) and exited on the caller's
            thread. ``None`` (default): nothing is called. Settable as the attribute
            ``comm_guard`` between steps.
        step_fn: ``step_fn(model, micro_batch) -> mean loss`` (0-d tensor) instead of the
            supervised default (dict batches, several outputs, auxiliary losses).
        precision: ``"fp32" | "bf16" | "fp16"`` (:mod:`~jabasray.engine.step`: autocast, and a
            GradScaler for fp16).
        grad_clip_norm: clip the GLOBAL gradient (all-reduced and averaged, i.e. the gradient of
            the plain large-batch step) to this L2 norm before the update (None: no clipping).
            The norm couples all parameters, so clipping (like fp16's inf check) runs the update
            after the last bucket: OWS falls back to SWS (module notes of ``weight_sync``).
        vsw_execution: ``"auto"``: batched execution wherever it is exact, per VSW otherwise
            (CUDA: ``"one_thread"``, CPU: ``"threads"``); ``"threads"`` or ``"one_thread"``
            force per-VSW execution with that scheme (module notes, "VSW execution").
        per_sample_loss: the step's loss is the mean of per-sample losses (the default
            ``loss_fn`` with ``reduction="mean"``), which batched execution needs; ``False``
            (e.g. a sum, a class-weighted mean, a loss normalised by token counts) runs per VSW.

    The learning rate the optimizer steps with is ``group["lr"] * lr_factor`` for each param
    group: ``group["lr"]`` stays the user's (and the user's LR scheduler's) value, and
    ``lr_factor`` (attribute, default 1) is the batch-size rule's multiplier
    (:func:`jabasray.adaptive.lr_factor`), applied only around the optimizer step.
    """

    def __init__(self, model: nn.Module, optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, device: str | torch.device = "cpu",
                 process_group: Any = None, weight_sync: str = "auto",
                 bucket_plan: BucketPlan | None = None, bucket_cap_mb: float = 25.0,
                 flat_grads: bool | None = None,
                 comm_guard: Callable[[str], ContextManager[Any]] | None = None,
                 step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                 precision: str = "fp32", grad_clip_norm: float | None = None,
                 vsw_execution: str = "auto", per_sample_loss: bool = True) -> None:
        check_choice("weight_sync", weight_sync, WEIGHT_SYNC_METHODS)
        check_choice("vsw_execution", vsw_execution, VSW_EXECUTIONS)
        check_choice("precision", precision, PRECISIONS)
        if grad_clip_norm is not None:
            check_float("grad_clip_norm", grad_clip_norm, min_value=0, min_exclusive=True)
        if not isinstance(per_sample_loss, bool):
            raise ValueError(f"per_sample_loss must be True or False, got {per_sample_loss!r}")
        if comm_guard is not None and not callable(comm_guard):
            raise ValueError(f"comm_guard must be None or a callable op_name -> context manager, "
                             f"got {comm_guard!r}")
        self.bucket_cap_mb = check_float("bucket_cap_mb", bucket_cap_mb, min_value=0, min_exclusive=True)
        if flat_grads is not None and not isinstance(flat_grads, bool):
            raise ValueError(f"flat_grads must be True, False or None, got {flat_grads!r}")
        if flat_grads is False and process_group is not None:
            raise ValueError("flat_grads must not be False when a process_group is set "
                             "(buckets are all-reduced from flat buffers)")
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(optimizer_fn):
            raise ValueError(f"optimizer_fn must be callable (params -> Optimizer), got {optimizer_fn!r}")
        if step_fn is not None and not callable(step_fn):
            raise ValueError(f"step_fn must be callable (model, batch) -> loss, got {step_fn!r}")
        if step_fn is None and not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable (outputs, targets) -> loss, got {loss_fn!r}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be 'cpu' or 'cuda[:index]', got {device!r}") from None
        if not trainable_parameters(model):
            raise ValueError("model must have at least one parameter with requires_grad=True")
        model.to(self.device)
        self.loss_fn = loss_fn
        self.step_fn = step_fn if step_fn is not None else supervised_step(loss_fn)
        self.precision = precision
        self.grad_clip_norm = grad_clip_norm
        self.lr_factor = 1.0
        self._scaler = make_grad_scaler(self.device, precision)
        self.process_group = process_group
        # NCCL needs device tensors; gloo takes CPU tensors
        self._comm_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        plan = (default_bucket_plan(model, bucket_cap_mb) if bucket_plan is None
                else validate_bucket_plan(model, bucket_plan))
        self.bucket_plan: BucketPlan = plan
        self._specs = make_bucket_specs(model, plan)
        self._param_names = [n for n, _ in trainable_parameters(model)]
        self.weight_sync = weight_sync
        nbytes = bucket_nbytes(self._specs)
        self._method = resolve_weight_sync(weight_sync, nbytes, bucket_cap_mb)
        if self._method == "ows" and (grad_clip_norm is not None or self._scaler is not None):
            # the global norm / inf check needs every bucket before any update
            log.info("IIDP: SWS instead of OWS (grad_clip_norm or fp16 loss scaling needs the "
                     "whole gradient before the update)")
            self._method = "sws"
        log.info("IIDP: %d buckets (%s bytes), weight sync %s (%s)", len(self._specs),
                 nbytes, self._method, weight_sync)

        self._lock = threading.Lock()
        # flat gradient buckets only when they are all-reduced; on a single device gradients
        # stay autograd's tensors (no bucket copy at all)
        self._flat_grads = process_group is not None if flat_grads is None else flat_grads
        self._lanes = Lanes(self.device)
        self._execution = (("one_thread" if self._lanes.is_cuda else "threads")
                           if vsw_execution == "auto" else vsw_execution)
        # batched execution (module notes): exact unless forced off, a ragged step, a loss that
        # is not a per-sample mean, or modules that couple a batch's samples
        self._forced = None if vsw_execution == "auto" else vsw_execution
        self.per_sample_loss = per_sample_loss
        self._coupling = coupling_modules(model)
        self._norms: list = []              # (main's BatchNorm layer, PackedNormStats) per layer
        self._stale = False                 # replicas' weights lag the main VSW's (batched steps)
        self._copy_replicas = True          # this step's update copies weights to the replicas
        self._prescaled = False             # this step's gradients are averaged already
        self._logged: set[str] = set()      # fallback reasons already logged
        self._pool = VSWThreadPool(0)
        self._comm: DispatcherThread | None = None   # communication thread (process group only)
        self._vsws: list[_VSW] = [_VSW(0, model, self._specs, self)]
        self._active: list[_VSW] = self._vsws[:1]   # VSWs that run backward in this step
        self._lanes.resize(1)
        params = [p for _, p in trainable_parameters(model)]
        self.optimizer = optimizer_fn(params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer_fn must return a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        self._shard = ShardOptimizer(self.optimizer, self._vsws[0].buffers.modules_params)

        self._num_vsw = 1
        self._num_ga = 0
        self._local_batch_size: int | None = None
        self._global_num_workers = 1
        # per-step state
        self._pending: list[int] = []
        self._ready: list[bool] = []
        self._next_launch = 0
        self._works: list[Any] = []
        self._snapshot: list[Any] | None = None
        self._split = False                    # this step keeps the two VSW halves apart
        self._metric_sums: dict[str, torch.Tensor] = {}   # step_fn's metrics x samples (float64)
        self._metric_counts: dict[str, int] = {}          # samples behind each metric sum
        self.comm_guard = comm_guard
        self._guard_cm: ContextManager[Any] | None = None   # the guard entered in this step
        # True: synchronise the device around timed phases (profiling on CUDA); CPU is
        # synchronous anyway
        self.sync_timing = False

    # ------------------------------------------------------------------ properties
    @property
    def model(self) -> nn.Module:
        """The main VSW's module (current weights)."""
        return self._vsws[0].module

    @property
    def num_vsw(self) -> int:
        return self._num_vsw

    @property
    def num_ga(self) -> int:
        return self._num_ga

    @property
    def local_batch_size(self) -> int | None:
        return self._local_batch_size

    @property
    def num_workers(self) -> int:
        """Decoupled workers on this device: ``num_vsw * (num_ga + 1)``."""
        return self._num_vsw * (self._num_ga + 1)

    @property
    def global_num_workers(self) -> int:
        return self._global_num_workers

    @property
    def vsw_execution(self) -> str:
        """The VSW execution scheme in use: ``"threads"`` or ``"one_thread"``."""
        return self._execution

    @property
    def weight_sync_method(self) -> str:
        """The method in use: ``"sws"`` or ``"ows"`` (``"auto"`` resolved)."""
        return self._method

    def set_weight_sync(self, method: str) -> None:
        """Use ``"sws"`` or ``"ows"`` from the next step on (a plan's predicted choice; the
        shard optimizer exists either way, so switching between steps is safe)."""
        self._method = check_choice("weight_sync", method, ("sws", "ows"))

    @property
    def bucket_nbytes(self) -> list[int]:
        return bucket_nbytes(self._specs)

    def replicas(self) -> list[nn.Module]:
        """All VSW modules, main first (read-only use: tests, diagnostics); their weights are
        brought up to date first (batched steps defer the weight copy to the replicas)."""
        self._refresh_replicas()
        return [v.module for v in self._vsws]

    def _refresh_replicas(self) -> None:
        """The one-way weight copy that batched steps skipped (no replica runs in them): done
        before a replica is used (a per-VSW step) or looked at."""
        if self._stale:
            main = self._vsws[0].buffers
            with torch.no_grad():
                for v in self._vsws[1:]:
                    v.buffers.copy_params_from(main)
            self._stale = False

    def batch_fallback_reason(self, ragged: bool = False) -> str | None:
        """Why a step (``ragged`` or not) would run per VSW now, or ``None``: it runs batched."""
        return batch_fallback_reason(self._num_vsw, ragged, self.per_sample_loss, self._coupling,
                                     self._forced)

    # ------------------------------------------------------------------ configuration
    def configure(self, num_vsw: int, num_ga: int, local_batch_size: int) -> None:
        """Set (n_vsw, n_GA, B_L) at run time. Replicas are added (copies of the main VSW's
        current weights and buffers) or removed; the optimizer and its state are kept.
        Collective when a process group is set: all ranks must call it (all-reduce of the
        decoupled-worker count)."""
        num_vsw = check_int("num_vsw", num_vsw, min_value=1)
        num_ga = check_int("num_ga", num_ga, min_value=0)
        local_batch_size = check_int("local_batch_size", local_batch_size, min_value=1)
        workers = num_vsw * (num_ga + 1)
        if self.process_group is not None:
            t = torch.tensor([workers], dtype=torch.int64, device=self._comm_device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
            self._global_num_workers = int(t.item())
        else:
            self._global_num_workers = workers
        self._lanes.synchronize()
        while len(self._vsws) < num_vsw:
            self._vsws.append(self._new_replica(len(self._vsws)))
        for v in self._vsws[num_vsw:]:
            v.remove_hooks()
        del self._vsws[num_vsw:]
        # every VSW's BatchNorm statistics in one [n, C] tensor per layer (views per replica)
        self._norms = pack_norm_stats([v.module for v in self._vsws])
        self._lanes.resize(num_vsw)
        self._pool.resize(num_vsw - 1 if self._execution == "threads" else 0)
        self._num_vsw, self._num_ga, self._local_batch_size = num_vsw, num_ga, local_batch_size
        log.debug("IIDP configured: n_vsw=%d n_ga=%d B_L=%d (global workers %d)",
                  num_vsw, num_ga, local_batch_size, self._global_num_workers)

    def _new_replica(self, index: int) -> _VSW:
        main = self._vsws[0].module
        with torch.no_grad():
            replica = copy.deepcopy(main)
        replica.train(main.training)
        return _VSW(index, replica, self._specs, self)

    def sync_replicas(self) -> None:
        """Copy the main VSW's weights and buffers to every other VSW (after the user changed
        ``model`` directly, e.g. loaded weights)."""
        main = self._vsws[0]
        with torch.no_grad():
            for v in self._vsws[1:]:
                v.buffers.copy_params_from(main.buffers)
                for (_, dst), (_, src) in zip(v.module.named_buffers(), main.module.named_buffers()):
                    dst.copy_(src)
        self._stale = False

    # ------------------------------------------------------------------ LR
    def set_lr(self, lr: float) -> None:
        check_float("lr", lr, min_value=0)
        for g in self.optimizer.param_groups:
            g["lr"] = float(lr)

    def get_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def effective_lr(self) -> float:
        """The LR of the first param group in the next update: ``lr * lr_factor``."""
        return self.get_lr() * self.lr_factor

    # ------------------------------------------------------------------ hooks & launching
    def _make_hook(self, vsw: _VSW, bucket: int, k: int) -> Callable[[torch.Tensor], None]:
        buffers = vsw.buffers

        def hook(_param: torch.Tensor) -> None:
            if not vsw.in_step:
                return
            buffers.on_grad(bucket, k)
            if not vsw.counting:
                return
            vsw.remaining[bucket] -= 1
            if vsw.remaining[bucket] == 0:
                self._vsw_bucket_done(vsw, bucket)
        return hook

    def _vsw_bucket_done(self, vsw: _VSW, bucket: int) -> None:
        if vsw.done[bucket]:
            return
        vsw.done[bucket] = True
        vsw.events[bucket] = self._lanes.record()    # CUDA: grads of this bucket are on this stream
        with self._lock:
            self._pending[bucket] -= 1
            if self._pending[bucket] == 0:
                self._ready[bucket] = True
                # launch strictly in plan order so that all ranks issue collectives alike
                while self._next_launch < len(self._ready) and self._ready[self._next_launch]:
                    self._launch(self._next_launch)
                    self._next_launch += 1

    def _finish_vsw(self, vsw: _VSW) -> None:
        """Mark the buckets this VSW never completed through hooks (unused params, empty
        micro-batches) as final, in plan order."""
        vsw.counting = False
        vsw.buffers.finish()
        for b in range(len(self._specs)):
            if not vsw.done[b]:
                self._vsw_bucket_done(vsw, b)

    def _half_sums(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket ``b`` summed over each half of the VSWs (first ``n/2`` / last ``n/2``), read
        before the local aggregation adds every VSW into the main one."""
        half = len(self._vsws) // 2
        out = []
        for vs in (self._vsws[:half], self._vsws[half:]):
            flat = vs[0].buffers.bucket_flat_copy(b)
            for v in vs[1:]:
                flat.add_(v.buffers.bucket_flat_copy(b))
            out.append(flat)
        return out[0], out[1]

    def _launch(self, b: int) -> None:
        """Local aggregation of bucket ``b`` into the main VSW (autograd hook: queues kernels,
        never blocks), then the async global all-reduce is handed to the communication thread."""
        lanes = self._lanes
        main = self._vsws[0].buffers
        with lanes.context(lanes.comm):
            for v in self._active:
                lanes.wait(lanes.comm, v.events[b])
            if self._snapshot is not None and self._split:
                self._snapshot[b] = self._half_sums(b)
            for v in self._active[1:]:
                main.add_bucket_from(v.buffers, b)
            if self._snapshot is not None and not self._split:
                self._snapshot[b] = main.bucket_flat_copy(b)
        if self.process_group is not None:
            # never block here (autograd hook): the guard and the collective run on the
            # communication thread, in submission (= plan) order
            self._works[b] = self._comm_thread().submit(lambda: self._all_reduce_bucket(b))

    def _comm_thread(self) -> DispatcherThread:
        if self._comm is None:
            self._comm = DispatcherThread("iidp-comm")
        return self._comm

    def _all_reduce_bucket(self, b: int) -> Any:
        """Communication thread: open the guard at bucket 0, start bucket ``b``'s all-reduce
        (CUDA: on the ``comm`` stream, after the aggregation queued there); returns its work."""
        lanes = self._lanes
        with lanes.device_context(), lanes.context(lanes.comm):
            if b == 0:              # launches are in plan order: bucket 0 opens the window
                self._enter_comm_guard()
            return dist.all_reduce(self._vsws[0].buffers.grads[b], op=dist.ReduceOp.SUM,
                                   group=self.process_group, async_op=True)

    def _launched(self) -> None:
        """Caller's thread: wait until the communication thread started every bucket's
        all-reduce (re-raises a launch error); from then on the guard is held."""
        for fut in self._works:
            if fut is not None:
                fut.result()

    def _drain_launches(self) -> None:
        """After a failed step: let the communication thread finish what was submitted (so
        it cannot enter the guard after the step gave it up); errors are the step's."""
        for fut in self._works:
            if fut is not None:
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001 - the step already fails
                    pass

    def _enter_comm_guard(self) -> None:
        """Enter ``comm_guard("allreduce")`` (communication thread, from bucket 0's launch)."""
        guard = self.comm_guard
        if guard is None or self._guard_cm is not None:
            return
        cm = guard("allreduce")
        cm.__enter__()
        self._guard_cm = cm

    def _exit_comm_guard(self, exc: BaseException | None = None) -> None:
        """Leave the guard entered by this step, if any (caller's thread, after the last wait)."""
        cm, self._guard_cm = self._guard_cm, None
        if cm is not None:
            cm.__exit__(type(exc) if exc is not None else None, exc,
                        exc.__traceback__ if exc is not None else None)

    def _wait_bucket(self, b: int) -> None:
        """Make the update stream (CUDA) / this thread (CPU) wait for bucket ``b``'s all-reduce."""
        fut = self._works[b]
        if fut is not None:
            fut.result().wait()   # CUDA/NCCL: makes the current (update) stream wait
        elif self._lanes.is_cuda:
            self._lanes.update.wait_stream(self._lanes.comm)

    # ------------------------------------------------------------------ training
    def _check_micro_batches(self, micro_batches: Sequence[MicroBatch], ragged: bool) -> list[int]:
        if self._local_batch_size is None:
            raise ValueError("configure(num_vsw, num_ga, local_batch_size) must be called before train_step")
        if not isinstance(micro_batches, (list, tuple)):
            raise ValueError(f"micro_batches must be a list of batches, got {type(micro_batches).__name__}")
        want = self.num_workers
        if len(micro_batches) != want:
            raise ValueError(f"micro_batches must hold num_vsw*(num_ga+1) = {self._num_vsw}*({self._num_ga}+1) "
                             f"= {want} batches, got {len(micro_batches)}")
        sizes = []
        for i, mb in enumerate(micro_batches):
            try:
                n = batch_size(mb)
            except ValueError as e:
                raise ValueError(f"micro_batches[{i}]: {e}") from None
            if ragged:
                if not 0 <= n <= self._local_batch_size:
                    raise ValueError(f"micro_batches[{i}] must hold between 0 and local_batch_size = "
                                     f"{self._local_batch_size} samples (ragged), got {n}")
            elif n != self._local_batch_size:
                raise ValueError(f"micro_batches[{i}] must hold local_batch_size = {self._local_batch_size} "
                                 f"samples, got {n} (use ragged=True for the last iteration of an epoch)")
            sizes.append(n)
        return sizes

    def train_step(self, micro_batches: Sequence[MicroBatch], keep_local_grad: bool | str = False,
                   ragged: bool = False) -> StepStats:
        """One IIDP iteration over ``num_vsw*(num_ga+1)`` micro-batches (see the module notes).

        ``keep_local_grad``: also return ``local_grad``, the flattened SUM over this device's
        decoupled workers of their micro-batch mean-loss gradients, before the global
        all-reduce, in trainable-parameter registration order (``ragged``: each term weighted
        by ``n_i / B_L``). ``keep_local_grad="split"`` (a GPU that forms both similarity groups
        on its own, JABAS section 6.1 with groups of decoupled workers): ``local_grad`` is a
        ``[2, P]`` tensor, row 0 the sum over VSWs ``0 .. n_vsw/2 - 1``, row 1 over the other
        half (``n_vsw`` must be even, so the two groups hold equally many decoupled workers).
        ``ragged``: micro-batches may hold 0..B_L samples; each gradient is
        weighted by its sample count so the step equals one step on the union (collective:
        all ranks must pass the same ``ragged``).
        """
        try:
            return self._train_step(micro_batches, keep_local_grad, ragged)
        except BaseException as e:
            self._drain_launches()
            self._exit_comm_guard(e)      # a failed step never leaves the guard entered
            raise

    def _train_step(self, micro_batches: Sequence[MicroBatch], keep_local_grad: bool | str,
                    ragged: bool) -> StepStats:
        if keep_local_grad not in (False, True, "split"):
            raise ValueError(f"keep_local_grad must be False, True or 'split', got {keep_local_grad!r}")
        self._split = keep_local_grad == "split"
        if self._split and self._num_vsw % 2:
            raise ValueError(f"keep_local_grad='split' needs an even num_vsw (two equal VSW groups), "
                             f"got {self._num_vsw}")
        sizes = self._check_micro_batches(micro_batches, ragged)
        lanes, B = self._lanes, self._local_batch_size
        nb = len(self._specs)
        G = self._num_ga + 1
        t0 = self._clock()

        # --- batched (one pass over the n VSWs' micro-batches of each GA round) or per VSW
        # a GPU forming both similarity groups needs each VSW's own gradient: per VSW (this is
        # only the last iteration of an adaptation interval)
        # (with a process group every rank all-reduces sums, batched or not)
        reason = self.batch_fallback_reason(ragged)
        if self._split:
            reason = "the similarity groups split the VSWs"
        pg_set = self.process_group is not None
        rounds = None
        if reason is None:
            try:
                n = self._num_vsw
                rounds = [join_batches([micro_batches[v * G + j] for v in range(n)]) for j in range(G)]
            except ValueError as e:
                reason = f"micro-batches cannot be joined: {e}"
        if reason is not None:
            if reason not in self._logged and self._num_vsw > 1:
                self._logged.add(reason)
                log.info("IIDP: per-VSW execution (%s)", reason)
            self._refresh_replicas()
        self._active = self._vsws[:1] if rounds is not None else self._vsws
        self._vsws[0].set_hooks(rounds is None or pg_set or self._flat_grads, self)

        # --- per-step state
        self._pending = [len(self._active)] * nb
        self._ready = [False] * nb
        self._next_launch = 0
        self._works = [None] * nb
        self._snapshot = [None] * nb if keep_local_grad else None
        self._metric_sums, self._metric_counts = {}, {}
        weights = [n / B for n in sizes] if ragged else [1.0] * len(sizes)
        pg = self.process_group
        count_work = None
        count_t = None
        if ragged:
            count_t = torch.tensor([sum(weights)], dtype=torch.float64, device=self._comm_device)
            if pg is not None:
                count_work = dist.all_reduce(count_t, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        start_ev = lanes.record()
        training = self.model.training

        def begin_vsw(vsw: _VSW) -> tuple[list[int], list[torch.Tensor]]:
            """(on the VSW's stream) its non-empty micro-batches and its (weighted) losses"""
            lanes.wait(lanes.vsw[vsw.index], start_ev)
            vsw.reset()
            vsw.buffers.begin_step()
            if vsw.index > 0 and vsw.module.training != training:
                vsw.module.train(training)
            base = vsw.index * G
            vsw.in_step = True
            return [base + j for j in range(G) if sizes[base + j] > 0], []

        if rounds is not None:
            # the 1/(global decoupled workers) of step 4 folded into the loss: the gradients
            # leave backward averaged (no extra pass over them in the update). Single device
            # only: with a process group another rank may run per VSW this step (e.g. forming
            # both similarity groups), and every rank must all-reduce SUMS
            fold = pg is None
            losses = self._run_batched(begin_vsw, rounds,
                                       self._num_vsw / (self._global_num_workers if fold else 1))
        elif self._execution == "threads":
            def run_vsw(vsw: _VSW) -> list[torch.Tensor]:
                with lanes.context(lanes.vsw[vsw.index]):
                    try:
                        idx, loss_sum = begin_vsw(vsw)
                        for k, i in enumerate(idx):
                            scaled = self._forward(vsw, micro_batches[i], weights[i], loss_sum)
                            self._backward(vsw, scaled, last=k == len(idx) - 1)
                        self._finish_vsw(vsw)
                    finally:
                        vsw.in_step = vsw.counting = False
                    return loss_sum

            losses = self._pool.run([lambda v=v: run_vsw(v) for v in self._vsws])
        else:
            losses = self._run_vsws_one_thread(begin_vsw, micro_batches, weights)
        t_compute = self._clock() - t0

        if pg is not None:
            self._launched()      # every bucket is in flight, the guard (if any) held

        # --- loss statistic (all-reduced with the gradients; waited at the end)
        with lanes.context(lanes.update):
            for v in self._active:
                lanes.wait(lanes.update, lanes.record(lanes.vsw[v.index]))
            flat_losses = [x for vsw_losses in losses for x in vsw_losses]
            loss_t = (torch.stack(flat_losses).sum().reshape(1).to(self._comm_device) if flat_losses
                      else torch.zeros(1, device=self._comm_device))
            loss_work = (dist.all_reduce(loss_t, op=dist.ReduceOp.SUM, group=pg, async_op=True)
                         if pg is not None else None)
            if ragged:   # (per-VSW fallback: reading the sample count synchronises)
                if count_work is not None:
                    count_work.wait()
                divisor = float(count_t.item())
                if divisor <= 0:
                    raise ValueError("micro_batches hold no samples on any device (ragged step)")
            else:
                divisor = float(self._global_num_workers)
            self._copy_replicas = rounds is None
            self._prescaled = rounds is not None and pg is None   # averaged in the loss already
            tm = self._update(divisor)
            comm_time = tm.comm
            if loss_work is not None:
                tw = time.perf_counter()
                loss_work.wait()
                comm_time += time.perf_counter() - tw
            end_ev = lanes.record(lanes.update)
        lanes.wait(lanes.current(), end_ev)
        # on the device: read once per interval (batched: the losses are already averaged)
        loss_value = loss_t.reshape(()) if self._prescaled else (loss_t / divisor).reshape(())
        self._exit_comm_guard()
        if rounds is not None and self._num_vsw > 1:
            self._stale = True                         # replicas get the weights when used

        local_grad = None
        if keep_local_grad:
            main = self._vsws[0].buffers
            if self._split:
                local_grad = torch.stack([
                    main.grads_in_param_order(self._param_names, [s[h] for s in self._snapshot])
                    for h in (0, 1)])
            else:
                local_grad = main.grads_in_param_order(self._param_names, self._snapshot)
                if self._prescaled and divisor != 1.0:
                    local_grad = local_grad * divisor        # the sum, before the folded average
        self._snapshot = None
        return StepStats(loss=loss_value, num_workers=self.num_workers,
                         global_num_workers=self._global_num_workers, num_samples=sum(sizes),
                         compute_time=t_compute, comm_time=comm_time, update_time=tm.optim + tm.copy,
                         weight_sync=self._method, local_grad=local_grad, optimizer_time=tm.optim,
                         copy_time=tm.copy, batched=rounds is not None,
                         metric_sums=self._metric_sums, metric_counts=self._metric_counts)

    def _run_batched(self, begin_vsw: Callable[[_VSW], tuple[list[int], list[torch.Tensor]]],
                     rounds: Sequence[MicroBatch], weight: float) -> list[list[torch.Tensor]]:
        """Batched execution (module notes): the main VSW runs GA round ``j`` as one pass over
        ``rounds[j]`` (the ``n`` VSWs' ``j``-th micro-batches side by side), BatchNorm per VSW
        (:func:`~jabasray.engine.vsw_norm.ghost_norms`), loss times ``weight`` = ``n`` (the sum
        of the VSWs' mean losses, :mod:`~jabasray.engine.batched`) / the global number of
        decoupled workers (the average of step 4, applied here); gradients accumulate in place."""
        lanes, main, n = self._lanes, self._vsws[0], weight
        try:
            with lanes.context(lanes.vsw[0]):
                _, losses = begin_vsw(main)
                for j, batch in enumerate(rounds):
                    with ghost_norms(self._norms):
                        scaled = self._forward(main, batch, n, losses)
                    self._backward(main, scaled, last=j == len(rounds) - 1)
                self._finish_vsw(main)
        finally:
            main.in_step = main.counting = False
        return [losses]

    def _run_vsws_one_thread(self, begin_vsw: Callable[[_VSW], tuple[list[int], list[torch.Tensor]]],
                             micro_batches: Sequence[MicroBatch], weights: list[float]
                             ) -> list[list[torch.Tensor]]:
        """The ``"one_thread"`` scheme (CUDA default; module notes "VSW execution"): the
        calling thread issues every VSW onto its own stream, GA round by GA round: the
        forwards of round ``k`` of all VSWs, then their backwards in VSW order (each inside
        its stream's context, so backward kernels stay on that stream). The device runs the
        VSWs' queued kernels concurrently while the host issues the next VSW's work."""
        lanes, vsws = self._lanes, self._vsws
        try:
            plans = []
            for v in vsws:
                with lanes.context(lanes.vsw[v.index]):
                    plans.append(begin_vsw(v))
            for v, (idx, _) in zip(vsws, plans):
                if not idx:                      # no samples at all (ragged): finished now
                    self._finish_vsw(v)
            for k in range(max(len(idx) for idx, _ in plans)):
                issued = []
                for v, (idx, loss_sum) in zip(vsws, plans):
                    if k < len(idx):
                        with lanes.context(lanes.vsw[v.index]):
                            issued.append((v, self._forward(v, micro_batches[idx[k]],
                                                            weights[idx[k]], loss_sum),
                                           k == len(idx) - 1))
                for v, scaled, last in issued:
                    with lanes.context(lanes.vsw[v.index]):
                        self._backward(v, scaled, last)
                        if last:
                            self._finish_vsw(v)
            return [loss_sum for _, loss_sum in plans]
        finally:
            for v in vsws:
                v.in_step = v.counting = False

    def _forward(self, vsw: _VSW, micro_batch: MicroBatch, weight: float,
                 losses: list[torch.Tensor]) -> torch.Tensor:
        """Forward of one micro-batch on ``vsw`` (current stream); appends ``loss * weight``
        (detached, on the device) to ``losses``; returns the (weighted, fp16-scaled) loss to
        back-propagate."""
        batch = to_device(micro_batch, self.device)
        with autocast(self.device, self.precision):
            loss, metrics = split_step_output(self.step_fn(vsw.module, batch))
            loss = check_loss(loss)
        if metrics:
            self._add_metrics(metrics, batch_size(batch))
        scaled = loss if weight == 1.0 else loss * weight
        losses.append(scaled.detach())
        return self._scaler.scale(scaled) if self._scaler is not None else scaled

    def _add_metrics(self, metrics: dict[str, Any], n: int) -> None:
        """Training metrics of one forward (means over its ``n`` samples) into this step's
        sample-weighted float64 sums, on the device (read once per interval by the caller)."""
        with self._lock:
            add_step_metrics(self._metric_sums, self._metric_counts, metrics, n, self.device)

    @staticmethod
    def _backward(vsw: _VSW, scaled: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch of ``vsw``; during its ``last`` one the hooks count
        bucket completion (GA steps before it only accumulate)."""
        vsw.counting = last
        scaled.backward()

    def _update(self, divisor: float) -> "_Timings":
        """Wait for the all-reduces, average, update and copy (SWS or OWS); runs on the
        update stream (CUDA). Host timings; with ``sync_timing`` the device is synchronised
        around each phase so that they are device times. After a batched step no replica ran:
        their copy is deferred (:meth:`_refresh_replicas`)."""
        main = self._vsws[0].buffers
        others = [v.buffers for v in self._vsws[1:]] if self._copy_replicas else []
        scale = 1.0 if self._prescaled else 1.0 / divisor
        tm = _Timings()
        clock = self._clock
        buckets = range(len(self._specs))
        if self._method == "ows":
            for b in buckets:   # (OWS never runs with clipping / a GradScaler: see __init__)
                t0 = clock()
                self._wait_bucket(b)
                t1 = clock()
                if scale != 1.0:
                    main.scale_bucket(b, scale)
                with self._scaled_lr():
                    self._shard.step_shard(b)
                t2 = clock()
                for o in others:
                    o.copy_params_from(main, b)
                t3 = clock()
                tm.comm += t1 - t0
                tm.optim += t2 - t1
                tm.copy += t3 - t2
        else:
            t0 = clock()
            for b in buckets:
                self._wait_bucket(b)
            t1 = clock()
            if scale != 1.0:
                for b in buckets:
                    main.scale_bucket(b, scale)
            self._full_step()
            t2 = clock()
            for o in others:
                o.copy_params_from(main)
            t3 = clock()
            tm.comm, tm.optim, tm.copy = t1 - t0, t2 - t1, t3 - t2
        return tm

    def _full_step(self) -> None:
        """SWS update of the averaged gradient: fp16 unscale, global-norm clip, optimizer step
        at ``lr * lr_factor`` (skipped by the GradScaler on inf/NaN), scale update."""
        opt, scaler = self.optimizer, self._scaler
        if scaler is not None:
            scaler.unscale_(opt)
        if self.grad_clip_norm is not None:
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip_norm)
        with self._scaled_lr():
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                self._shard.step()

    @contextlib.contextmanager
    def _scaled_lr(self):
        """Param groups' LR times ``lr_factor`` for the duration of an optimizer step."""
        f = self.lr_factor
        if f == 1.0:
            yield
            return
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g, lr in zip(groups, saved):
            g["lr"] = lr * f
        try:
            yield
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr

    def _clock(self) -> float:
        if self.sync_timing:
            self._lanes.synchronize()
        return time.perf_counter()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """A snapshot (deep copy, not views of live tensors) of the weights (+ the main VSW's
        buffers, e.g. BatchNorm running statistics), optimizer state and configuration."""
        self._lanes.synchronize()
        return {
            "model": _clone_state(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "config": {"num_vsw": self._num_vsw, "num_ga": self._num_ga,
                       "local_batch_size": self._local_batch_size},
            "weight_sync": self._method,
            **({"grad_scaler": self._scaler.state_dict()} if self._scaler is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved; re-applies the saved configuration
        (collective when a process group is set) and copies weights to all VSWs."""
        if not isinstance(state, dict) or not {"model", "optimizer", "config"} <= set(state):
            raise ValueError("state must be a dict with keys 'model', 'optimizer', 'config' "
                             f"(from IIDPWorker.state_dict()), got {type(state).__name__}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self._scaler is not None and state.get("grad_scaler"):
            self._scaler.load_state_dict(state["grad_scaler"])
        cfg = state["config"]
        if cfg.get("local_batch_size") is not None:
            self.configure(cfg["num_vsw"], cfg["num_ga"], cfg["local_batch_size"])
        self.sync_replicas()

    def close(self) -> None:
        """Stop the VSW threads and remove the hooks from the main model."""
        self._pool.close()
        if self._comm is not None:
            self._comm.stop()
            self._comm = None
        for v in self._vsws:
            v.remove_hooks()

    def __del__(self) -> None:  # best effort
        try:
            self._pool.close()
            if self._comm is not None:
                self._comm.stop()
        except Exception:  # noqa: BLE001
            pass
