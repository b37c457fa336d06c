"""Convergence on the simulated clock: training progress per sample at a global batch B, the
validation metric reached, and the two-group gradient similarity Phi that JABAS's batch rule reads.

Implementation notes
--------------------
The model is Pollux's (Qiao et al., OSDI 2021, section 3.1 "statistical efficiency"), fitted
from the same fixed-batch traces its simulator reads (AdaptDL repository, branch osdi21-artifact:
``simulator/traces/<app>/validation-<B>.csv``, parsed by ``simulator/applications.py``), plus the
one step that links it to SimiGrad/JABAS: Phi follows from the same gradient statistics.

Units (pinned down from AdaptDL's estimator, ``adaptdl/torch/adascale.py`` on that branch, whose
``scale`` is ``batch / M0``: ``parallel.py`` calls ``set_batch_scale(local_bsz * replicas /
loader.batch_size)``, ``loader.batch_size`` being the initial batch, and gradient accumulation
multiplies it by the accumulation count; tests/test_sim_convergence.py checks these units
against Pollux's own progress columns):

* ``M0``: the reference batch, Pollux's initial batch size (``init_batch_size``): the batch the
  traces' units refer to, :attr:`ConvergenceModel.reference_batch_`.
* ``G``: the true gradient (expected per-sample gradient); ``sigma^2``: trace of the covariance of
  ONE sample's gradient, so a mean over b samples has noise ``E|eps|^2 = sigma^2 / b``.
* ``grad_sqr``: estimate of ``|G|^2``.
* ``grad_var``: estimate of ``sigma^2 / M0`` -- NOT per sample: the noise variance of a mean
  gradient over M0 samples. (AdaptDL computes ``(local_sqr - total_sqr) * scale / (count - 1)``
  from ``count`` gradients of ``B / count`` samples each; its expectation is
  ``sigma^2 (count-1) / B * scale / (count-1) = sigma^2 / M0``.)
* gradient noise scale, per sample (McCandlish et al. 2018, section 2.2, B_simple; Pollux's
  "pre-conditioned gradient noise scale" phi_t, here without a pre-conditioner)::

      B_noise = sigma^2 / |G|^2 = M0 * grad_var / grad_sqr                          (1)

* gain of one step at batch B (AdaScale's r, AdaptDL ``gain(scale)``), ``s = B / M0``::

      r(B) = (grad_var + grad_sqr) / (grad_var / s + grad_sqr)                       (2)

* statistical efficiency of B relative to M0 (Pollux section 3.1; ``goodput.py``
  ``efficiency``): the progress one sample gives at B over the progress it gives at M0::

      E(B) = r(B) * M0 / B = (B_noise + M0) / (B_noise + B)                         (3)

  E(M0) = 1; E -> 1 when noise dominates (B_noise >> B), E -> M0 / B when it does not.
* progress: AdaptDL adds ``r`` at every optimizer step (``AdaScale.step``), so progress counts
  steps at M0: ``progress * M0`` is the number of samples weighted by their efficiency. In a
  trace at B = M0, progress equals the number of steps. Per sample::

      d progress / d sample = E(progress, B) / M0                                   (4)

* two-group similarity (SimiGrad, Qin et al. NeurIPS 2021, Alg. 1; JABAS section 6.1): the two
  GPU groups each average the gradients of B/2 samples (IIDP's identical local batches make every
  group's gradient a mean over exactly B/2 i.i.d. samples, JABAS sections 2.3 and 4), so
  ``g_A = G + eps_A``, ``g_B = G + eps_B`` with independent noise ``E|eps|^2 = 2 sigma^2 / B``.
  Then ``E<g_A, g_B> = |G|^2`` and ``E|g_A|^2 = E|g_B|^2 = |G|^2 + 2 sigma^2 / B``; in the high
  dimension of a model's gradient both concentrate around their means, hence::

      Phi = <g_A, g_B> / (|g_A| |g_B|) ~= |G|^2 / (|G|^2 + 2 sigma^2 / B)
          = 1 / (1 + 2 B_noise / B) = grad_sqr / (grad_sqr + 2 grad_var * M0 / B)     (5)

  (the last form is (5) in the traces' units, by (1)). A SimiGrad threshold gamma therefore
  holds B near ``2 B_noise gamma / (1 - gamma)``: gamma = 0.5 targets B = 2 B_noise. On the
  recorded digits traces, whose similarity column is measured from the two halves and whose
  statistics from all per-sample gradients, (5) holds within the sampling noise of the
  recorded epoch means (mean absolute error 0.06, correlation 0.95; tests/test_sim_convergence.py).

Assumption: progress as a batch-independent clock is AdaScale's premise; the runs behind the
traces (Pollux's and ours) scale the learning rate by r(B). A run that keeps its learning rate
when B grows (jabasray's default LR rule, ``lr_scaling="none"``) makes less progress per sample
at B > M0 than (4) says.

Trace rows and how the model reads them:

* A row is written at the end of an epoch. Pollux's rows are "progress epochs" (AdaptDL's
  loader ends an epoch once progress reaches ``len(dataset) * (epoch + 1) / M0``), so every
  trace of an application has its rows at about the same progress; the traces this project
  records (``benchmarks/record_convergence.py``) write one row per pass over the data. The model
  only needs the progress column, so both read the same way.
* ``iteration`` counts optimizer steps (in Pollux's B = M0 traces it is progress - 1, a 0-based
  index of the last step; the one-step offset is ignored).
* ``grad_sqr`` / ``grad_var`` of row i describe the epoch that ends at row i. Pollux's simulator
  uses them for that whole epoch (``get_grad_stats(batch_size, epoch)``), and so does this model:
  the statistics are piecewise constant in progress, row i holding on (progress[i-1],
  progress[i]], the first row from 0, the last row beyond. With constant statistics (4) is
  integrated exactly segment by segment (:meth:`ConvergenceModel.step`). That reproduces the
  progress column of a trace recorded here exactly from its iterations, and Pollux's (summed
  online from exponential averages) within 1 % (median over rows) up to B = 4 M0, and within
  17 % at 8-64 M0, where the averages lag the fast early change of the statistics.
* Between batch sizes, statistics are interpolated linearly in B between the two neighbouring
  traces (Pollux's ``get_grad_stats``), grad_sqr and grad_var apart; outside the traced range
  the nearest trace is used. ``batch=None`` reads the reference trace.
* The metric is interpolated linearly in progress between rows of the reference trace (at
  B = M0 progress is the step count: a measurement, no model in it); below the first row it is
  held at the first row's value, beyond the last at the last. With ``envelope=True`` (default)
  the curve is the best value so far, as Pollux's ``get_best_metric`` (running max for a
  metric that grows, running min for one that falls), so "first reaches" is well defined.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..validation import check_float, check_int

REQUIRED_COLUMNS = ("progress", "iteration", "metric", "grad_sqr", "grad_var")
OPTIONAL_COLUMNS = ("similarity",)
# M0 of the shipped traces (traces/README.md): a Pollux row of progress is a dataset's worth of
# steps at M0 (cifar10 50000 / 128 = 390.6); cifar10's own M0 trace (B = 128) is not shipped.
PACKAGED_REFERENCE_BATCH = {"bert": 12, "cifar10": 128, "digits": 16, "imagenet": 200}
# samples per epoch and the metric of the shipped traces' jobs (traces/README.md)
PACKAGED_DATASET_SIZE = {"bert": 88641, "cifar10": 50000, "digits": 1408, "imagenet": 1281167}
PACKAGED_METRIC = {"bert": "f1", "cifar10": "accuracy", "digits": "accuracy", "imagenet": "accuracy"}
_TRACE_NAME = re.compile(r"^validation-(\d+)\.csv$")


# ----------------------------------------------------------------------------- traces
@dataclass(eq=False)
class ConvergenceTrace:
    """One fixed-batch training run, one row per epoch (Pollux's ``validation-<B>.csv``).

    Attributes:
        batch_size: the global batch B of the run (integer >= 1).
        progress: (n,) float, cumulative progress at the end of each row's epoch, in steps at M0
            (module notes, (4)); strictly increasing, >= 0.
        iteration: (n,) float, cumulative optimizer steps at the end of each row; non-decreasing.
        metric: (n,) float, validation metric after the epoch (e.g. top-1 accuracy).
        grad_sqr: (n,) float, estimate of |G|^2 during the epoch.
        grad_var: (n,) float, estimate of sigma^2 / M0 during the epoch (module notes).
        similarity: (n,) float or None, mean measured two-halves Phi over the epoch (our
            recorded traces; Pollux's have none).
        source: where the trace was read from (for messages).
    """

    batch_size: int
    progress: np.ndarray
    iteration: np.ndarray
    metric: np.ndarray
    grad_sqr: np.ndarray
    grad_var: np.ndarray
    similarity: np.ndarray | None = None
    source: str = ""

    def __post_init__(self) -> None:
        where = f"{self.source}: " if self.source else ""
        check_int("batch_size", self.batch_size, min_value=1)
        cols = {c: np.asarray(getattr(self, c), dtype=np.float64) for c in REQUIRED_COLUMNS}
        if self.similarity is not None:
            cols["similarity"] = np.asarray(self.similarity, dtype=np.float64)
        for name, arr in cols.items():
            if arr.ndim != 1:
                raise ValueError(f"{where}{name} must be a 1-d sequence, got shape {arr.shape}")
        n = len(cols["progress"])
        for name, arr in cols.items():
            if len(arr) != n:
                raise ValueError(f"{where}{name} must have one value per row ({n}), got {len(arr)}")
            bad = np.flatnonzero(~np.isfinite(arr))
            if bad.size:
                raise ValueError(f"{where}{name} must hold finite numbers, got "
                                 f"{float(arr[bad[0]])} in row {int(bad[0])}")
            setattr(self, name, arr)
        if n == 0:
            raise ValueError(f"{where}a trace needs at least one row, got none")
        p = cols["progress"]
        if p[0] < 0 or np.any(np.diff(p) <= 0):
            raise ValueError(f"{where}progress must be >= 0 and strictly increasing row by row, "
                             f"got {p.tolist()[:6]}{' ...' if n > 6 else ''}")
        it = cols["iteration"]
        if it[0] < 0 or np.any(np.diff(it) < 0):
            raise ValueError(f"{where}iteration must be >= 0 and non-decreasing row by row")
        if "similarity" in cols and np.any(np.abs(cols["similarity"]) > 1 + 1e-9):
            raise ValueError(f"{where}similarity must lie in [-1, 1], got "
                             f"{float(cols['similarity'][np.abs(cols['similarity']) > 1][0])}")

    def __len__(self) -> int:
        return len(self.progress)

    @property
    def samples(self) -> np.ndarray:
        """Samples processed by the end of each row: ``iteration * batch_size``."""
        return self.iteration * self.batch_size

    def __repr__(self) -> str:
        return (f"ConvergenceTrace(batch_size={self.batch_size}, rows={len(self)}, "
                f"progress={self.progress[-1]:.6g}, similarity={self.similarity is not None})")


def _read_text(path: Any) -> tuple[str, str]:
    """(text, display name) of a path or an ``importlib.resources`` Traversable."""
    if isinstance(path, (str, os.PathLike)):
        path = Path(path)
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except FileNotFoundError:
        raise ValueError(f"path: no trace file at {str(path)!r}") from None


def load_trace_csv(path: Any, batch_size: int | None = None) -> ConvergenceTrace:
    """Read one ``validation-<B>.csv`` (Pollux's schema) into a :class:`ConvergenceTrace`.

    Args:
        path: a file path or an ``importlib.resources`` Traversable.
        batch_size: B of the run; by default read from the file name ``validation-<B>.csv``.

    The header must hold ``progress, iteration, metric, grad_sqr, grad_var`` (any order; other
    columns are ignored) and may hold ``similarity``. Every cell of those columns must be a
    finite number.

    Raises:
        ValueError: a one-line message naming the file and the bad field (missing column,
            empty file, a cell that is not a number, a batch size that is not an integer >= 1).
    """
    text, name = _read_text(path)
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    if batch_size is None:
        m = _TRACE_NAME.match(base)
        if m is None or int(m.group(1)) < 1:
            raise ValueError(f"{name}: batch_size must be given or the file named validation-<B>.csv "
                             f"with B an integer >= 1, got file name {base!r}")
        batch_size = int(m.group(1))
    check_int("batch_size", batch_size, min_value=1)
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    if not header:
        raise ValueError(f"{name}: empty file; expected a header with columns "
                         f"{', '.join(REQUIRED_COLUMNS)} (optional: {', '.join(OPTIONAL_COLUMNS)})")
    reader.fieldnames = header
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{name}: missing column(s) {', '.join(missing)}; required: "
                         f"{', '.join(REQUIRED_COLUMNS)} (optional: {', '.join(OPTIONAL_COLUMNS)})")
    cols = [c for c in REQUIRED_COLUMNS + OPTIONAL_COLUMNS if c in header]
    values: dict[str, list[float]] = {c: [] for c in cols}
    for lineno, row in enumerate(reader, start=2):
        if all((v or "").strip() == "" for v in row.values() if isinstance(v, str)):
            continue                                     # blank line
        for c in cols:
            cell = (row.get(c) or "").strip()
            try:
                v = float(cell)
            except ValueError:
                v = float("nan")
            if not math.isfinite(v):
                raise ValueError(f"{name}: line {lineno}, column {c} must be a finite number, "
                                 f"got {cell!r}")
            values[c].append(v)
    if not values["progress"]:
        raise ValueError(f"{name}: no rows after the header; a trace needs at least one epoch")
    return ConvergenceTrace(batch_size=batch_size, progress=values["progress"],
                            iteration=values["iteration"], metric=values["metric"],
                            grad_sqr=values["grad_sqr"], grad_var=values["grad_var"],
                            similarity=values.get("similarity"), source=name)


def load_trace_dir(path: Any) -> dict[int, ConvergenceTrace]:
    """All ``validation-<B>.csv`` of one application, by batch size (ascending).

    ``path``: a folder path or an ``importlib.resources`` Traversable (see
    :func:`packaged_trace_dir`). Other files (Pollux's ``placements.csv``, a README) are ignored.

    Raises:
        ValueError: the folder does not exist or holds no ``validation-<B>.csv``; or a file is bad.
    """
    if isinstance(path, (str, os.PathLike)):
        path = Path(path)
    if not path.is_dir():
        raise ValueError(f"path must be a folder of validation-<B>.csv files, got {str(path)!r}")
    traces = {}
    for entry in path.iterdir():
        m = _TRACE_NAME.match(entry.name)
        if m is not None:
            traces[int(m.group(1))] = load_trace_csv(entry, int(m.group(1)))
    if not traces:
        raise ValueError(f"{str(path)!r} holds no validation-<B>.csv file")
    return dict(sorted(traces.items()))


def packaged_trace_dir(app: str) -> Any:
    """The traces shipped with jabasray for ``app`` (``jabasray/sim/traces/<app>``, see its
    README for sources and licences), as an ``importlib.resources`` Traversable that
    :func:`load_trace_dir` and :meth:`ConvergenceModel.fit` read."""
    root = resources.files(__package__) / "traces"
    apps = sorted(e.name for e in root.iterdir() if e.is_dir() and not e.name.startswith(("_", ".")))
    if app not in apps:
        raise ValueError(f"app must be one of {', '.join(repr(a) for a in apps)}, got {app!r}")
    return root / app


def packaged_model(app: str, **kwargs: Any) -> "ConvergenceModel":
    """A :class:`ConvergenceModel` fitted on the traces shipped for ``app``, with the M0 they
    were recorded at (:data:`PACKAGED_REFERENCE_BATCH`); ``kwargs`` go to the constructor."""
    kwargs.setdefault("reference_batch", PACKAGED_REFERENCE_BATCH.get(app))
    kwargs.setdefault("metric_name", PACKAGED_METRIC.get(app, "accuracy"))
    return ConvergenceModel(**kwargs).fit(packaged_trace_dir(app))


# ----------------------------------------------------------------------------- the model
class ConvergenceModel:
    """Pollux's statistical-efficiency model fitted from fixed-batch traces, with the two-group
    similarity Phi derived from the same statistics (module notes, equations (1)-(5)).

    Parameters:
        reference_batch: M0, the batch the traces' units refer to (their progress counts steps
            at M0, their grad_var is sigma^2 / M0). Default: the smallest trace batch, as
            Pollux's ``Application.init_batch_size``. Give it when the trace at M0 is not among
            those fitted (e.g. Pollux's cifar10 traces were recorded with M0 = 128).
        envelope: the metric curve is the best value so far (Pollux's ``get_best_metric``);
            False: the raw interpolated values.
        higher_is_better: direction of the metric; None: from the reference trace, as Pollux
            (first row below last row means the metric grows).
        metric_name: what the traces' metric is (the simulated runs' validation metric).

    Fitted attributes:
        traces_ (dict[int, ConvergenceTrace]): the traces, by batch size, ascending.
        batch_sizes_ (np.ndarray): their batch sizes, ascending.
        reference_batch_ (int): M0.
        reference_trace_ (ConvergenceTrace): the trace at M0 if fitted, else the smallest batch.
        higher_is_better_ (bool): direction of the metric.

    Example::

        model = ConvergenceModel().fit(packaged_trace_dir("imagenet"))
        p = model.step(0.0, batch=800, samples=1_281_167)      # progress after one epoch at 800
        model.efficiency(p, 800), model.similarity(p, 800), model.metric(p)
    """

    def __init__(self, reference_batch: int | None = None, envelope: bool = True,
                 higher_is_better: bool | None = None, metric_name: str = "accuracy") -> None:
        if reference_batch is not None:
            check_int("reference_batch", reference_batch, min_value=1)
        if not isinstance(envelope, bool):
            raise ValueError(f"envelope must be True or False, got {envelope!r}")
        if higher_is_better is not None and not isinstance(higher_is_better, bool):
            raise ValueError(f"higher_is_better must be True, False or None, got {higher_is_better!r}")
        self.reference_batch = reference_batch
        self.envelope = envelope
        self.higher_is_better = higher_is_better
        if not isinstance(metric_name, str) or not metric_name:
            raise ValueError(f"metric_name must be a non-empty string, got {metric_name!r}")
        self.metric_name = metric_name

    # -------------------------------------------------------------------------------- fit
    def fit(self, traces: Any) -> "ConvergenceModel":
        """Fit on the traces of one application.

        Args:
            traces: a folder of ``validation-<B>.csv`` (path or Traversable), a mapping
                batch -> :class:`ConvergenceTrace`, or an iterable of traces (distinct batches).

        Returns:
            self.
        """
        if isinstance(traces, Mapping):
            items = list(traces.values())
        elif isinstance(traces, (str, os.PathLike)) or hasattr(traces, "iterdir"):
            items = list(load_trace_dir(traces).values())
        else:
            items = list(traces)
        if not items:
            raise ValueError("traces must hold at least one ConvergenceTrace, got none")
        by_batch: dict[int, ConvergenceTrace] = {}
        for t in items:
            if not isinstance(t, ConvergenceTrace):
                raise ValueError(f"traces must be ConvergenceTrace objects, got {type(t).__name__}")
            if t.batch_size in by_batch:
                raise ValueError(f"traces must have distinct batch sizes, got {t.batch_size} twice")
            by_batch[t.batch_size] = t
        self.traces_ = dict(sorted(by_batch.items()))
        self.batch_sizes_ = np.array(list(self.traces_), dtype=np.int64)
        self.reference_batch_ = int(self.reference_batch or self.batch_sizes_[0])
        self.reference_trace_ = self.traces_.get(self.reference_batch_, self.traces_[int(self.batch_sizes_[0])])
        ref = self.reference_trace_.metric
        self.higher_is_better_ = (bool(ref[0] <= ref[-1]) if self.higher_is_better is None
                                  else self.higher_is_better)
        self._curves = {b: (t.progress, self._envelope(t.metric)) for b, t in self.traces_.items()}
        return self

    def _envelope(self, metric: np.ndarray) -> np.ndarray:
        if not self.envelope:
            return metric.copy()
        return (np.maximum.accumulate(metric) if self.higher_is_better_
                else np.minimum.accumulate(metric))

    def _check_fitted(self) -> None:
        if not hasattr(self, "traces_"):
            raise ValueError("this ConvergenceModel is not fitted yet; call fit(traces) first")

    # ------------------------------------------------------------------- gradient statistics
    def _neighbours(self, batch: float | None) -> list[tuple[int, float]]:
        """(trace batch, weight) pairs for linear interpolation in batch (Pollux's
        ``_validated_batch_sizes``): the two traced batches around ``batch``, or the nearest."""
        if batch is None:
            return [(self.reference_trace_.batch_size, 1.0)]
        bs = self.batch_sizes_
        if batch <= bs[0]:
            return [(int(bs[0]), 1.0)]
        if batch >= bs[-1]:
            return [(int(bs[-1]), 1.0)]
        hi = int(np.searchsorted(bs, batch, side="left"))
        lo_b, hi_b = int(bs[hi - 1]), int(bs[hi])
        if hi_b == batch:
            return [(hi_b, 1.0)]
        w = (batch - lo_b) / (hi_b - lo_b)
        return [(lo_b, 1.0 - w), (hi_b, w)]

    @staticmethod
    def _row(trace: ConvergenceTrace, progress: float) -> int:
        # row i holds on (progress[i-1], progress[i]]; row 0 from 0; the last row beyond
        return min(int(np.searchsorted(trace.progress, progress, side="left")), len(trace) - 1)

    def grad_stats(self, progress: float, batch: float | None = None) -> tuple[float, float]:
        """``(grad_sqr, grad_var)`` at ``progress`` for a run at ``batch`` in the traces' units
        (|G|^2 and sigma^2 / M0), clipped at 0 as AdaptDL does before using them.

        Piecewise constant in progress (the row of the epoch that holds ``progress``), linear in
        batch between the neighbouring traces; ``batch=None``: the reference trace."""
        self._check_fitted()
        progress = check_float("progress", progress, min_value=0.0)
        if batch is not None:
            batch = check_float("batch", batch, min_value=0.0, min_exclusive=True)
        sqr = var = 0.0
        for b, w in self._neighbours(batch):
            t = self.traces_[b]
            i = self._row(t, progress)
            sqr += w * t.grad_sqr[i]
            var += w * t.grad_var[i]
        return max(sqr, 0.0), max(var, 0.0)

    def noise_scale(self, progress: float, batch: float | None = None) -> float:
        """Gradient noise scale in samples, ``B_noise = sigma^2 / |G|^2 = M0 * grad_var /
        grad_sqr`` (module notes (1)), from :meth:`grad_stats` (``batch=None``: the reference
        trace's statistics; a batch: Pollux's interpolation between the traces around it).
        ``inf`` where the estimate of |G|^2 is 0 (noise only)."""
        sqr, var = self.grad_stats(progress, batch)
        if sqr <= 0.0:
            return math.inf
        return self.reference_batch_ * var / sqr

    def efficiency(self, progress: float, batch: float) -> float:
        """Pollux's statistical efficiency of ``batch`` relative to M0 (module notes (3))::

            E = (B_noise + M0) / (B_noise + B) = (grad_var + grad_sqr) / (grad_var + grad_sqr B/M0)

        the progress a sample gives at B over what it gives at M0; 1 at B = M0, in (0, 1] for
        B >= M0, above 1 for B < M0. Statistics of a run at ``batch`` (:meth:`grad_stats`)."""
        batch = check_float("batch", batch, min_value=0.0, min_exclusive=True)
        sqr, var = self.grad_stats(progress, batch)
        return _efficiency(sqr, var, batch / self.reference_batch_)

    def similarity(self, progress: float, batch: float) -> float:
        """Expected cosine similarity of the mean gradients of the two halves of a global batch
        B (module notes (5))::

            Phi = 1 / (1 + 2 B_noise / B) = grad_sqr / (grad_sqr + 2 grad_var M0 / B)

        0 where the estimate of |G|^2 is 0. ``batch`` >= 2 (two halves of at least a sample)."""
        batch = check_float("batch", batch, min_value=2.0)
        sqr, var = self.grad_stats(progress, batch)
        return _similarity(sqr, var, batch / self.reference_batch_)

    # -------------------------------------------------------------------------- progress
    def _knots(self, batch: float) -> np.ndarray:
        return np.unique(np.concatenate([self.traces_[b].progress for b, _ in self._neighbours(batch)]))

    def step(self, progress: float, batch: float, samples: float) -> float:
        """Progress after training ``samples`` more samples at a global batch ``batch``.

        Integrates d progress / d sample = E(progress, B) / M0 (module notes (4)). The
        statistics are constant between trace rows, so the integral is exact: segment by
        segment, ``samples_needed = (segment_end - progress) * M0 / E``. Per optimizer step
        this adds r(B) = E * B / M0, what AdaptDL adds. ``samples`` may be fractional.
        """
        self._check_fitted()
        p = check_float("progress", progress, min_value=0.0)
        batch = check_float("batch", batch, min_value=0.0, min_exclusive=True)
        left = check_float("samples", samples, min_value=0.0)
        m0 = float(self.reference_batch_)
        knots = self._knots(batch)
        while left > 0.0:
            j = int(np.searchsorted(knots, p, side="right"))     # first knot beyond p
            end = float(knots[j]) if j < len(knots) else math.inf
            inside = p + 0.5 * (end - p) if math.isfinite(end) else p + 1.0
            sqr, var = self.grad_stats(inside, batch)
            rate = _efficiency(sqr, var, batch / m0) / m0        # progress per sample
            need = (end - p) / rate
            if left <= need:
                p += left * rate
                break
            p, left = end, left - need
        return p

    def samples_to(self, progress: float, target: float, batch: float) -> float:
        """Samples needed at ``batch`` to go from ``progress`` to ``target`` progress: the
        exact inverse of :meth:`step` (``step(p, B, samples_to(p, t, B)) == t``), 0 if
        ``target <= progress``."""
        self._check_fitted()
        p = check_float("progress", progress, min_value=0.0)
        target = check_float("target", target, min_value=0.0)
        batch = check_float("batch", batch, min_value=0.0, min_exclusive=True)
        m0 = float(self.reference_batch_)
        knots = self._knots(batch)
        total = 0.0
        while p < target:
            j = int(np.searchsorted(knots, p, side="right"))
            end = min(float(knots[j]) if j < len(knots) else math.inf, target)
            sqr, var = self.grad_stats(p + 0.5 * (end - p), batch)
            total += (end - p) * m0 / _efficiency(sqr, var, batch / m0)
            p = end
        return total

    # ---------------------------------------------------------------------------- metric
    def metric(self, progress: float, batch: float | None = None) -> float:
        """Validation metric at ``progress``: the reference trace's curve (``batch=None``),
        interpolated linearly between its rows, held constant outside them, the best-so-far
        envelope if ``envelope``; with a ``batch``, the curves of the traces around it
        interpolated linearly in batch at the same progress (Pollux's ``get_best_metric``)."""
        self._check_fitted()
        progress = check_float("progress", progress, min_value=0.0)
        if batch is not None:
            batch = check_float("batch", batch, min_value=0.0, min_exclusive=True)
        total = 0.0
        for b, w in self._neighbours(batch):
            x, y = self._curves[b]
            total += w * float(np.interp(progress, x, y))
        return total

    def progress_for(self, metric: float, batch: float | None = None) -> float | None:
        """The least progress at which the metric curve (:meth:`metric`, same ``batch``) reaches
        ``metric`` (>= for a metric that grows, <= for one that falls); None if it never does
        within the traces. Never below the first row's progress: the traces do not say when,
        before their first evaluation, a target was reached."""
        self._check_fitted()
        target = check_float("metric", metric)
        nb = self._neighbours(batch if batch is None else
                              check_float("batch", batch, min_value=0.0, min_exclusive=True))
        xs = np.unique(np.concatenate([self._curves[b][0] for b, _ in nb]))
        ys = np.zeros_like(xs)
        for b, w in nb:
            x, y = self._curves[b]
            ys += w * np.interp(xs, x, y)
        sign = 1.0 if self.higher_is_better_ else -1.0
        d = sign * (ys - target)                               # >= 0: reached
        hit = np.flatnonzero(d >= 0)
        if hit.size == 0:
            return None
        i = int(hit[0])
        if i == 0:
            return float(xs[0])
        # linear crossing inside (xs[i-1], xs[i]]: d[i-1] < 0 <= d[i]
        frac = -d[i - 1] / (d[i] - d[i - 1])
        return float(xs[i - 1] + frac * (xs[i] - xs[i - 1]))

    def __repr__(self) -> str:
        if not hasattr(self, "traces_"):
            return (f"ConvergenceModel(reference_batch={self.reference_batch}, "
                    f"envelope={self.envelope}) (not fitted)")
        return (f"ConvergenceModel(M0={self.reference_batch_}, batches={self.batch_sizes_.tolist()}, "
                f"envelope={self.envelope})")


def settled_batch(noise_scale: float, gamma: float) -> float:
    """The global batch at which (5)'s expected two-group similarity equals ``gamma``::

        Phi(B) = 1 / (1 + 2 B_noise / B) = gamma   <=>   B = 2 gamma B_noise / (1 - gamma)

    where SimiGrad's and JABAS's batch rule (section 6.1: grow while Phi < gamma, shrink while
    Phi > gamma) holds B_G, before its bounds: gamma = 0.5 holds it at 2 B_noise, 0.1 at
    0.22 B_noise. By (3) the samples it then needs per unit of progress grow as
    ``(B_noise + B) / (B_noise + M0)``: a threshold is a choice of statistical efficiency."""
    gamma = check_float("gamma", gamma, min_value=0.0, max_value=1.0, min_exclusive=True,
                        max_exclusive=True)
    noise_scale = check_float("noise_scale", noise_scale, min_value=0.0)
    return 2.0 * gamma * noise_scale / (1.0 - gamma)


def _efficiency(sqr: float, var: float, scale: float) -> float:
    """E = (var + sqr) / (var + sqr * scale), scale = B / M0 (module notes (3)); 1 if both are 0
    (no information: treated as noise, where batches scale perfectly)."""
    den = var + sqr * scale
    return (var + sqr) / den if den > 0.0 else 1.0


def _similarity(sqr: float, var: float, scale: float) -> float:
    """Phi = sqr / (sqr + 2 var / scale), scale = B / M0 (module notes (5)); 0 if sqr is 0."""
    if sqr <= 0.0:
        return 0.0
    return sqr / (sqr + 2.0 * var / scale)


# ----------------------------------------------------------------------------- replay
class ReplaySimilarity:
    """The per-interval Phi of a recorded run, fed back instead of the model's (replay mode).

    Keys are ``(epoch, interval)`` as the driver records them (``IntervalRecord.epoch``,
    ``.interval``: 0-based, the interval within its epoch); values are the recorded ``phi``,
    or None where the run measured none (then the driver did not adapt; a replay returns None
    too). An interval the recording does not have (the simulated run took more intervals)
    is answered by ``fallback`` (e.g. a :class:`ConvergenceModel`) from progress and batch,
    or raises ``ValueError`` when there is no fallback.
    """

    def __init__(self, phis: Mapping[tuple[int, int], float | None],
                 fallback: ConvergenceModel | None = None) -> None:
        self.phis: dict[tuple[int, int], float | None] = {}
        for key, phi in phis.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise ValueError(f"phis keys must be (epoch, interval) pairs, got {key!r}")
            e = check_int("epoch", key[0], min_value=0)
            i = check_int("interval", key[1], min_value=0)
            self.phis[(e, i)] = (None if phi is None else
                                 check_float(f"phi of epoch {e} interval {i}", phi,
                                             min_value=-1.0 - 1e-9, max_value=1.0 + 1e-9))
        if fallback is not None and not hasattr(fallback, "similarity"):
            raise ValueError(f"fallback must have a similarity(progress, batch) method, "
                             f"got {type(fallback).__name__}")
        self.fallback = fallback

    @classmethod
    def from_history(cls, history: Any, fallback: ConvergenceModel | None = None) -> "ReplaySimilarity":
        """From a run's ``metrics.json`` (``MetricsHistory``): a path to the file or to its run
        folder, or the parsed dict. Reads ``intervals[*].epoch``, ``.interval``, ``.phi``."""
        if isinstance(history, (str, os.PathLike)):
            path = Path(history)
            if path.is_dir():
                path = path / "metrics.json"
            try:
                history = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise ValueError(f"history: no metrics.json at {str(path)!r}") from None
        if not isinstance(history, Mapping) or not isinstance(history.get("intervals"), list):
            raise ValueError("history must be a metrics.json document with an 'intervals' list")
        phis: dict[tuple[int, int], float | None] = {}
        for k, rec in enumerate(history["intervals"]):
            if not isinstance(rec, Mapping) or not {"epoch", "interval", "phi"} <= set(rec):
                raise ValueError(f"intervals[{k}] must have the fields epoch, interval and phi")
            phis[(rec["epoch"], rec["interval"])] = rec["phi"]
        return cls(phis, fallback)

    def __len__(self) -> int:
        return len(self.phis)

    def intervals(self, epoch: int) -> int:
        """How many intervals of ``epoch`` the recording holds."""
        return sum(1 for e, _ in self.phis if e == epoch)

    def similarity(self, epoch: int, interval: int, progress: float | None = None,
                   batch: float | None = None) -> float | None:
        """The recorded Phi of ``(epoch, interval)`` (None: the run measured none there); an
        interval not recorded: ``fallback.similarity(progress, batch)``."""
        key = (check_int("epoch", epoch, min_value=0), check_int("interval", interval, min_value=0))
        if key in self.phis:
            return self.phis[key]
        if self.fallback is None or progress is None or batch is None:
            raise ValueError(f"epoch {epoch} interval {interval} is not in the recording "
                             f"({self.intervals(epoch)} intervals in that epoch) and there is no "
                             "fallback model with progress and batch to answer it")
        return self.fallback.similarity(progress, batch)
