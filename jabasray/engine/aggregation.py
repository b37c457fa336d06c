"""Buckets and aggregation: a VSW's replica and bucket counters, the hooks that complete
buckets during backward, local aggregation, the overlapped all-reduce and the update
(JABAS/IIDP section 4, steps 2-5 of one ``train_step``; the worker facade is
:class:`~jabasray.engine.iidp.IIDPWorker`).

2. **Backward into buckets**: with a process group, every replica's gradients live in flat
   bucket buffers (:class:`~jabasray.engine.buckets.FlatBuffers`), zeroed at the start of the
   step and bound as ``p.grad``, so autograd accumulates every micro-batch in place. Without a
   process group nothing is all-reduced, so gradients stay autograd's tensors and bucket
   operations act on per-parameter lists (saves the zeroing; ``flat_grads=True`` forces the
   flat layout); nothing is then launched during backward, and no hook is registered: the
   buckets complete when the VSW's backward has ended (:meth:`BucketAggregation._finish_vsw`).

   **One hook per bucket** (flat buckets), not one per parameter per replica: a Python hook
   per parameter per micro-batch is host time a plain step does not pay (the DDP reducer's
   per-parameter hooks are C++). In-place accumulation into a bucket's views bumps the flat
   tensor's shared version counter once per parameter, so during the LAST micro-batch of a
   VSW, bucket ``b`` is complete exactly when its version has grown by ``len(b)`` since that
   backward began (each parameter accumulates at most once per backward). One
   post-accumulate-grad hook per bucket, on the parameter autograd finishes LAST within the
   bucket, checks that and completes the bucket, overlapping its aggregation and all-reduce
   with the rest of backward as a per-parameter counter would. Which parameter is last is
   learned from one traced backward (the first step of each VSW: hooks on every parameter,
   each checking the version; the one whose check passes first is the last). The check keeps
   every step exact whatever the order: a bucket whose hooked parameter is not last (a
   dynamic graph), or that holds a parameter without gradient, is simply completed after the
   VSW's backward, and a hook placement found stale (a bucket complete at the end of backward
   but not through its hook) is traced again in the VSW's next step.
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

:class:`BucketAggregation` is a mixin of :class:`~jabasray.engine.iidp.IIDPWorker`; it uses the
worker's ``_vsws`` (main first), ``_active`` (VSWs that run backward in this step), ``_specs``
(bucket layouts), ``_lanes`` (streams/events), ``_lock``, the per-step ``_pending``/``_ready``/
``_next_launch``/``_works``/``_snapshot``/``_split``, ``process_group``, ``comm_guard``,
``optimizer``/``_shard``/``_scaler``, ``grad_clip_norm``, ``lr_factor``, ``_method``,
``_copy_replicas``/``_prescaled`` and ``_clock``.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .buckets import FlatBuffers
from .stats import _Timings
from .streams import DispatcherThread

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .iidp import IIDPWorker


class _VSW:
    """One virtual stream worker: a model replica, its flat buffers and its bucket state."""

    def __init__(self, index: int, module: nn.Module, specs, owner: "IIDPWorker") -> None:
        self.index = index
        self.module = module
        self.buffers = FlatBuffers(module, specs, flat_grads=owner._flat_grads)
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

    def set_hooks(self, on: bool, owner: "IIDPWorker") -> None:
        """Register (``on``, flat gradient buckets only) or remove the bucket hooks (module
        notes, step 2): hooks on every parameter while the order is traced, then one per
        bucket. Autograd's own gradients (no process group) need none: nothing is copied or
        launched during backward, :meth:`BucketAggregation._finish_vsw` completes the buckets."""
        want = None
        if on and self.buffers.flat_grads and owner._bucket_hooks:
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
            self.handles.append(params[b][k].register_post_accumulate_grad_hook(
                owner._make_hook(self, b, k)))

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

    def end_backward(self, owner: "IIDPWorker") -> None:
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
        self.set_hooks(True, owner)

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.hooks = None



class BucketAggregation:
    """Bucket completion, local aggregation, all-reduce launches and the update (module notes)."""

    _bucket_hooks = True    # False: buckets complete only after backward (no overlap; ablation)
    # this step has work on the comm lane: a process group (or flat gradient buckets), several
    # active VSWs or a snapshot of the local gradient (else a bucket is final once its VSW
    # finished it: no event, no launch, no wait - host work a plain step does not have)
    _comm_work = True

    def _make_hook(self, vsw: _VSW, bucket: int, k: int) -> Callable[[torch.Tensor], None]:
        """The hook on parameter ``k`` of ``bucket`` (module notes, step 2): in the VSW's last
        backward, complete the bucket once every parameter of it has its gradient."""
        def hook(_param: torch.Tensor) -> None:
            if not vsw.counting or vsw.done[bucket] or not vsw.complete(bucket):
                return
            if vsw.hooks == "trace":
                vsw.traced[bucket] = k
            self._vsw_bucket_done(vsw, bucket)
        return hook

    def _vsw_bucket_done(self, vsw: _VSW, bucket: int) -> None:
        if vsw.done[bucket]:
            return
        vsw.done[bucket] = True
        if not self._comm_work:
            return          # one VSW's gradients, nothing to aggregate, snapshot or all-reduce
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
        vsw.end_backward(self)
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
        elif self._lanes.is_cuda and self._comm_work:
            self._lanes.update.wait_stream(self._lanes.comm)

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
