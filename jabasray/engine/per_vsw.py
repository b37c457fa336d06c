"""Per-VSW execution: every VSW runs its own forward/backward on its own replica (where a
batched pass would not be exact; :func:`~jabasray.engine.batched.batch_fallback_reason`).

**Per VSW.** Two schemes issue the VSWs' forward/backward, with the same arithmetic (each
VSW's micro-batches in order; bucket aggregation and launches from the hooks as above):

* ``"threads"`` (CPU default): one persistent dispatcher thread per VSW
  (:class:`~jabasray.engine.streams.VSWThreadPool`), VSW 0 on the caller's thread. On CPU the
  kernels run on the issuing thread and release the GIL, so the VSWs really compute in
  parallel. Each VSW's backward runs on its own thread
  (``torch.autograd.set_multithreading_enabled(False)``): on CUDA autograd would otherwise
  execute every VSW's backward on the device's one worker thread, one after another.
* ``"one_thread"`` (CUDA default): the caller's thread issues all VSWs, each onto its own
  (foreground-priority) stream, GA round by GA round - the forwards of every VSW's k-th
  micro-batch, then their backwards in VSW order. Reason: on CUDA, threads buy little
  concurrency: their Python forwards and backwards contend for the GIL (and by default
  autograd runs every CUDA ``backward()`` on the device's ONE worker thread, whichever
  thread calls it; the ``"threads"`` scheme turns that off per VSW thread). What
  makes VSWs overlap on a GPU is that each VSW's kernels are queued on its own stream ahead
  of the device: launches are asynchronous, so while the device still executes VSW k's
  forward/backward kernels, the host is already issuing VSW k+1's onto another stream, and
  the device runs them side by side. Issuing from one thread does exactly that without
  cross-thread hand-offs, and holds all VSWs' activations of one round at once, as the
  concurrent VSWs of the paper do (which is what the profiler's n_max probe measures).
  Per-VSW CUDA graphs were rejected: the bucket hooks (aggregation, launching all-reduces)
  are host code inside backward and cannot be captured.

:class:`PerVSWExecution` runs such a step on a :class:`~jabasray.engine.state.StepState` (its
VSWs, lanes and dispatcher threads) inside the eager frame of :mod:`.eager`; the bucket hooks
and :meth:`~jabasray.engine.aggregation.BucketAggregation.finish_vsw` aggregate.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .eager import EagerExecution, StepRequest
from .state import VSW, backward

MicroBatch = Any


class PerVSWExecution(EagerExecution):
    """The ``"threads"`` and ``"one_thread"`` schemes (module notes), the state's ``execution``."""

    def passes(self, req: StepRequest, begin_vsw: Callable[[VSW], tuple[list[int], list[torch.Tensor]]],
               weights: list[float], plan: Any = None) -> list[list[torch.Tensor]]:
        if self.state.execution == "threads":
            return self.run_threads(begin_vsw, req.micro_batches, weights)
        return self.run_one_thread(begin_vsw, req.micro_batches, weights)

    def run_threads(self, begin_vsw: Callable[[VSW], tuple[list[int], list[torch.Tensor]]],
                    micro_batches: Sequence[MicroBatch], weights: list[float]
                    ) -> list[list[torch.Tensor]]:
        """The ``"threads"`` scheme (CPU default): VSW 0 on the calling thread, VSW ``v`` on
        its own dispatcher thread, each running its micro-batches in order on its lane, its
        backward on that thread too (``torch.autograd.set_multithreading_enabled(False)``)."""
        state = self.state
        lanes, finish = state.lanes, self.buckets.finish_vsw

        def run_vsw(vsw: VSW) -> list[torch.Tensor]:
            # each VSW thread runs its own backward (CUDA: not queued behind the other VSWs on
            # the device's single autograd thread; thread-local; CPU: already the case)
            with lanes.context(lanes.vsw[vsw.index]), torch.autograd.set_multithreading_enabled(False):
                try:
                    idx, loss_sum = begin_vsw(vsw)
                    for k, i in enumerate(idx):
                        scaled = state.forward(vsw, micro_batches[i], weights[i], loss_sum)
                        backward(vsw, scaled, last=k == len(idx) - 1)
                    finish(vsw)
                finally:
                    vsw.in_step = vsw.counting = False
                return loss_sum

        return state.pool.run([lambda v=v: run_vsw(v) for v in state.vsws])

    def run_one_thread(self, begin_vsw: Callable[[VSW], tuple[list[int], list[torch.Tensor]]],
                       micro_batches: Sequence[MicroBatch], weights: list[float]
                       ) -> list[list[torch.Tensor]]:
        """The ``"one_thread"`` scheme (CUDA default; module notes): the
        calling thread issues every VSW onto its own stream, GA round by GA round: the
        forwards of round ``k`` of all VSWs, then their backwards in VSW order (each inside
        its stream's context, so backward kernels stay on that stream). The device runs the
        VSWs' queued kernels concurrently while the host issues the next VSW's work."""
        state = self.state
        lanes, vsws, finish = state.lanes, state.vsws, self.buckets.finish_vsw
        try:
            plans = []
            for v in vsws:
                with lanes.context(lanes.vsw[v.index]):
                    plans.append(begin_vsw(v))
            for v, (idx, _) in zip(vsws, plans):
                if not idx:                      # no samples at all (ragged): finished now
                    finish(v)
            for k in range(max(len(idx) for idx, _ in plans)):
                issued = []
                for v, (idx, loss_sum) in zip(vsws, plans):
                    if k < len(idx):
                        with lanes.context(lanes.vsw[v.index]):
                            issued.append((v, state.forward(v, micro_batches[idx[k]],
                                                            weights[idx[k]], loss_sum),
                                           k == len(idx) - 1))
                for v, scaled, last in issued:
                    with lanes.context(lanes.vsw[v.index]):
                        backward(v, scaled, last)
                        if last:
                            finish(v)
            return [loss_sum for _, loss_sum in plans]
        finally:
            for v in vsws:
                v.in_step = v.counting = False
