"""The segmented step: a batched step with a process group, split at bucket boundaries, the
bucket all-reduces issued between the segments (JABAS/IIDP section 4 steps 2-5; DeepPool
section 5 for issuing a step as a few graph launches).

A whole-step CUDA graph (:mod:`.graphs`) cannot hold the bucket all-reduces as the eager step
issues them (from the communication thread, while backward goes on). The segmented step
keeps the overlap by cutting the step where a gradient bucket becomes complete:

1. **Segments.** The batched step (:class:`~jabasray.engine.batched.BatchedExecution`'s
   arithmetic: ``n_GA + 1`` forward/backward rounds of the main VSW over the VSWs' joined
   micro-batches, per-VSW BatchNorm, loss weight ``n``) runs with the bucket hooks on. Each
   time buckets become ready (in plan order, :class:`~jabasray.engine.aggregation.BucketAggregation`)
   the current segment ends; the segment's ready buckets are all-reduced (SUM) on the ``comm``
   lane, after the segment, while the next segment runs. The last backward segment also sums
   the loss, which is all-reduced after it.
2. **Update.** After every all-reduce (a device-side wait on CUDA) the gradient is divided by
   the global number of decoupled workers and the optimizer steps (SWS arithmetic: per
   parameter the same as OWS); the weight copy to the replicas stays deferred, as after every
   batched step.

On CUDA each segment is captured as a CUDA graph (:func:`~jabasray.engine.graphs.captured_for`
decides warm-up, memory and failures, exactly as for the whole-step graph; the segments share
one memory pool and are replayed in capture order), the update as one more graph; a replay
step issues the segments and the all-reduces from the caller's thread and never reads the
device. Capture runs backward on the capturing thread
(``torch.autograd.set_multithreading_enabled(False)``), so the hook that ends a segment and
begins the next runs where the capture began.

On CPU (``segmented="on"``) nothing is captured: the segments run eagerly in capture order,
each bucket's all-reduce issued at its boundary (asynchronously, on the step's own thread:
CPU backward runs on the caller's thread) and waited before the update. The arithmetic is
that of the eager step with a process group; the tests compare the two in float64.

The ``comm_guard`` window opens before the first all-reduce and closes after the update, as
in the eager step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .aggregation import BucketAggregation, Issued
from .batched import batched_rounds, join_any_order, join_batches
from .eager import StepRequest
from .graphs import (GraphCache, StaticRounds, batch_signature, captured_for, graph_key, lr_tensors_in,
                     round_parts, static_inputs_of)
from .state import StepState
from .stats import StepStats
from .streams import new_stream
from .weight_sync import WeightUpdate

log = logging.getLogger(__name__)


@dataclass
class Segment:
    """One captured segment: its graph and the buckets complete at its end."""

    graph: Any                                  # torch.cuda.CUDAGraph (None on CPU)
    buckets: list[int] = field(default_factory=list)


@dataclass
class SegmentedStep:
    """A captured segmented step: the backward segments, the update graph, static inputs,
    static outputs (the loss, metric sums and counts) and the LR tensors."""

    segments: list[Segment]
    update: Any                                 # torch.cuda.CUDAGraph
    inputs: StaticRounds
    lr_tensors: list[torch.Tensor]
    lr_values: list[float]
    outputs: Any

    def refill(self, rounds: Sequence[Sequence[Any]], lrs: Sequence[float]) -> None:
        self.inputs.fill(rounds)
        for i, v in enumerate(lrs):
            if v != self.lr_values[i]:
                self.lr_tensors[i].fill_(v)
                self.lr_values[i] = v


class _Cutter:
    """Ends the running capture and begins the next one where buckets become ready (the
    ``on_ready`` of the aggregation during a capture). Buckets that become ready while no
    gradient accumulated since the last cut join the previous segment (no empty graphs)."""

    def __init__(self, state: StepState, pool: Any, stream: Any) -> None:
        self.state, self.pool, self.stream = state, pool, stream
        self.segments: list[Segment] = []
        self.graph: Any = None
        self.versions: tuple[int, ...] | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):     # (a hook may run under another stream guard)
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self, buckets: list[int]) -> None:
        self.graph.capture_end()
        self.segments.append(Segment(self.graph, buckets))
        self.graph = None

    def _versions(self) -> tuple[int, ...]:
        main = self.state.vsws[0].buffers
        return tuple(main.grad_version(b) for b in range(len(self.state.specs)))

    def on_ready(self, b: int) -> None:
        now = self._versions()
        if self.segments and now == self.versions:
            self.segments[-1].buckets.append(b)      # nothing accumulated since the last cut
            return
        self.end([b])
        self.versions = now
        self.begin()

    def abort(self) -> None:
        """End a capture left open by a failure (its graph is dropped)."""
        if self.graph is not None:
            try:
                self.graph.capture_end()
            except Exception:  # noqa: BLE001 - the capture already failed
                pass
            self.graph = None


class SegmentedExecution:
    """A batched step with a process group, as segments with the all-reduces between them
    (module notes). ``run`` returns ``None`` where the step runs eagerly instead (CUDA:
    warm-up of its key, a refused or failed capture; a reason logged once by ``say``)."""

    def __init__(self, state: StepState, buckets: BucketAggregation, update: WeightUpdate,
                 process_group: Any, comm_device: torch.device, cache: GraphCache,
                 clock: Callable[[], float], say: Callable[[str], None]) -> None:
        self.state, self.buckets, self.update = state, buckets, update
        self.process_group, self.comm_device = process_group, comm_device
        self.cache, self.clock, self.say = cache, clock, say
        self.capture_stream: Any = None

    # ------------------------------------------------------------------ shared
    def _begin(self) -> None:
        st = self.state
        main = st.vsws[0]
        self.buckets.begin_step([main], False, False)
        st.begin_metrics()
        st.graph_grads = None
        main.reset()
        main.set_hooks(self.buckets.hook_factory())
        main.in_step = True

    def _backward_rounds(self, rounds: Sequence[Any], weight: float) -> list[torch.Tensor]:
        """The batched forward/backward rounds of the main VSW (the bucket hooks end segments);
        returns the weighted losses."""
        st = self.state
        main = st.vsws[0]
        losses: list[torch.Tensor] = []
        main.buffers.begin_step()
        try:
            batched_rounds(st, self.buckets, rounds, weight, losses)
        finally:
            main.in_step = main.counting = False
        return losses

    def _stats(self, loss: torch.Tensor, req: StepRequest, t_compute: float, comm: float,
               optim: float, copy: float, graphed: bool, sums: dict, counts: dict) -> StepStats:
        st = self.state
        if st.num_vsw > 1:
            st.stale = True                       # replicas get the weights when used
        return StepStats(loss=loss, num_workers=st.num_workers, global_num_workers=st.global_num_workers,
                         num_samples=sum(req.sizes), compute_time=t_compute, comm_time=comm,
                         update_time=optim + copy, weight_sync=self.update.method, optimizer_time=optim,
                         copy_time=copy, batched=True, graphed=graphed, metric_sums=sums,
                         metric_counts=counts)

    def _all_reduce(self, b: int) -> None:
        """Bucket ``b``'s all-reduce on the ``comm`` lane (after the work queued on the
        current stream), issued from this thread; the guard opens at the first one."""
        lanes = self.state.lanes
        ready = lanes.record()
        with lanes.context(lanes.comm):
            lanes.wait(lanes.comm, ready)
            self.buckets.enter_guard()
            work = dist.all_reduce(self.state.vsws[0].buffers.grads[b], op=dist.ReduceOp.SUM,
                                   group=self.process_group, async_op=True)
        self.buckets.works[b] = Issued(work)

    # ------------------------------------------------------------------ run
    def run(self, req: StepRequest) -> StepStats | None:
        if self.state.lanes.is_cuda:
            return self._run_graphed(req)
        return self._run_eager(req)

    def _run_eager(self, req: StepRequest) -> StepStats | None:
        """CPU: the segments in capture order, each bucket's all-reduce at its boundary."""
        st, buckets = self.state, self.buckets
        join = join_batches if st.norms.active else join_any_order
        try:
            rounds = [join(r) for r in round_parts(req.micro_batches, st.num_vsw, st.num_ga)]
        except ValueError as e:
            self.say(f"micro-batches cannot be joined: {e}")
            return None
        self._begin()
        buckets.on_ready = self._all_reduce
        try:
            losses = self._backward_rounds(rounds, float(st.num_vsw))
        finally:
            buckets.on_ready = None
        t_compute = self.clock() - req.t0
        # float64 on every rank, as the eager step's (a ragged rank falls back to it and gloo
        # aborts on a collective of mixed dtypes)
        loss_t = torch.stack(losses).sum().reshape(1).to(self.comm_device, torch.float64)
        loss_work = dist.all_reduce(loss_t, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
        divisor = float(st.global_num_workers)
        self.update.copy_replicas, self.update.prescaled = False, False
        tm = self.update.update(buckets, st.vsws, len(st.specs), divisor, self.clock)
        tw = time.perf_counter()
        loss_work.wait()
        comm = tm.comm + time.perf_counter() - tw
        buckets.exit_guard()
        loss = (loss_t / divisor).reshape(())
        return self._stats(loss, req, t_compute, comm, tm.optim, tm.copy, False,
                           st.metric_sums, st.metric_counts)

    def _run_graphed(self, req: StepRequest) -> StepStats | None:
        """CUDA: replay the captured segments (capturing them once the key's warm-up is done)."""
        st = self.state
        sigs = {batch_signature(mb) for mb in req.micro_batches}
        if None in sigs or len(sigs) > 1:
            self.say("micro-batches hold values that are not tensors" if None in sigs
                     else "micro-batches of different shapes")
            return None
        key = ("segmented", st.global_num_workers) + graph_key(
            st.num_vsw, st.num_ga, st.local_batch_size, sigs.pop(), st.vsws[0].module.training,
            self.update.optimizer, self.update.grad_clip_norm)
        parts = round_parts(req.micro_batches, st.num_vsw, st.num_ga)

        def capture() -> SegmentedStep:
            cap = self.capture(parts)
            log.info("IIDP: step captured as %d CUDA graph segments and an update graph "
                     "(n_vsw=%d, n_GA=%d, B_L=%d)", len(cap.segments), st.num_vsw, st.num_ga,
                     st.local_batch_size)
            return cap
        cap = captured_for(self.cache, key, st.device, capture, self.say)
        if cap is None:
            return None
        return self.replay(cap, parts, req)

    def capture(self, parts: list[list[Any]]) -> SegmentedStep:
        """Capture the backward segments and the update graph (module notes); executes
        nothing. The segments share one memory pool (replayed in capture order)."""
        st, upd, buckets = self.state, self.update, self.buckets
        main = st.vsws[0]
        inputs = static_inputs_of(st, parts)
        if self.capture_stream is None:
            self.capture_stream = new_stream(st.device)
        divisor = float(st.global_num_workers)
        lr_t = [torch.full((), float(v), dtype=torch.float32, device=st.device) for v in upd.lr_values()]
        torch.cuda.synchronize(st.device)
        cutter = _Cutter(st, torch.cuda.graph_pool_handle(), self.capture_stream)
        self._begin()
        buckets.record_events = False          # no cross-stream events inside a capture
        buckets.on_ready = cutter.on_ready
        st.autocast_cache = False
        try:
            with torch.cuda.stream(self.capture_stream), torch.autograd.set_multithreading_enabled(False):
                cutter.begin()
                losses = self._backward_rounds(inputs.buffers, float(st.num_vsw))
                loss = torch.stack(losses).sum().reshape(1)
                sums, counts = dict(st.metric_sums), dict(st.metric_counts)
                cutter.end([])                 # the loss sum: all-reduced after this segment
                cutter.begin()                 # the update graph
                update = cutter.graph
                main_buffers = main.buffers
                for b in range(len(st.specs)):
                    main_buffers.scale_bucket(b, 1.0 / divisor)
                with lr_tensors_in(upd.optimizer, lr_t):
                    upd.clip()
                    upd.shard.step()
                update.capture_end()
                cutter.graph = None
        except BaseException:
            cutter.abort()
            raise
        finally:
            buckets.on_ready = None
            buckets.record_events = True
            st.autocast_cache = True
            st.begin_metrics()
        return SegmentedStep(cutter.segments, update, inputs, lr_t, [float(v) for v in upd.lr_values()],
                             (loss, sums, counts))

    def replay(self, cap: SegmentedStep, parts: list[list[Any]], req: StepRequest) -> StepStats:
        """Refill the inputs, replay every segment with its buckets' all-reduces after it,
        all-reduce the loss, wait for every all-reduce on the device, replay the update."""
        st, buckets = self.state, self.buckets
        lanes = st.lanes
        nb = len(st.specs)
        buckets.begin_step([st.vsws[0]], False, False)
        start_ev = lanes.record()
        with lanes.context(lanes.vsw[0]):
            lanes.wait(lanes.vsw[0], start_ev)
            cap.refill(parts, self.update.lr_values())
            for seg in cap.segments:
                seg.graph.replay()
                for b in seg.buckets:
                    self._all_reduce(b)
            loss_s, sums_s, counts = cap.outputs
            loss_t = loss_s.detach().to(torch.float64, copy=True)   # dtype as the eager step's
            sums = {k: v.clone() for k, v in sums_s.items()}
            ready = lanes.record()
            with lanes.context(lanes.comm):
                lanes.wait(lanes.comm, ready)
                loss_work = dist.all_reduce(loss_t, op=dist.ReduceOp.SUM, group=self.process_group,
                                            async_op=True)
            for b in range(nb):
                buckets.wait_bucket(b)            # NCCL: the current stream waits, not the host
            loss_work.wait()
            cap.update.replay()
            end_ev = lanes.record(lanes.vsw[0])
        lanes.wait(lanes.current(), end_ev)
        buckets.exit_guard()
        loss = (loss_t / float(st.global_num_workers)).reshape(())
        t = self.clock() - req.t0
        return self._stats(loss, req, t, 0.0, 0.0, 0.0, True, sums, dict(counts))
