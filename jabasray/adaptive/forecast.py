"""Global batch size forecaster (JABAS section 6.2, evaluated in 7.5).

At the end of every epoch the auto-scaler needs the B_G trajectory of the NEXT epoch (one value
per p iterations). The forecaster learns it from the trajectories so far, concatenated into one
time series y_1..y_n (oldest first), and extrapolates y_{n+1}..y_{n+h}.

Models (all fitted on log B_G: the paper observes "a global batch size tends to increase
exponentially while also experiencing periodic fluctuations", which is a linear trend plus
fluctuation in log space; working in logs also keeps every prediction positive):

* ``"gpr"`` -- Gaussian Process Regression (paper [79]) over normalised time
  ``x_i = (i - (n-1)) / (n-1)`` (the history in [-1, 0], the forecast at x > 0) on standardised
  log B_G, kernel ``ConstantKernel * RBF + WhiteKernel`` (amplitude, smooth fluctuation,
  observation noise; hyper-parameters by maximum marginal likelihood). Close to the data it
  follows the recent level and fluctuation; far from it, it reverts to the mean of the history,
  which is conservative for a growing B_G -- the ESM's trend makes up for that in the ensemble.
  (We measured a linear-trend mean as well: best on smooth exponential trajectories, but it
  overshoots badly when B_G turns, see benchmarks/RESULTS.md.)
* ``"esm"`` -- exponential smoothing (paper [18]): Holt's linear trend with a damped trend
  (statsmodels ``ExponentialSmoothing(trend="add", damped_trend=True)``), which captures the
  temporal dependency GPR ignores; the damping stops the trend from running away.
* ``"ensemble"`` -- the paper's GBS forecaster: "runs the two models concurrently and calculates
  the average predicted value", i.e. the arithmetic mean of the GPR and ESM forecasts of B_G.
* ``"arima"`` -- statsmodels ARIMA(1,1,1) with drift on log B_G, the statistical baseline of
  Figure 14 (for comparison; not used by JABAS).

Fallbacks: with fewer than ``min_points`` observations (default 4) no model is fitted and the
forecast is persistence (the last value repeated); if a model's fit fails numerically it
falls back the same way (logged at debug). Predictions are clipped to ``[min_batch, max_batch]``
when those are given (B_G never leaves them, JABAS 6.1). statsmodels/scikit-learn convergence
warnings are silenced inside ``fit`` and logged at debug level.

API in scikit-learn style: ``GBSForecaster(method).fit(trajectories) -> self``; the fitted
state ends with ``_``; ``predict(num_steps) -> np.ndarray``.
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Any, Sequence

import numpy as np

from ..validation import check_choice, check_int

log = logging.getLogger(__name__)

FORECAST_METHODS = ("ensemble", "gpr", "esm", "arima")


class GBSForecaster:
    """Forecast the next epoch's B_G trajectory from the trajectories of the epochs so far.

    Parameters:
        method: "ensemble" (GPR + ESM mean, the paper's choice), "gpr", "esm" or "arima".
        min_batch, max_batch: optional bounds of B_G; predictions are clipped to them.
        min_points: fewer observations than this -> persistence forecast (>= 2).
        max_history: only the last ``max_history`` observations are used (bounds the O(n^3)
            GPR fit; older epochs say little about the next one).
        random_state: handed to the GPR (its optimiser starts from fixed initial
            hyper-parameters without random restarts, so fits are deterministic anyway).

    Fitted attributes:
        history_ (np.ndarray): the observations used, oldest first.
        n_epochs_ (int): number of trajectories given to ``fit``.
        last_epoch_len_ (int): length of the last trajectory (a default horizon).
        fitted_methods_ (tuple[str, ...]): the models actually fitted ("persistence" on fallback;
            an ensemble whose GPR or ESM fit failed averages the one that succeeded).
        models_ (dict[str, object]): the fitted models by name.
        fit_time_ (float): seconds spent in ``fit``.
    """

    def __init__(self, method: str = "ensemble", *, min_batch: float | None = None,
                 max_batch: float | None = None, min_points: int = 4, max_history: int = 128,
                 random_state: int = 0) -> None:
        self.method = check_choice("method", method, FORECAST_METHODS)
        if min_batch is not None and not (isinstance(min_batch, (int, float)) and min_batch > 0):
            raise ValueError(f"min_batch must be a number > 0 or None, got {min_batch!r}")
        if max_batch is not None and not (isinstance(max_batch, (int, float)) and max_batch > 0):
            raise ValueError(f"max_batch must be a number > 0 or None, got {max_batch!r}")
        if min_batch is not None and max_batch is not None and min_batch > max_batch:
            raise ValueError(f"min_batch must be <= max_batch ({max_batch}), got {min_batch}")
        self.min_batch = min_batch
        self.max_batch = max_batch
        self.min_points = check_int("min_points", min_points, min_value=2)
        self.max_history = check_int("max_history", max_history, min_value=2)
        self.random_state = check_int("random_state", random_state, min_value=0)

    # ------------------------------------------------------------------------------------
    def fit(self, trajectories: Sequence[Sequence[float]]) -> "GBSForecaster":
        """Fit on the B_G trajectories of the epochs so far (oldest epoch first).

        Raises:
            ValueError: no trajectory, or no value at all, or a value that is not a finite
                number > 0.
        """
        t0 = time.perf_counter()
        if isinstance(trajectories, np.ndarray) and trajectories.ndim == 1:
            trajectories = [trajectories]
        if len(trajectories) == 0:
            raise ValueError("trajectories must hold at least one epoch's B_G trajectory, got []")
        values: list[float] = []
        for e, traj in enumerate(trajectories):
            if np.ndim(traj) != 1:
                raise ValueError(f"trajectories[{e}] must be a flat list of B_G values, "
                                 f"got {np.ndim(traj)}-d data")
            for i, v in enumerate(traj):
                try:
                    f = float(v)
                except (TypeError, ValueError):
                    f = float("nan")
                if not (math.isfinite(f) and f > 0):
                    raise ValueError(f"trajectories[{e}][{i}] must be a finite B_G > 0, got {v!r}")
                values.append(f)
        if not values:
            raise ValueError("trajectories must contain at least one B_G value, got only empty epochs")
        self.n_epochs_ = len(trajectories)
        self.last_epoch_len_ = max(1, len(trajectories[-1]))
        self.history_ = np.asarray(values[-self.max_history:], dtype=np.float64)
        self.models_: dict[str, object] = {}
        if len(self.history_) < self.min_points:
            self.fitted_methods_ = ("persistence",)
        else:
            wanted = ("gpr", "esm") if self.method == "ensemble" else (self.method,)
            y = np.log(self.history_)
            fitted = []
            with one_blas_thread():
                for name in wanted:
                    model = _fit_quietly(name, y, self.random_state)
                    if model is not None:
                        self.models_[name] = model
                        fitted.append(name)
            self.fitted_methods_ = tuple(fitted) if fitted else ("persistence",)
        self.fit_time_ = time.perf_counter() - t0
        log.debug("GBSForecaster(%s): %d points, fitted %s in %.1f ms", self.method,
                  len(self.history_), self.fitted_methods_, 1e3 * self.fit_time_)
        return self

    def predict(self, num_steps: int | None = None) -> np.ndarray:
        """Forecast the next ``num_steps`` values (default: the last epoch's length).

        Returns a float array of shape (num_steps,), positive and within the bounds if given.
        """
        if not hasattr(self, "history_"):
            raise ValueError("GBSForecaster is not fitted yet: call fit(trajectories) first")
        if num_steps is None:
            num_steps = self.last_epoch_len_
        check_int("num_steps", num_steps, min_value=1)
        if not self.models_:
            pred = np.full(num_steps, self.history_[-1])
        else:
            last = float(np.log(self.history_[-1]))
            with one_blas_thread():
                preds = [np.exp(_predict_log(name, model, num_steps, last))
                         for name, model in self.models_.items()]
            pred = np.mean(preds, axis=0)            # ensemble: mean of the predicted values
        lo = self.min_batch if self.min_batch is not None else 0.0
        hi = self.max_batch if self.max_batch is not None else np.inf
        return np.clip(pred, lo, hi)

    def predict_epoch(self, dataset_size: int, adapt_interval: int,
                      max_steps: int = 100_000) -> np.ndarray:
        """Forecast exactly one epoch: values until the predicted windows cover the dataset.

        Window k processes ``adapt_interval * B_k`` samples; the forecast is cut after the
        first window at which the running sum reaches ``dataset_size`` (a partial last window
        counts as one value, like the epoch's ragged tail).
        """
        check_int("dataset_size", dataset_size, min_value=1)
        check_int("adapt_interval", adapt_interval, min_value=1)
        check_int("max_steps", max_steps, min_value=1)
        steps = max(1, self.last_epoch_len_)
        while True:
            pred = self.predict(steps)
            covered = np.cumsum(adapt_interval * pred)
            idx = int(np.searchsorted(covered, dataset_size))  # first index with sum >= size
            if idx < steps:
                return pred[:idx + 1]
            if steps >= max_steps:
                return pred
            steps = min(max_steps, 2 * steps)

    def __repr__(self) -> str:
        return f"GBSForecaster(method={self.method!r})"


# ---------------------------------------------------------------------------------------------
# Individual models, on y = log B_G (oldest first). Each fit returns an opaque model or None.

def one_blas_thread() -> Any:
    """A context in which BLAS/OpenMP use one thread. The forecaster's matrices are at most
    ``max_history`` square (a Cholesky of 128 x 128 per GP likelihood evaluation): threads cost
    more than they save there, and on a busy host (the driver shares its node with GPU actors
    and their loaders) spinning BLAS threads made each evaluation tens of times slower."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=1)


def forecast_next_epoch(trajectories: list[list[int]], job: Any, dataset_size: int) -> list[float]:
    """The driver's forecast of the next epoch's B_G (JABAS 6.2): the GPR + ESM ensemble fitted
    on every completed epoch's trajectory, within the job's [min B_G, max B_G] and seeded with
    its seed, one value per interval of ``job.adapt_interval`` iterations until the epoch's
    ``dataset_size`` samples are covered; ``[]`` without a trajectory."""
    if not trajectories:
        return []
    f = GBSForecaster("ensemble", min_batch=job.min_global_batch, max_batch=job.max_global_batch,
                      random_state=job.seed)
    f.fit(trajectories)
    return [float(x) for x in f.predict_epoch(dataset_size, job.adapt_interval)]


class _GPRModel:
    """GP(ConstantKernel*RBF + WhiteKernel) on standardised log B_G over normalised time."""

    def __init__(self, y: np.ndarray, random_state: int) -> None:
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

        n = len(y)
        self.scale = float(n - 1)
        x = (np.arange(n, dtype=np.float64) - (n - 1)) / self.scale   # history in [-1, 0]
        self.mean = float(np.mean(y))
        self.std = float(np.std(y)) or 1.0
        kernel = (ConstantKernel(1.0, (1e-3, 1e2)) * RBF(length_scale=0.1, length_scale_bounds=(1e-3, 1e1))
                  + WhiteKernel(noise_level=0.1, noise_level_bounds=(1e-6, 1e1)))
        # One optimiser run from the initial hyper-parameters (no random restarts): deterministic
        # and within the time budget (paper 7.6: the forecaster must be negligible).
        self.gp = GaussianProcessRegressor(kernel=kernel, normalize_y=False, n_restarts_optimizer=0,
                                           random_state=random_state)
        self.gp.fit(x[:, None], (y - self.mean) / self.std)

    def predict(self, num_steps: int) -> np.ndarray:
        x = np.arange(1, num_steps + 1, dtype=np.float64) / self.scale
        return self.mean + self.std * self.gp.predict(x[:, None])


class _ESMModel:
    """Holt's additive damped trend (statsmodels ExponentialSmoothing)."""

    def __init__(self, y: np.ndarray) -> None:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        self.res = ExponentialSmoothing(y, trend="add", damped_trend=True,
                                        initialization_method="estimated").fit()

    def predict(self, num_steps: int) -> np.ndarray:
        return np.asarray(self.res.forecast(num_steps), dtype=np.float64)


class _ARIMAModel:
    """ARIMA(1,1,1) with drift."""

    def __init__(self, y: np.ndarray) -> None:
        from statsmodels.tsa.arima.model import ARIMA

        self.res = ARIMA(y, order=(1, 1, 1), trend="t").fit()

    def predict(self, num_steps: int) -> np.ndarray:
        return np.asarray(self.res.forecast(num_steps), dtype=np.float64)


def _fit_quietly(name: str, y: np.ndarray, random_state: int) -> object | None:
    """Fit one model with convergence warnings silenced (logged at debug); None on failure."""
    if np.ptp(y) == 0.0:
        return _Constant(float(y[-1]))          # a flat history: every model predicts it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if name == "gpr":
                model: object = _GPRModel(y, random_state)
            elif name == "esm":
                model = _ESMModel(y)
            else:
                model = _ARIMAModel(y)
        except (ValueError, np.linalg.LinAlgError, FloatingPointError) as e:
            log.debug("GBSForecaster: %s fit failed (%s); falling back", name, e)
            return None
    for w in caught:
        log.debug("GBSForecaster: %s: %s: %s", name, w.category.__name__, w.message)
    return model


class _Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    def predict(self, num_steps: int) -> np.ndarray:
        return np.full(num_steps, self.value)


def _predict_log(name: str, model: object, num_steps: int, last: float) -> np.ndarray:
    """Forecast of log B_G; persistence (``last``) if the model produces non-finite values."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pred = np.asarray(model.predict(num_steps), dtype=np.float64)  # type: ignore[attr-defined]
    if not np.all(np.isfinite(pred)):
        log.debug("GBSForecaster: %s produced non-finite forecasts; using persistence", name)
        return np.full(num_steps, last)
    return pred
