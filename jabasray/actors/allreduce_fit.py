"""The all-reduce fit of Eq. 3 measured with the job's backend on the placed GPU actors.

JABAS (section 5.1, Eq. 3-4) fits ``t_allreduce(d) = alpha (d 4 (N_G - 1) / N_G) / K + beta``
to all-reduce times the profiler collects offline (10 tensors, one fit within a node and one
across nodes). Deviation (ours): the fit is measured after a placement, by the GPU actors that
train (:meth:`jabasray.actors.gpu_actor.GPUActor.allreduce_times`), over the job's own process
group. Why: the fit depends on the link the collective actually uses - NVLink or PCIe within a
node, the network across nodes - and on the backend (NCCL on GPUs, gloo on CPUs), none of
which a profiling host's loopback gloo group sees. Each (backend, world size, span) is measured
once per run (the measurements are checkpointed with the driver's state), with a few sizes
spanning the model's gradient buckets (:func:`measurement_sizes`; 4 rather than the paper's 10,
so a new allocation costs well under a second on CPU).

The pieces (no Ray):

* :func:`~jabasray.profiler.measure.time_allreduces`: one rank's timing loop (the GPU actor
  runs it on the job's group; the profiler's loopback measurement runs the same loop);
* :func:`fit_key` / :func:`parse_key`: ``"<backend>/<world size>/<intra|inter>"``;
* :func:`measurement_sizes`: the float32 tensor sizes timed (bytes);
* :func:`collective_times`: the collective's time per size = the slowest rank's (the
  all-reduce ends when its last rank has the result);
* :func:`measurement_record`: what the driver keeps of one measurement (sizes, every rank's
  times, the fit) and :func:`record_fit` to read the fit back;
* :func:`fits_for_model`: the recorded fits of a backend as ``PerfModel(measured_fits=...)``;
* :func:`fit_description`: which fit the plans of an epoch used (its record);
* :class:`MeasuredFits`: the driver's book of one run's measurements (what is due, the model
  with them, the measurement through the fan-out with its deadline, one log line each).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ..profiler.measure import time_allreduces
from ..profiles import AllReduceFit
from ..serialization import JsonMixin

log = logging.getLogger(__name__)

SPANS = {False: "intra", True: "inter"}
MEASURE_WARMUP = 1     # untimed all-reduces per size
MEASURE_REPEATS = 3    # timed all-reduces per size (each rank's median)
MEASURE_COUNT = 4      # sizes timed
MEASURE_SPREAD = 8.0   # the smallest size is at most max bucket / this (leverage for the slope)


@dataclass(frozen=True)
class AllReduceTimes(JsonMixin):
    """One rank's answer to the micro-benchmark: where it ran, over which backend, and its
    median seconds per size (sizes in the order asked)."""

    rank: int
    node_id: str
    backend: str
    times: list[float] = field(default_factory=list)


def fit_key(backend: str, world_size: int, multi_node: bool) -> str:
    """``"gloo/4/inter"``: what a measurement stands for."""
    return f"{backend}/{int(world_size)}/{SPANS[bool(multi_node)]}"


def parse_key(key: str) -> tuple[str, int, bool]:
    """(backend, world size, multi-node) of a :func:`fit_key` (ValueError, one line, if not one)."""
    parts = str(key).split("/")
    if len(parts) != 3 or parts[2] not in SPANS.values() or not parts[1].isdigit():
        raise ValueError(f"allreduce fit key must be '<backend>/<world size>/<intra|inter>', got {key!r}")
    return parts[0], int(parts[1]), parts[2] == "inter"


def measurement_sizes(bucket_sizes: Sequence[int], count: int = MEASURE_COUNT,
                      spread: float = MEASURE_SPREAD) -> list[int]:
    """Up to ``count`` float32 tensor sizes (bytes, multiples of 4 rounded down at the ends,
    increasing, distinct) spaced geometrically from ``min(smallest bucket, largest bucket /
    spread)`` to the largest bucket: the range Eq. 4 evaluates Eq. 3 on, with enough spread for
    the slope. At least 2 sizes (one float's bucket: 4 and 8 bytes)."""
    if not bucket_sizes or any(int(b) <= 0 for b in bucket_sizes):
        raise ValueError(f"bucket_sizes must be positive byte counts, got {list(bucket_sizes)!r}")
    if int(count) < 2:
        raise ValueError(f"count must be >= 2, got {count!r}")
    hi = max(4, int(max(bucket_sizes)) // 4 * 4)
    lo = max(4, int(min(min(bucket_sizes), hi / spread)) // 4 * 4)
    inner = [lo * (hi / lo) ** (i / (count - 1)) for i in range(1, count - 1)]
    sizes = sorted({lo, hi, *(max(4, int(round(x / 4)) * 4) for x in inner)})
    return sizes if len(sizes) >= 2 else [hi, 2 * hi]


def collective_times(rank_times: Sequence[Sequence[float]]) -> list[float]:
    """The collective's seconds per size: the slowest rank's time for each size."""
    if not rank_times or len({len(t) for t in rank_times}) != 1:
        raise ValueError(f"rank_times must list the same number of sizes for every rank, got "
                         f"{[len(t) for t in rank_times]}")
    return [max(float(t[i]) for t in rank_times) for i in range(len(rank_times[0]))]


def measurement_record(key: str, sizes: Sequence[int], replies: Sequence[AllReduceTimes],
                       bandwidth: float) -> dict:
    """What the driver keeps of the measurement ``key`` (JSON): the sizes, every rank's times
    and node, and Eq. 3 fitted (:meth:`AllReduceFit.fit`, N_G = the ranks, K = ``bandwidth``)
    to :func:`collective_times`. ValueError (one line) when a rank did not measure with the
    key's backend, the ranks are not the key's world size, or a time is not finite and > 0."""
    backend, world, _ = parse_key(key)
    wrong = sorted({r.backend for r in replies} - {backend})
    if wrong or len(replies) != world:
        raise ValueError(f"all-reduce measurement {key}: {len(replies)} ranks over backend(s) "
                         f"{sorted({r.backend for r in replies})}, expected {world} over {backend}")
    rank_times = [list(map(float, r.times)) for r in replies]
    if any(not math.isfinite(t) or t <= 0 for ts in rank_times for t in ts):
        raise ValueError(f"all-reduce measurement {key}: times must be finite and > 0, got {rank_times}")
    fit = AllReduceFit.fit(list(sizes), collective_times(rank_times), num_gpus=world, bandwidth=bandwidth)
    return {"key": key, "sizes": [int(s) for s in sizes], "rank_times": rank_times,
            "nodes": [r.node_id for r in replies], "fit": fit.to_dict()}


def record_fit(record: Mapping) -> AllReduceFit:
    return AllReduceFit.from_dict(dict(record["fit"]))


def fits_for_model(records: Mapping[str, Mapping], backend: str) -> dict[tuple[int, bool], AllReduceFit]:
    """The recorded fits measured with ``backend`` as ``{(N_G, multi_node): fit}`` (what
    ``PerfModel(measured_fits=...)`` takes)."""
    out = {}
    for key, rec in records.items():
        b, world, multi = parse_key(key)
        if b == backend:
            out[(world, multi)] = record_fit(rec)
    return out


def fit_description(source: str, fit: AllReduceFit, world_size: int, multi_node: bool) -> dict:
    """An epoch record's ``allreduce_fit``: which Eq. 3 fit its plans used (``source``:
    "measured" on placed actors or "profiled"), for which allocation, and the fit itself
    (``num_gpus``: N_G it was measured at)."""
    return {"source": source, "span": SPANS[bool(multi_node)], "world_size": int(world_size),
            **fit.to_dict()}


def span_bandwidth(profiles: Mapping, multi_node: bool) -> float:
    """K of Eq. 3 for a measured fit: the nominal bandwidth of the profiles' fit of the same span
    (the first profile's; the intra-node one when it has no inter-node fit)."""
    prof = next(iter(profiles.values()))
    fit = prof.allreduce_inter if multi_node and prof.allreduce_inter is not None else prof.allreduce_intra
    return fit.bandwidth


class MeasuredFits:
    """The Eq. 3 fits one run measured on its placed actors (module notes).

    Args:
        backend: the job's process-group backend (:func:`.rendezvous.backend_for`).
        enabled: ``DriverOptions.measure_allreduce`` (False: nothing is measured or applied).

    ``records``: ``{key: measurement_record}`` (checkpointed with the driver's state);
    ``measured``: the keys this process measured, in order.
    """

    def __init__(self, backend: str, enabled: bool = True) -> None:
        self.backend, self.enabled = backend, bool(enabled)
        self.records: dict[str, dict] = {}
        self.measured: list[str] = []

    def applies_to(self, model: object) -> bool:
        """Whether ``model`` plans with measured fits: on, and a PerfModel-like model with
        profiles (a ready model given by the user is used as given: pass None)."""
        return self.enabled and model is not None and hasattr(model, "with_measured_fits") \
            and bool(getattr(model, "profiles", None))

    def adopt(self, records: Mapping[str, Mapping]) -> bool:
        """Take the checkpointed ``records`` of keys not known yet; True when any was new."""
        new = {k: dict(v) for k, v in (records or {}).items() if k not in self.records}
        self.records.update(new)
        return bool(new)

    def fitted(self, model: object) -> object:
        """``model`` planning with the recorded fits of this backend (a new model, see
        ``PerfModel.with_measured_fits``), or ``model`` itself when they do not apply."""
        if not self.applies_to(model):
            return model
        return model.with_measured_fits(fits_for_model(self.records, self.backend))

    def due(self, model: object, world_size: int, multi_node: bool) -> str | None:
        """The key to measure after a placement of ``world_size`` ranks (spanning nodes or
        not), or None: nothing applies, a single rank (no all-reduce), or measured already."""
        if world_size < 2 or not self.applies_to(model):
            return None
        key = fit_key(self.backend, world_size, multi_node)
        return None if key in self.records else key

    def measure(self, key: str, model: object, call_all: Callable[..., list]) -> dict | None:
        """Time all-reduces on every placed rank (``call_all(method, *args)``: the driver's
        fan-out, with its deadline: a hang is an actor failure), fit, record and log it.
        A measurement that cannot be fitted (:func:`measurement_record`'s ValueError) is said
        in a warning and the profiles' fit stays (None is returned)."""
        _, _, multi = parse_key(key)
        sizes = measurement_sizes([b for p in model.profiles.values() for b in p.bucket_sizes])
        t0 = time.perf_counter()
        replies = call_all("allreduce_times", sizes, MEASURE_WARMUP, MEASURE_REPEATS)
        try:
            rec = measurement_record(key, sizes, replies, span_bandwidth(model.profiles, multi))
        except ValueError as e:
            log.warning("%s; planning with the profiles' all-reduce fit", e)
            return None
        rec["seconds"] = time.perf_counter() - t0   # what the measurement cost the run
        self.records[key], fit = rec, record_fit(rec)
        self.measured.append(key)
        log.info("all-reduce fit %s measured on the placed actors in %.2fs: alpha=%.4g beta=%.4gs "
                 "(K=%.3g B/s) over sizes %s bytes", key, rec["seconds"], fit.alpha, fit.beta,
                 fit.bandwidth, rec["sizes"])
        return rec


__all__ = ["AllReduceTimes", "MeasuredFits", "time_allreduces", "span_bandwidth", "fit_key", "parse_key", "measurement_sizes", "collective_times",
           "measurement_record", "record_fit", "fits_for_model", "fit_description"]
