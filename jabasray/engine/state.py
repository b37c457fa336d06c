"""The state one IIDP step runs on: virtual stream workers, lanes, BatchNorm statistics, and
the forward of one micro-batch (JABAS/IIDP section 4).

:class:`StepState` is everything an execution (:mod:`.batched`, :mod:`.per_vsw`,
:mod:`.graphs`, :mod:`.segmented`) reads or writes besides the gradient buckets
(:class:`~jabasray.engine.aggregation.BucketAggregation`) and the update
(:class:`~jabasray.engine.weight_sync.WeightUpdate`):

* the VSWs (:class:`VSW`, main first): a replica, its flat buffers and its bucket counters;
* the lanes (:class:`~jabasray.engine.streams.Lanes`: CUDA streams, or their no-op CPU twins)
  and the VSW dispatcher threads (per-VSW execution on CPU);
* the per-VSW BatchNorm statistics (:class:`~jabasray.engine.vsw_norm.VSWNorms`, packed as one
  ``[n, C]`` tensor per layer);
* the configuration ``(n_vsw, n_GA, B_L)`` and the global number of decoupled workers;
* the step function (the user's ``step_fn``, autocast, fp16 scaling) as :meth:`StepState.forward`,
  and the training metrics a step accumulates.

No module of the engine's step imports the worker facade (:mod:`.iidp`); this module imports
none of the executions.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .buckets import BucketSpec, FlatBuffers
from .loader import batch_size, to_device
from .step import autocast, check_loss, split_step_output
from .streams import Lanes, VSWThreadPool
from .train_metrics import add_step_metrics
from .vsw_norm import VSWNorms

log = logging.getLogger(__name__)

MicroBatch = Any     # (inputs, targets) for the default step; any batch for a step_fn
HookFactory = Callable[["VSW", int, int], Callable[[torch.Tensor], None]]


class VSW:
    """One virtual stream worker: a model replica, its flat buffers and its bucket state.

    The bucket hooks (flat gradient buckets only) are made by the aggregation's ``make_hook``
    (:class:`~jabasray.engine.aggregation.BucketAggregation`, module notes, step 2): hooks on
    every parameter while the order of the last backward is traced, then one per bucket."""

    def __init__(self, index: int, module: nn.Module, specs: Sequence[BucketSpec], flat_grads: bool) -> None:
        self.index = index
        self.module = module
        self.buffers = FlatBuffers(module, specs, flat_grads=flat_grads)
        self.sizes = [len(s.names) for s in specs]  # parameters per bucket
        self.in_step = False                        # True while train_step runs this VSW (a
        # comm_guard may wait for it, as a background runner waits for the autograd engine)
        self.counting = False                       # True during this VSW's last backward
        self.done = [False] * len(specs)
        self.events: list[Any] = [None] * len(specs)
        self.marks: list[int] | None = None         # bucket versions before the last backward
        self.handles: list[Any] = []
        self.hooks: str | None = None               # "trace", "bucket" or None (no hooks)
        self.last: list[int | None] | None = None   # per bucket: the parameter finished last
        self.traced: list[int | None] = []          # what the running trace found
        self.retrace = False                        # the hook placement went stale

    def set_hooks(self, make_hook: HookFactory | None) -> None:
        """Register (``make_hook`` given, flat gradient buckets only) or remove (``None``) the
        bucket hooks. Autograd's own gradients (no process group) need none: nothing is copied
        or launched during backward, the buckets complete when the VSW's backward has ended."""
        want = None
        if make_hook is not None and self.buffers.flat_grads:
            want = "trace" if self.last is None or self.retrace else "bucket"
        if want == self.hooks:
            return
        self.remove_hooks()
        self.hooks = want
        params = self.buffers.modules_params
        if want == "trace":
            self.traced = [None] * len(params)
            targets = [(b, k) for b, plist in enumerate(params) for k in range(len(plist))]
        elif want == "bucket":
            targets = [(b, k) for b, k in enumerate(self.last) if k is not None]
        else:
            return
        for b, k in targets:
            self.handles.append(params[b][k].register_post_accumulate_grad_hook(make_hook(self, b, k)))

    def reset(self) -> None:
        self.done = [False] * len(self.sizes)
        self.events = [None] * len(self.sizes)
        self.marks = None

    def mark(self) -> None:
        """Before the last backward: the buckets' versions the hooks count from."""
        if self.buffers.flat_grads:
            self.marks = [self.buffers.grad_version(b) for b in range(len(self.sizes))]

    def complete(self, bucket: int) -> bool:
        """Every parameter of ``bucket`` accumulated its gradient in the last backward."""
        return self.buffers.grad_version(bucket) - self.marks[bucket] == self.sizes[bucket]

    def end_backward(self, make_hook: HookFactory | None) -> None:
        """After the last backward, before the unhooked buckets are completed: finish a trace
        (one hook per bucket from now on) or note a stale placement (traced again next step)."""
        if self.hooks is None or self.marks is None:
            return
        if self.hooks == "trace":
            self.last, self.retrace = list(self.traced), False
        elif any(not self.done[b] and self.complete(b) for b in range(len(self.sizes))):
            self.retrace = True
            log.debug("IIDP: VSW %d's bucket hooks are traced again (gradient order changed)",
                      self.index)
        self.set_hooks(make_hook)

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.hooks = None


def backward(vsw: VSW, scaled: torch.Tensor, last: bool) -> None:
    """Backward of one micro-batch of ``vsw``; during its ``last`` one the bucket hooks
    complete buckets (GA steps before it only accumulate)."""
    if last:
        vsw.mark()
    vsw.counting = last
    scaled.backward()


class StepState:
    """The state of one device's IIDP steps (module notes). Owned by the worker facade;
    executions read it and keep their per-step fields here (``active``, the metric sums)."""

    def __init__(self, model: nn.Module, specs: Sequence[BucketSpec], device: torch.device,
                 step_fn: Callable[[nn.Module, Any], torch.Tensor], precision: str, scaler: Any,
                 flat_grads: bool, execution: str, param_names: list[str]) -> None:
        self.device = device
        self.specs = list(specs)
        self.step_fn = step_fn
        self.precision = precision
        self.scaler = scaler                 # torch.amp.GradScaler (fp16) or None
        self.flat_grads = flat_grads         # gradients in flat bucket buffers
        self.execution = execution           # per-VSW scheme: "threads" or "one_thread"
        self.param_names = param_names       # trainable parameters in registration order
        self.lanes = Lanes(device)
        self.pool = VSWThreadPool(0)
        self.norms = VSWNorms([])            # (main's BatchNorm layer, PackedNormStats) per layer
        self.packed = False                  # norms packed for the current VSWs
        self.stale = False                   # replicas' weights lag the main VSW's (batched steps)
        self.vsws: list[VSW] = [VSW(0, model, specs, flat_grads)]
        self.lanes.resize(1)
        self.lock = threading.Lock()
        self.num_vsw = 1
        self.num_ga = 0
        self.local_batch_size: int | None = None
        self.global_num_workers = 1
        # per step
        self.active: list[VSW] = self.vsws[:1]   # VSWs that run backward in this step
        self.metric_sums: dict[str, torch.Tensor] = {}   # step_fn's metrics x samples (float64)
        self.metric_counts: dict[str, int] = {}          # samples behind each metric sum
        self.autocast_cache = True                       # False while a forward is captured
        self.graph_grads: Any = None         # the captured step whose gradients p.grad shows

    @property
    def main(self) -> VSW:
        return self.vsws[0]

    @property
    def num_workers(self) -> int:
        """Decoupled workers on this device: ``num_vsw * (num_ga + 1)``."""
        return self.num_vsw * (self.num_ga + 1)

    def refresh_replicas(self) -> None:
        """The one-way weight copy that batched steps skipped (no replica runs in them): done
        before a replica is used (a per-VSW step) or looked at."""
        if self.stale:
            main = self.vsws[0].buffers
            with torch.no_grad():
                for v in self.vsws[1:]:
                    v.buffers.copy_params_from(main)
            self.stale = False

    def begin_metrics(self) -> None:
        self.metric_sums, self.metric_counts = {}, {}

    def forward(self, vsw: VSW, micro_batch: MicroBatch, weight: float,
                losses: list[torch.Tensor]) -> torch.Tensor:
        """Forward of one micro-batch on ``vsw`` (current stream); appends ``loss * weight``
        (detached, on the device) to ``losses``; returns the (weighted, fp16-scaled) loss to
        back-propagate."""
        batch = to_device(micro_batch, self.device)
        with autocast(self.device, self.precision, self.autocast_cache):
            loss, metrics = split_step_output(self.step_fn(vsw.module, batch))
            loss = check_loss(loss)
        if metrics:
            with self.lock:
                add_step_metrics(self.metric_sums, self.metric_counts, metrics, batch_size(batch),
                                 self.device)
        scaled = loss if weight == 1.0 else loss * weight
        losses.append(scaled.detach())
        return self.scaler.scale(scaled) if self.scaler is not None else scaled
