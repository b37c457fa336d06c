"""A ``ray.tune.ResultGrid`` built directly from what packed Hyperband recorded.

Implementation notes
--------------------
Packed Hyperband trains configurations inside PACK trials, so Tune never sees one trial per
configuration. Users still expect ``tuner.fit()`` to return a ``ResultGrid`` with ONE ROW PER
CONFIGURATION. Earlier versions obtained it by a second Tune run that re-reported every
configuration's results (one trial per configuration, no training): correct, but it cost as
much wall-clock as the search itself on small problems (Tune's per-trial fixed costs).

:class:`PackedResultGrid` is a ``ResultGrid`` subclass (``isinstance(grid, ResultGrid)`` holds)
whose rows are ``ray.tune.Result`` objects made from the :class:`ConfigRecord` histories:

* ``result.config``: the configuration plus ``config_id``;
* ``result.metrics``: its last rung's row (``metric``, ``train_loss``, ``steps``, ``rung``,
  ``resource``, ``bracket``, ``pack``, ``pack_size``) plus ``training_iteration`` (rungs
  reached), ``trial_id``, ``done`` and ``config`` -- the keys a Tune row carries;
* ``result.metrics_dataframe``: one row per rung reached (nested ``config`` flattened to
  ``config/<key>`` columns, as Tune does);
* ``result.checkpoint``: the configuration's last member checkpoint (a directory holding
  ``member.pt``, written by the pack trial; no copy).

Each row also gets a folder ``<storage>/<name>/config_<id>`` with ``result.json`` (one JSON line
per rung) and ``params.json``, so ``ray.tune.Result.from_path`` can read the metrics back.
``get_best_result`` / ``get_dataframe`` follow ``ResultGrid``'s semantics (scope ``last``,
``avg``, ``all``, ``last-5-avg``, ``last-10-avg``; NaN/inf filtered; ties go to the earlier row,
i.e. the lower ``config_id``).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Sequence

from ray.tune import ResultGrid

from jabasray.tuner.state import ConfigRecord

__all__ = ["PackedResultGrid", "build_result_grid"]

SCOPES = ("all", "last", "avg", "last-5-avg", "last-10-avg")


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def _row_result(rec: ConfigRecord, row_dir: str | None):
    """One ``ray.tune.Result`` for one configuration."""
    import pandas as pd
    from ray.tune import Checkpoint, Result

    config = {**rec.config, "config_id": rec.config_id}
    trial_id = f"config_{rec.config_id}"
    rows = []
    for k, h in enumerate(rec.history):
        rows.append({**h, "training_iteration": k + 1, "trial_id": trial_id,
                     "done": k == len(rec.history) - 1, "config": dict(config)})
    ckpt = None
    if rec.checkpoint:
        ckpt_dir = rec.checkpoint if os.path.isdir(rec.checkpoint) else os.path.dirname(rec.checkpoint)
        ckpt = Checkpoint.from_directory(ckpt_dir)
    if row_dir is not None:
        os.makedirs(row_dir, exist_ok=True)
        with open(os.path.join(row_dir, "result.json"), "w") as fh:
            fh.write("".join(json.dumps({k: _jsonable(v) for k, v in r.items()}) + "\n" for r in rows))
        with open(os.path.join(row_dir, "params.json"), "w") as fh:
            json.dump({k: _jsonable(v) for k, v in config.items()}, fh)
    df = pd.json_normalize(rows, sep="/") if rows else pd.DataFrame()
    return Result(metrics=dict(rows[-1]) if rows else {}, checkpoint=ckpt, error=None,
                  path=row_dir or "", metrics_dataframe=df,
                  best_checkpoints=[(ckpt, dict(rows[-1]))] if ckpt is not None else [])


def _score(result, metric: str, mode: str, scope: str, filter_nan_and_inf: bool) -> float | None:
    """``ExperimentAnalysis.get_best_trial``'s per-trial score, from the row's dataframe."""
    df = result.metrics_dataframe
    if df is None or metric not in df.columns:
        return None
    values = [float(v) for v in df[metric].tolist()]
    if filter_nan_and_inf:
        values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    if scope == "last":
        return values[-1]
    if scope == "avg":
        return sum(values) / len(values)
    if scope in ("last-5-avg", "last-10-avg"):
        tail = values[-(5 if scope == "last-5-avg" else 10):]
        return sum(tail) / len(tail)
    return max(values) if mode == "max" else min(values)           # scope == "all"


def build_result_grid(records: Iterable[ConfigRecord], *, experiment_path: str, metric: str | None,
                      mode: str | None, write_files: bool = True):
    """A :class:`PackedResultGrid` with one row per configuration that reported (rows in
    ``config_id`` order); row folders go under ``experiment_path`` if ``write_files``."""
    recs = sorted((r for r in records if r.history), key=lambda r: r.config_id)
    if write_files:
        os.makedirs(experiment_path, exist_ok=True)
    results = [_row_result(r, os.path.join(experiment_path, f"config_{r.config_id}") if write_files else None)
               for r in recs]
    return PackedResultGrid(results, experiment_path=experiment_path, metric=metric, mode=mode)


class PackedResultGrid(ResultGrid):
    """``ray.tune.ResultGrid`` over ready-made ``Result`` rows (no ExperimentAnalysis)."""

    def __init__(self, results: Sequence[Any], *, experiment_path: str, metric: str | None = None,
                 mode: str | None = None) -> None:
        if mode not in (None, "max", "min"):
            raise ValueError(f"mode must be None, 'max' or 'min', got {mode!r}")
        self._results = list(results)
        self._experiment_path = os.fspath(experiment_path)
        self._metric, self._mode = metric, mode
        self._experiment_analysis = None

    @property
    def experiment_path(self) -> str:
        return self._experiment_path

    @property
    def filesystem(self):
        import pyarrow.fs
        return pyarrow.fs.LocalFileSystem()

    def get_best_result(self, metric: str | None = None, mode: str | None = None,
                        scope: str = "last", filter_nan_and_inf: bool = True):
        if len(self._results) == 1:
            return self._results[0]
        metric = metric or self._metric
        mode = mode or self._mode
        if not metric:
            raise ValueError("No metric is provided. Pass a `metric` arg to `get_best_result`.")
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        best, best_score = None, None
        for r in self._results:
            s = _score(r, metric, mode, scope, filter_nan_and_inf)
            if s is None:
                continue
            if best_score is None or (s > best_score if mode == "max" else s < best_score):
                best, best_score = r, s
        if best is None:
            raise RuntimeError(f"No best trial found for the given metric: {metric}. "
                               "This means that no trial has reported this metric, or all "
                               "values reported for this metric are NaN.")
        return best

    def get_dataframe(self, filter_metric: str | None = None, filter_mode: str | None = None):
        import pandas as pd

        if (filter_metric is None) != (filter_mode is None):
            raise ValueError("pass both filter_metric and filter_mode, or neither")
        rows = []
        for r in self._results:
            df = r.metrics_dataframe
            if filter_metric is not None and df is not None and filter_metric in df.columns:
                i = df[filter_metric].idxmax() if filter_mode == "max" else df[filter_metric].idxmin()
                rows.append(df.loc[i].to_dict())
            elif df is not None and len(df):
                rows.append(df.iloc[-1].to_dict())
        out = pd.DataFrame(rows)
        if len(out):
            out["logdir"] = [r.path for r in self._results][:len(out)]
        return out

    @property
    def errors(self):
        return []

    @property
    def num_errors(self) -> int:
        return 0

    @property
    def num_terminated(self) -> int:
        return len(self._results)

    def __repr__(self) -> str:
        return (f"PackedResultGrid<{len(self._results)} configurations, "
                f"experiment_path={self._experiment_path!r}>")
