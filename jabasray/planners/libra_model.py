"""LIBRA contention model (Liu et al., "LIBRA: Contention-Aware GPU Thread Allocation", Sec. III).

Implementation notes
--------------------
* Computation overlapped with an all-reduce that holds ``r`` GPU threads runs slower (Eq. 5)::

      g(b, r) = b / (alpha1 - alpha2 * r)

  ``b`` is the computation's standalone time (seconds). ``alpha1 - alpha2*r`` is the fraction of
  full speed left to the computation, so the fit is a linear least-squares problem in
  ``(alpha1, alpha2)`` on ``y = b / g``.
* The transmission time of an all-reduce of ``c`` gradient bytes shows diminishing returns in
  ``r`` (Eq. 6)::

      p(c, r) = c_hat / (gamma1 - gamma2 * exp(-gamma3 * r**gamma4)),   gamma4 = 0.6

  ``p`` uses the parameters fitted on overlapped all-reduces, ``q`` (same form) the parameters
  fitted on all-reduces that ran alone. ``c_hat`` and the startup ``a`` follow the ring
  all-reduce (Eq. 4): ``a = 2(N-1) * hop_latency``, ``c_hat = 2(N-1)/N * c``. The measured
  all-reduce time is ``a + p`` (Eq. 3); ``a`` comes from the separately measured hop latency.
  The fit is a separable least squares: a log-grid over ``gamma3`` with linear least squares
  for ``(gamma1, gamma2)`` on the rate ``c_hat / (t - a)``, refined by a Gauss-Newton style
  solver (``scipy.optimize.least_squares``) on the relative time residuals.
* Overlap and residual times (Eq. 8-11) are vectorised over numpy arrays so the DP planner
  (``jabasray.planners.libra``) can tabulate all stage times at once.

Every fitted model carries its fit error per component (relative RMSE, MAPE, max relative
error of the predicted times against the measured rows), like Sec. V-B validates the model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from ..profiles import ContentionMeasurement
from ..serialization import JsonMixin
from ..validation import check_float, check_int

log = logging.getLogger(__name__)

GAMMA4 = 0.6  # the empirical exponent the paper fixes in Eq. 6


# --------------------------------------------------------------------------- measurement rows
@dataclass(frozen=True)
class ComputeRow(JsonMixin):
    """One computation task timed while an all-reduce with ``threads`` threads overlapped it."""

    standalone_time: float   # b: the task's time without any overlap (s)
    threads: int             # r: threads allocated to the concurrent all-reduce
    time: float              # measured time of the task while fully overlapped (s)


@dataclass(frozen=True)
class CommRow(JsonMixin):
    """One all-reduce of ``size`` gradient bytes with ``threads`` threads, timed end to end."""

    size: float              # c: gradient bytes reduced (before the ring's 2(N-1)/N factor)
    threads: int             # r: threads allocated to the all-reduce
    time: float              # measured all-reduce time including the startup a (s)
    overlapped: bool         # True: ran alongside computation (fits p); False: alone (fits q)


# --------------------------------------------------------------------------- fitted parameters
@dataclass(frozen=True)
class ComputeParams(JsonMixin):
    """Eq. 5: overlapped computation runs at speed ``alpha1 - alpha2 * r`` of its standalone speed."""

    alpha1: float
    alpha2: float

    def speed(self, threads: np.ndarray | float) -> np.ndarray | float:
        return self.alpha1 - self.alpha2 * np.asarray(threads, dtype=float)


@dataclass(frozen=True)
class CommParams(JsonMixin):
    """Eq. 6: all-reduce transmission rate ``gamma1 - gamma2 * exp(-gamma3 * r**gamma4)`` (bytes/s)."""

    gamma1: float
    gamma2: float
    gamma3: float
    gamma4: float = GAMMA4

    def rate(self, threads: np.ndarray | float) -> np.ndarray | float:
        r = np.asarray(threads, dtype=float)
        return self.gamma1 - self.gamma2 * np.exp(-self.gamma3 * r ** self.gamma4)


@dataclass(frozen=True)
class FitError(JsonMixin):
    """How well a fitted component predicts its own measurement rows (relative time errors)."""

    rel_rmse: float          # sqrt(mean((pred/meas - 1)^2))
    mape: float              # mean(|pred/meas - 1|)
    max_rel_error: float     # max(|pred/meas - 1|)
    num_rows: int


def _fit_error(pred: np.ndarray, meas: np.ndarray) -> FitError:
    rel = pred / meas - 1.0
    return FitError(rel_rmse=float(np.sqrt(np.mean(rel ** 2))), mape=float(np.mean(np.abs(rel))),
                    max_rel_error=float(np.max(np.abs(rel))), num_rows=int(rel.size))


# --------------------------------------------------------------------------- the model
def _ring_startup(num_workers: int, hop_latency: float) -> float:
    """a = 2(N-1) * alpha (Eq. 4)."""
    return 2.0 * (num_workers - 1) * hop_latency


def _ring_bytes(num_workers: int, size: np.ndarray | float) -> np.ndarray:
    """c_hat = 2(N-1)/N * c (Eq. 4)."""
    return 2.0 * (num_workers - 1) / num_workers * np.asarray(size, dtype=float)


@dataclass(frozen=True)
class ContentionModel(JsonMixin):
    """g, p, q of Eq. 5-6 for one model on one cluster, plus the ring all-reduce geometry (Eq. 4).

    All methods accept scalars or numpy arrays (broadcast). Times are seconds, sizes bytes.
    """

    compute: ComputeParams           # g (Eq. 5)
    overlapped: CommParams           # p (Eq. 6, fitted on overlapped all-reduces)
    alone: CommParams                # q (Eq. 6 form, fitted on non-overlapped all-reduces)
    num_workers: int = 2             # N: ranks in the ring all-reduce
    hop_latency: float = 0.0         # alpha of Eq. 4: average one-hop latency (s)
    fit_errors: dict[str, FitError] = field(default_factory=dict)  # "g", "p", "q" when fitted

    def __post_init__(self) -> None:
        check_int("num_workers", self.num_workers, min_value=2)
        check_float("hop_latency", self.hop_latency, min_value=0.0)

    # Eq. 4 -------------------------------------------------------------------------------
    @property
    def startup(self) -> float:
        """a = 2(N-1) * alpha (Eq. 4)."""
        return _ring_startup(self.num_workers, self.hop_latency)

    def transmitted(self, size: np.ndarray | float) -> np.ndarray | float:
        """c_hat = 2(N-1)/N * c (Eq. 4)."""
        return _ring_bytes(self.num_workers, size)

    # Eq. 5-6 -----------------------------------------------------------------------------
    def g(self, b, r):
        """Overlapped computation time g(b, r) = b / (alpha1 - alpha2 r) (Eq. 5)."""
        return np.asarray(b, dtype=float) / self.compute.speed(r)

    def p(self, c, r):
        """Overlapped transmission time p(c, r) (Eq. 6), startup excluded."""
        return self.transmitted(c) / self.overlapped.rate(r)

    def q(self, c, r):
        """Non-overlapped transmission time q(c, r) (Eq. 6 form), startup excluded."""
        return self.transmitted(c) / self.alone.rate(r)

    def allreduce_time(self, c, r):
        """Eq. 3 for an all-reduce that runs alone: a + q(c, r); 0 for an empty tensor."""
        c = np.asarray(c, dtype=float)
        return np.where(c > 0, self.startup + self.q(c, r), 0.0)

    # Eq. 8-11 ----------------------------------------------------------------------------
    def overlap(self, c, b, r) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Overlap of a communication of size c with computation of size b, r comm threads.

        Returns ``(f_o, f_b, f_c)``: overlap time (Eq. 8), residual computation time and residual
        communication time (Eq. 9-11)::

            f_o = 0 if c == 0 or b == 0 else min(p(c,r) + a, g(b,r))
            f_b = b * (1 - f_o / g(b,r))            (0 if b == 0)
            f_c = (q(c,r) + a) * (1 - f_o / (p(c,r) + a))   (0 if c == 0)

        Exactly one of f_b, f_c is non-zero unless both tasks end together.
        """
        c, b, r = np.broadcast_arrays(np.asarray(c, dtype=float), np.asarray(b, dtype=float),
                                      np.asarray(r, dtype=float))
        a = self.startup
        comm = self.p(c, r) + a
        comp = self.g(b, r)
        active = (c > 0) & (b > 0)
        f_o = np.where(active, np.minimum(comm, comp), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            delta_b = np.where(b > 0, 1.0 - f_o / np.where(b > 0, comp, 1.0), 0.0)
            delta_c = np.where(c > 0, 1.0 - f_o / np.where(c > 0, comm, 1.0), 0.0)
        f_b = b * delta_b
        f_c = (self.q(c, r) + a) * delta_c
        return f_o, f_b, f_c

    # checks ------------------------------------------------------------------------------
    def check_threads(self, threads: Sequence[int], name: str = "thread_choices") -> list[int]:
        """Validate a set of thread counts: integers >= 1 at which every fitted speed is > 0."""
        if len(threads) == 0:
            raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {list(threads)!r}")
        out = [check_int(f"{name}[{i}]", t, min_value=1) for i, t in enumerate(threads)]
        r = np.asarray(out, dtype=float)
        for label, values in (("computation speed alpha1 - alpha2*r", self.compute.speed(r)),
                              ("overlapped rate of p", self.overlapped.rate(r)),
                              ("non-overlapped rate of q", self.alone.rate(r))):
            bad = [t for t, v in zip(out, np.atleast_1d(values)) if not v > 0]
            if bad:
                raise ValueError(f"{name} {bad} give a non-positive {label} under this contention "
                                 f"model; choose thread counts where the model is valid")
        return out


# --------------------------------------------------------------------------- fitting
def fit_compute(rows: Sequence[ComputeRow]) -> tuple[ComputeParams, FitError]:
    """Least-squares fit of Eq. 5 on ``y = b / t = alpha1 - alpha2 * r`` (linear in the parameters).

    Needs at least 2 rows with at least 2 distinct thread counts.
    """
    if len(rows) < 2:
        raise ValueError(f"compute_rows must hold at least 2 rows (2 parameters alpha1, alpha2), "
                         f"got {len(rows)}")
    b = np.array([check_float(f"compute_rows[{i}].standalone_time", row.standalone_time,
                              min_value=0.0, min_exclusive=True) for i, row in enumerate(rows)])
    t = np.array([check_float(f"compute_rows[{i}].time", row.time, min_value=0.0, min_exclusive=True)
                  for i, row in enumerate(rows)])
    r = np.array([check_int(f"compute_rows[{i}].threads", row.threads, min_value=0)
                  for i, row in enumerate(rows)], dtype=float)
    if np.unique(r).size < 2:
        raise ValueError(f"compute_rows must cover at least 2 distinct thread counts, got {sorted(set(r))}")
    y = b / t
    design = np.column_stack([np.ones_like(r), -r])
    (alpha1, alpha2), *_ = np.linalg.lstsq(design, y, rcond=None)
    params = ComputeParams(alpha1=float(alpha1), alpha2=float(alpha2))
    return params, _fit_error(b / params.speed(r), t)


def fit_comm(rows: Sequence[CommRow], num_workers: int, hop_latency: float, *,
             name: str = "comm_rows", gamma4: float = GAMMA4) -> tuple[CommParams, FitError]:
    """Least-squares fit of Eq. 6 to all-reduce rows (all of them overlapped, or all alone).

    The measured time is ``a + c_hat / rate(r)`` with ``rate = gamma1 - gamma2 exp(-gamma3 r^gamma4)``.
    Step 1 (variable projection): for each ``gamma3`` on a log grid, ``(gamma1, gamma2)`` solve a
    linear least squares on the observed rates ``c_hat / (t - a)``; keep the best by relative
    time error. Step 2: refine all three on the relative time residuals with
    ``scipy.optimize.least_squares`` (exact data -> exact parameters). Needs >= 3 rows and >= 3
    distinct thread counts.
    """
    from scipy.optimize import least_squares

    check_int("num_workers", num_workers, min_value=2)
    check_float("hop_latency", hop_latency, min_value=0.0)
    if len(rows) < 3:
        raise ValueError(f"{name} must hold at least 3 rows (3 parameters gamma1..gamma3), got {len(rows)}")
    a = _ring_startup(num_workers, hop_latency)
    c_hat = _ring_bytes(num_workers, [check_float(f"{name}[{i}].size", row.size, min_value=0.0,
                                                  min_exclusive=True) for i, row in enumerate(rows)])
    t = np.array([check_float(f"{name}[{i}].time", row.time, min_value=a, min_exclusive=True)
                  for i, row in enumerate(rows)])
    r = np.array([check_int(f"{name}[{i}].threads", row.threads, min_value=1)
                  for i, row in enumerate(rows)], dtype=float)
    if np.unique(r).size < 3:
        raise ValueError(f"{name} must cover at least 3 distinct thread counts, got {sorted(set(r))}")
    rate = c_hat / (t - a)
    scale = float(np.median(rate))          # work with rates of order 1
    y = rate / scale
    rg = r ** gamma4

    def residual(theta: np.ndarray) -> np.ndarray:
        g1, g2, g3 = theta
        model_rate = g1 - g2 * np.exp(-g3 * rg)
        with np.errstate(divide="ignore", invalid="ignore"):
            pred = a + c_hat / (scale * model_rate)
        res = pred / t - 1.0
        return np.where(np.isfinite(res) & (model_rate > 0), res, 1e6)

    best: tuple[float, np.ndarray] | None = None
    for g3 in np.logspace(-4, 2, 121) / float(np.median(rg)):
        design = np.column_stack([np.ones_like(rg), -np.exp(-g3 * rg)])
        (g1, g2), *_ = np.linalg.lstsq(design, y, rcond=None)
        theta = np.array([g1, g2, g3])
        cost = float(np.sum(residual(theta) ** 2))
        if best is None or cost < best[0]:
            best = (cost, theta)
    assert best is not None
    sol = least_squares(residual, best[1], bounds=([-np.inf, -np.inf, 0.0], np.inf),
                        x_scale="jac", xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=2000)
    g1, g2, g3 = sol.x if sol.cost <= 0.5 * best[0] else best[1]
    params = CommParams(gamma1=float(g1 * scale), gamma2=float(g2 * scale), gamma3=float(g3), gamma4=gamma4)
    pred = a + c_hat / params.rate(r)
    return params, _fit_error(pred, t)


def fit_contention_model(compute_rows: Sequence[ComputeRow], comm_rows: Sequence[CommRow], *,
                         num_workers: int, hop_latency: float) -> ContentionModel:
    """Fit g (Eq. 5), p and q (Eq. 6) from measurement rows (Algorithm 2, line 3).

    ``comm_rows`` with ``overlapped=True`` fit p, the others fit q; each needs >= 3 rows.
    ``hop_latency`` is the ring's one-hop latency alpha of Eq. 4 (measure it with a tiny
    all-reduce); the startup ``a = 2(N-1) alpha`` is subtracted before fitting the rates.
    The fit errors are returned in ``model.fit_errors`` ("g", "p", "q").
    """
    check_int("num_workers", num_workers, min_value=2)
    check_float("hop_latency", hop_latency, min_value=0.0)
    compute, err_g = fit_compute(compute_rows)
    over = [row for row in comm_rows if row.overlapped]
    alone = [row for row in comm_rows if not row.overlapped]
    p, err_p = fit_comm(over, num_workers, hop_latency, name="comm_rows (overlapped)")
    q, err_q = fit_comm(alone, num_workers, hop_latency, name="comm_rows (non-overlapped)")
    model = ContentionModel(compute=compute, overlapped=p, alone=q, num_workers=num_workers,
                            hop_latency=hop_latency, fit_errors={"g": err_g, "p": err_p, "q": err_q})
    log.info("LIBRA contention fit: rel RMSE g=%.3g p=%.3g q=%.3g", err_g.rel_rmse, err_p.rel_rmse,
             err_q.rel_rmse)
    if max(err_g.mape, err_p.mape, err_q.mape) > 0.1:
        log.warning("LIBRA contention model fits poorly (MAPE g=%.3g p=%.3g q=%.3g)",
                    err_g.mape, err_p.mape, err_q.mape)
    return model


def fit_one_thread_count(meas: ContentionMeasurement) -> ContentionModel:
    """Eq. 5-6 fitted to measurements taken at ONE communication thread count (gloo, where no
    thread/CTA knob exists; see :class:`jabasray.profiles.ContentionMeasurement`).

    With a single r only the values at that r are identifiable, so the thread terms are flat:

    * Eq. 5: ``g(b) = b / alpha1`` with ``alpha1 = b_meas / g_meas`` (alpha2 = 0);
    * Eq. 3-4 alone (q): ``t = a + c_hat / rate_q``, linear least squares over the sizes gives the
      startup ``a`` (clipped at 0; hop latency ``a / 2(N-1)``) and ``1 / rate_q``;
    * Eq. 6 overlapped (p): ``t - a = c_hat / rate_p``, least squares through the origin with the
      same ``a`` (LIBRA also subtracts one separately measured startup from both);
    * gamma2 = 0, so ``rate(r) = gamma1`` for every r (gamma3 is irrelevant, stored as 1).

    A non-positive slope (sizes too small to show the bandwidth) is a ValueError naming the sizes.
    """
    n = meas.num_workers
    c_hat = _ring_bytes(n, meas.sizes)
    alone = np.asarray(meas.comm_alone, dtype=float)
    over = np.asarray(meas.comm_overlapped, dtype=float)
    design = np.column_stack([np.ones_like(c_hat), c_hat])
    (a, inv_q), *_ = np.linalg.lstsq(design, alone, rcond=None)
    a = max(0.0, float(a))
    if a == 0.0:
        inv_q = float(np.dot(c_hat, alone) / np.dot(c_hat, c_hat))
    inv_p = float(np.dot(c_hat, over - a) / np.dot(c_hat, c_hat))
    span = 1e-6 * float(max(alone.max(), over.max()))   # transmission ~0 at the largest size: no bandwidth seen
    if not (inv_q * float(c_hat.max()) > span and inv_p * float(c_hat.max()) > span):
        raise ValueError(f"contention.sizes {list(meas.sizes)} do not show the all-reduce bandwidth "
                         f"(non-positive time per byte); measure larger all-reduces")
    r = np.asarray([meas.threads], dtype=float)
    compute = ComputeParams(alpha1=meas.compute_alone / meas.compute_overlapped, alpha2=0.0)
    q = CommParams(gamma1=1.0 / float(inv_q), gamma2=0.0, gamma3=1.0)
    p = CommParams(gamma1=1.0 / inv_p, gamma2=0.0, gamma3=1.0)
    model = ContentionModel(compute=compute, overlapped=p, alone=q, num_workers=n,
                            hop_latency=a / (2.0 * (n - 1)))
    errors = {"g": _fit_error(np.atleast_1d(model.g(meas.compute_alone, r)), np.array([meas.compute_overlapped])),
              "p": _fit_error(model.startup + model.p(meas.sizes, r), over),
              "q": _fit_error(model.startup + model.q(meas.sizes, r), alone)}
    return replace(model, fit_errors=errors)


def overlap_slowdowns(model: ContentionModel, threads: int = 1) -> tuple[float, float]:
    """``(sigma_comm, sigma_compute)``: how much slower an all-reduce's transmission runs while
    computation overlaps it (q rate / p rate, Eq. 6) and how much slower computation runs while
    an all-reduce overlaps it (1 / (alpha1 - alpha2 r), Eq. 5), at ``threads`` threads."""
    sigma_c = float(model.alone.rate(threads)) / float(model.overlapped.rate(threads))
    sigma_u = 1.0 / float(model.compute.speed(threads))
    return sigma_c, sigma_u


def measured_slowdowns(meas: ContentionMeasurement) -> tuple[float, float]:
    """:func:`overlap_slowdowns` of the one-thread fit of ``meas``, each at least 1: a speed-up
    under overlap is measurement noise, so it counts as no interference (never as a gain)."""
    sigma_c, sigma_u = overlap_slowdowns(fit_one_thread_count(meas), meas.threads)
    return max(1.0, sigma_c), max(1.0, sigma_u)


def synthetic_rows(model: ContentionModel, threads: Sequence[int], sizes: Sequence[float],
                   compute_times: Sequence[float], *, noise: float = 0.0,
                   seed: int = 0) -> tuple[list[ComputeRow], list[CommRow]]:
    """Measurement rows generated from ``model`` itself (times x (1 + noise * N(0,1))).

    For tests and benchmarks: a fit on noiseless rows must give ``model`` back.
    """
    check_float("noise", noise, min_value=0.0)
    rng = np.random.default_rng(seed)

    def jitter() -> float:
        return float(1.0 + noise * rng.standard_normal()) if noise > 0 else 1.0

    compute_rows = [ComputeRow(float(b), int(r), float(model.g(b, r)) * jitter())
                    for r in threads for b in compute_times]
    comm_rows = []
    for overlapped, transmission in ((True, model.p), (False, model.q)):
        for r in threads:
            for c in sizes:
                t = model.startup + float(transmission(c, r))
                comm_rows.append(CommRow(float(c), int(r), t * jitter(), overlapped))
    return compute_rows, comm_rows
