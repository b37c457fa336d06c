"""JABAS iteration-time model (paper section 5.1, Eq. 1-6) over profiled data.

Source: JABAS (the JABAS/IIDP paper), section 5.1 (Eq. 1-6).

For GPU type g, local batch B_L, ``n_vsw`` VSWs and ``n_GA`` gradient-accumulation steps:

* Eq. 1  thp_vsw(B_L, n) = alpha_thp * ln(n) + beta_thp, fitted exactly through the two
  profiled points n = 1 and n = n_max (so beta_thp = B_L / t(1) and
  alpha_thp = (B_L * n_max / t(n_max) - beta_thp) / ln(n_max); alpha_thp = 0 when n_max = 1);
* Eq. 2  t_vsw = B_L * n / thp_vsw(B_L, n);
* Eq. 3  t_allreduce(d) = alpha_comm * (d * 4 (N_G - 1) / N_G) / K + beta_comm, the intra-node
  fit when the allocation is on one node, the inter-node fit otherwise - a fit measured on the
  placed actors (``measured_fits``, :func:`measured_fit`) before the profile's;
* Eq. 4  t_comm = sum_i t_allreduce(b_i) over the gradient buckets;
* Eq. 5  t_update = tau * (t_optim + t_copy * (n - 1)), tau = b_l / W for OWS (only the last
  bucket's update is not hidden behind all-reduce), tau = 1 for SWS;
* Eq. 6  t = t_vsw * n_GA + zeta * t_vsw + max((1 - zeta) * t_vsw, t_comm) + t_update.

Deviation (documented, measured): we add the profile's ``step_overhead`` once per iteration,
t = Eq. 6 + t_overhead. It is the engine's per-step host time outside forward/backward,
all-reduce and update (loss bookkeeping, thread hand-offs), measured by the profiler as
wall - compute - comm - update at n_vsw = 1. On a GPU it is mostly hidden by asynchronous
launches (and ~0); on CPU with small models it is a large share of a step (1-2 ms on the dev
machine), and Eq. 6 alone under-predicts. Profiles without the field use 0 (pure Eq. 6).

Local batch sizes between two profiled sizes B_a < B_L < B_b (this is our choice; the paper
only profiles multiples of min B_L): each profiled point keeps its own Eq. 1 fit, t_vsw is
computed at both points for the requested n and interpolated linearly in B_L; zeta is
interpolated linearly; n_max is taken from B_b (memory use grows with B_L, so the larger
neighbour's limit is the safe one). Below the smallest profiled size B_0 (only the equal-batch
baselines of the simulator ask there: the solver's B_L are the profiled multiples of min B_L),
t_vsw follows the line through the two smallest profiled sizes, t(B_L) = t(B_0) + s (B_L - B_0),
s the slope between them: a step keeps its fixed part (kernel launches, a GPU not filled)
however small its batch; with one profiled size, or a line that does not fall with B_L
(s <= 0, or a negative intercept), t_vsw is proportional to B_L (the smallest size's
throughput). Above max B_L^g there is no configuration (``max_num_vsw`` returns 0,
``iteration_time`` raises).

Emulation on one host (ours): ``host_devices`` is how many emulated GPUs the host can run at
once (its cores / torch threads per actor). With N_G > host_devices the emulated GPUs time-share
the cores, so compute terms (t_vsw, t_update, t_overhead) are multiplied by N_G / host_devices;
the auto-scaler then no longer sees 4 actors on 2 cores as twice the compute of 2. None (real
GPUs): no such term.

Measured on the placed actors (ours, :mod:`.interval_model`): ``host_costs``, the terms of an
interval around its iterations (the driver's call, the loader, the similarity collective ...),
which :func:`.interval_model.interval_terms` adds per interval; and on CPU-emulated GPUs
``emulation_fits``, per GPU type the line ``t = a + b t_model`` from this model's iteration time
to the one the placed actors take, fitted over every profiled point, with GA rounds at their own
measured ratio (the term ``t_emulation = t - t_model``; see
:class:`.interval_model.EmulationCost` for why the emulation costs more than the profile's hot
loop).

Weight sync chosen by the model (``weight_sync="auto"``; ours, replacing the fixed threshold
when the profile carries a contention measurement). Eq. 6 is evaluated for SWS and for OWS and
the faster is taken (a tie goes to SWS: one optimizer call, no shard bookkeeping). With Eq. 5
alone OWS (tau = b_l / W <= 1) is never predicted slower than SWS; the paper's R_buffer rule
("mean bucket / user cap > 0.5 -> SWS") exists because the overlapped update *interferes* with
the all-reduce it overlaps, which Eq. 5 does not model. We model that interference explicitly
from the measured contention (:class:`jabasray.profiles.ContentionMeasurement`, fitted with
LIBRA's Eq. 5-6 by :func:`jabasray.planners.libra_model.fit_one_thread_count`):

* sigma_c = q rate / p rate >= 1: the all-reduce's slowdown while computation overlaps it;
* sigma_u = 1 / (alpha1 - alpha2 r): the computation's slowdown while an all-reduce overlaps it;
* U = t_optim + t_copy (n_vsw - 1) (Eq. 5 with tau = 1); V = (1 - tau) U, the update work OWS
  overlaps with communication; C = t_comm (Eq. 4).

Both tasks run slowed while both run (LIBRA Eq. 8-11 with g = sigma_u V, p = sigma_c C), so the
communication phase of OWS ends at

    T_ows = C + sigma_u V (1 - 1/sigma_c)   if sigma_u V <= sigma_c C  (the update ends first)
          = V + sigma_c C (1 - 1/sigma_u)   otherwise                  (the all-reduce ends first)

and  t_OWS = t_vsw n_GA + t_fwd + max(t_bwd, T_ows) + tau U,
     t_SWS = t_vsw n_GA + t_fwd + max(t_bwd, C) + U   (Eq. 6 unchanged).

OWS loses when the interference costs more than the hidden update, e.g. (update ending first,
communication-bound) when sigma_u (1 - 1/sigma_c) > 1. Large buffers are where this bites: few
buckets, so a long overlapped update per bucket next to a long all-reduce - the case R_buffer
stands in for. ``IterationBreakdown.t_comm`` reports T_ows for OWS (the interference included).
Without a measurement (``Profile.contention is None``) the paper's model is kept unchanged:
Eq. 5-6 as printed and the R_buffer rule for "auto". Both ignore the three-way overlap with
backward (as Eq. 6 does) and the per-shard call overhead of the shard optimizer.

No torch or ray import here: profiles are plain data (:mod:`jabasray.profiles`).
"""
from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..config import WEIGHT_SYNC_METHODS, choose_weight_sync
from .interval_model import EmulationCost, HostCosts
from .libra_model import measured_slowdowns
from ..profiles import AllReduceFit, BatchProfile, Profile
from ..serialization import JsonMixin
from ..validation import check_choice, check_float, check_int

log = logging.getLogger(__name__)

_WARNED_NO_INTER: set[str] = set()   # warn once per GPU type and process


@dataclass(frozen=True)
class IterationBreakdown(JsonMixin):
    """The terms of Eq. 6 for one configuration (seconds)."""

    t_vsw: float      # Eq. 2: one round of n_vsw concurrent micro-batches (fwd + bwd)
    t_fwd: float      # zeta * t_vsw
    t_bwd: float      # (1 - zeta) * t_vsw
    t_comm: float     # Eq. 4
    t_update: float   # Eq. 5
    num_ga: int       # n_GA
    total: float      # Eq. 6 + t_overhead
    t_overhead: float = 0.0  # per-step host overhead of the profile (see module notes)
    weight_sync: str = ""    # "sws" | "ows": the method these terms are for
    t_emulation: float = 0.0  # emulated GPUs: the emulation's cost beyond the model (EmulationCost)


def throughput_fit(point: BatchProfile) -> tuple[float, float]:
    """(alpha_thp, beta_thp) of Eq. 1 through the profiled points n = 1 and n = n_max."""
    beta = point.local_batch / point.compute_time_1
    n_max = point.max_num_vsw
    if n_max <= 1:
        return 0.0, beta
    thp_max = point.local_batch * n_max / point.compute_time_max
    return (thp_max - beta) / math.log(n_max), beta


def vsw_time_at(point: BatchProfile, num_vsw: int) -> float:
    """Eq. 2 at a profiled point: t_vsw = B_L * n / thp_vsw(B_L, n).

    Beyond the measured range (n > n_max, only reached when interpolating between profiled
    sizes) the throughput is not allowed to fall below the lower of the two measured ones.
    """
    alpha, beta = throughput_fit(point)
    thp = alpha * math.log(num_vsw) + beta
    if num_vsw > point.max_num_vsw:
        floor = min(beta, point.local_batch * point.max_num_vsw / point.compute_time_max)
        thp = max(thp, floor)
    return point.local_batch * num_vsw / thp


class PerfModel:
    """Iteration-time model for an allocation of GPUs whose types have profiles.

    Parameters
    ----------
    profiles : mapping gpu_type -> Profile (one per GPU type that may be asked about).
    num_gpus : N_G, GPUs taking part in the all-reduce (both groups of the allocation).
    multi_node : use the inter-node all-reduce fit (falls back to the intra-node one, with a
        warning, when a profile has none).
    weight_sync : "auto" (the faster of SWS and OWS by Eq. 6 with measured interference, or
        IIDP's R_buffer rule when the profile has no contention measurement), "sws" or "ows".
    r_buffer : threshold of the selection rule (paper: 0.5).

    measured_fits : ``{(N_G, multi_node): AllReduceFit}`` measured with the job's backend on
        placed actors (:mod:`jabasray.actors.allreduce_fit`); for an allocation the fit of
        :func:`measured_fit` replaces the profiles' fit of the same span (the Profile objects
        stay as profiled). ``with_measured_fits`` returns a copy with other fits (new caches).

    host_costs : :class:`.interval_model.HostCosts` measured on the placed actors (None: not
        measured; the interval is then Eq. 6 alone). emulation_fits : ``{gpu_type:
        EmulationCost}`` measured on placed emulated GPUs (module notes). ``with_measured_costs``
        returns a copy with others.

    ``for_allocation(num_gpus, multi_node)`` returns a copy for another allocation (sharing the
    allocation-independent t_vsw memo); the auto-scaler uses it. The object satisfies the solver's model protocol
    (``iteration_time``, ``max_local_batch``, ``max_num_vsw``) and also offers the vectorised
    ``iteration_times`` the solver uses when present.
    """

    def __init__(self, profiles: Mapping[str, Profile], num_gpus: int = 2, multi_node: bool = False,
                 weight_sync: str = "auto", r_buffer: float = 0.5, host_devices: int | None = None,
                 measured_fits: Mapping[tuple[int, bool], AllReduceFit] | None = None,
                 host_costs: HostCosts | None = None,
                 emulation_fits: Mapping[str, EmulationCost] | None = None) -> None:
        if not isinstance(profiles, Mapping) or not profiles:
            raise ValueError(f"profiles must be a non-empty mapping gpu_type -> Profile, got {profiles!r}")
        for k, v in profiles.items():
            if not isinstance(v, Profile):
                raise ValueError(f"profiles[{k!r}] must be a Profile, got {type(v).__name__}")
        self.profiles = dict(profiles)
        self.num_gpus = check_int("num_gpus", num_gpus, min_value=1)
        self.multi_node = bool(multi_node)
        self.weight_sync = check_choice("weight_sync", weight_sync, WEIGHT_SYNC_METHODS)
        self.r_buffer = check_float("r_buffer", r_buffer, min_value=0)
        self.host_devices = None if host_devices is None else check_int("host_devices", host_devices, min_value=1)
        self.measured_fits = dict(measured_fits or {})
        self.host_costs = host_costs
        self.emulation_fits = dict(emulation_fits or {})
        self._cache: dict[tuple[str, int, int], tuple[float, float]] = {}
        self._comm: dict[str, float] = {}
        self._slow: dict[str, tuple[float, float] | None] = {}

    def for_allocation(self, num_gpus: int, multi_node: bool) -> "PerfModel":
        m = PerfModel(self.profiles, num_gpus=num_gpus, multi_node=multi_node,
                      weight_sync=self.weight_sync, r_buffer=self.r_buffer, host_devices=self.host_devices,
                      measured_fits=self.measured_fits, host_costs=self.host_costs,
                      emulation_fits=self.emulation_fits)
        m._cache = self._cache   # t_vsw and zeta depend on the profiles only, not the allocation
        return m

    def with_measured_costs(self, host_costs: HostCosts | None,
                            emulation_fits: Mapping[str, EmulationCost] | None) -> "PerfModel":
        """This model with the host costs and emulation fits measured on placed actors (class
        notes): a new object (t_vsw's memo is shared)."""
        m = self.for_allocation(self.num_gpus, self.multi_node)
        m.host_costs = host_costs
        m.emulation_fits = dict(emulation_fits or {})
        return m

    def with_measured_fits(self, fits: Mapping[tuple[int, bool], AllReduceFit]) -> "PerfModel":
        """This model with ``fits`` as its measured all-reduce fits (class notes): a new object,
        so no Eq. 4 time cached with the old fits survives (t_vsw's memo is shared)."""
        m = self.for_allocation(self.num_gpus, self.multi_node)
        m.measured_fits = dict(fits)
        return m

    # ------------------------------------------------------------ profile look-up
    def to_record(self) -> dict:
        """What this model is built from, as plain JSON (:meth:`from_record` rebuilds an equal
        model): the profiles, the weight-sync setting, the OWS buffer, the emulation host's
        devices, the measured all-reduce fits, host costs and emulation fits. A run writes it
        whenever its model changes (``model.json``), so that the simulator can replay the run
        with the model the driver planned with."""
        return {"profiles": {g: p.to_dict() for g, p in self.profiles.items()},
                "num_gpus": self.num_gpus, "multi_node": self.multi_node,
                "weight_sync": self.weight_sync, "r_buffer": self.r_buffer,
                "host_devices": self.host_devices,
                "measured_fits": [[n, multi, f.to_dict()] for (n, multi), f in self.measured_fits.items()],
                "host_costs": self.host_costs.to_dict() if self.host_costs is not None else None,
                "emulation_fits": {g: f.to_dict() for g, f in self.emulation_fits.items()}}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "PerfModel":
        """The model :meth:`to_record` describes. ValueError (one line) naming a missing field."""
        missing = [k for k in ("profiles", "weight_sync") if k not in record]
        if missing:
            raise ValueError(f"model record: missing field(s) {missing}; it must hold profiles, "
                             f"weight_sync and optionally r_buffer, host_devices, measured_fits, "
                             f"host_costs, emulation_fits")
        costs = record.get("host_costs")
        return cls({g: Profile.from_dict(p) for g, p in record["profiles"].items()},
                   num_gpus=int(record.get("num_gpus", 2)), multi_node=bool(record.get("multi_node", False)),
                   weight_sync=record["weight_sync"],
                   r_buffer=record.get("r_buffer", 0.5), host_devices=record.get("host_devices"),
                   measured_fits={(int(n), bool(multi)): AllReduceFit.from_dict(f)
                                  for n, multi, f in record.get("measured_fits", [])},
                   host_costs=HostCosts.from_dict(costs) if costs is not None else None,
                   emulation_fits={g: EmulationCost.from_dict(f)
                                   for g, f in (record.get("emulation_fits") or {}).items()})

    def profile(self, gpu: str) -> Profile:
        try:
            return self.profiles[gpu]
        except KeyError:
            raise ValueError(f"gpu must be one of the profiled GPU types {sorted(self.profiles)}, "
                             f"got {gpu!r}") from None

    def max_local_batch(self, gpu: str) -> int:
        """max B_L^g of the profile."""
        return self.profile(gpu).max_local_batch

    def _neighbours(self, prof: Profile, local_batch: int) -> tuple[BatchProfile, BatchProfile | None, float]:
        """(lower point, upper point or None, weight of the upper point) for interpolation."""
        sizes = prof.local_batches
        i = bisect.bisect_left(sizes, local_batch)
        if i == len(sizes):
            raise ValueError(f"local_batch must be <= max local batch {sizes[-1]} of GPU type "
                             f"{prof.gpu_type!r}, got {local_batch}")
        b = prof.batches[i]
        if i == 0 or b.local_batch == local_batch:   # a profiled size, or below the smallest one
            return b, None, 0.0
        a = prof.batches[i - 1]
        return a, b, (local_batch - a.local_batch) / (b.local_batch - a.local_batch)

    def max_num_vsw(self, gpu: str, local_batch: int) -> int:
        """n_max for ``local_batch`` (0 when it exceeds max B_L^g)."""
        check_int("local_batch", local_batch, min_value=1)
        prof = self.profile(gpu)
        if local_batch > prof.max_local_batch:
            return 0
        a, b, _ = self._neighbours(prof, local_batch)
        return (b or a).max_num_vsw

    # ------------------------------------------------------------ Eq. 1-5
    def vsw_time(self, gpu: str, local_batch: int, num_vsw: int) -> float:
        """Eq. 2 (with interpolation between profiled B_L, see module docstring)."""
        return self._vsw_and_zeta(gpu, local_batch, num_vsw)[0]

    def _vsw_and_zeta(self, gpu: str, local_batch: int, num_vsw: int) -> tuple[float, float]:
        key = (gpu, local_batch, num_vsw)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        check_int("local_batch", local_batch, min_value=1)
        check_int("num_vsw", num_vsw, min_value=1)
        prof = self.profile(gpu)
        a, b, w = self._neighbours(prof, local_batch)
        if b is None:
            t = vsw_time_at(a, num_vsw)
            if local_batch != a.local_batch:  # below the smallest profiled size (module notes)
                t = _below_smallest(prof, local_batch, num_vsw, t)
            zeta = a.zeta
        else:
            t = (1 - w) * vsw_time_at(a, num_vsw) + w * vsw_time_at(b, num_vsw)
            zeta = (1 - w) * a.zeta + w * b.zeta
        self._cache[key] = (t, zeta)
        return t, zeta

    def allreduce_fit(self, gpu: str) -> AllReduceFit:
        """Eq. 3's fit for this allocation (:meth:`allreduce_fit_used`)."""
        return self.allreduce_fit_used(gpu)[1]

    def allreduce_fit_used(self, gpu: str) -> tuple[str, AllReduceFit]:
        """(``"measured"`` or ``"profiled"``, fit): the fit measured on placed actors for this
        allocation's span (:func:`measured_fit`), else the profile's fit of that span (the
        intra-node one, with a warning, when a profile has no inter-node fit)."""
        prof = self.profile(gpu)
        fit = measured_fit(self.measured_fits, self.num_gpus, self.multi_node)
        if fit is not None:
            return "measured", fit
        if self.multi_node:
            if prof.allreduce_inter is not None:
                return "profiled", prof.allreduce_inter
            if prof.gpu_type not in _WARNED_NO_INTER:
                _WARNED_NO_INTER.add(prof.gpu_type)
                log.warning("profile %s has no inter-node all-reduce fit; using the intra-node one",
                            prof.gpu_type)
        return "profiled", prof.allreduce_intra

    def comm_time(self, gpu: str) -> float:
        """Eq. 4: sum over buckets of Eq. 3."""
        t = self._comm.get(gpu)
        if t is None:
            fit = self.allreduce_fit(gpu)
            t = sum(fit.time(b, self.num_gpus) for b in self.profile(gpu).bucket_sizes)
            self._comm[gpu] = t
        return t

    def weight_sync_method(self, gpu: str, local_batch: int | None = None, num_vsw: int = 1) -> str:
        """"sws" or "ows" for this GPU type and configuration: the configured method; for "auto"
        the faster by Eq. 6 with interference (module notes; at B_L = ``local_batch``, default the
        smallest profiled one), or the R_buffer rule without a contention measurement."""
        if self.weight_sync != "auto" or self.overlap_slowdowns(gpu) is None:
            return self._fixed_method(gpu)
        bl = self.profile(gpu).local_batches[0] if local_batch is None else local_batch
        return self.breakdown(gpu, bl, num_vsw, 0).weight_sync

    def _fixed_method(self, gpu: str) -> str:
        if self.weight_sync != "auto":
            return self.weight_sync
        prof = self.profile(gpu)
        return choose_weight_sync(prof.bucket_sizes, prof.bucket_cap_mb, self.r_buffer)

    def overlap_slowdowns(self, gpu: str) -> tuple[float, float] | None:
        """(sigma_c, sigma_u) of the interference model from the profile's contention
        measurement (module notes), None when it has none."""
        if gpu not in self._slow:
            meas = self.profile(gpu).contention
            try:
                self._slow[gpu] = None if meas is None else measured_slowdowns(meas)
            except ValueError as e:   # too noisy to fit (e.g. measured on a loaded host)
                log.warning("GPU type %s: its contention measurement cannot be fitted (%s); "
                            "planning without it", gpu, e)
                self._slow[gpu] = None
        return self._slow[gpu]

    def tau(self, gpu: str, method: str | None = None) -> float:
        """tau of Eq. 5: b_l / W for OWS, 1 for SWS (``method`` None: the configured/R_buffer one)."""
        if (method or self._fixed_method(gpu)) == "sws":
            return 1.0
        prof = self.profile(gpu)
        return min(1.0, prof.bucket_sizes[-1] / prof.param_bytes)

    def update_time(self, gpu: str, num_vsw: int, method: str | None = None) -> float:
        """Eq. 5."""
        prof = self.profile(gpu)
        return self.tau(gpu, method) * (prof.optimizer_time + prof.copy_time * (num_vsw - 1))

    @property
    def host_share(self) -> float:
        """Emulation: compute slows by N_G / host_devices when the allocation has more emulated
        GPUs than the host can run at once (they share its cores); 1 otherwise."""
        if self.host_devices is None:
            return 1.0
        return max(1.0, self.num_gpus / self.host_devices)

    # ------------------------------------------------------------ Eq. 6
    def breakdown(self, gpu: str, local_batch: int, num_vsw: int, num_ga: int) -> IterationBreakdown:
        """Eq. 6 terms for the configured weight sync; for "auto" with a contention measurement
        the faster of SWS and OWS (module notes; a tie goes to SWS)."""
        if self.weight_sync == "auto" and self.overlap_slowdowns(gpu) is not None:
            sws = self._breakdown(gpu, local_batch, num_vsw, num_ga, "sws")
            ows = self._breakdown(gpu, local_batch, num_vsw, num_ga, "ows")
            return ows if ows.total < sws.total else sws
        return self._breakdown(gpu, local_batch, num_vsw, num_ga, self._fixed_method(gpu))

    def _breakdown(self, gpu: str, local_batch: int, num_vsw: int, num_ga: int, method: str
                   ) -> IterationBreakdown:
        check_int("num_ga", num_ga, min_value=0)
        t_vsw, zeta = self._vsw_and_zeta(gpu, local_batch, num_vsw)
        share = self.host_share
        t_vsw *= share
        t_fwd, t_bwd = zeta * t_vsw, (1 - zeta) * t_vsw
        t_comm = self.comm_time(gpu) if self.num_gpus > 1 else 0.0
        t_update = self.update_time(gpu, num_vsw, method) * share
        slow = self.overlap_slowdowns(gpu)
        if method == "ows" and slow is not None:
            hidden = self.update_time(gpu, num_vsw, "sws") * share - t_update   # V = (1 - tau) U
            t_comm = ows_comm_phase(t_comm, hidden, *slow)
        t_over = self.profile(gpu).step_overhead * share
        total = t_vsw * num_ga + t_fwd + max(t_bwd, t_comm) + t_update + t_over
        fit = self.emulation_fits.get(gpu)
        t_emul = fit.time(total, t_vsw * num_ga) - total if fit is not None else 0.0
        return IterationBreakdown(t_vsw=t_vsw, t_fwd=t_fwd, t_bwd=t_bwd, t_comm=t_comm,
                                  t_update=t_update, num_ga=num_ga, total=total + t_emul,
                                  t_overhead=t_over, weight_sync=method, t_emulation=t_emul)

    def model_iteration_time(self, gpu: str, local_batch: int, num_vsw: int, num_ga: int) -> float:
        """Eq. 6 (+ the step overhead) without the emulation's measured cost: the x of
        :class:`.interval_model.EmulationCost`."""
        b = self.breakdown(gpu, local_batch, num_vsw, num_ga)
        return b.total - b.t_emulation

    def iteration_time(self, gpu: str, local_batch: int, num_vsw: int, num_ga: int) -> float:
        """Eq. 6 (+ the profile's step overhead), seconds per iteration."""
        return self.breakdown(gpu, local_batch, num_vsw, num_ga).total

    def iteration_times(self, gpu: str, local_batch: int, num_vsw: int, num_ga: np.ndarray) -> np.ndarray:
        """Eq. 6 for an array of n_GA values at once (Eq. 6 is affine in n_GA, and so is its
        emulation cost)."""
        b = self.breakdown(gpu, local_batch, num_vsw, 0)
        rounds = b.t_vsw * np.asarray(num_ga, dtype=float)
        model = b.total - b.t_emulation + rounds
        fit = self.emulation_fits.get(gpu)
        return model if fit is None else fit.time(model, rounds)

    def with_profiles(self, profiles: Mapping[str, Profile]) -> "PerfModel":
        return PerfModel(profiles, num_gpus=self.num_gpus, multi_node=self.multi_node,
                         weight_sync=self.weight_sync, r_buffer=self.r_buffer, host_devices=self.host_devices,
                         measured_fits=self.measured_fits, host_costs=self.host_costs,
                         emulation_fits=self.emulation_fits)

    def __repr__(self) -> str:
        return (f"PerfModel(types={sorted(self.profiles)}, num_gpus={self.num_gpus}, "
                f"multi_node={self.multi_node}, weight_sync={self.weight_sync!r})")


def _below_smallest(prof: Profile, local_batch: int, num_vsw: int, t0: float) -> float:
    """t_vsw below the smallest profiled B_L (module notes): the line through the two smallest
    profiled sizes, else proportional to B_L; ``t0`` is t_vsw at the smallest size."""
    a = prof.batches[0]
    linear = t0 * local_batch / a.local_batch
    if len(prof.batches) < 2:
        return linear
    b = prof.batches[1]
    slope = (vsw_time_at(b, num_vsw) - t0) / (b.local_batch - a.local_batch)
    if slope <= 0 or t0 - slope * a.local_batch < 0:
        return linear
    return t0 + slope * (local_batch - a.local_batch)


def measured_fit(fits: Mapping[tuple[int, bool], AllReduceFit], num_gpus: int, multi_node: bool
                 ) -> AllReduceFit | None:
    """The measured Eq. 3 fit an allocation of ``num_gpus`` GPUs on one node
    (``multi_node`` False) or several uses, from ``fits`` = ``{(N_G, multi_node): fit}``: the
    fit of the same span measured at N_G = ``num_gpus``, else at the nearest measured N_G (a tie
    goes to the larger; Eq. 3 carries N_G in its regressor, so a fit extrapolates in N_G), None
    when that span was never measured (the profile's fit stands). A fit measured within a node
    never stands for one across nodes or back: the link differs."""
    same = [n for n, multi in fits if multi == bool(multi_node)]
    if not same:
        return None
    best = min(same, key=lambda n: (abs(n - num_gpus), -n))
    return fits[(best, bool(multi_node))]


def ows_comm_phase(comm: float, update: float, sigma_c: float, sigma_u: float) -> float:
    """End of OWS's communication phase: an all-reduce of ``comm`` s and an update of ``update``
    s (both standalone times) run concurrently, each slowed (x sigma_c, x sigma_u) while both run
    (LIBRA Eq. 8-11; module notes): ``comm + sigma_u update (1 - 1/sigma_c)`` when the update
    ends first, ``update + sigma_c comm (1 - 1/sigma_u)`` otherwise."""
    if comm <= 0 or update <= 0:
        return max(comm, update)
    if sigma_u * update <= sigma_c * comm:
        return comm + sigma_u * update * (1.0 - 1.0 / sigma_c)
    return update + sigma_c * comm * (1.0 - 1.0 / sigma_u)


def emulated_profiles(base: Profile, speeds: Mapping[str, float]) -> dict[str, Profile]:
    """``{gpu_type: base.scaled(speed, gpu_type)}`` for CPU-emulated clusters."""
    return {g: base.scaled(s, g) for g, s in speeds.items()}


__all__ = ["PerfModel", "IterationBreakdown", "measured_fit", "throughput_fit", "vsw_time_at", "emulated_profiles",
           "ows_comm_phase"]
