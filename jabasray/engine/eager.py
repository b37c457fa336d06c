"""The eager step: one ``train_step`` issued op by op, batched or per VSW (JABAS/IIDP section 4).

:class:`EagerSteps` (a mixin of :class:`~jabasray.engine.iidp.IIDPWorker`) runs a step that is
not replayed as a CUDA graph, in the order of the worker's module notes:

1. choose the execution: batched (:mod:`.batched`; the GA rounds' micro-batches joined) unless
   the facade gave a ``reason`` not to, or the micro-batches cannot be joined; then per VSW
   (:mod:`.per_vsw`, threads or one thread), with one log line per reason;
2. reset the per-step bookkeeping of buckets and launches (:mod:`.aggregation`) and, for a
   ragged step, start the all-reduce of its sample count;
3. forward/backward; the hooks complete buckets and launch their all-reduces meanwhile;
4. sum the losses on the update lane (all-reduced with a process group), then the update:
   the all-reduced gradient divided by the global number of decoupled workers -- or, batched
   on one device, already averaged in the loss -- and one-way weight sync (:mod:`.weight_sync`);
5. the :class:`~jabasray.engine.stats.StepStats`, the loss a 0-d device tensor that the caller
   reads once per interval (only a ragged step reads the device: its sample count).

It uses the worker's state (``_vsws``, ``_lanes``, ``_specs``, the per-step fields), its
``_log_once`` and ``_refresh_replicas``, and the other mixins' ``_run_batched``,
``_run_vsws_threads``/``_run_vsws_one_thread``, ``_launched``, ``_update`` and
``_exit_comm_guard``.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from .batched import join_any_order, join_batches
from .stats import StepStats

if TYPE_CHECKING:
    from .aggregation import _VSW


class EagerSteps:
    """The eager ``train_step`` of :class:`~jabasray.engine.iidp.IIDPWorker` (module notes)."""

    def _eager_step(self, micro_batches: Sequence[Any], sizes: list[int], reason: str | None,
                    ragged: bool, keep_local_grad: bool | str, t0: float) -> StepStats:
        """One step without a CUDA graph; ``reason``: why it cannot run batched (or None)."""
        lanes, B = self._lanes, self._local_batch_size
        nb = len(self._specs)
        ga_rounds = self._num_ga + 1
        self._graph_grads = None          # an eager step allocates its own gradients
        rounds = None
        if reason is None:
            try:
                n = self._num_vsw
                # without per-VSW BatchNorm the row order is free: micro-batches that lie back
                # to back (the loader's views of one batch) join without a copy
                join = join_batches if self._norms.active else join_any_order
                rounds = [join([micro_batches[v * ga_rounds + j] for v in range(n)]) for j in range(ga_rounds)]
            except ValueError as e:
                reason = f"micro-batches cannot be joined: {e}"
        if reason is not None:
            if self._num_vsw > 1:
                self._log_once("IIDP: per-VSW execution (%s)", reason)
            self._refresh_replicas()
        self._active = self._vsws[:1] if rounds is not None else self._vsws

        # --- per-step state
        self._pending = [len(self._active)] * nb
        self._ready = [False] * nb
        self._next_launch = 0
        self._works = [None] * nb
        self._snapshot = [None] * nb if keep_local_grad else None
        # (flat gradient buckets: hooks complete and launch buckets during backward, as with a
        # process group, even when there is none)
        self._comm_work = (self.process_group is not None or self._flat_grads
                           or len(self._active) > 1 or self._snapshot is not None)
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
            vsw.set_hooks(True, self)            # bucket hooks with flat gradients only
            vsw.buffers.begin_step()
            if vsw.index > 0 and vsw.module.training != training:
                vsw.module.train(training)
            base = vsw.index * ga_rounds
            vsw.in_step = True
            return [base + j for j in range(ga_rounds) if sizes[base + j] > 0], []

        if rounds is not None:
            # the 1/(global decoupled workers) of step 4 folded into the loss: the gradients
            # leave backward averaged (no extra pass over them in the update). Single device
            # only: with a process group another rank may run per VSW this step (e.g. forming
            # both similarity groups), and every rank must all-reduce SUMS
            fold = pg is None
            losses = self._run_batched(begin_vsw, rounds,
                                       self._num_vsw / (self._global_num_workers if fold else 1))
        elif self._execution == "threads":
            losses = self._run_vsws_threads(begin_vsw, micro_batches, weights)
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
            if pg is None:          # nothing to all-reduce: one loss is the sum (no op at all)
                loss_t = (flat_losses[0] if len(flat_losses) == 1 else torch.stack(flat_losses).sum()
                          if flat_losses else torch.zeros((), device=self.device))
            else:
                # float64 on every rank: a rank without samples (a ragged step) has no loss to
                # take the dtype from, and gloo aborts on a collective of mixed dtypes
                loss_t = (torch.stack(flat_losses).sum().reshape(1).to(self._comm_device, torch.float64)
                          if flat_losses else torch.zeros(1, dtype=torch.float64, device=self._comm_device))
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
        loss_value = loss_t if self._prescaled else loss_t / divisor
        if loss_value.dim():
            loss_value = loss_value.reshape(())
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

