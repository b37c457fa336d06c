"""IIDP on one device: the worker facade over virtual stream workers, buckets and graphs.

JABAS/IIDP section 4. One :class:`IIDPWorker` owns one device and runs ``num_vsw`` virtual
stream workers (VSWs) on it, each a replica of the model (CUDA: its own stream; CPU: its own
persistent thread), each doing ``num_ga`` gradient-accumulation steps over micro-batches of the
SAME local batch size B_L, i.e. ``num_vsw * (num_ga + 1)`` *decoupled workers* on this device.

How one ``train_step`` executes, and where each part lives (read one module at a time)
-------------------------------------------------------------------------------------
1. **Micro-batch assignment**: VSW ``v`` processes ``micro_batches[v*(num_ga+1) + j]`` for
   ``j = 0 .. num_ga`` in that order (VSW 0 is the main VSW). This module.
2. **Forward/backward**, by one of three executions (the eager step that issues the first
   and the third op by op: :mod:`~jabasray.engine.eager`):

   * **batched** (:mod:`~jabasray.engine.batched`, the default wherever it is exact): after
     one-way weight sync every VSW holds the main VSW's weights, so GA round ``j`` of all ``n``
     VSWs is ONE forward/backward of the main VSW's module over the ``n`` micro-batches
     interleaved, BatchNorm per VSW (:mod:`~jabasray.engine.vsw_norm`); the same arithmetic
     as per-VSW execution (tests: equal in float64). The weight copy to the replicas is
     deferred until a replica is used (a per-VSW step) or looked at (``replicas()``);
   * **batched as a CUDA graph** (:mod:`~jabasray.engine.graphs`, ``cuda_graphs="auto"``, one
     CUDA device without a process group): the whole batched step including the optimizer
     captured once per key and replayed;
   * **per VSW** (:mod:`~jabasray.engine.per_vsw`) where batching is not exact (a ragged step,
     ``per_sample_loss=False``, batch-coupled modules, micro-batches that cannot be joined, a
     forced ``vsw_execution``), with one log line naming the reason.
3. **Buckets, aggregation, all-reduce, update** (:mod:`~jabasray.engine.aggregation`): hooks
   complete gradient buckets during backward, VSWs' buckets are added into the main VSW's,
   a communication thread all-reduces them in plan order while backward goes on; the sum is
   divided by the GLOBAL number of decoupled workers; one-way weight sync (SWS/OWS,
   :mod:`~jabasray.engine.weight_sync`) updates the main VSW and copies its weights.
4. **What the step reports** (:mod:`~jabasray.engine.stats`): :class:`StepStats`, the loss a
   0-d device tensor read once per interval (:func:`read_losses`).

Parameters of every VSW are views into 64-byte-aligned flat parameter buffers (one per
bucket), so the weight copy is one ``copy_`` per bucket; do not move ``model`` to another
device after handing it to the worker (that would re-allocate the parameters).

BatchNorm and other buffers: every VSW normalises over its own micro-batch and keeps its own
running statistics (no buffer broadcast, unlike DDP's default); the main VSW's buffers are the
model's, and :meth:`IIDPWorker.state_dict` holds them. With ``n > 1`` VSWs each BatchNorm
layer's statistics of all VSWs live in one ``[n, C]`` tensor, every VSW's buffers being views
of its row (so do not re-assign BatchNorm buffers of ``model`` while it is in the worker).

The step never reads the device (no ``.item()``); a ragged step reads its all-reduced sample
count (the fallback path). New replicas start from a copy of the main VSW (weights and buffers).
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..validation import check_choice, check_float, check_int
from ..config import WEIGHT_SYNC_METHODS
from .aggregation import _VSW, BucketAggregation
from .batched import BatchedExecution, batch_fallback_reason
from .eager import EagerSteps
from .buckets import (BucketPlan, bucket_nbytes, default_bucket_plan, make_bucket_specs,
                      trainable_parameters, validate_bucket_plan)
from .graphs import (CUDA_GRAPH_MODES, CapturedStep, GraphCache, GraphedSteps, step_graph_blocker,
                     worker_graph_blocker)
from .loader import batch_size, to_device
from .per_vsw import PerVSWExecution
from .stats import StepStats, _DeviceScalar, _Timings, read_losses  # noqa: F401  (re-exported)
from .step import PRECISIONS, autocast, check_loss, make_grad_scaler, split_step_output, supervised_step
from .train_metrics import add_step_metrics
from .streams import DispatcherThread, Lanes, VSWThreadPool
from .vsw_norm import VSWNorms, coupling_modules, pack_norm_stats
from .weight_sync import ShardOptimizer, resolve_weight_sync

log = logging.getLogger(__name__)

MicroBatch = Any   # (inputs, targets) for the default step; any batch for a step_fn
VSW_EXECUTIONS = ("auto", "threads", "one_thread")


def _clone_state(sd: dict) -> dict:
    """A compact copy of a module's ``state_dict`` (BatchNorm statistics are views of packed
    ``[n, C]`` tensors, which ``deepcopy`` would copy whole); keeps its version metadata."""
    out = type(sd)((k, v.detach().clone()) for k, v in sd.items())
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        out._metadata = copy.deepcopy(meta)
    return out


class IIDPWorker(EagerSteps, BucketAggregation, BatchedExecution, PerVSWExecution, GraphedSteps):
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
            force per-VSW execution with that scheme (:mod:`~jabasray.engine.per_vsw`).
        per_sample_loss: the step's loss is the mean of per-sample losses (the default
            ``loss_fn`` with ``reduction="mean"``), which batched execution needs; ``False``
            (e.g. a sum, a class-weighted mean, a loss normalised by token counts) runs per VSW.
        cuda_graphs: ``"auto"``: batched steps on one CUDA device are captured as CUDA graphs
            and replayed where possible (:mod:`~jabasray.engine.graphs`; otherwise eager, with
            one log line naming the reason); ``"off"``: always eager.

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
                 vsw_execution: str = "auto", per_sample_loss: bool = True,
                 cuda_graphs: str = "auto") -> None:
        check_choice("weight_sync", weight_sync, WEIGHT_SYNC_METHODS)
        check_choice("cuda_graphs", cuda_graphs, CUDA_GRAPH_MODES)
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
        self._norms = VSWNorms([])          # (main's BatchNorm layer, PackedNormStats) per layer
        self._packed = False                # _norms packed for the current VSWs
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
        # whole-step CUDA graphs (graphs module): captured steps by key, the capture stream
        self._graph_mode = cuda_graphs
        self._graphs = GraphCache(on_drop=self._lanes.synchronize)
        self._capture_stream: Any = None
        self._made_capturable = False
        self._graph_grads: CapturedStep | None = None   # the graph whose gradients p.grad shows
        self._autocast_cache = True                      # False while a forward is captured

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

    @property
    def cuda_graphs(self) -> str:
        """``"auto"`` or ``"off"`` (constructor argument)."""
        return self._graph_mode

    def graph_fallback_reason(self, ragged: bool = False, keep_local_grad: bool | str = False) -> str | None:
        """Why a step (``ragged``, keeping its local gradient or not) would run eagerly rather
        than as a CUDA graph, or ``None`` (it is captured after its warm-up, then replayed)."""
        return (worker_graph_blocker(self._graph_mode, self.device, self.precision, self.process_group,
                                     self._flat_grads, self.sync_timing, self.optimizer)
                or step_graph_blocker(self.batch_fallback_reason(ragged), ragged, keep_local_grad)
                or self._graphs.disabled)

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
        repack = num_vsw != len(self._vsws) or not self._packed
        while len(self._vsws) < num_vsw:
            self._vsws.append(self._new_replica(len(self._vsws)))
        for v in self._vsws[num_vsw:]:
            v.remove_hooks()
        del self._vsws[num_vsw:]
        if repack:
            # every VSW's BatchNorm statistics in one [n, C] tensor per layer (views per
            # replica); captured steps read the old tensors: forget them
            self._norms = pack_norm_stats([v.module for v in self._vsws])
            self._packed = True
            self._graphs.clear()
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
        t0 = self._clock()

        # --- batched (one pass over the n VSWs' micro-batches of each GA round) or per VSW
        # a GPU forming both similarity groups needs each VSW's own gradient: per VSW (this is
        # only the last iteration of an adaptation interval)
        # (with a process group every rank all-reduces sums, batched or not)
        reason = self.batch_fallback_reason(ragged)
        if self._split:
            reason = "the similarity groups split the VSWs"
        if self._graph_mode != "off":
            graphed = self._graph_step(micro_batches, sizes, reason, ragged, keep_local_grad, t0)
            if graphed is not None:
                return graphed
        return self._eager_step(micro_batches, sizes, reason, ragged, keep_local_grad, t0)

    # ------------------------------------------------------------------ shared by every execution
    def _log_once(self, message: str, reason: str) -> None:
        line = message % reason
        if line not in self._logged:
            self._logged.add(line)
            log.info(line)

    def _forward(self, vsw: _VSW, micro_batch: MicroBatch, weight: float,
                 losses: list[torch.Tensor]) -> torch.Tensor:
        """Forward of one micro-batch on ``vsw`` (current stream); appends ``loss * weight``
        (detached, on the device) to ``losses``; returns the (weighted, fp16-scaled) loss to
        back-propagate."""
        batch = to_device(micro_batch, self.device)
        with autocast(self.device, self.precision, self._autocast_cache):
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
        self._graphs.clear()             # the optimizer's state tensors are new
        self._made_capturable = False
        if self._scaler is not None and state.get("grad_scaler"):
            self._scaler.load_state_dict(state["grad_scaler"])
        cfg = state["config"]
        if cfg.get("local_batch_size") is not None:
            self.configure(cfg["num_vsw"], cfg["num_ga"], cfg["local_batch_size"])
        self.sync_replicas()

    def helper_cpu_s(self) -> float:
        """CPU seconds the VSW dispatcher threads spent computing so far (per-VSW execution on
        CPU runs VSWs 1..n-1 there; the caller's own thread and the communication thread are not
        counted): with the caller's ``time.thread_time`` the step's compute CPU, which the
        "wait" emulation scales (:mod:`jabasray.actors.emulation`)."""
        return self._pool.cpu_s

    def close(self) -> None:
        """Stop the VSW threads, drop captured graphs and remove the hooks from the main model."""
        self._graphs.clear()
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
