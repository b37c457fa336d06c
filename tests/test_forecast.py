"""GBS forecaster (JABAS 6.2): equivalence with direct scikit-learn / statsmodels fits, the
ensemble = mean of GPR and ESM, fallbacks, clipping, epoch roll-out, errors and warnings."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from jabasray.adaptive import FORECAST_METHODS, GBSForecaster
from jabasray.adaptive.forecast import forecast_next_epoch
from jabasray.config import JobConfig


def _growing(n=40, seed=0):
    rng = np.random.default_rng(seed)
    k = np.arange(n)
    return 32 * np.exp(0.04 * k + 0.1 * np.sin(k / 3.0) + rng.normal(0, 0.03, n))


@pytest.fixture(scope="module")
def series():
    y = _growing(50)
    return [list(y[:20]), list(y[20:35]), list(y[35:50])]


def test_gpr_equals_direct_sklearn_fit(series):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    y = np.log(np.concatenate(series))
    n = len(y)
    x = (np.arange(n) - (n - 1)) / (n - 1)
    mu, sd = y.mean(), y.std()
    k = ConstantKernel(1.0, (1e-3, 1e2)) * RBF(0.1, (1e-3, 1e1)) + WhiteKernel(0.1, (1e-6, 1e1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gp = GaussianProcessRegressor(k, n_restarts_optimizer=0, random_state=0).fit(x[:, None], (y - mu) / sd)
    xp = np.arange(1, 11) / (n - 1)
    expected = np.exp(mu + sd * gp.predict(xp[:, None]))
    got = GBSForecaster("gpr").fit(series).predict(10)
    np.testing.assert_allclose(got, expected, rtol=1e-9)


def test_esm_equals_direct_statsmodels_fit(series):
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    y = np.log(np.concatenate(series))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = ExponentialSmoothing(y, trend="add", damped_trend=True,
                                   initialization_method="estimated").fit()
    expected = np.exp(res.forecast(7))
    np.testing.assert_allclose(GBSForecaster("esm").fit(series).predict(7), expected, rtol=1e-9)


def test_ensemble_is_mean_of_gpr_and_esm(series):
    ens = GBSForecaster("ensemble").fit(series)
    assert ens.fitted_methods_ == ("gpr", "esm")
    gpr = GBSForecaster("gpr").fit(series).predict(12)
    esm = GBSForecaster("esm").fit(series).predict(12)
    np.testing.assert_allclose(ens.predict(12), (gpr + esm) / 2, rtol=1e-12)
    assert ens.predict().shape == (15,)             # default horizon: the last epoch's length


def test_ensemble_beats_persistence_on_exponential_growth():
    """The trajectories the paper describes (exponential growth + fluctuation): the ensemble
    tracks the growth that persistence (the no-forecast baseline of 7.4) misses."""
    y = _growing(60, seed=3)
    hist, actual = [list(y[:25]), list(y[25:45])], y[45:60]
    pred = GBSForecaster("ensemble").fit(hist).predict(len(actual))
    mape = np.mean(np.abs(pred - actual) / actual)
    mape_persist = np.mean(np.abs(y[44] - actual) / actual)
    assert mape < mape_persist


@pytest.mark.parametrize("history", [[[64]], [[64, 70]], [[64], [70, 77]]])
def test_short_history_falls_back_to_persistence(history):
    f = GBSForecaster("ensemble").fit(history)
    assert f.fitted_methods_ == ("persistence",)
    np.testing.assert_array_equal(f.predict(4), np.full(4, history[-1][-1], dtype=float))


@pytest.mark.parametrize("method", FORECAST_METHODS)
def test_flat_history_predicts_flat(method):
    f = GBSForecaster(method).fit([[128] * 6, [128] * 5])
    np.testing.assert_allclose(f.predict(5), 128.0)


def test_predictions_clipped_to_bounds():
    y = 16 * 1.3 ** np.arange(20)                          # runs far past max_batch
    f = GBSForecaster("esm", min_batch=16, max_batch=1024).fit([list(y[:10]), list(y[10:])])
    pred = f.predict(30)
    assert pred.max() == 1024 and pred.min() >= 16


def test_predict_epoch_covers_the_dataset():
    f = GBSForecaster().fit([[100]])                       # persistence: B = 100 per window
    # p = 2 iterations per window -> 200 samples per window; 1000 samples -> 5 windows
    np.testing.assert_array_equal(f.predict_epoch(1000, 2), np.full(5, 100.0))
    assert len(f.predict_epoch(1001, 2)) == 6              # ragged tail counts as a window
    g = GBSForecaster("ensemble").fit([[30, 33, 36, 40, 44, 48], [53, 58, 64]])
    traj = g.predict_epoch(5000, 3)
    covered = np.cumsum(3 * traj)
    assert covered[-1] >= 5000 and (len(traj) == 1 or covered[-2] < 5000)


@pytest.mark.parametrize("bad,match", [
    ([], "at least one epoch"), ([[]], "at least one B_G value"), ([[64, -1]], r"trajectories\[0\]\[1\]"),
    ([[64, float("nan")]], "finite"), ([[[1, 2]]], "flat list"),
])
def test_fit_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        GBSForecaster().fit(bad)


def test_config_and_predict_errors():
    with pytest.raises(ValueError, match="method"):
        GBSForecaster("lstm")
    with pytest.raises(ValueError, match="min_batch"):
        GBSForecaster(min_batch=100, max_batch=10)
    with pytest.raises(ValueError, match="not fitted"):
        GBSForecaster().predict(3)
    with pytest.raises(ValueError, match="num_steps"):
        GBSForecaster().fit([[1, 2]]).predict(0)


def test_no_warnings_escape():
    rng = np.random.default_rng(7)
    noisy = list(np.exp(rng.normal(4, 0.5, 9)))            # short, erratic: convergence warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in ("ensemble", "arima"):                     # ensemble fits gpr and esm
            GBSForecaster(m).fit([noisy[:5], noisy[5:]]).predict(6)
    assert [str(w.message) for w in caught] == []


def test_forecast_next_epoch_is_the_ensemble_with_the_jobs_settings():
    job = JobConfig(initial_global_batch=16, min_global_batch=8, max_global_batch=40, adapt_interval=2,
                    min_local_batch=4, seed=3)
    trajectories = [[8, 10, 12, 14], [16, 18, 20]]
    assert forecast_next_epoch([], job, 100) == []
    f = GBSForecaster("ensemble", min_batch=8, max_batch=40, random_state=3).fit(trajectories)
    want = [float(x) for x in f.predict_epoch(100, 2)]
    got = forecast_next_epoch(trajectories, job, 100)
    assert got == want and sum(2 * b for b in got[:-1]) < 100 <= sum(2 * b for b in got)
    assert all(8 <= b <= 40 for b in got)
