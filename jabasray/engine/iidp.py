"""IIDP on one device: the worker facade over virtual stream workers, buckets and graphs.

JABAS/IIDP section 4. One :class:`IIDPWorker` owns one device and runs ``num_vsw`` virtual
stream workers (VSWs) on it, each a replica of the model (CUDA: its own stream; CPU: its own
persistent thread), each doing ``num_ga`` gradient-accumulation steps over micro-batches of the
SAME local batch size B_L, i.e. ``num_vsw * (num_ga + 1)`` *decoupled workers* on this device.

How one ``train_step`` executes, and where each part lives (read one module at a time)
-------------------------------------------------------------------------------------
1. **Micro-batch assignment**: VSW ``v`` processes ``micro_batches[v*(num_ga+1) + j]`` for
   ``j = 0 .. num_ga`` in that order (VSW 0 is the main VSW). This module.
2. **Forward/backward**, by one of four executions, each a small object running a step on
   the worker's :class:`~jabasray.engine.state.StepState` (VSWs, lanes, BatchNorm statistics,
   configuration), chosen per step by ONE function that says why
   (:func:`~jabasray.engine.execution.choose_execution`); the eager frame the batched and
   per-VSW executions share is :mod:`~jabasray.engine.eager`:

   * **batched** (:mod:`~jabasray.engine.batched`, the default wherever it is exact): after
     one-way weight sync every VSW holds the main VSW's weights, so GA round ``j`` of all ``n``
     VSWs is ONE forward/backward of the main VSW's module over the ``n`` micro-batches
     interleaved, BatchNorm per VSW (:mod:`~jabasray.engine.vsw_norm`); the same arithmetic
     as per-VSW execution (tests: equal in float64). The weight copy to the replicas is
     deferred until a replica is used (a per-VSW step) or looked at (``replicas()``);
   * **batched as a CUDA graph** (:mod:`~jabasray.engine.graphs`, ``cuda_graphs="auto"``, one
     CUDA device without a process group): the whole batched step including the optimizer
     captured once per key and replayed;
   * **segmented** (:mod:`~jabasray.engine.segmented`, a process group): the batched step
     split at bucket boundaries, the bucket all-reduces issued between the segments (CUDA:
     each segment a captured graph; CPU with ``segmented="on"``: eager segments);
   * **per VSW** (:mod:`~jabasray.engine.per_vsw`) where batching is not exact (a ragged step,
     ``per_sample_loss=False``, batch-coupled modules, micro-batches that cannot be joined, a
     forced ``vsw_execution``), with one log line naming the reason.
3. **Buckets, aggregation, all-reduce, update** (:mod:`~jabasray.engine.aggregation`,
   :class:`~jabasray.engine.weight_sync.WeightUpdate`): hooks
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
import time
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..validation import check_choice, check_float, check_int
from ..config import WEIGHT_SYNC_METHODS
from .aggregation import BucketAggregation
from .batched import BatchedExecution, batch_fallback_reason
from .buckets import (BucketPlan, bucket_nbytes, default_bucket_plan, make_bucket_specs,
                      trainable_parameters, validate_bucket_plan)
from .eager import StepRequest
from .execution import SEGMENTED_DEFAULT, SEGMENTED_MODES, Choice, choose_execution
from . import graphs
from .graphs import CUDA_GRAPH_MODES, GraphCache, GraphedExecution
from .loader import batch_size
from .per_vsw import PerVSWExecution
from .segmented import SegmentedExecution
from .state import VSW, StepState
from .stats import StepStats, _DeviceScalar, _Timings, read_losses  # noqa: F401  (re-exported)
from .step import PRECISIONS, make_grad_scaler, supervised_step
from .vsw_norm import coupling_modules, pack_norm_stats
from .weight_sync import ShardOptimizer, WeightUpdate, resolve_weight_sync

log = logging.getLogger(__name__)

MicroBatch = Any   # (inputs, targets) for the default step; any batch for a step_fn
# the global norm / inf check needs every bucket before any update
_SWS_WHY = "grad_clip_norm or loss scaling needs the whole gradient before the update"
VSW_EXECUTIONS = ("auto", "threads", "one_thread")


def _clone_state(sd: dict) -> dict:
    """A compact copy of a module's ``state_dict`` (BatchNorm statistics are views of packed
    ``[n, C]`` tensors, which ``deepcopy`` would copy whole); keeps its version metadata."""
    out = type(sd)((k, v.detach().clone()) for k, v in sd.items())
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        out._metadata = copy.deepcopy(meta)
    return out


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
            thread; a segmented step enters it on the caller's thread between two segments
            (CPU: from the bucket hook, CPU backward running on the caller's thread). ``None`` (default): nothing is called. Settable as the attribute
            ``comm_guard`` between steps.
        step_fn: ``step_fn(model, micro_batch) -> mean loss`` (0-d tensor) instead of the
            supervised default (dict batches, several outputs, auxiliary losses). A step_fn
            with the attribute ``runs_on_caller_thread = True`` (a coroutine of the calling
            thread: the user's own loop, :mod:`jabasray.train.bridge`) is called only from the
            thread calling :meth:`train_step`: per VSW, ``"one_thread"``.
        precision: ``"fp32" | "bf16" | "fp16"`` (:mod:`~jabasray.engine.step`: autocast, and a
            GradScaler for fp16).
        grad_clip_norm: clip the GLOBAL gradient (all-reduced and averaged, i.e. the gradient of
            the plain large-batch step) to this L2 norm before the update (None: no clipping).
            The norm couples all parameters, so clipping (like fp16's inf check) runs the update
            after the last bucket: OWS falls back to SWS (module notes of ``weight_sync``).
        vsw_execution: ``"auto"``: batched execution wherever it is exact, per VSW otherwise
            (CUDA, or a step_fn that runs on the caller's thread: ``"one_thread"``; CPU:
            ``"threads"``); ``"threads"`` or ``"one_thread"``
            force per-VSW execution with that scheme (:mod:`~jabasray.engine.per_vsw`).
        per_sample_loss: the step's loss is the mean of per-sample losses (the default
            ``loss_fn`` with ``reduction="mean"``), which batched execution needs; ``False``
            (e.g. a sum, a class-weighted mean, a loss normalised by token counts) runs per VSW.
        cuda_graphs: ``"auto"``: batched steps on one CUDA device are captured as CUDA graphs
            and replayed where possible (:mod:`~jabasray.engine.graphs`; otherwise eager, with
            one log line naming the reason); ``"off"``: always eager.
        segmented: steps with a process group, batched and otherwise capturable, as segments
            split at bucket boundaries with the all-reduces between them
            (:mod:`~jabasray.engine.segmented`): ``"auto"`` on CUDA with ``cuda_graphs="auto"``
            (each segment a CUDA graph); ``"on"`` also on CPU (eager segments); ``"off"``
            (the default, :data:`~jabasray.engine.execution.SEGMENTED_DEFAULT`, until the CUDA
            path has run on a GPU): the eager step with the communication thread.

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
                 cuda_graphs: str = "auto", segmented: str = SEGMENTED_DEFAULT) -> None:
        check_choice("weight_sync", weight_sync, WEIGHT_SYNC_METHODS)
        check_choice("segmented", segmented, SEGMENTED_MODES)
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
        scaler = make_grad_scaler(self.device, precision)
        self.process_group = process_group
        # NCCL needs device tensors; gloo takes CPU tensors
        self._comm_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        plan = (default_bucket_plan(model, bucket_cap_mb) if bucket_plan is None
                else validate_bucket_plan(model, bucket_plan))
        self.bucket_plan: BucketPlan = plan
        specs = make_bucket_specs(model, plan)
        self.weight_sync = weight_sync
        nbytes = bucket_nbytes(specs)
        method = resolve_weight_sync(weight_sync, nbytes, bucket_cap_mb)
        if method == "ows" and (grad_clip_norm is not None or scaler is not None):
            log.info("IIDP: SWS instead of OWS (%s)", _SWS_WHY)
            method = "sws"
        log.info("IIDP: %d buckets (%s bytes), weight sync %s (%s)", len(specs), nbytes, method, weight_sync)

        # flat gradient buckets only when they are all-reduced; on a single device gradients
        # stay autograd's tensors (no bucket copy at all)
        flat = process_group is not None if flat_grads is None else flat_grads
        is_cuda = self.device.type == "cuda"
        caller_thread = bool(getattr(step_fn, "runs_on_caller_thread", False))
        if caller_thread and vsw_execution == "threads":
            raise ValueError("vsw_execution='threads' calls step_fn from one thread per VSW, but this "
                             "step_fn runs only on the caller's thread (the user's own loop); use "
                             "'auto' or 'one_thread'")
        execution = (("one_thread" if is_cuda or caller_thread else "threads") if vsw_execution == "auto"
                     else vsw_execution)
        # the step's state: VSWs, lanes, BatchNorm statistics, configuration (state module)
        self.state = StepState(model, specs, self.device, self.step_fn, precision, scaler, flat,
                               execution, [n for n, _ in trainable_parameters(model)])
        # batched execution (module notes): exact unless forced off, a ragged step, a loss that
        # is not a per-sample mean, or modules that couple a batch's samples
        self._forced = None if vsw_execution == "auto" else vsw_execution
        self.per_sample_loss = per_sample_loss
        self._coupling = coupling_modules(model)
        self._logged: set[str] = set()      # fallback reasons already logged
        params = [p for _, p in trainable_parameters(model)]
        optimizer = optimizer_fn(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer_fn must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
        shard = ShardOptimizer(optimizer, self.state.vsws[0].buffers.modules_params)
        self._weights = WeightUpdate(optimizer, shard, scaler, grad_clip_norm, method)
        self._buckets = BucketAggregation(self.state, process_group, comm_guard)
        # True: synchronise the device around timed phases (profiling on CUDA); CPU is
        # synchronous anyway
        self.sync_timing = False
        # CUDA graphs (graphs and segmented modules): captured steps by key
        self._graph_mode = cuda_graphs
        self._segmented = segmented
        self._graphs = GraphCache(on_drop=self.state.lanes.synchronize)
        self._make_executions()

    def _make_executions(self) -> None:
        """The four executions over this worker's state (execution module)."""
        st, pg, cd = self.state, self.process_group, self._comm_device
        eager = (st, self._buckets, self._weights, pg, cd, self._clock,
                 lambda divisor: self._update(divisor))
        self._batched = BatchedExecution(*eager)
        self._per_vsw = PerVSWExecution(*eager)
        say = self._say_no_graph
        self._graphed = GraphedExecution(st, self._weights, self._graphs, self._clock, say)
        self._segments = SegmentedExecution(st, self._buckets, self._weights, pg, cd, self._graphs,
                                            self._clock, say)

    def _say_no_graph(self, why: str) -> None:
        self._log_once("IIDP: eager step (no CUDA graph: %s)", why)

    # ------------------------------------------------------------------ state views
    @property
    def _vsws(self) -> list[VSW]:
        return self.state.vsws

    @property
    def _lanes(self) -> Any:
        return self.state.lanes

    @property
    def _pool(self) -> Any:
        return self.state.pool

    @property
    def _specs(self) -> list:
        return self.state.specs

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer (over the main VSW's trainable parameters)."""
        return self._weights.optimizer

    @property
    def lr_factor(self) -> float:
        """The batch-size rule's LR multiplier, applied only around the optimizer step."""
        return self._weights.lr_factor

    @lr_factor.setter
    def lr_factor(self, value: float) -> None:
        self._weights.lr_factor = value

    @property
    def grad_clip_norm(self) -> float | None:
        return self._weights.grad_clip_norm

    @grad_clip_norm.setter
    def grad_clip_norm(self, value: float | None) -> None:
        self._weights.grad_clip_norm = value

    @property
    def comm_guard(self) -> Callable[[str], ContextManager[Any]] | None:
        """See the constructor; settable between steps."""
        return self._buckets.comm_guard

    @comm_guard.setter
    def comm_guard(self, value: Callable[[str], ContextManager[Any]] | None) -> None:
        self._buckets.comm_guard = value

    # ------------------------------------------------------------------ properties
    @property
    def model(self) -> nn.Module:
        """The main VSW's module (current weights)."""
        return self.state.vsws[0].module

    @property
    def num_vsw(self) -> int:
        return self.state.num_vsw

    @property
    def num_ga(self) -> int:
        return self.state.num_ga

    @property
    def local_batch_size(self) -> int | None:
        return self.state.local_batch_size

    @property
    def num_workers(self) -> int:
        """Decoupled workers on this device: ``num_vsw * (num_ga + 1)``."""
        return self.state.num_workers

    @property
    def global_num_workers(self) -> int:
        return self.state.global_num_workers

    @property
    def vsw_execution(self) -> str:
        """The VSW execution scheme in use: ``"threads"`` or ``"one_thread"``."""
        return self.state.execution

    @property
    def weight_sync_method(self) -> str:
        """The method in use: ``"sws"`` or ``"ows"`` (``"auto"`` resolved)."""
        return self._weights.method

    def set_weight_sync(self, method: str) -> None:
        """Use ``"sws"`` or ``"ows"`` from the next step on (a plan's predicted choice; the
        shard optimizer exists either way, so switching between steps is safe)."""
        self._weights.method = self._weight_sync_for(check_choice("weight_sync", method, ("sws", "ows")))

    def _weight_sync_for(self, method: str) -> str:
        """``method``, or SWS where it is OWS and clipping or a loss scaler is on (OWS updates
        buckets before the whole gradient is there; the global norm and the inf check need it)."""
        if method == "ows" and (self._weights.grad_clip_norm is not None or self.state.scaler is not None):
            self._log_once("IIDP: SWS instead of OWS (%s)", _SWS_WHY)
            return "sws"
        return method

    @property
    def grad_scaler(self) -> "torch.amp.GradScaler | None":
        """The loss scaler in use: the worker's own (fp16), one set by :meth:`set_grad_scaler`,
        or None."""
        return self.state.scaler

    def set_grad_scaler(self, scaler: "torch.amp.GradScaler") -> None:
        """Scale the losses with ``scaler`` (an enabled ``torch.amp.GradScaler``: a user's loop's,
        :mod:`jabasray.train`) from the next step on, in place of the worker's own.

        As for fp16 (:mod:`~jabasray.engine.step`): every micro-batch's loss of a global
        iteration is scaled by the same scale (it changes only in the update); the update
        unscales the ALL-REDUCED gradient, skips the optimizer step if it holds inf/NaN and
        updates the scale (:meth:`WeightUpdate.full_step`). An inf/NaN on any rank is in the
        all-reduced sum of every rank, so all ranks find it, skip and back off alike (no extra
        collective). The inf check is the host's: SWS, eager steps (no CUDA graph, no segments).
        A step function may name its scaler instead: ``step_fn.grad_scaler()`` (returning a
        GradScaler or None) is asked at the start of every step."""
        if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
            raise ValueError(f"grad_scaler must be an enabled torch.amp.GradScaler, got {scaler!r}")
        kind = getattr(scaler, "_device", self.device.type)
        if kind != self.device.type:
            raise ValueError(f"GradScaler: device must be {self.device.type!r} (the engine's device), "
                             f"got {kind!r}; build it as torch.amp.GradScaler({self.device.type!r})")
        # initialise the scale now (as make_grad_scaler: lazy initialisation is not thread-safe)
        type(scaler).scale(scaler, torch.ones((), device=self.device))
        self.state.scaler = self._weights.scaler = scaler
        self._weights.method = self._weight_sync_for(self._weights.method)
        if self._graph_mode != "off" or self._segmented != "off":
            self._log_once("IIDP: eager steps (%s)", "a GradScaler decides on the host whether to step")
            self._graph_mode, self._segmented = "off", "off"
            self._graphs.clear()

    def _adopt_grad_scaler(self) -> None:
        """The step function's own scaler (``step_fn.grad_scaler()``), where it names one."""
        ask = getattr(self.state.step_fn, "grad_scaler", None)
        if ask is not None:
            scaler = ask()
            if scaler is not None and scaler is not self.state.scaler:
                self.set_grad_scaler(scaler)

    @property
    def bucket_nbytes(self) -> list[int]:
        return bucket_nbytes(self.state.specs)

    def replicas(self) -> list[nn.Module]:
        """All VSW modules, main first (read-only use: tests, diagnostics); their weights are
        brought up to date first (batched steps defer the weight copy to the replicas)."""
        self.state.refresh_replicas()
        return [v.module for v in self.state.vsws]

    @property
    def cuda_graphs(self) -> str:
        """``"auto"`` or ``"off"`` (constructor argument)."""
        return self._graph_mode

    def graph_fallback_reason(self, ragged: bool = False, keep_local_grad: bool | str = False) -> str | None:
        """Why a step (``ragged``, keeping its local gradient or not) would run eagerly rather
        than as a CUDA graph (whole-step or segmented), or ``None`` (it is captured after its
        warm-up, then replayed)."""
        choice = self._choose(ragged, keep_local_grad)
        if choice.execution in ("graphed", "segmented"):
            return None if self.state.lanes.is_cuda else "segments run eagerly on CPU"
        return choice.graph_why or graphs.worker_graph_blocker(
            self._graph_mode, self.device, self.precision, self.process_group, self.state.flat_grads,
            self.sync_timing, self.optimizer) or graphs.step_graph_blocker(choice.batch_why, ragged, keep_local_grad)

    def batch_fallback_reason(self, ragged: bool = False) -> str | None:
        """Why a step (``ragged`` or not) would run per VSW now, or ``None``: it runs batched."""
        return batch_fallback_reason(self.state.num_vsw, ragged, self.per_sample_loss, self._coupling,
                                     self._forced)

    def _choose(self, ragged: bool, keep_local_grad: bool | str) -> Choice:
        """The execution of the next step and why (:func:`choose_execution`)."""
        st = self.state
        return choose_execution(
            num_vsw=st.num_vsw, ragged=ragged, keep_local_grad=keep_local_grad,
            per_sample_loss=self.per_sample_loss, coupling=self._coupling, forced=self._forced,
            graph_mode=self._graph_mode, segmented=self._segmented, device=self.device,
            precision=self.precision, process_group=self.process_group, flat_grads=st.flat_grads,
            hooks_enabled=self._buckets.hooks_enabled, sync_timing=self.sync_timing,
            optimizer=self.optimizer, graphs_disabled=self._graphs.disabled)

    # ------------------------------------------------------------------ configuration
    def configure(self, num_vsw: int, num_ga: int, local_batch_size: int) -> None:
        """Set (n_vsw, n_GA, B_L) at run time. Replicas are added (copies of the main VSW's
        current weights and buffers) or removed; the optimizer and its state are kept.
        Collective when a process group is set: all ranks must call it (all-reduce of the
        decoupled-worker count)."""
        num_vsw = check_int("num_vsw", num_vsw, min_value=1)
        num_ga = check_int("num_ga", num_ga, min_value=0)
        local_batch_size = check_int("local_batch_size", local_batch_size, min_value=1)
        st = self.state
        workers = num_vsw * (num_ga + 1)
        if self.process_group is not None:
            t = torch.tensor([workers], dtype=torch.int64, device=self._comm_device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
            st.global_num_workers = int(t.item())
        else:
            st.global_num_workers = workers
        st.lanes.synchronize()
        repack = num_vsw != len(st.vsws) or not st.packed
        while len(st.vsws) < num_vsw:
            st.vsws.append(self._new_replica(len(st.vsws)))
        for v in st.vsws[num_vsw:]:
            v.remove_hooks()
        del st.vsws[num_vsw:]
        if repack:
            # every VSW's BatchNorm statistics in one [n, C] tensor per layer (views per
            # replica); captured steps read the old tensors: forget them
            st.norms = pack_norm_stats([v.module for v in st.vsws])
            st.packed = True
            self._graphs.clear()
        st.lanes.resize(num_vsw)
        st.pool.resize(num_vsw - 1 if st.execution == "threads" else 0)
        st.num_vsw, st.num_ga, st.local_batch_size = num_vsw, num_ga, local_batch_size
        log.debug("IIDP configured: n_vsw=%d n_ga=%d B_L=%d (global workers %d)",
                  num_vsw, num_ga, local_batch_size, st.global_num_workers)

    def _new_replica(self, index: int) -> VSW:
        main = self.state.vsws[0].module
        with torch.no_grad():
            replica = copy.deepcopy(main)
        replica.train(main.training)
        return VSW(index, replica, self.state.specs, self.state.flat_grads)

    def sync_replicas(self) -> None:
        """Copy the main VSW's weights and buffers to every other VSW (after the user changed
        ``model`` directly, e.g. loaded weights)."""
        vsws = self.state.vsws
        main = vsws[0]
        with torch.no_grad():
            for v in vsws[1:]:
                v.buffers.copy_params_from(main.buffers)
                for (_, dst), (_, src) in zip(v.module.named_buffers(), main.module.named_buffers()):
                    dst.copy_(src)
        self.state.stale = False

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
        B = self.state.local_batch_size
        if B is None:
            raise ValueError("configure(num_vsw, num_ga, local_batch_size) must be called before train_step")
        if not isinstance(micro_batches, (list, tuple)):
            raise ValueError(f"micro_batches must be a list of batches, got {type(micro_batches).__name__}")
        want = self.num_workers
        if len(micro_batches) != want:
            raise ValueError(f"micro_batches must hold num_vsw*(num_ga+1) = {self.num_vsw}*({self.num_ga}+1) "
                             f"= {want} batches, got {len(micro_batches)}")
        sizes = []
        for i, mb in enumerate(micro_batches):
            try:
                n = batch_size(mb)
            except ValueError as e:
                raise ValueError(f"micro_batches[{i}]: {e}") from None
            if ragged:
                if not 0 <= n <= B:
                    raise ValueError(f"micro_batches[{i}] must hold between 0 and local_batch_size = "
                                     f"{B} samples (ragged), got {n}")
            elif n != B:
                raise ValueError(f"micro_batches[{i}] must hold local_batch_size = {B} "
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
            self._buckets.drain()
            self._buckets.exit_guard(e)      # a failed step never leaves the guard entered
            raise

    def _train_step(self, micro_batches: Sequence[MicroBatch], keep_local_grad: bool | str,
                    ragged: bool) -> StepStats:
        if keep_local_grad not in (False, True, "split"):
            raise ValueError(f"keep_local_grad must be False, True or 'split', got {keep_local_grad!r}")
        if keep_local_grad == "split" and self.num_vsw % 2:
            raise ValueError(f"keep_local_grad='split' needs an even num_vsw (two equal VSW groups), "
                             f"got {self.num_vsw}")
        sizes = self._check_micro_batches(micro_batches, ragged)
        self._adopt_grad_scaler()
        req = StepRequest(micro_batches, sizes, ragged, keep_local_grad, self._clock())
        # the one decision (execution module): a graph or segments where possible (they run
        # eagerly batched while their key warms up), batched where exact, else per VSW
        choice = self._choose(ragged, keep_local_grad)
        if choice.graph_why is not None:
            self._say_no_graph(choice.graph_why)
        if choice.capturable:
            self._graphed.prepare()
        if choice.execution == "graphed":
            stats = self._graphed.run(req)
            if stats is not None:
                return stats
        elif choice.execution == "segmented":
            stats = self._segments.run(req)
            if stats is not None:
                return stats
        why = choice.batch_why
        if why is None:
            try:
                rounds = self._batched.join(micro_batches)
            except ValueError as e:
                why = f"micro-batches cannot be joined: {e}"
            else:
                return self._batched.run(req, rounds)
        if self.num_vsw > 1:
            self._log_once("IIDP: per-VSW execution (%s)", why)
        return self._per_vsw.run(req)

    # ------------------------------------------------------------------ shared by every execution
    def _update(self, divisor: float) -> _Timings:
        """The update after the all-reduces (:meth:`WeightUpdate.update` over this worker's
        buckets and VSWs); a subclass may replace it (the benchmarks' naive baseline)."""
        return self._weights.update(self._buckets, self.state.vsws, len(self.state.specs), divisor,
                                    self._clock)

    def _log_once(self, message: str, reason: str) -> None:
        line = message % reason
        if line not in self._logged:
            self._logged.add(line)
            log.info(line)

    def _clock(self) -> float:
        if self.sync_timing:
            self.state.lanes.synchronize()
        return time.perf_counter()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """A snapshot (deep copy, not views of live tensors) of the weights (+ the main VSW's
        buffers, e.g. BatchNorm running statistics), optimizer state and configuration."""
        self.state.lanes.synchronize()
        scaler = self.state.scaler
        return {
            "model": _clone_state(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "config": {"num_vsw": self.num_vsw, "num_ga": self.num_ga,
                       "local_batch_size": self.local_batch_size},
            "weight_sync": self._weights.method,
            **({"grad_scaler": scaler.state_dict()} if scaler is not None else {}),
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
        self._graphed.made_capturable = False
        scaler = self.state.scaler
        if scaler is not None and state.get("grad_scaler"):
            scaler.load_state_dict(state["grad_scaler"])
        cfg = state["config"]
        if cfg.get("local_batch_size") is not None:
            self.configure(cfg["num_vsw"], cfg["num_ga"], cfg["local_batch_size"])
        self.sync_replicas()

    def helper_cpu_s(self) -> float:
        """CPU seconds the VSW dispatcher threads spent computing so far (per-VSW execution on
        CPU runs VSWs 1..n-1 there; the caller's own thread and the communication thread are not
        counted): with the caller's ``time.thread_time`` the step's compute CPU, which the
        "wait" emulation scales (:mod:`jabasray.actors.emulation`)."""
        return self.state.pool.cpu_s

    def close(self) -> None:
        """Stop the VSW threads, drop captured graphs and remove the hooks from the main model."""
        self._graphs.clear()
        self.state.pool.close()
        self._buckets.stop()
        for v in self.state.vsws:
            v.remove_hooks()

    def __del__(self) -> None:  # best effort
        try:
            self.state.pool.close()
            self._buckets.stop()
        except Exception:  # noqa: BLE001
            pass
