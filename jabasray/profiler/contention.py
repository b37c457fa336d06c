"""Measurements that feed the LIBRA planner (Algorithm 2, lines 1-3).

* :func:`measure_contention_rows` times a computation task and an all-reduce alone and fully
  overlapped (the other task runs in a loop in a background thread for the whole measurement),
  giving the rows that :func:`jabasray.planners.libra_model.fit_contention_model` fits g, p, q
  to (Eq. 5-6). It is device-agnostic: the caller passes two synchronous callables. On CUDA,
  each callable issues its work on its own stream and synchronises that stream before it
  returns; ``comm_fn(size, threads)`` runs an all-reduce of ``size`` bytes with ``threads``
  communication threads (with NCCL: a communicator created for that thread/channel setting).
* :func:`measure_hop_latency` estimates the one-hop latency alpha of Eq. 4 from a tiny all-reduce.
* :func:`measure_gloo_contention` is the CPU/gloo instance the driver uses: on a local gloo
  group of ``world_size`` processes (one torch thread each, as the emulated GPU actors run),
  all-reduces alone and while a compute thread runs on every rank, and a compute task alone and
  while all-reduces run: a :class:`~jabasray.profiles.ContentionMeasurement` (cached per host,
  :func:`cached_contention`). On CPU the compute threads and gloo's communication thread share
  the cores - a real contention, fitted by
  :func:`jabasray.planners.libra_model.fit_one_thread_count`. LIBRA's thread/CTA allocation does
  not apply there: gloo has no per-collective thread setting, so one nominal thread count (1) is
  measured and the thread terms of Eq. 5-6 stay flat. With NCCL the thread count is the
  communicator's channel/CTA setting (``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS`` or
  ``ncclConfig_t.minCTAs/maxCTAs`` per communicator); that is NOT wired here (no communicator is
  created per thread choice) and was not measured (no GPU), so nothing is claimed for it.
* :func:`layer_profiles` measures each parameterised layer's standalone backward time and
  gradient bytes, in backward order, from gradient-accumulation hooks (CUDA events on GPU,
  ``perf_counter`` on CPU): the :class:`~jabasray.planners.libra.LayerProfile` list LIBRA plans on.
"""
from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from typing import Any, Callable, Sequence

from pathlib import Path

from ..planners.libra import LayerProfile, group_params_by_layer
from ..planners.libra_model import CommRow, ComputeRow
from ..profiles import ContentionMeasurement
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


CONTENTION_SIZES = (262144, 1048576, 4194304)   # bytes: 256 KiB .. 4 MiB, transmission-dominated
COMPUTE_DIM = 192                                # compute task: matmuls of COMPUTE_DIM^2 float32


def _compute_task(dim: int = COMPUTE_DIM) -> Callable[[], Any]:
    import torch
    a = torch.randn(dim, dim)

    def task() -> Any:
        x = a
        for _ in range(4):
            x = torch.mm(x, a).tanh_()
        return x
    return task


def _contention_worker(rank: int, cfg: dict) -> None:
    """One rank of :func:`measure_gloo_contention` (a child process; every rank runs the same
    number of collectives in the same order, so background all-reduces cannot deadlock)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=cfg["world"])
    repeats, warmup, clock = cfg["repeats"], cfg["warmup"], time.perf_counter
    compute = _compute_task()
    try:
        tensors = {c: torch.ones(max(1, c // 4)) for c in cfg["sizes"]}
        alone, over = [], []
        for c in cfg["sizes"]:
            reduce = lambda c=c: dist.all_reduce(tensors[c])  # noqa: E731
            dist.barrier()
            alone.append(_median_time(reduce, repeats, warmup, clock))
            dist.barrier()
            with _Loop(compute):               # a local loop: no collective inside
                over.append(_median_time(reduce, repeats, warmup, clock))
        b = _median_time(compute, repeats, warmup, clock)
        # compute while all-reduces run: a FIXED number of them in a background thread (the
        # same on every rank), compute timed until they end; only calls that ended before
        # the all-reduces did count
        big = tensors[max(cfg["sizes"])]
        agreed = torch.tensor([max(4, int(3 * (repeats + 1) * b / max(alone[-1], 1e-6)) + 4)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)     # the count must be the same on every rank
        count = int(agreed.item())
        done = threading.Event()

        def reduce_many() -> None:
            for _ in range(count):
                dist.all_reduce(big)
            done.set()
        dist.barrier()
        thread = threading.Thread(target=reduce_many, daemon=True)
        thread.start()
        samples = []
        while not done.is_set():
            t0 = clock()
            compute()
            if not done.is_set():
                samples.append(clock() - t0)
        thread.join()
        g = statistics.median(samples[1:] or samples) if samples else b
        row = torch.tensor(alone + over + [b, g], dtype=torch.float64)
        dist.all_reduce(row, op=dist.ReduceOp.MAX)   # a collective ends with its slowest rank
        if rank == 0:
            n = len(cfg["sizes"])
            vals = row.tolist()
            Path(cfg["out"]).write_text(json.dumps({"alone": vals[:n], "over": vals[n:2 * n],
                                                    "b": vals[2 * n], "g": vals[2 * n + 1],
                                                    "samples": len(samples)}))
    finally:
        dist.destroy_process_group()


def measure_gloo_contention(world_size: int = 2, sizes: Sequence[int] = CONTENTION_SIZES, *,
                            repeats: int = 5, warmup: int = 1, timeout_s: float = 120.0
                            ) -> ContentionMeasurement:
    """Contention of compute and gloo all-reduces on this host (module notes): per size the
    all-reduce alone and with a compute thread running on every rank, and the compute task alone
    and while all-reduces run (medians over ``repeats``; the max over ranks)."""
    from .measure import run_gloo_children

    check_int("world_size", world_size, min_value=2)
    check_int("repeats", repeats, min_value=1)
    check_int("warmup", warmup, min_value=0)
    sizes = [check_int(f"sizes[{i}]", int(c), min_value=4) for i, c in enumerate(sizes)]
    if len(set(sizes)) < 2:
        raise ValueError(f"sizes must hold at least two different sizes, got {sizes}")
    data = run_gloo_children("jabasray.profiler.contention", world_size,
                             {"sizes": sizes, "repeats": repeats, "warmup": warmup}, timeout_s)
    if data["samples"] == 0:
        log.warning("contention: no compute call ended while all-reduces ran; compute slowdown "
                    "taken as none")
    meas = ContentionMeasurement(num_workers=world_size, sizes=[float(c) for c in sizes],
                                 comm_alone=data["alone"], comm_overlapped=data["over"],
                                 compute_alone=data["b"], compute_overlapped=data["g"])
    log.info("gloo contention (%d ranks): all-reduce x%s under compute, compute x%.2f under all-reduce",
             world_size, ", ".join(f"{o / a:.2f}" for a, o in zip(meas.comm_alone, meas.comm_overlapped)),
             meas.compute_overlapped / meas.compute_alone)
    return meas


def cached_contention(cache_dir: str | Path | None, world_size: int = 2, refresh: bool = False
                      ) -> ContentionMeasurement:
    """:func:`measure_gloo_contention`, cached per host like the all-reduce fit (it does not
    depend on the model)."""
    from .measure import host_cached
    return host_cached(cache_dir, "contention", {"world": world_size, "sizes": list(CONTENTION_SIZES),
                                                 "dim": COMPUTE_DIM},
                       lambda: measure_gloo_contention(world_size), ContentionMeasurement.from_json, refresh)


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


if __name__ == "__main__":  # child process of measure_gloo_contention (run_gloo_children)
    import sys
    if len(sys.argv) == 4 and sys.argv[1] == "--gloo-child":
        _contention_worker(int(sys.argv[2]), json.loads(sys.argv[3]))
