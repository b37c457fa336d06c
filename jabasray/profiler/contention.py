"""Measurements that feed the LIBRA planner (Algorithm 2, lines 1-3).

* :func:`measure_contention_rows` times a computation task and an all-reduce alone and fully
  overlapped (the other task runs in a loop in a background thread for the whole measurement),
  giving the rows that :func:`jabasray.planners.libra_model.fit_contention_model` fits g, p, q
  to (Eq. 5-6). It is device-agnostic: the caller passes two synchronous callables. On CUDA,
  each callable issues its work on its own stream and synchronises that stream before it
  returns; ``comm_fn(size, threads)`` runs an all-reduce of ``size`` bytes with ``threads``
  communication threads (with NCCL: a communicator created for that thread/channel setting).
* :func:`measure_hop_latency` estimates the one-hop latency alpha of Eq. 4 from a tiny all-reduce.
* :func:`layer_profiles` measures each parameterised layer's standalone backward time and
  gradient bytes, in backward order, from gradient-accumulation hooks (CUDA events on GPU,
  ``perf_counter`` on CPU): the :class:`~jabasray.planners.libra.LayerProfile` list LIBRA plans on.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any, Callable, Sequence

from ..planners.libra import LayerProfile, group_params_by_layer
from ..planners.libra_model import CommRow, ComputeRow
from ..validation import check_int

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class _Loop:
    """Run ``fn`` back to back in a daemon thread while the ``with`` block runs."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._started.set()
                self._fn()
        except BaseException as exc:  # surfaced in __exit__
            self._error = exc
            self._started.set()

    def __enter__(self) -> "_Loop":
        self._thread.start()
        self._started.wait()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error


def _median_time(fn: Callable[[], Any], repeats: int, warmup: int, clock: Clock) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def measure_contention_rows(compute_fn: Callable[[], Any], comm_fn: Callable[[float, int], Any],
                            sizes: Sequence[float], threads: Sequence[int], *, repeats: int = 3,
                            warmup: int = 1, clock: Clock = time.perf_counter
                            ) -> tuple[list[ComputeRow], list[CommRow]]:
    """Rows for the contention fit, for every (thread count r, all-reduce size c):

    * ``ComputeRow(b, r, g)``: ``compute_fn`` timed while ``comm_fn(c, r)`` loops (Eq. 5 data),
      ``b`` its standalone time;
    * ``CommRow(c, r, t, overlapped=True)``: ``comm_fn(c, r)`` timed while ``compute_fn`` loops (p);
    * ``CommRow(c, r, t, overlapped=False)``: ``comm_fn(c, r)`` alone (q).

    Times are medians over ``repeats`` after ``warmup`` calls.
    """
    check_int("repeats", repeats, min_value=1)
    check_int("warmup", warmup, min_value=0)
    if not sizes or not threads:
        raise ValueError(f"sizes and threads must be non-empty, got {list(sizes)!r} and {list(threads)!r}")
    threads = [check_int(f"threads[{i}]", r, min_value=1) for i, r in enumerate(threads)]
    b = _median_time(compute_fn, repeats, warmup, clock)
    compute_rows: list[ComputeRow] = []
    comm_rows: list[CommRow] = []
    for r in threads:
        for c in sizes:
            comm = lambda c=c, r=r: comm_fn(c, r)  # noqa: E731
            alone = _median_time(comm, repeats, warmup, clock)
            with _Loop(compute_fn):
                over = _median_time(comm, repeats, warmup, clock)
            with _Loop(comm):
                slowed = _median_time(compute_fn, repeats, warmup, clock)
            compute_rows.append(ComputeRow(b, r, slowed))
            comm_rows.append(CommRow(float(c), r, over, True))
            comm_rows.append(CommRow(float(c), r, alone, False))
            log.debug("contention r=%d c=%g: compute %.3g->%.3g s, comm %.3g/%.3g s", r, c, b, slowed,
                      alone, over)
    return compute_rows, comm_rows


def measure_hop_latency(comm_fn: Callable[[float, int], Any], num_workers: int, threads: int, *,
                        tiny_bytes: float = 4.0, repeats: int = 10,
                        clock: Clock = time.perf_counter) -> float:
    """alpha of Eq. 4 from a tiny all-reduce: its time is ~ the startup a = 2(N-1) alpha."""
    check_int("num_workers", num_workers, min_value=2)
    check_int("repeats", repeats, min_value=1)
    t = _median_time(lambda: comm_fn(tiny_bytes, threads), repeats, 1, clock)
    return t / (2.0 * (num_workers - 1))


def layer_profiles(model: Any, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Any], *,
                   repeats: int = 3) -> list[LayerProfile]:
    """Per-layer standalone backward time and gradient bytes, in backward (gradient-ready) order.

    A layer is a module that owns parameters (names as :func:`group_params_by_layer` gives
    them). Its backward time is the time from the previous layer's gradients being ready to its
    own (so parameter-free modules are charged to the next layer with parameters, which is
    where their cost delays the bucket). Medians over ``repeats`` backward passes.
    """
    import torch

    from ..engine.buckets import trainable_parameters

    check_int("repeats", repeats, min_value=1)
    named = trainable_parameters(model)
    if not named:
        raise ValueError("model has no trainable parameters")
    layer_of = {n: layer for layer, names in group_params_by_layer([n for n, _ in named]).items()
                for n in names}
    nbytes: dict[str, float] = {}
    for n, p in named:
        nbytes[layer_of[n]] = nbytes.get(layer_of[n], 0.0) + p.numel() * p.element_size()
    device = named[0][1].device
    cuda = device.type == "cuda"

    def stamp() -> Any:
        if not cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    # layer -> time its LAST gradient was ready; re-inserting keeps the dict in that order
    stamps: dict[str, Any] = {}

    def hook(name: str) -> None:
        layer = layer_of[name]
        stamps.pop(layer, None)
        stamps[layer] = stamp()

    samples: dict[str, list[float]] = {layer: [] for layer in nbytes}
    order: list[str] = []
    handles = [p.register_post_accumulate_grad_hook(lambda t, n=n: hook(n)) for n, p in named]
    try:
        for rep in range(repeats + 1):                      # first pass is a warm-up
            stamps.clear()
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            start = stamp()
            loss.backward()
            if cuda:
                torch.cuda.synchronize(device)
            missing = [layer for layer in nbytes if layer not in stamps]
            if missing:
                raise ValueError(f"layers {missing} received no gradient; layer_profiles needs every "
                                 "trainable parameter to be used by loss_fn(model(inputs), targets)")
            if rep == 0:
                order = list(stamps)
                continue
            prev = start
            for layer in order:
                cur = stamps[layer]
                dt = prev.elapsed_time(cur) / 1000.0 if cuda else cur - prev
                samples[layer].append(max(0.0, float(dt)))
                prev = cur
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return [LayerProfile(layer, statistics.median(samples[layer]), nbytes[layer]) for layer in order]
