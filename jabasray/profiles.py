"""The ``Profile`` of one model on one device type: plain data, versioned JSON, no torch import.

A profile holds what the JABAS iteration-time model (paper section 5.1, Eq. 1-6) needs:

* per local batch size B_L (multiples of the user's min B_L up to max B_L^g): the compute time
  of one iteration with ``n_vsw = 1`` and with ``n_vsw = n_max`` (the two points of the
  logarithmic throughput fit, Eq. 1), ``n_max`` itself and the forward share zeta;
* the optimizer time t_optim and the weight-copy time t_copy (Eq. 5);
* the gradient bucket sizes b_1..b_l in backward order and the total parameter size W (Eq. 4, 5);
* the all-reduce regressions of Eq. 3, within a node and (if measured) across nodes;
* the per-step host overhead outside Eq. 6 (``step_overhead``; see planners/perf_model.py);
* optionally the contention measured on this host (``contention``, a
  :class:`ContentionMeasurement`): LIBRA's Eq. 5-6 and the SWS/OWS interference are fitted to it.

``Profile.scaled(speed, gpu_type)`` emulates a faster/slower GPU on CPU by dividing every
compute time (forward/backward, optimizer, weight copy) by ``speed``; communication is left as
measured (it does not depend on the GPU's compute speed).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from .serialization import JsonMixin, atomic_write_text
from .validation import check_float, check_int

PROFILE_VERSION = 1


@dataclass(frozen=True)
class BatchProfile(JsonMixin):
    """Measurements for one local batch size B_L."""

    local_batch: int            # B_L (samples per VSW micro-batch)
    max_num_vsw: int            # n_max: VSWs that fit concurrently at this B_L
    compute_time_1: float       # seconds of fwd+bwd with n_vsw = 1 (one micro-batch)
    compute_time_max: float     # seconds of fwd+bwd with n_vsw = n_max (one micro-batch each)
    zeta: float = 1.0 / 3.0     # forward share of compute time (zeta of Eq. 6)

    def __post_init__(self) -> None:
        check_int("local_batch", self.local_batch, min_value=1)
        check_int(f"batches[B_L={self.local_batch}].max_num_vsw", self.max_num_vsw, min_value=1)
        check_float(f"batches[B_L={self.local_batch}].compute_time_1", self.compute_time_1,
                    min_value=0, min_exclusive=True)
        check_float(f"batches[B_L={self.local_batch}].compute_time_max", self.compute_time_max,
                    min_value=0, min_exclusive=True)
        check_float(f"batches[B_L={self.local_batch}].zeta", self.zeta, min_value=0, max_value=1)

    def scaled(self, speed: float) -> "BatchProfile":
        return replace(self, compute_time_1=self.compute_time_1 / speed,
                       compute_time_max=self.compute_time_max / speed)


@dataclass(frozen=True)
class AllReduceFit(JsonMixin):
    """Eq. 3: ``t_allreduce(d) = alpha * (d * 4 (N_G - 1) / N_G) / K + beta``.

    ``d`` is in bytes, ``K`` (``bandwidth``) is the nominal link bandwidth in bytes/s; alpha
    (dimensionless) and beta (seconds) come from a least-squares fit of measured all-reduce
    times (``fit``). ``num_gpus`` records N_G of the measurement (informational).
    """

    alpha: float
    beta: float
    bandwidth: float = 1.25e9   # K, bytes/s (10 Gb/s nominal)
    num_gpus: int = 2

    def __post_init__(self) -> None:
        check_float("allreduce.alpha", self.alpha)
        check_float("allreduce.beta", self.beta)
        check_float("allreduce.bandwidth", self.bandwidth, min_value=0, min_exclusive=True)
        check_int("allreduce.num_gpus", self.num_gpus, min_value=2)

    @staticmethod
    def volume(nbytes: float, num_gpus: int, bandwidth: float) -> float:
        """The regressor of Eq. 3: ``d * 4 (N_G - 1) / N_G / K`` (seconds at peak bandwidth)."""
        return nbytes * 4.0 * (num_gpus - 1) / num_gpus / bandwidth

    def time(self, nbytes: float, num_gpus: int) -> float:
        """Predicted seconds for one all-reduce of ``nbytes`` over ``num_gpus`` GPUs (Eq. 3);
        0 when there is a single GPU (nothing to reduce). Never negative."""
        if num_gpus <= 1:
            return 0.0
        return max(0.0, self.alpha * self.volume(nbytes, num_gpus, self.bandwidth) + self.beta)

    @classmethod
    def fit(cls, sizes: Sequence[float], times: Sequence[float], num_gpus: int,
            bandwidth: float = 1.25e9) -> "AllReduceFit":
        """Least-squares fit of (alpha, beta) from all-reduce times measured for ``sizes`` bytes."""
        if len(sizes) != len(times) or len(sizes) < 2:
            raise ValueError(f"allreduce fit needs >= 2 (size, time) pairs of equal length, "
                             f"got {len(sizes)} sizes and {len(times)} times")
        check_int("num_gpus", num_gpus, min_value=2)
        xs = [cls.volume(s, num_gpus, bandwidth) for s in sizes]
        n = len(xs)
        mx, my = sum(xs) / n, sum(times) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            raise ValueError("allreduce fit needs at least two different tensor sizes")
        alpha = sum((x - mx) * (y - my) for x, y in zip(xs, times)) / sxx
        beta = my - alpha * mx
        return cls(alpha=float(alpha), beta=float(beta), bandwidth=float(bandwidth), num_gpus=num_gpus)


@dataclass(frozen=True)
class ContentionMeasurement(JsonMixin):
    """Compute/communication contention measured on a ``num_workers``-process gloo group on one
    host (:func:`jabasray.profiler.contention.measure_gloo_contention`): every rank times
    all-reduces of ``sizes`` bytes alone and while a compute thread runs on it, and a compute
    task alone and while all-reduces run. Plain measurements: LIBRA's Eq. 5-6 are fitted to them
    in :func:`jabasray.planners.libra_model.fit_one_thread_count`.

    ``threads`` is the communication thread count of the measurement; gloo offers no such knob,
    so it is the single nominal value 1 (LIBRA's thread dimension is not measurable there).
    """

    num_workers: int             # N: processes in the gloo group
    sizes: list[float]           # all-reduce sizes c (bytes)
    comm_alone: list[float]      # s per all-reduce of sizes[i], nothing else running
    comm_overlapped: list[float] # s per all-reduce of sizes[i] while a compute thread runs
    compute_alone: float         # b: s per compute task alone
    compute_overlapped: float    # g: s per compute task while all-reduces run
    threads: int = 1             # communication threads (gloo: no knob, one nominal value)

    def __post_init__(self) -> None:
        check_int("contention.num_workers", self.num_workers, min_value=2)
        check_int("contention.threads", self.threads, min_value=1)
        n = len(self.sizes)
        if n < 2 or len(self.comm_alone) != n or len(self.comm_overlapped) != n:
            raise ValueError(f"contention.sizes, comm_alone and comm_overlapped must have the same "
                             f"length >= 2, got {n}, {len(self.comm_alone)}, {len(self.comm_overlapped)}")
        for name in ("sizes", "comm_alone", "comm_overlapped"):
            for i, v in enumerate(getattr(self, name)):
                check_float(f"contention.{name}[{i}]", v, min_value=0, min_exclusive=True)
        check_float("contention.compute_alone", self.compute_alone, min_value=0, min_exclusive=True)
        check_float("contention.compute_overlapped", self.compute_overlapped, min_value=0, min_exclusive=True)


@dataclass(frozen=True)
class Profile(JsonMixin):
    """Everything the iteration-time model needs about one model on one GPU type."""

    model_signature: str                  # hash of architecture + parameter shapes
    gpu_type: str                         # GPU type name this profile describes
    min_local_batch: int                  # the user's min B_L; batches are its multiples
    batches: list[BatchProfile]           # increasing B_L, the last one is max B_L^g
    optimizer_time: float                 # t_optim (s), full optimizer step of the main VSW
    copy_time: float                      # t_copy (s), copying the weights to one other VSW
    bucket_sizes: list[int]               # gradient bucket sizes in bytes, backward order
    param_bytes: int                      # W: total parameter size in bytes
    allreduce_intra: AllReduceFit         # Eq. 3 fit within a node
    allreduce_inter: AllReduceFit | None = None  # Eq. 3 fit across nodes (None: not measured)
    device: str = "cpu"                   # torch device type the measurements ran on
    bucket_cap_mb: float = 25.0           # bucket size cap the engine used
    speed: float = 1.0                    # emulation factor applied by ``scaled`` (1 = measured)
    memory_budget_gb: float | None = None # memory bound used to find max B_L / n_max
    step_overhead: float = 0.0            # s per iteration outside Eq. 6 (host bookkeeping), see perf_model
    contention: ContentionMeasurement | None = None  # measured compute/comm contention (None: not measured)
    execution: str | None = None          # what the engine ran at n_max: "batched", "per_vsw" or
                                          # "graphed" (None: not recorded)
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version must be {PROFILE_VERSION}, got {self.version!r}; "
                             "re-run `jabasray profile` to regenerate it")
        if not isinstance(self.gpu_type, str) or not self.gpu_type:
            raise ValueError(f"gpu_type must be a non-empty string, got {self.gpu_type!r}")
        check_int("min_local_batch", self.min_local_batch, min_value=1)
        if not self.batches:
            raise ValueError("batches must list at least one local batch size, got []")
        sizes = [b.local_batch for b in self.batches]
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"batches must have strictly increasing local_batch, got {sizes}")
        check_float("optimizer_time", self.optimizer_time, min_value=0)
        check_float("copy_time", self.copy_time, min_value=0)
        if not self.bucket_sizes or any(int(s) <= 0 for s in self.bucket_sizes):
            raise ValueError(f"bucket_sizes must be a non-empty list of positive byte counts, "
                             f"got {self.bucket_sizes!r}")
        check_int("param_bytes", self.param_bytes, min_value=1)
        check_float("speed", self.speed, min_value=0, min_exclusive=True)
        check_float("bucket_cap_mb", self.bucket_cap_mb, min_value=0, min_exclusive=True)
        check_float("step_overhead", self.step_overhead, min_value=0)

    # ---------------------------------------------------------------- derived
    @property
    def max_local_batch(self) -> int:
        """max B_L^g: the largest profiled local batch size."""
        return self.batches[-1].local_batch

    @property
    def local_batches(self) -> list[int]:
        return [b.local_batch for b in self.batches]

    def batch(self, local_batch: int) -> BatchProfile:
        for b in self.batches:
            if b.local_batch == local_batch:
                return b
        raise ValueError(f"local_batch must be one of the profiled sizes {self.local_batches}, "
                         f"got {local_batch!r}")

    def scaled(self, speed: float, gpu_type: str | None = None) -> "Profile":
        """A profile of an emulated GPU that computes ``speed`` times as fast as this one.

        Compute times (fwd/bwd at both n_vsw points, optimizer, weight copy, step overhead) are
        divided by ``speed``; memory limits (max B_L, n_max), bucket sizes and all-reduce fits are kept.
        """
        check_float("speed", speed, min_value=0, min_exclusive=True)
        return replace(self, gpu_type=gpu_type or self.gpu_type,
                       batches=[b.scaled(speed) for b in self.batches],
                       optimizer_time=self.optimizer_time / speed,
                       copy_time=self.copy_time / speed,
                       step_overhead=self.step_overhead / speed,
                       speed=self.speed * speed)


def profile_cache_key(model_signature: str, gpu_type: str, settings: dict | None = None) -> str:
    """File stem of a cached profile: model signature, device type and (if given) a hash of the
    measurement settings (``profiler.measure.measurement_settings``: torch version, device, ...)."""
    import hashlib
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu_type)
    tag = ""
    if settings:
        tag = "-" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    return f"{model_signature}-{safe}{tag}-v{PROFILE_VERSION}"


def load_profiles(paths: Sequence[str | Path]) -> dict[str, Profile]:
    """Read profiles from JSON files; each file holds one profile or ``{"profiles": [...]}``.

    Returns ``{gpu_type: Profile}``. A GPU type given twice is an error naming both files.
    """
    out: dict[str, Profile] = {}
    origin: dict[str, str] = {}
    for p in paths:
        path = Path(p)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"profile file {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"profile file {path} is not valid JSON: {e}") from None
        items = data.get("profiles") if isinstance(data, dict) and "profiles" in data else [data]
        if not isinstance(items, list) or not items:
            raise ValueError(f"profile file {path}: profiles must be a non-empty list")
        for i, item in enumerate(items):
            try:
                prof = Profile.from_dict(item)
            except (TypeError, KeyError, AttributeError) as e:
                raise ValueError(f"profile file {path}: entry {i} is not a valid Profile ({e})") from None
            except ValueError as e:
                raise ValueError(f"profile file {path}: {e}") from None
            if prof.gpu_type in out:
                raise ValueError(f"profile gpu_type {prof.gpu_type!r} is given twice "
                                 f"({origin[prof.gpu_type]} and {path})")
            out[prof.gpu_type] = prof
            origin[prof.gpu_type] = str(path)
    return out


def save_profiles(profiles: Sequence[Profile], path: str | Path) -> Path:
    """Write several profiles into one JSON file (``{"profiles": [...]}``)."""
    return atomic_write_text(path, json.dumps({"profiles": [p.to_dict() for p in profiles]}, indent=2))


def synthetic_profile(gpu_type: str = "cpu", *, min_local_batch: int = 8, num_batches: int = 4,
                      time_per_sample: float = 1e-3, fixed_time: float = 2e-3, max_num_vsw: int = 4,
                      vsw_exponent: float = 0.7, zeta: float = 0.35, optimizer_time: float = 1e-3,
                      copy_time: float = 2e-4, bucket_sizes: Sequence[int] = (400_000, 300_000, 100_000),
                      allreduce_alpha: float = 1.5, allreduce_beta: float = 2e-4,
                      inter_alpha: float | None = 4.0, inter_beta: float = 1e-3,
                      model_signature: str = "synthetic") -> Profile:
    """A made-up but plausible profile for tests, benchmarks and docs (no measurement).

    For B_L = min_local_batch * i (i = 1..num_batches): t(1) = fixed + B_L * time_per_sample,
    n_max = max(1, max_num_vsw - (i - 1) // 2) and t(n_max) = t(1) * n_max ** vsw_exponent
    (concurrent VSWs share the device: throughput grows sub-linearly with n_vsw).
    """
    check_int("num_batches", num_batches, min_value=1)
    batches = []
    for i in range(1, num_batches + 1):
        bl = min_local_batch * i
        t1 = fixed_time + bl * time_per_sample
        n = max(1, max_num_vsw - (i - 1) // 2)
        batches.append(BatchProfile(local_batch=bl, max_num_vsw=n, compute_time_1=t1,
                                    compute_time_max=t1 * n ** vsw_exponent, zeta=zeta))
    inter = (AllReduceFit(alpha=inter_alpha, beta=inter_beta) if inter_alpha is not None else None)
    return Profile(model_signature=model_signature, gpu_type=gpu_type, min_local_batch=min_local_batch,
                   batches=batches, optimizer_time=optimizer_time, copy_time=copy_time,
                   bucket_sizes=[int(b) for b in bucket_sizes], param_bytes=int(sum(bucket_sizes)),
                   allreduce_intra=AllReduceFit(alpha=allreduce_alpha, beta=allreduce_beta),
                   allreduce_inter=inter)
