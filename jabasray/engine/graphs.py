"""Whole-step CUDA graphs for batched IIDP steps: when a step can be captured, and the bookkeeping.

A batched IIDP step on one device (:mod:`~jabasray.engine.batched`) is a fixed sequence of
kernels once ``(B_L, n_vsw, n_GA)`` and the input shapes are fixed: the ``n_GA + 1`` forward /
backward rounds over the VSWs' interleaved micro-batches, the gradient accumulation in place,
the optimizer step. Issuing it from Python costs host time per kernel (the step is host-bound
on a GPU for small local batches); a CUDA graph issues it with one launch. This module follows
PyTorch's documented whole-network capture recipe (``torch.cuda.graph``, "CUDA Graphs" in the
CUDA semantics notes):

1. **Warm-up on a side stream.** The first :data:`GRAPH_WARMUP_STEPS` steps of a signature run
   eagerly (they are real training steps, on the VSW's non-default stream): they create the
   optimizer state and let the libraries pick their kernels before anything is captured.
2. **Capture.** Gradients are set to ``None`` first, so backward allocates them from the
   graph's private memory pool, and every replay writes them afresh (GA rounds after the first
   accumulate into them, as eagerly). The step's inputs are read from *static* buffers
   (:class:`StaticRounds`) that each replay refills in place; the loss and training metrics are
   static outputs, copied (on the device, no read) after each replay. Capture records kernels
   and executes none, so the step it was captured for is then run by one replay.
3. **Optimizer.** Its step is captured only where it is capturable AND its learning rate can
   change without a new capture (:func:`graph_optimizer_blocker`): ``Adam``/``AdamW`` run with
   ``capturable=True`` (step counters on the device), ``SGD`` runs fused (``fused=True``); both
   take the LR as a 0-d device tensor (:func:`lr_tensors_in`), refilled before a replay when
   ``lr * lr_factor`` changed (a scheduler, the batch-size rule), so an LR change is a kernel,
   not a re-capture. :func:`make_capturable` switches the user's optimizer over (the same
   update arithmetic; the eager warm-up steps already use it).
4. **Replay.** Refill the static inputs (one ``torch.stack`` per round into the interleaved
   buffer), refill changed LRs, ``graph.replay()``: no host synchronisation; the loss is read
   once per interval by the caller (:func:`~jabasray.engine.iidp.read_losses`).

Where a step cannot be captured it runs eagerly, and the worker logs ONE line naming the
reason (:func:`worker_graph_blocker` for reasons of the whole worker: CPU, ``cuda_graphs="off"``,
fp16 loss scaling, a process group, a non-capturable optimizer, ...; :func:`step_graph_blocker`
for reasons of one step: per-VSW execution, a ragged last batch, a local gradient to keep;
:class:`GraphCache` for keys that change too often and failed captures;
:func:`memory_headroom_blocker` where the graph's memory pool would leave too little for a
later eager step). :func:`captured_for` is that decision for one key (warm-up, memory check,
capture, failure), shared with the packed step's graphs (:mod:`jabasray.engine.packing.graphed`).

The one-way weight copy to the replicas is not captured: a batched step runs no replica, so
the copy is deferred until a replica is used (:meth:`~jabasray.engine.state.StepState.refresh_replicas`), as eagerly.

What invalidates a graph: a different key (:func:`graph_key`: configuration, input signature,
train/eval mode, the optimizer's hyper-parameters other than the LR, clipping), a
reconfiguration to another ``n_vsw`` (the BatchNorm statistics are re-packed) and a loaded
optimizer state (new state tensors): the worker clears the cache then.

:class:`GraphedExecution` takes a step down this path on a
:class:`~jabasray.engine.state.StepState` (configuration, VSWs, lanes, BatchNorm statistics,
the forward) with the worker's :class:`~jabasray.engine.weight_sync.WeightUpdate` (optimizer,
clipping, LR values) and :class:`GraphCache`.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Mapping   # (isinstance with typing's alias is ~5x slower)
from typing import Any, Callable, Iterator, Sequence

import torch

from ..config import CUDA_GRAPH_MODES  # noqa: F401  ("auto" | "off"; torch-free, shared with JobConfig)
from .loader import _is_per_sample, to_device
from .stats import StepStats
from .streams import new_stream
from .vsw_norm import ghost_norms

log = logging.getLogger(__name__)

GRAPH_WARMUP_STEPS = 3               # eager steps of a key before its capture (PyTorch's recipe: a few)
MAX_GRAPHS = 1                       # captured steps kept (LRU): each holds a private memory pool
                                     # of about one step's working memory, on top of what eager
                                     # steps (warm-up, ragged, similarity) still need
MEMORY_MARGIN = 1.1                  # capture only if free device memory >= this x a step's working set
MAX_SIGNATURES = 8                   # captures before the thrash check below applies
REPLAYS_PER_CAPTURE = 4              # fewer replays per capture than this (after MAX_SIGNATURES
                                     # captures): keys change too often, stop capturing

# optimizers whose step is captured with the LR as a device tensor (see graph_optimizer_blocker)
_GRAPH_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


# ------------------------------------------------------------------------------ decisions
def graph_optimizer_blocker(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step cannot be captured with a device LR, or ``None`` if it can.

    Exactly ``SGD`` (run fused: ``torch._fused_sgd_`` takes a tensor LR), ``Adam`` and ``AdamW``
    (run with ``capturable=True``: device step counters, tensor LR); not with
    ``differentiable=True`` (an autograd graph through the update) or sparse gradients. Other
    optimizers either keep host state in their step or take the LR only as a Python number in
    torch 2.13's foreach kernels; they run eagerly.
    """
    t = type(optimizer)
    if t not in _GRAPH_OPTIMIZERS:
        return (f"optimizer {t.__name__} is not captured (CUDA graphs support SGD, Adam and AdamW "
                "with the LR as a device tensor)")
    for i, g in enumerate(optimizer.param_groups):
        if isinstance(g.get("lr"), torch.Tensor):
            return f"optimizer param group {i} has a tensor LR (the engine owns the LR tensor)"
        if g.get("differentiable", False):
            return f"optimizer param group {i} has differentiable=True"
    return None


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Switch ``optimizer`` (accepted by :func:`graph_optimizer_blocker`) to its capturable form,
    in place and idempotently: ``SGD`` groups to ``fused=True, foreach=False``; ``Adam``/``AdamW``
    groups to ``capturable=True`` with existing step counters moved to their parameter's device
    (their dtype kept). The update arithmetic is the same (up to rounding of fused kernels)."""
    if isinstance(optimizer, torch.optim.SGD):
        for g in optimizer.param_groups:
            g["foreach"] = False
            g["fused"] = True
        return
    for g in optimizer.param_groups:
        g["capturable"] = True
        for p in g["params"]:
            st = optimizer.state.get(p)
            if st and isinstance(st.get("step"), torch.Tensor) and st["step"].device != p.device:
                st["step"] = st["step"].to(p.device)
    # capturable steps also run eagerly (the warm-up, fallback steps): that is intended here
    optimizer._warned_capturable_if_run_uncaptured = True


def worker_graph_blocker(mode: str, device: torch.device, precision: str, process_group: Any,
                         flat_grads: bool, sync_timing: bool,
                         optimizer: torch.optim.Optimizer | None) -> str | None:
    """Why NO step of this worker is captured, or ``None`` (steps may be captured).

    In order: ``cuda_graphs="off"``; not a CUDA device; fp16 (the GradScaler's inf check and
    scale update decide on the host whether to step); a process group (the bucket all-reduces
    are issued by the communication thread, not captured); flat gradient buckets bound by
    hooks; ``sync_timing`` (the profiler's phase timings synchronise between phases); the
    optimizer (:func:`graph_optimizer_blocker`).
    """
    if mode == "off":
        return "cuda_graphs='off'"
    if torch.device(device).type != "cuda":
        return f"device {device} is not CUDA"
    if precision == "fp16":
        return "precision='fp16' (the GradScaler decides on the host whether to step)"
    if process_group is not None:
        return "a process group (bucket all-reduces are issued by the communication thread)"
    if flat_grads:
        return "flat_grads=True (gradients bound to bucket views by hooks)"
    if sync_timing:
        return "sync_timing (phase timings synchronise the device)"
    if optimizer is not None:
        return graph_optimizer_blocker(optimizer)
    return None


def memory_headroom_blocker(free: int, reserved: int, allocated: int,
                            margin: float = MEMORY_MARGIN) -> str | None:
    """Why capturing now could run a later eager step out of memory, or ``None``.

    A captured step keeps its working memory (activations, gradients) in the graph's private
    pool for good; an eager step of the same worker (warm-up of another key, a ragged or
    similarity step) then needs about as much again from the device. The last warm-up step
    runs on an emptied cache (:func:`release_cached_memory`), so afterwards the caching
    allocator's ``reserved - allocated`` bytes are that eager step's working set ``W`` (the
    capture returns them to the device first: ``torch.cuda.graph`` empties the cache).
    With ``free`` bytes free on the device, pool + a later eager step fit iff
    ``free + W >= 2 W``, i.e. ``free >= W`` (times ``margin`` for fragmentation)."""
    working = max(0, reserved - allocated)
    if free < margin * working:
        return "not enough free device memory to keep a captured step beside eager steps"
    return None


def release_cached_memory(device: torch.device) -> None:
    """Return the caching allocator's free blocks to the device (before the last warm-up step
    of a key; synchronises, once per capture)."""
    with torch.cuda.device(device):
        torch.cuda.empty_cache()


def device_memory_blocker(device: torch.device) -> str | None:
    """:func:`memory_headroom_blocker` with ``device``'s current figures (no synchronisation)."""
    free, _ = torch.cuda.mem_get_info(device)
    return memory_headroom_blocker(free, torch.cuda.memory_reserved(device),
                                   torch.cuda.memory_allocated(device))


def step_graph_blocker(batched_reason: str | None, ragged: bool, keep_local_grad: Any) -> str | None:
    """Why THIS step runs eagerly although the worker captures steps, or ``None``."""
    if ragged:
        return "ragged step (micro-batches of unequal size)"
    if batched_reason is not None:
        return f"per-VSW execution ({batched_reason})"
    if keep_local_grad:
        return "the step keeps its local gradient (similarity)"
    return None


# ------------------------------------------------------------------------------ static inputs
def batch_signature(batch: Any) -> tuple | None:
    """A hashable description of a micro-batch's structure and tensor leaves (shape, dtype,
    device), or ``None`` when it holds a leaf that cannot live in a static buffer (collated
    strings/numbers, other objects)."""
    if isinstance(batch, torch.Tensor):
        return ("t", tuple(batch.shape), batch.dtype, batch.device.type)
    if isinstance(batch, Mapping):
        items = []
        for k, v in batch.items():
            s = batch_signature(v)
            if s is None:
                return None
            items.append((k, s))
        return ("d", tuple(items))
    if isinstance(batch, (list, tuple)) and batch and not _is_per_sample(batch):
        parts = []
        for v in batch:
            s = batch_signature(v)
            if s is None:
                return None
            parts.append(s)
        return (type(batch).__name__, tuple(parts))
    return None


def _fill(buf: Any, parts: Sequence[Any]) -> None:
    """Write the ``n`` micro-batches ``parts`` interleaved into ``buf`` (row ``b*n + v`` = row
    ``b`` of ``parts[v]``, the layout of :func:`~jabasray.engine.batched.join_batches`) in place."""
    if isinstance(buf, torch.Tensor):
        n = len(parts)
        src = [p if p.device == buf.device else p.to(buf.device, non_blocking=True) for p in parts]
        if n == 1:
            buf.copy_(src[0])
        else:
            rows = buf.shape[0] // n
            torch.stack(src, dim=1, out=buf.view(rows, n, *buf.shape[1:]))
        return
    if isinstance(buf, Mapping):
        for k in buf:
            _fill(buf[k], [p[k] for p in parts])
        return
    for i, b in enumerate(buf):
        _fill(b, [p[i] for p in parts])


def _alloc(parts: Sequence[Any], device: torch.device) -> Any:
    """A fresh buffer of the joined layout of ``parts`` on ``device`` (not filled)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.empty((first.shape[0] * len(parts),) + tuple(first.shape[1:]),
                           dtype=first.dtype, device=device)
    if isinstance(first, Mapping):
        return {k: _alloc([p[k] for p in parts], device) for k in first}
    return type(first)(_alloc([p[i] for p in parts], device) for i in range(len(first)))


class StaticRounds:
    """The static input buffers of a captured step: ``buffers[j]`` holds GA round ``j``'s
    micro-batches of the ``n`` VSWs interleaved (what the batched forward reads).

    ``rounds[j][v]`` is VSW ``v``'s micro-batch of round ``j`` (:func:`round_parts`). The
    buffers are allocated once (:meth:`__init__`) and refilled in place (:meth:`fill`), so the
    addresses the graph was captured with stay valid."""

    def __init__(self, rounds: Sequence[Sequence[Any]], device: torch.device) -> None:
        self.n = len(rounds[0])
        self.buffers = [_alloc(parts, device) for parts in rounds]
        self.fill(rounds)

    def fill(self, rounds: Sequence[Sequence[Any]]) -> None:
        """Copy a step's micro-batches into the buffers (device copies, no synchronisation)."""
        if len(rounds) != len(self.buffers) or any(len(r) != self.n for r in rounds):
            raise ValueError(f"rounds must hold {len(self.buffers)} rounds of {self.n} micro-batches")
        for buf, parts in zip(self.buffers, rounds):
            _fill(buf, parts)


def round_parts(micro_batches: Sequence[Any], num_vsw: int, num_ga: int) -> list[list[Any]]:
    """``out[j][v] = micro_batches[v*(num_ga+1) + j]``: VSW ``v`` takes micro-batches
    ``v*(num_ga+1) .. v*(num_ga+1)+num_ga`` (the IIDP assignment), round ``j`` its ``j``-th."""
    ga_rounds = num_ga + 1
    return [[micro_batches[v * ga_rounds + j] for v in range(num_vsw)] for j in range(ga_rounds)]


# ------------------------------------------------------------------------------ LR as a tensor
@contextlib.contextmanager
def lr_tensors_in(optimizer: torch.optim.Optimizer, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within the block, param group ``i``'s ``"lr"`` is ``tensors[i]`` (restored on exit): the
    captured optimizer kernels then read the LR from that tensor's memory."""
    groups = optimizer.param_groups
    if len(tensors) != len(groups):
        raise ValueError(f"tensors must hold one LR per param group ({len(groups)}), got {len(tensors)}")
    saved = [g["lr"] for g in groups]
    try:
        for g, t in zip(groups, tensors):
            g["lr"] = t
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr


def graph_key(num_vsw: int, num_ga: int, local_batch: int, signature: tuple, training: bool,
              optimizer: torch.optim.Optimizer, grad_clip_norm: float | None) -> tuple:
    """What a captured step depends on besides the LR: configuration, input signature, train
    mode, every param group's hyper-parameters except ``params``/``lr`` (e.g. momentum, weight
    decay: constants of the captured kernels) and the clipping norm."""
    hyper = tuple(tuple(sorted((k, _hashable(v)) for k, v in g.items() if k not in ("params", "lr")))
                  for g in optimizer.param_groups)
    return (num_vsw, num_ga, local_batch, signature, bool(training), hyper, grad_clip_norm)


def _hashable(v: Any) -> Any:
    """A hyper-parameter as a key part, without reading a tensor's value (no device read)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", id(v))
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, (int, float, bool, str, type(None))):
        return v
    return repr(v)


# ------------------------------------------------------------------------------ capture / replay
@dataclass
class CapturedStep:
    """One captured step: the graph, its static inputs and outputs, its LR tensors."""

    graph: Any                           # torch.cuda.CUDAGraph
    inputs: StaticRounds
    lr_tensors: list[torch.Tensor]       # one 0-d float32 device tensor per param group
    lr_values: list[float]               # the values they hold
    outputs: Any                         # what the captured body returned (static tensors)
    grads: list[torch.Tensor | None] = field(default_factory=list)   # the graph's gradients

    def replay(self, rounds: Sequence[Sequence[Any]], lrs: Sequence[float]) -> None:
        """Refill the inputs and (changed) LRs on the current stream, then replay the graph."""
        self.inputs.fill(rounds)
        for i, v in enumerate(lrs):
            if v != self.lr_values[i]:
                self.lr_tensors[i].fill_(v)
                self.lr_values[i] = v
        self.graph.replay()


def capture_step(body: Callable[[list[Any]], Any], inputs: StaticRounds,
                 optimizer: torch.optim.Optimizer, lrs: Sequence[float], stream: Any,
                 params: Sequence[torch.Tensor]) -> CapturedStep:
    """Capture ``body(inputs.buffers)`` (forward, backward, optimizer step; returns its static
    outputs) as one CUDA graph on ``stream``, with the optimizer reading its LRs from device
    tensors. Gradients of ``params`` are set to ``None`` first (backward allocates them in the
    graph's pool). Nothing is executed; raises whatever the capture raised."""
    device = params[0].device
    lr_t = [torch.full((), float(v), dtype=torch.float32, device=device) for v in lrs]
    for p in params:
        p.grad = None
    with lr_tensors_in(optimizer, lr_t):
        graph, outputs = cuda_capture(lambda: body(inputs.buffers), stream)
    return CapturedStep(graph, inputs, lr_t, [float(v) for v in lrs], outputs,
                        [p.grad for p in params])


def cuda_capture(fn: Callable[[], Any], stream: Any) -> tuple[Any, Any]:
    """``(graph, fn's return value)``: ``fn`` captured on ``stream`` (``torch.cuda.graph``,
    after its device synchronisation; a private memory pool per graph)."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads (a background runner, a loader) may use the device meanwhile
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class GraphCache:
    """Captured steps by key (LRU, at most :data:`MAX_GRAPHS`), eager steps seen per key (the
    warm-up) and the reason the worker stopped capturing, if it did.

    ``decide(key)`` says what a step of ``key`` does: ``"replay"`` (a captured step exists),
    ``"capture"`` (its warm-up is done), ``"eager"`` (warm-up; counted) - or ``"eager"`` for
    good once :attr:`disabled` is set: a failed capture, or keys that change too often
    (dynamic shapes, optimizer constants moved by a scheduler): after ``max_signatures``
    captures, a capture due while fewer than :data:`REPLAYS_PER_CAPTURE` replays per capture
    happened. A key whose shapes never repeat three times is never captured at all (the
    warm-up counts of the ``4 * max_signatures`` most recent keys are kept)."""

    def __init__(self, warmup: int = GRAPH_WARMUP_STEPS, max_graphs: int = MAX_GRAPHS,
                 max_signatures: int = MAX_SIGNATURES, on_drop: Callable[[], None] | None = None) -> None:
        self.warmup, self.max_graphs, self.max_signatures = warmup, max_graphs, max_signatures
        self.on_drop = on_drop           # called before captured steps are dropped (e.g. wait
                                         # for pending replays: their memory is released)
        self.graphs: OrderedDict[tuple, Any] = OrderedDict()   # key -> captured step
        self.eager_steps: OrderedDict[tuple, int] = OrderedDict()
        self.disabled: str | None = None
        self.refused: set[tuple] = set()         # keys that run eagerly (e.g. not enough memory)
        self.captures = 0
        self.replays = 0

    def decide(self, key: tuple) -> str:
        if self.disabled is not None:
            return "eager"
        if key in self.graphs:
            self.graphs.move_to_end(key)
            self.replays += 1
            return "replay"
        if key in self.refused:
            return "eager"
        seen = self.eager_steps.get(key, 0)
        if seen >= self.warmup:
            if self.captures >= self.max_signatures and self.replays < REPLAYS_PER_CAPTURE * self.captures:
                self.disable(f"the step's shapes or optimizer constants change too often "
                             f"({self.captures} captures, {self.replays} replays)")
                return "eager"
            return "capture"
        self.eager_steps[key] = seen + 1
        self.eager_steps.move_to_end(key)
        while len(self.eager_steps) > 4 * self.max_signatures:
            self.eager_steps.popitem(last=False)
        return "eager"

    def refuse(self, key: tuple) -> None:
        """Run ``key`` eagerly from now on (until :meth:`clear`)."""
        self.refused.add(key)

    def get(self, key: tuple) -> Any:
        return self.graphs[key]

    def add(self, key: tuple, step: Any) -> None:
        self.graphs[key] = step
        self.graphs.move_to_end(key)
        self.captures += 1
        if len(self.graphs) > self.max_graphs:
            self._drop()
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)

    def _drop(self) -> None:
        if self.on_drop is not None and self.graphs:
            self.on_drop()

    def disable(self, reason: str) -> None:
        self.disabled = reason
        self._drop()
        self.graphs.clear()

    def clear(self) -> None:
        """Forget every captured step and warm-up count (invalidated state); a disabled cache
        stays disabled."""
        self._drop()
        self.graphs.clear()
        self.eager_steps.clear()
        self.refused.clear()


def captured_for(cache: GraphCache, key: tuple, device: torch.device, capture: Callable[[], Any],
                 say: Callable[[str], None]) -> Any | None:
    """The captured step of ``key`` to replay now, or ``None``: run this step eagerly.

    The decision every graphed engine shares (:meth:`GraphCache.decide`): a warm-up step runs
    eagerly (its last one on an emptied allocator cache, so the memory check sees one step's
    working set, :func:`memory_headroom_blocker`); a due capture is refused for ``key`` when
    memory is short; ``capture()`` (records, executes nothing) failing disables the cache for
    good. ``say(reason)`` is called with the reason of every fallback (the caller logs it once).
    A returned step was just captured or captured before; either way its replay runs the step.
    """
    action = cache.decide(key)
    if cache.disabled is not None:
        say(cache.disabled)
        return None
    if action == "eager":
        if cache.eager_steps.get(key) == cache.warmup:
            release_cached_memory(device)        # this step's working set shows alone
        return None
    if action == "capture":
        why = device_memory_blocker(device)
        if why is not None:
            cache.refuse(key)
            say(why)
            return None
        try:
            cache.add(key, capture())
        except Exception as e:  # noqa: BLE001 - the step runs eagerly instead
            first = (str(e).strip().splitlines() or [""])[0]
            cache.disable(f"capture failed ({type(e).__name__}: {first})")
            say(cache.disabled)
            return None
    return cache.get(key)


def static_inputs_of(st: Any, parts: list[list[Any]]) -> StaticRounds:
    """The static input buffers of a captured step on state ``st`` (a
    :class:`~jabasray.engine.state.StepState`), allocated and first filled on the main VSW's
    stream, after the caller's stream (which produced the micro-batches)."""
    lanes = st.lanes
    ready = lanes.record()
    with lanes.context(lanes.vsw[0]):     # buffers live on the stream that refills them
        lanes.wait(lanes.vsw[0], ready)
        return StaticRounds([[to_device(p, st.device) for p in r] for r in parts], st.device)


class GraphedExecution:
    """A batched step as the replay of a captured CUDA graph (module notes), on one device.

    ``state``: the step's :class:`~jabasray.engine.state.StepState`; ``update``: the worker's
    :class:`~jabasray.engine.weight_sync.WeightUpdate` (optimizer, clipping, LR values);
    ``cache``: the worker's :class:`GraphCache`; ``say(reason)`` logs a fallback reason once."""

    def __init__(self, state: Any, update: Any, cache: GraphCache, clock: Callable[[], float],
                 say: Callable[[str], None]) -> None:
        self.state, self.update, self.cache, self.clock, self.say = state, update, cache, clock, say
        self.capture_stream: Any = None
        self.made_capturable = False

    def prepare(self) -> None:
        """Switch the optimizer to its capturable form once (the warm-up steps run it too)."""
        if not self.made_capturable:
            make_capturable(self.update.optimizer)
            self.made_capturable = True

    def key_of(self, micro_batches: Sequence[Any]) -> tuple | str:
        """The graph key of a step over ``micro_batches``, or why it cannot be captured."""
        sigs = {batch_signature(mb) for mb in micro_batches}
        if None in sigs:
            return "micro-batches hold values that are not tensors"
        if len(sigs) > 1:
            return "micro-batches of different shapes"
        st = self.state
        return graph_key(st.num_vsw, st.num_ga, st.local_batch_size, sigs.pop(),
                         st.vsws[0].module.training, self.update.optimizer, self.update.grad_clip_norm)

    def run(self, req: Any) -> StepStats | None:
        """The step as a replay of a captured CUDA graph (capturing it first once its key's
        warm-up is done), or ``None``: run it eagerly (warm-up, or a reason logged once)."""
        key = self.key_of(req.micro_batches)
        if isinstance(key, str):
            self.say(key)
            return None
        st = self.state
        parts = round_parts(req.micro_batches, st.num_vsw, st.num_ga)

        def capture() -> CapturedStep:
            cap = self.capture(parts)
            log.info("IIDP: step captured as a CUDA graph (n_vsw=%d, n_GA=%d, B_L=%d)",
                     st.num_vsw, st.num_ga, st.local_batch_size)
            return cap
        cap = captured_for(self.cache, key, st.device, capture, self.say)
        if cap is None:
            return None
        return self.replay(cap, parts, req.sizes, req.t0)

    def static_inputs(self, parts: list[list[Any]]) -> StaticRounds:
        """:func:`static_inputs_of` this worker's state, and the capture stream made once."""
        inputs = static_inputs_of(self.state, parts)
        if self.capture_stream is None:
            self.capture_stream = new_stream(self.state.device)
        return inputs

    def capture(self, parts: list[list[Any]]) -> CapturedStep:
        """Capture one batched step (module notes, item 2): the GA rounds' forward/backward
        over the static inputs (per-VSW BatchNorm, loss weight ``n / global workers`` as in
        the eager batched step), the zero gradient of unused parameters, clipping and the
        optimizer step. The weight copy to the replicas stays deferred (batched steps use none)."""
        st, upd = self.state, self.update
        main = st.vsws[0]
        main.set_hooks(None)
        inputs = self.static_inputs(parts)
        weight = st.num_vsw / st.global_num_workers
        params = [p for plist in main.buffers.modules_params for p in plist]

        def body(buffers: list[Any]) -> tuple[torch.Tensor, dict, dict]:
            losses: list[torch.Tensor] = []
            st.begin_metrics()
            for batch in buffers:
                with ghost_norms(st.norms):
                    scaled = st.forward(main, batch, weight, losses)
                scaled.backward()
            main.buffers.finish()                     # zero gradient for unused parameters
            if upd.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, upd.grad_clip_norm)
            upd.shard.step()                          # LR read from the device tensors
            return torch.stack(losses).sum(), dict(st.metric_sums), dict(st.metric_counts)

        main.buffers.begin_step()
        st.autocast_cache = False
        try:
            return capture_step(body, inputs, upd.optimizer, upd.lr_values(), self.capture_stream,
                                params)
        finally:
            st.autocast_cache = True
            st.begin_metrics()

    def replay(self, cap: CapturedStep, parts: list[list[Any]], sizes: list[int],
               t0: float) -> StepStats:
        """One replay on the main VSW's stream (after the caller's stream, which then waits for
        it); the loss and metric sums are copied on the device (nothing is read)."""
        st = self.state
        lanes = st.lanes
        start_ev = lanes.record()
        with lanes.context(lanes.vsw[0]):
            lanes.wait(lanes.vsw[0], start_ev)
            cap.replay(parts, self.update.lr_values())
            loss_s, sums_s, counts = cap.outputs
            loss = loss_s.detach().clone()
            sums = {k: v.clone() for k, v in sums_s.items()}
            end_ev = lanes.record(lanes.vsw[0])
        lanes.wait(lanes.current(), end_ev)
        if st.graph_grads is not cap:             # p.grad shows this step's gradient
            main = st.vsws[0].buffers
            for p, g in zip((p for plist in main.modules_params for p in plist), cap.grads):
                p.grad = g
            st.graph_grads = cap
        if st.num_vsw > 1:
            st.stale = True                       # replicas get the weights when used
        t = self.clock() - t0
        return StepStats(loss=loss, num_workers=st.num_workers, global_num_workers=st.global_num_workers,
                         num_samples=sum(sizes), compute_time=t, comm_time=0.0, update_time=0.0,
                         weight_sync=self.update.method, batched=True, graphed=True,
                         metric_sums=sums, metric_counts=dict(counts))
