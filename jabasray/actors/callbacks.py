"""What ``JabasTrainer.fit()`` reports while it runs: the console (:class:`ConsoleReporter`) and
Ray Tune's own logger callbacks (:class:`TuneCallbackAdapter`).

**Console.** One line per epoch (:func:`jabasray.actors.metrics.epoch_line`) on stdout, the
driver's events on stderr, and a tqdm bar of the samples trained on stderr when it is a
terminal (``jabasray train`` always shows it unless ``--no-progress``). Until training starts
the bar's description is the driver's phase (``on_phase``: profiling, placing the actors), and
its clock (rate, time left) starts with the first interval's training. ``JabasTrainer(verbose=)``
as Ray's ``verbose``: 0 nothing, 1 this reporter, 2 also the actors' INFO log lines.

**Trackers.** ``RunConfig(callbacks=[...])`` takes Ray's logger callbacks unchanged -
``ray.tune.logger.TBXLoggerCallback`` (TensorBoard), ``CSVLoggerCallback``,
``JsonLoggerCallback``, ``ray.air.integrations.mlflow.MLflowLoggerCallback``,
``ray.air.integrations.wandb.WandbLoggerCallback`` - or any ``ray.tune.Callback``. The adapter
drives Ray's callback API as Tune drives it for one trial: ``setup()``, ``on_trial_start``,
one ``on_trial_result`` per interval and per epoch, ``on_trial_complete`` (or
``on_trial_error``) and ``on_experiment_end``. The trial is a :class:`RunTrial`: the run's name,
its ``JobConfig`` as ``config``, and as ``local_path`` the run folder (a local run; TensorBoard
event files land beside ``metrics.json``, so ``tensorboard --logdir <storage_path>`` shows every
run) or ``./jabasray_logs/<name>`` for a run on remote storage (Ray's loggers write local files).

A result carries every scalar field of the record (and every dict of scalars, flattened with
``/``: validation metrics, and any training metrics the records gain) under ``interval/...`` or
``epoch/...``, with ``training_iteration`` (results so far) and ``timesteps_total`` (the
global training iteration, which continues across a resume; Ray's loggers use it as the step).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from typing import Any, Iterable, Sequence

from .driver_options import TRAINING_PHASE, DriverCallback

log = logging.getLogger(__name__)

SKIPPED_FIELDS = {"served", "served_digest", "plan", "layout", "learners", "trajectory",
                  "predicted_trajectory", "gpu_types", "allocation", "burst",
                  "train_metric_sums", "train_metric_counts", "train_metrics"}


def scalar_metrics(record: Any, prefix: str) -> dict[str, float | int]:
    """Every finite number (bools as 0/1) of a metrics record's fields, and of its dicts of
    numbers (flattened ``field/key``; ``val_metrics`` as ``val_<key>``), and the step's training
    metrics (the record's sample-weighted ``train_metrics``, as ``train_<key>``, the names of
    ``metrics.csv``), under ``prefix/``."""
    out: dict[str, float | int] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[f"{prefix}/{key}"] = value

    for f in dataclasses.fields(record):
        if f.name in SKIPPED_FIELDS:
            continue
        value = getattr(record, f.name)
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"val_{k}" if f.name == "val_metrics" else f"{f.name}/{k}", v)
        else:
            put(f.name, value)
    for k, v in getattr(record, "train_metrics", {}).items():
        if k != "loss":                    # the record's own loss is the training loss
            put(f"train_{k}", v)
    return out


class RunTrial:
    """The trial-like object Ray's callbacks are given (module notes): what Ray's logger
    callbacks read of a ``Trial`` (``trial_id``, ``config``, ``evaluated_params``,
    ``local_path``, ``init_local_path()``, ``experiment_dir_name``, ``checkpoint``)."""

    def __init__(self, name: str, config: dict, local_path: str, experiment: str) -> None:
        self.trial_id = self.trial_name = name
        self.config = dict(config)
        self.evaluated_params = dict(config)
        self.local_path = local_path
        self.experiment_dir_name = experiment
        self.checkpoint = None
        self.storage = None
        self.status = "RUNNING"

    def init_local_path(self) -> None:
        os.makedirs(self.local_path, exist_ok=True)

    def __str__(self) -> str:
        return self.trial_name

    def __repr__(self) -> str:
        return f"RunTrial({self.trial_name!r})"


def is_tune_callback(cb: Any) -> bool:
    """A Ray Tune ``Callback`` (duck-typed: it has ``on_trial_result``)."""
    return hasattr(cb, "on_trial_result") and not hasattr(cb, "on_epoch")


class TuneCallbackAdapter(DriverCallback):
    """Drives one Ray Tune callback with a run's records (module notes)."""

    def __init__(self, callback: Any, trial: RunTrial) -> None:
        self.callback, self.trial = callback, trial
        self.results = 0              # training_iteration
        self.iteration = 0            # global training iteration (timesteps_total)

    def _call(self, method: str, **kw: Any) -> None:
        getattr(self.callback, method)(iteration=self.results, trials=[self.trial],
                                       trial=self.trial, **kw)

    def start(self) -> None:
        self.callback.setup(stop=None, num_samples=1, total_num_samples=1)
        self.trial.init_local_path()
        self._call("on_trial_start")

    def _result(self, metrics: dict) -> None:
        self.results += 1
        result = {"training_iteration": self.results, "timesteps_total": self.iteration,
                  "trial_id": self.trial.trial_id, **metrics}
        self._call("on_trial_result", result=result)

    def on_interval(self, driver: Any, record: Any) -> None:
        self.iteration = record.iteration + record.num_iterations
        self._result(scalar_metrics(record, "interval"))

    def on_epoch(self, driver: Any, record: Any) -> None:
        self._result(scalar_metrics(record, "epoch"))

    def finish(self, failed: bool) -> None:
        self.trial.status = "ERROR" if failed else "TERMINATED"
        self._call("on_trial_error" if failed else "on_trial_complete")
        self.callback.on_experiment_end(trials=[self.trial])


def tracker_callbacks(callbacks: Iterable[Any], run_dir: Any, name: str, config: dict
                      ) -> tuple[list[Any], list[TuneCallbackAdapter]]:
    """Split ``RunConfig.callbacks`` into the driver callbacks (as given) and adapters of Ray
    Tune callbacks over one :class:`RunTrial` of the run ``name`` in ``run_dir``."""
    driver, adapters = [], []
    trial = None
    for cb in callbacks:
        if not is_tune_callback(cb):
            driver.append(cb)
            continue
        if trial is None:
            local = str(run_dir.local_path) if run_dir.is_local else os.path.abspath(
                os.path.join("jabasray_logs", name))
            if not run_dir.is_local:
                log.info("run %s is on remote storage: Ray's logger callbacks write into %s",
                         name, local)
            trial = RunTrial(name, config, local, str(run_dir.parent.name or name))
        adapters.append(TuneCallbackAdapter(cb, trial))
    return driver, adapters


class ConsoleReporter(DriverCallback):
    """Progress on the console (module notes): one line per epoch on stdout, events on stderr,
    a tqdm bar of samples on stderr (``bar`` None: when stderr is a terminal)."""

    def __init__(self, bar: bool | None = None) -> None:
        self.want_bar = sys.stderr.isatty() if bar is None else bool(bar)
        self.bar: Any = None
        self.total: int | None = None
        self.lines: list[str] = []     # the epoch lines printed (tests, summaries)
        self._training = False         # training has begun (the bar's clock restarted)

    def start(self, total: int | None = None) -> None:
        """Show the bar (``total`` samples), once the run has passed its checks."""
        self.total = total
        if self.want_bar and self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="sample", file=sys.stderr, dynamic_ncols=True,
                            leave=False)

    def on_phase(self, driver: Any, phase: str) -> None:
        """The bar's description until training (re)starts (without a bar: nothing; the
        events and epoch lines say what happened)."""
        if self.bar is not None:
            self.bar.set_description_str("" if phase == TRAINING_PHASE else f"{phase}...")

    def on_interval(self, driver: Any, record: Any) -> None:
        if self.bar is not None and not self._training:
            # the bar's clock (rate, time left) starts with the first interval's training, not
            # with Ray's start, the checks, profiling and the actors' start before it
            self.bar.reset(total=self.total)
            self.bar.start_t = self.bar.last_print_t = self.bar.start_t - max(0.0, record.time_s)
        self._training = True
        if self.bar is not None:
            left = None if self.total is None else max(0, self.total - self.bar.n)
            self.bar.update(record.samples if left is None else min(left, record.samples))
            self.bar.set_postfix(B_G=record.global_batch, B_L=record.local_batch,
                                 phi=f"{record.phi:.2f}" if record.phi is not None else "-",
                                 loss=f"{record.loss:.3f}")

    def on_epoch(self, driver: Any, record: Any) -> None:
        from .metrics import epoch_line
        line = epoch_line(record)
        self.lines.append(line)
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def on_event(self, driver: Any, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def console_reporter(callbacks: Sequence[Any]) -> ConsoleReporter | None:
    """The :class:`ConsoleReporter` among ``callbacks`` (None: none)."""
    return next((cb for cb in callbacks if isinstance(cb, ConsoleReporter)), None)


__all__ = ["scalar_metrics", "RunTrial", "TuneCallbackAdapter", "tracker_callbacks",
           "ConsoleReporter", "console_reporter", "is_tune_callback"]
