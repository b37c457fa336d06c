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
its ``JobConfig`` as ``config``, and as ``local_path`` the run folder, so that TensorBoard event
files and ``progress.csv`` land beside ``metrics.json`` (``tensorboard --logdir <storage_path>``
shows every run). Ray's loggers write local files: for a run on remote storage (S3, GCS, ...)
:class:`RunTrackers` gives them a temporary folder and uploads what they wrote into the run
folder, through the run's filesystem, at every epoch end and at the end.

**Where they run.** In the process that follows the run: ``fit()``'s (the driver in this
process, or the driver actor's progress replayed here). A detached run (``fit(wait=False)``,
``jabasray train --detach``) has no such process: its ``RunConfig.callbacks`` travel to the
driver actor (cloudpickled with the job; :func:`check_sendable` refuses one that cannot, in one
line, before any work) and run there.

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
import shutil
import sys
import tempfile
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


class RunTrackers(DriverCallback):
    """Ray Tune callbacks of one run, fed its records over one :class:`RunTrial` whose
    ``local_path`` is the run folder, or for a run on remote storage a temporary folder
    uploaded into the run folder at every epoch end and by :meth:`finish` (module notes)."""

    def __init__(self, callbacks: Sequence[Any], run_dir: Any, name: str, config: dict) -> None:
        from ..storage import as_storage_path

        self.callbacks, self.name, self.config = list(callbacks), name, dict(config)
        self.run_dir = as_storage_path(run_dir)
        self.adapters: list[TuneCallbackAdapter] = []
        self.staging: str | None = None      # the temporary folder of a remote run folder

    def start(self) -> None:
        """The trial's folder, then ``setup`` and ``on_trial_start`` of every callback."""
        if self.run_dir.is_local:
            local = str(self.run_dir.local_path)
        else:
            self.staging = local = tempfile.mkdtemp(prefix=f"jabasray-{self.name}-logs-")
        trial = RunTrial(self.name, self.config, local, str(self.run_dir.parent.name or self.name))
        self.adapters = [TuneCallbackAdapter(cb, trial) for cb in self.callbacks]
        for a in self.adapters:
            a.start()

    def on_interval(self, driver: Any, record: Any) -> None:
        for a in self.adapters:
            a.on_interval(driver, record)

    def on_epoch(self, driver: Any, record: Any) -> None:
        for a in self.adapters:
            a.on_epoch(driver, record)
        self.upload()

    def finish(self, failed: bool) -> None:
        """End the trial (``on_trial_complete`` or ``on_trial_error``, ``on_experiment_end``),
        upload what the callbacks wrote and remove the temporary folder."""
        try:
            for a in self.adapters:
                a.finish(failed)
            self.upload()
        finally:
            if self.staging is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
                self.staging = None

    def upload(self) -> None:
        """Copy every file of the temporary folder into the run folder (remote storage only);
        a failed upload is logged, never the run's failure."""
        if self.staging is None:
            return
        try:
            for folder, _, files in os.walk(self.staging):
                if not files:
                    continue
                rel = os.path.relpath(folder, self.staging).replace(os.sep, "/")
                target = self.run_dir if rel == "." else self.run_dir / rel
                target.mkdir()
                for f in files:
                    (target / f).upload(os.path.join(folder, f))
        except Exception as e:  # noqa: BLE001 - the trackers' files must not fail the run
            log.warning("run %s: could not upload the logger callbacks' files to %s: %s",
                        self.name, self.run_dir, e)


def tracker_callbacks(callbacks: Iterable[Any], run_dir: Any, name: str, config: dict
                      ) -> tuple[list[Any], RunTrackers | None]:
    """Split ``RunConfig.callbacks`` into the driver callbacks (as given) and the
    :class:`RunTrackers` of its Ray Tune callbacks in run ``name``'s folder ``run_dir``
    (None: there are none)."""
    driver, tune = [], []
    for cb in callbacks:
        (tune if is_tune_callback(cb) else driver).append(cb)
    return driver, (RunTrackers(tune, run_dir, name, config) if tune else None)


def check_sendable(callbacks: Sequence[Any]) -> None:
    """One-line ValueError when a callback cannot travel to the driver actor of a detached run
    (it must survive cloudpickle, as the job does)."""
    from ray import cloudpickle

    for i, cb in enumerate(callbacks):
        try:
            cloudpickle.dumps(cb)
        except Exception as e:  # noqa: BLE001 - whatever pickling raises: one line
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"callbacks: RunConfig.callbacks[{i}] ({type(cb).__name__}) cannot be "
                             f"sent to the driver actor of a detached run ({type(e).__name__}"
                             f"{': ' + text if text else ''}); make it picklable or follow the run "
                             f"with fit() so that it runs in this process") from None


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


__all__ = ["scalar_metrics", "RunTrial", "TuneCallbackAdapter", "RunTrackers", "tracker_callbacks",
           "check_sendable", "ConsoleReporter", "console_reporter", "is_tune_callback"]
