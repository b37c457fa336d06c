"""The eager step: one ``train_step`` issued op by op (JABAS/IIDP section 4).

:class:`EagerExecution` is the frame every step without a CUDA graph shares; a subclass says
how the forward/backward passes run (:meth:`EagerExecution.passes`): batched
(:class:`~jabasray.engine.batched.BatchedExecution`, the GA rounds' micro-batches joined) or
per VSW (:class:`~jabasray.engine.per_vsw.PerVSWExecution`, threads or one thread). The frame:

1. reset the per-step bookkeeping of buckets and launches
   (:meth:`~jabasray.engine.aggregation.BucketAggregation.begin_step`) and, for a ragged step,
   start the all-reduce of its sample count;
2. forward/backward (the subclass); the hooks complete buckets and launch their all-reduces
   meanwhile;
3. sum the losses on the update lane (all-reduced with a process group), then the update
   (:class:`~jabasray.engine.weight_sync.WeightUpdate`): the all-reduced gradient divided by
   the global number of decoupled workers -- or, batched on one device, already averaged in
   the loss -- and one-way weight sync;
4. the :class:`~jabasray.engine.stats.StepStats`, the loss a 0-d device tensor that the caller
   reads once per interval (only a ragged step reads the device: its sample count).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .aggregation import BucketAggregation
from .state import StepState, VSW
from .stats import StepStats
from .weight_sync import WeightUpdate


@dataclass
class StepRequest:
    """One ``train_step``'s arguments, checked: the micro-batches, their sizes, whether the
    step is ragged, keeps its local gradient (``True`` or ``"split"``), and its start time."""

    micro_batches: Sequence[Any]
    sizes: list[int]
    ragged: bool
    keep_local_grad: bool | str
    t0: float

    @property
    def split(self) -> bool:
        return self.keep_local_grad == "split"


class EagerExecution:
    """The frame of an eager step (module notes); subclasses implement :meth:`passes`.

    ``run_update(divisor) -> _Timings`` runs the update (the worker's
    :class:`~jabasray.engine.weight_sync.WeightUpdate` ``update`` over this state's buckets),
    after this frame set the update's per-step ``copy_replicas`` and ``prescaled``;
    ``clock()`` returns the host time (synchronising the device when the profiler asks)."""

    batched = False      # the step runs the main VSW's module only (replicas' copy deferred)

    def __init__(self, state: StepState, buckets: BucketAggregation, update: WeightUpdate,
                 process_group: Any, comm_device: torch.device, clock: Callable[[], float],
                 run_update: Callable[[float], Any]) -> None:
        self.state, self.buckets, self.update = state, buckets, update
        self.process_group, self.comm_device, self.clock = process_group, comm_device, clock
        self.run_update = run_update

    def active(self) -> list[VSW]:
        """The VSWs whose backward runs in this step."""
        return self.state.vsws

    def passes(self, req: StepRequest, begin_vsw: Callable[[VSW], tuple[list[int], list[torch.Tensor]]],
               weights: list[float], plan: Any) -> list[list[torch.Tensor]]:
        """Forward/backward of the step; returns each active VSW's (weighted) losses."""
        raise NotImplementedError

    def loss_weight_folded(self) -> bool:
        """The 1/(global decoupled workers) of the update is folded into the loss."""
        return False

    def run(self, req: StepRequest, plan: Any = None) -> StepStats:
        """One step without a CUDA graph (module notes); ``plan``: what :meth:`passes` needs
        beyond the request (the joined rounds of a batched step)."""
        state, buckets = self.state, self.buckets
        lanes, B = state.lanes, state.local_batch_size
        ga_rounds = state.num_ga + 1
        sizes = req.sizes
        active = self.active()
        buckets.begin_step(active, bool(req.keep_local_grad), req.split)
        state.begin_metrics()
        state.graph_grads = None          # an eager step allocates its own gradients
        if not self.batched:
            state.refresh_replicas()      # replicas run: their weights brought up to date first
        weights = [n / B for n in sizes] if req.ragged else [1.0] * len(sizes)
        pg = self.process_group
        count_work = None
        count_t = None
        if req.ragged:
            count_t = torch.tensor([sum(weights)], dtype=torch.float64, device=self.comm_device)
            if pg is not None:
                count_work = dist.all_reduce(count_t, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        start_ev = lanes.record()
        training = state.vsws[0].module.training
        make_hook = buckets.hook_factory()

        def begin_vsw(vsw: VSW) -> tuple[list[int], list[torch.Tensor]]:
            """(on the VSW's stream) its non-empty micro-batches and its (weighted) losses"""
            lanes.wait(lanes.vsw[vsw.index], start_ev)
            vsw.reset()
            vsw.set_hooks(make_hook)             # bucket hooks with flat gradients only
            vsw.buffers.begin_step()
            if vsw.index > 0 and vsw.module.training != training:
                vsw.module.train(training)
            base = vsw.index * ga_rounds
            vsw.in_step = True
            return [base + j for j in range(ga_rounds) if sizes[base + j] > 0], []

        losses = self.passes(req, begin_vsw, weights, plan)
        t_compute = self.clock() - req.t0

        if pg is not None:
            buckets.launched()    # every bucket is in flight, the guard (if any) held

        # --- loss statistic (all-reduced with the gradients; waited at the end)
        prescaled = self.loss_weight_folded()
        with lanes.context(lanes.update):
            for v in active:
                lanes.wait(lanes.update, lanes.record(lanes.vsw[v.index]))
            flat_losses = [x for vsw_losses in losses for x in vsw_losses]
            if pg is None:          # nothing to all-reduce: one loss is the sum (no op at all)
                loss_t = (flat_losses[0] if len(flat_losses) == 1 else torch.stack(flat_losses).sum()
                          if flat_losses else torch.zeros((), device=state.device))
            else:
                # float64 on every rank: a rank without samples (a ragged step) has no loss to
                # take the dtype from, and gloo aborts on a collective of mixed dtypes
                loss_t = (torch.stack(flat_losses).sum().reshape(1).to(self.comm_device, torch.float64)
                          if flat_losses else torch.zeros(1, dtype=torch.float64, device=self.comm_device))
            loss_work = (dist.all_reduce(loss_t, op=dist.ReduceOp.SUM, group=pg, async_op=True)
                         if pg is not None else None)
            if req.ragged:   # (per-VSW fallback: reading the sample count synchronises)
                if count_work is not None:
                    count_work.wait()
                divisor = float(count_t.item())
                if divisor <= 0:
                    raise ValueError("micro_batches hold no samples on any device (ragged step)")
            else:
                divisor = float(state.global_num_workers)
            self.update.copy_replicas, self.update.prescaled = not self.batched, prescaled
            tm = self.run_update(divisor)
            comm_time = tm.comm
            if loss_work is not None:
                tw = time.perf_counter()
                loss_work.wait()
                comm_time += time.perf_counter() - tw
            end_ev = lanes.record(lanes.update)
        lanes.wait(lanes.current(), end_ev)
        # on the device: read once per interval (batched: the losses are already averaged)
        loss_value = loss_t if prescaled else loss_t / divisor
        if loss_value.dim():
            loss_value = loss_value.reshape(())
        buckets.exit_guard()
        if self.batched and state.num_vsw > 1:
            state.stale = True                         # replicas get the weights when used
        local_grad = self.local_grad(req, divisor if prescaled else 1.0)
        return StepStats(loss=loss_value, num_workers=state.num_workers,
                         global_num_workers=state.global_num_workers, num_samples=sum(sizes),
                         compute_time=t_compute, comm_time=comm_time, update_time=tm.optim + tm.copy,
                         weight_sync=self.update.method, local_grad=local_grad, optimizer_time=tm.optim,
                         copy_time=tm.copy, batched=self.batched,
                         metric_sums=state.metric_sums, metric_counts=state.metric_counts)

    def local_grad(self, req: StepRequest, unfold: float) -> torch.Tensor | None:
        """The kept local gradient (``train_step``'s ``keep_local_grad``) from the snapshot;
        ``unfold``: the factor that undoes an average folded into the loss."""
        buckets = self.buckets
        out = None
        if req.keep_local_grad:
            main = self.state.vsws[0].buffers
            names = self.state.param_names
            if req.split:
                out = torch.stack([main.grads_in_param_order(names, [s[h] for s in buckets.snapshot])
                                   for h in (0, 1)])
            else:
                out = main.grads_in_param_order(names, buckets.snapshot)
                if unfold != 1.0:
                    out = out * unfold        # the sum, before the folded average
        buckets.snapshot = None
        return out
