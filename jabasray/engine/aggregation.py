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
   buckets complete when the VSW's backward has ended (:meth:`BucketAggregation.finish_vsw`).

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

:class:`BucketAggregation` is one object per worker: the per-step bucket bookkeeping (which
VSWs finished which bucket, what is launched, the local-gradient snapshot), the hooks, the
communication thread and the ``comm_guard`` window. It reads the VSWs and lanes of the
:class:`~jabasray.engine.state.StepState` it is given, nothing else of the worker. The update
after the all-reduces is :class:`~jabasray.engine.weight_sync.WeightUpdate`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from .state import StepState, VSW
from .streams import DispatcherThread

log = logging.getLogger(__name__)


class Issued:
    """An all-reduce issued on the caller's thread, shaped like the communication thread's
    futures (``result()`` is its work)."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def result(self) -> Any:
        return self.work


class BucketAggregation:
    """Bucket completion, local aggregation and all-reduce launches (module notes).

    ``process_group``: the group the buckets are all-reduced over, or ``None``.
    ``comm_guard``: see :class:`~jabasray.engine.iidp.IIDPWorker` (entered once per step that
    communicates, just before the first bucket's all-reduce, left after the last wait)."""

    hooks_enabled = True    # False: buckets complete only after backward (no overlap; ablation)

    def __init__(self, state: StepState, process_group: Any,
                 comm_guard: Callable[[str], ContextManager[Any]] | None = None) -> None:
        self.state = state
        self.process_group = process_group
        self.comm_guard = comm_guard
        self.guard_cm: ContextManager[Any] | None = None   # the guard entered in this step
        self.comm: DispatcherThread | None = None          # communication thread (process group)
        # per step
        self.pending: list[int] = []
        self.ready: list[bool] = []
        self.next_launch = 0
        self.works: list[Any] = []
        self.snapshot: list[Any] | None = None
        self.split = False               # this step keeps the two VSW halves apart
        # this step has work on the comm lane: a process group (or flat gradient buckets),
        # several active VSWs or a snapshot of the local gradient (else a bucket is final once
        # its VSW finished it: no event, no launch, no wait - host work a plain step does not have)
        self.comm_work = True
        # where a completed bucket goes: None -> local aggregation + comm thread (eager
        # steps); a segmented step installs its own (the all-reduce between segments)
        self.on_ready: Callable[[int], None] | None = None
        self.record_events = True

    def begin_step(self, active: list[VSW], keep_local_grad: bool, split: bool) -> None:
        """Reset the per-step bookkeeping for a step whose backward runs on ``active``."""
        nb = len(self.state.specs)
        self.state.active = active
        self.pending = [len(active)] * nb
        self.ready = [False] * nb
        self.next_launch = 0
        self.works = [None] * nb
        self.split = split
        self.snapshot = [None] * nb if keep_local_grad else None
        # (flat gradient buckets: hooks complete and launch buckets during backward, as with a
        # process group, even when there is none)
        self.comm_work = (self.process_group is not None or self.state.flat_grads
                          or len(active) > 1 or self.snapshot is not None)

    def hook_factory(self) -> Callable[[VSW, int, int], Callable[[torch.Tensor], None]] | None:
        """What :meth:`VSW.set_hooks` registers: :meth:`make_hook`, or ``None`` (no hooks)."""
        return self.make_hook if self.hooks_enabled else None

    def make_hook(self, vsw: VSW, bucket: int, k: int) -> Callable[[torch.Tensor], None]:
        """The hook on parameter ``k`` of ``bucket`` (module notes, step 2): in the VSW's last
        backward, complete the bucket once every parameter of it has its gradient."""
        def hook(_param: torch.Tensor) -> None:
            if not vsw.counting or vsw.done[bucket] or not vsw.complete(bucket):
                return
            if vsw.hooks == "trace":
                vsw.traced[bucket] = k
            self.bucket_done(vsw, bucket)
        return hook

    def bucket_done(self, vsw: VSW, bucket: int) -> None:
        if vsw.done[bucket]:
            return
        vsw.done[bucket] = True
        if not self.comm_work:
            return          # one VSW's gradients, nothing to aggregate, snapshot or all-reduce
        # CUDA: grads of this bucket are on this stream (not inside a capture: no event a
        # stream outside the graph could wait for)
        vsw.events[bucket] = self.state.lanes.record() if self.record_events else None
        with self.state.lock:
            self.pending[bucket] -= 1
            if self.pending[bucket] == 0:
                self.ready[bucket] = True
                # launch strictly in plan order so that all ranks issue collectives alike
                while self.next_launch < len(self.ready) and self.ready[self.next_launch]:
                    self.launch(self.next_launch)
                    self.next_launch += 1

    def finish_vsw(self, vsw: VSW) -> None:
        """Mark the buckets this VSW never completed through hooks (unused params, empty
        micro-batches) as final, in plan order."""
        vsw.counting = False
        vsw.end_backward(self.hook_factory())
        vsw.buffers.finish()
        for b in range(len(self.state.specs)):
            if not vsw.done[b]:
                self.bucket_done(vsw, b)

    def half_sums(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket ``b`` summed over each half of the VSWs (first ``n/2`` / last ``n/2``), read
        before the local aggregation adds every VSW into the main one."""
        vsws = self.state.vsws
        half = len(vsws) // 2
        out = []
        for vs in (vsws[:half], vsws[half:]):
            flat = vs[0].buffers.bucket_flat_copy(b)
            for v in vs[1:]:
                flat.add_(v.buffers.bucket_flat_copy(b))
            out.append(flat)
        return out[0], out[1]

    def aggregate(self, b: int) -> None:
        """Local aggregation of bucket ``b`` into the main VSW on the ``comm`` lane (after the
        active VSWs' events), with the snapshot of the local gradient if one is kept."""
        lanes, active = self.state.lanes, self.state.active
        main = self.state.vsws[0].buffers
        with lanes.context(lanes.comm):
            for v in active:
                lanes.wait(lanes.comm, v.events[b])
            if self.snapshot is not None and self.split:
                self.snapshot[b] = self.half_sums(b)
            for v in active[1:]:
                main.add_bucket_from(v.buffers, b)
            if self.snapshot is not None and not self.split:
                self.snapshot[b] = main.bucket_flat_copy(b)

    def launch(self, b: int) -> None:
        """Local aggregation of bucket ``b`` into the main VSW (autograd hook: queues kernels,
        never blocks), then the async global all-reduce is handed to the communication thread
        (or to the segmented step's ``on_ready``)."""
        self.aggregate(b)
        if self.on_ready is not None:
            self.on_ready(b)
        elif self.process_group is not None:
            # never block here (autograd hook): the guard and the collective run on the
            # communication thread, in submission (= plan) order
            self.works[b] = self.comm_thread().submit(lambda: self.all_reduce_bucket(b))

    def comm_thread(self) -> DispatcherThread:
        if self.comm is None:
            self.comm = DispatcherThread("iidp-comm")
        return self.comm

    def all_reduce_bucket(self, b: int) -> Any:
        """Communication thread: open the guard at bucket 0, start bucket ``b``'s all-reduce
        (CUDA: on the ``comm`` stream, after the aggregation queued there); returns its work."""
        lanes = self.state.lanes
        with lanes.device_context(), lanes.context(lanes.comm):
            if b == 0:              # launches are in plan order: bucket 0 opens the window
                self.enter_guard()
            return dist.all_reduce(self.state.vsws[0].buffers.grads[b], op=dist.ReduceOp.SUM,
                                   group=self.process_group, async_op=True)

    def launched(self) -> None:
        """Caller's thread: wait until the communication thread started every bucket's
        all-reduce (re-raises a launch error); from then on the guard is held."""
        for fut in self.works:
            if fut is not None:
                fut.result()

    def drain(self) -> None:
        """After a failed step: let the communication thread finish what was submitted (so
        it cannot enter the guard after the step gave it up); errors are the step's."""
        for fut in self.works:
            if fut is not None:
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001 - the step already fails
                    pass

    def enter_guard(self) -> None:
        """Enter ``comm_guard("allreduce")`` once per step (before the first all-reduce)."""
        guard = self.comm_guard
        if guard is None or self.guard_cm is not None:
            return
        cm = guard("allreduce")
        cm.__enter__()
        self.guard_cm = cm

    def exit_guard(self, exc: BaseException | None = None) -> None:
        """Leave the guard entered by this step, if any (caller's thread, after the last wait)."""
        cm, self.guard_cm = self.guard_cm, None
        if cm is not None:
            cm.__exit__(type(exc) if exc is not None else None, exc,
                        exc.__traceback__ if exc is not None else None)

    def wait_bucket(self, b: int) -> None:
        """Make the update stream (CUDA) / this thread (CPU) wait for bucket ``b``'s all-reduce."""
        fut = self.works[b]
        if fut is not None:
            fut.result().wait()   # CUDA/NCCL: makes the current (update) stream wait
        elif self.state.lanes.is_cuda and self.comm_work:
            self.state.lanes.update.wait_stream(self.state.lanes.comm)

    def stop(self) -> None:
        if self.comm is not None:
            self.comm.stop()
            self.comm = None
