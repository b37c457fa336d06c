"""Measures what packing costs on this machine: the :class:`~jabasray.planners.pack_cost.PackCosts`
the decision of :func:`jabasray.tuner.packed` is made from (Pack paper, sections 4.2 and 4.6).

* process starts (per host, cached): the CPU seconds of a fresh Python process importing what
  a packed trial's process imports (Ray Tune and jabasray's trial module, no torch) and what a
  trial training alone imports (also torch and the training module), each measured on a child
  process (``resource.getrusage(RUSAGE_CHILDREN)``), so a loaded machine does not inflate it;
* per sweep (cached per model, configurations, device and threads): the data's build time
  (``data_fn``, paid by every trial process that trains alone and by each coordinator), a
  member's load and free, one unit of each configuration trained alone and one packed unit of
  the first ``k = 1 .. K`` of them, all on the spec's device with the coordinator's torch
  threads. Each is timed as a unit of ``n = steps`` and of ``m = 2 n`` steps (the lower median
  of 5 runs after a warm-up: load on a shared machine only slows a run down) and a unit of
  ``N = steps_per_unit`` steps is ``t(n) + (N - n) (t(m) - t(n)) / (m - n)``: what a unit
  pays once (the metric, the report, the pack's bookkeeping) counts once; a pack's unit is
  then taken at configurations of the mean cost alone (:func:`typical_packed`). The
  runs of all variants alternate (each round times every variant once, in a rotated order),
  so a change in the machine's load shifts them alike; on a CPU device with one torch thread
  a run is timed in the thread's CPU seconds (``time.thread_time``): the same core-seconds as
  the process starts, what the run costs on a core of its own however busy the machine is;
* the relay: the round trip of a no-op Ray actor call (a packed trial asks its coordinator
  for every unit), when Ray is running.

Cached like the profiler's host measurements (:func:`jabasray.profiler.measure.host_cached`):
one JSON file per key in ``cache_dir`` (default :func:`default_cache_dir`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from jabasray.planners.pack_cost import PackCosts
from jabasray.validation import check_int

log = logging.getLogger(__name__)

__all__ = ["measure_pack_costs", "process_start_costs", "relay_round_trip", "default_cache_dir", "typical_packed"]

RELAY_IMPORTS = "import ray.tune, jabasray.tuner.packed_trials"
ALONE_IMPORTS = "import ray.tune, torch, jabasray.tuner.packed_trials, jabasray.tuner.trainable"
REVISION = 5                 # bump when the measurement changes (every cache key's "pack_revision";
                             # "revision" is host_cached's own, the profiler's)


@dataclasses.dataclass
class _Starts:
    relay_s: float           # core-s of a process importing what a packed trial imports
    alone_s: float           # ... what a trial training alone imports

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "_Starts":
        return cls(**json.loads(text))


def default_cache_dir() -> str:
    """``$JABASRAY_CACHE_DIR``, else ``~/.cache/jabasray``."""
    return os.environ.get("JABASRAY_CACHE_DIR") or str(Path.home() / ".cache" / "jabasray")


def _child_cpu_s(code: str) -> float:
    """CPU seconds (user + system) a fresh interpreter spends running ``code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def process_start_costs(cache_dir: str | None = None, refresh: bool = False) -> tuple[float, float]:
    """``(packed trial, trial alone)``: CPU seconds to start each kind of trial process (the
    imports; the data comes on top for a trial alone), per host, cached."""
    from jabasray.profiler.measure import host_cached

    def measure() -> _Starts:
        return _Starts(_child_cpu_s(RELAY_IMPORTS), _child_cpu_s(ALONE_IMPORTS))

    s = host_cached(cache_dir, "trialstart", {"python": sys.executable, "pack_revision": REVISION},
                    measure, _Starts.from_json, refresh)
    return s.relay_s, s.alone_s


def relay_round_trip(calls: int = 30) -> float:
    """Seconds of one no-op Ray actor call (the lower median of ``calls``), or 0.0 when Ray is
    not running. Starts (and ends) one actor that holds no CPU."""
    import ray

    if not ray.is_initialized():
        return 0.0

    @ray.remote(num_cpus=0)
    class _Echo:
        def ping(self) -> None:
            return None

    from jabasray.profiler.measure import lower_median

    a = _Echo.remote()
    try:
        ray.get(a.ping.remote())
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            ray.get(a.ping.remote())
            times.append(time.perf_counter() - t0)
        return lower_median(times)
    finally:
        ray.kill(a)


def _time(fn, clock=time.perf_counter) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def _unit_clock(device: Any, threads: int):
    """``time.thread_time`` on a CPU device with one torch thread (the run's core-seconds, not
    inflated by other processes on a shared machine), else wall time (a GPU's work is not the
    host thread's CPU time, nor is the work of several threads one thread's)."""
    return time.thread_time if str(device).startswith("cpu") and threads == 1 else time.perf_counter


def typical_packed(packed: Sequence[float], alone: Sequence[float]) -> list[float]:
    """``P[k] * mean(S) / mean(S[:k])``: the packed unit of the first ``k`` configurations
    (``packed[k - 1]``) as a pack of ``k`` configurations of the mean cost alone, the unit
    :class:`~jabasray.planners.pack_cost.PackCosts` compares it with (``unit_alone_s`` is the
    mean over all of them): a first configuration dearer alone than the rest must not make a
    pack of it look dear."""
    mean = statistics.mean(alone)
    return [p * mean / statistics.mean(alone[:k]) for k, p in enumerate(packed, start=1)]


def _measure_units(spec: Any, configs: Sequence[Mapping], stream_batch: int, threads: int,
                   steps: int, repeats: int = 5) -> dict:
    """Data build, load+free, a unit alone and packed units of 1..len(configs) (module docstring)."""
    import torch

    from jabasray.profiler.measure import lower_median
    from jabasray.tuner.pack_runner import PackRunner
    from jabasray.tuner.trainable import PlainMember
    from jabasray.tuner.training import cached_data

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.process_time()
        data = spec.data_fn()
        data_s = time.process_time() - t0
        cached_data(spec)                       # PlainMember reads the process's cached copy
        # two unit lengths n < m: a unit of N steps costs t(n) + (N - n) (t(m) - t(n)) / (m - n),
        # so what a unit pays once (the metric, the report, the pack's bookkeeping) is counted
        # once, not scaled up with the steps as t(n) N / n would
        n = min(steps, spec.steps_per_unit)
        m = min(2 * n, spec.steps_per_unit)
        lengths = [n] if m == n else [n, m]
        clock = _unit_clock(spec.device, threads)

        def unit_time(t: list[float]) -> float:
            if len(t) == 1:
                return t[0]
            per_step = max(0.0, (t[1] - t[0]) / (m - n))
            return t[0] + (spec.steps_per_unit - n) * per_step

        # alone: the same configurations the packs hold (a packed unit of k is compared with
        # k of their units alone); packed: one runner per k holding the first k (no restack
        # between the rounds); loads and frees timed on the runner of all K
        variants, loads, last = [], [], None
        for steps_ in lengths:
            short = dataclasses.replace(spec, steps_per_unit=steps_)
            variants += [PlainMember(short, dict(c), stream_batch).unit for c in configs]
            for k in range(1, len(configs) + 1):
                runner = PackRunner(short, stream_batch, data)
                for i, c in enumerate(configs[:k]):
                    t = _time(lambda: runner.load(f"m{i}", c))
                    if k == len(configs) and steps_ == n:
                        loads.append(t)
                last = last or (runner if k == len(configs) else None)
                variants.append(lambda r=runner, keys=[f"m{i}" for i in range(k)]: r.unit(keys))
        for run_unit in variants:
            run_unit()                          # warm-up (allocations, the first pass)
        times: list[list[float]] = [[] for _ in variants]
        for rnd in range(repeats):              # interleaved, the order rotated every round
            for v in range(len(variants)):
                i = (v + rnd) % len(variants)
                times[i].append(_time(variants[i], clock))
        # the lower median of ``repeats``: load only slows a run down
        per = len(configs) * 2                  # variants per unit length
        best = [lower_median(t) for t in times]
        units = [unit_time([best[j * per + i] for j in range(len(lengths))]) for i in range(per)]
        alone, packed = units[:len(configs)], typical_packed(units[len(configs):], units[:len(configs)])
        frees = [_time(lambda k=k: last.free(k)) for k in [f"m{i}" for i in range(len(configs))]]
        return {"data_s": data_s, "load_s": statistics.median(loads) + statistics.median(frees),
                "unit_alone_s": statistics.mean(alone), "unit_packed_s": packed}
    finally:
        torch.set_num_threads(old_threads)


def measure_pack_costs(spec: Any, configs: Sequence[Mapping], stream_batch: int, threads: int = 1,
                       cache_dir: str | None = None, refresh: bool = False, steps: int = 10) -> PackCosts:
    """:class:`PackCosts` of ``spec`` at ``configs`` (packed units of 1..``len(configs)``
    members), measured here (the module docstring), cached in ``cache_dir`` (None: not cached;
    see :func:`default_cache_dir`). The relay round trip is measured each time (Ray's)."""
    from jabasray.profiler.measure import callable_fingerprint, host_cached

    if not configs:
        raise ValueError("configs must hold at least one configuration to measure, got []")
    check_int("threads", threads, min_value=1)
    check_int("steps", steps, min_value=1)
    relay_start, alone_start = process_start_costs(cache_dir, refresh)
    key = {"fns": [callable_fingerprint(getattr(spec, f)) for f in
                   ("model_fn", "optimizer_fn", "data_fn", "metric_fn", "loss_fn")],
           "batch": repr(spec.batch_size), "steps_per_unit": spec.steps_per_unit, "seed": spec.seed,
           "device": str(spec.device), "threads": threads, "stream_batch": stream_batch,
           "configs": json.dumps([dict(c) for c in configs], sort_keys=True, default=str),
           "steps": steps, "pack_revision": REVISION}

    class _Units(dict):
        def to_json(self) -> str:
            return json.dumps(self)

    units = host_cached(cache_dir, "packcost", key,
                        lambda: _Units(_measure_units(spec, configs, stream_batch, threads, steps)),
                        lambda text: _Units(json.loads(text)), refresh)
    costs = PackCosts(start_alone_s=alone_start + units["data_s"], start_relay_s=relay_start,
                      start_coordinator_s=alone_start + units["data_s"], load_s=units["load_s"],
                      unit_alone_s=units["unit_alone_s"], unit_packed_s=list(units["unit_packed_s"]),
                      relay_s=relay_round_trip())
    log.info("packing costs measured: %s", costs.to_json())
    return costs
