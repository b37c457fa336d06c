"""``model.json``: what a run's driver planned with, so that the run can be simulated again.

A run folder's ``model.json`` holds the job (``JobConfig``), the cluster, the training set's
size, the model the initial allocation was chosen with and, for every epoch whose model
differs from the previous epoch's (the all-reduce fit and the interval's host costs measured
after a placement, a re-profiling), a snapshot of the model's inputs
(:meth:`jabasray.planners.perf_model.PerfModel.to_record`) taken once the epoch's actors are
placed. The auto-scaling decision at the end of an epoch is made with that epoch's model
(unless a re-profiling replaced it there: a replay then differs). ``jabasray simulate --replay RUN`` reads
it (:func:`load_model_record`), so the simulator decides with the model the driver decided with.
Only a :class:`~jabasray.planners.perf_model.PerfModel` is recorded; a run given another
model object records none (its replay then needs the profiles).

Plain JSON through the run's filesystem (:mod:`jabasray.storage`); no Ray, no torch.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from ..config import JobConfig
from ..storage import StoragePath, as_storage_path
from ..types import ClusterSpec

log = logging.getLogger(__name__)

MODEL_FILE = "model.json"
FORMAT = 1


@dataclass
class ModelRecord:
    """The content of ``model.json`` (module notes)."""

    job: JobConfig
    cluster: ClusterSpec
    dataset_size: int
    snapshots: list[dict] = field(default_factory=list)   # {"epochs_done": k, "model": record}
    initial: dict | None = None   # the model the initial allocation was chosen with

    def note_initial(self, model: Any) -> None:
        """``model`` chose the run's initial allocation (the first one noted is kept: a resumed
        run's start is not the run's start)."""
        to_record = getattr(model, "to_record", None)
        if self.initial is None and callable(to_record):
            self.initial = to_record()

    def note(self, model: Any, epochs_done: int) -> bool:
        """``model`` planned epoch ``epochs_done`` (0-based: after that many epochs) and the
        epochs after it until the next snapshot; a snapshot of an epoch that is run again (a
        resume, a restart) is replaced. False for a model that cannot say what it is built
        from (no ``to_record``) or that did not change."""
        to_record = getattr(model, "to_record", None)
        if not callable(to_record):
            return False
        rec = to_record()
        self.snapshots = [s for s in self.snapshots if s["epochs_done"] < epochs_done]
        if self.snapshots and self.snapshots[-1]["model"] == rec:
            return False
        self.snapshots.append({"epochs_done": int(epochs_done), "model": rec})
        return True

    def model_at(self, epochs_done: int) -> dict | None:
        """The model record that planned epoch ``epochs_done`` (None: none recorded)."""
        found = None
        for snap in self.snapshots:
            if snap["epochs_done"] <= epochs_done:
                found = snap["model"]
        return found

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "job": self.job.to_dict(), "cluster": self.cluster.to_dict(),
                           "dataset_size": self.dataset_size, "initial": self.initial,
                           "snapshots": self.snapshots}, indent=1)

    def save(self, run_dir: str | StoragePath) -> None:
        """Write ``model.json`` into ``run_dir`` (atomically)."""
        (as_storage_path(run_dir) / MODEL_FILE).write_text(self.to_json())


def load_model_record(run_dir: str | StoragePath) -> ModelRecord:
    """``model.json`` of ``run_dir``. ValueError (one line) when it is missing or malformed."""
    path = as_storage_path(run_dir) / MODEL_FILE
    if not path.exists():
        raise ValueError(f"run folder {run_dir}: no {MODEL_FILE} (runs record what they planned "
                         f"with since this file was introduced; re-run the job, or simulate it "
                         f"with --profiles instead of --replay)")
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format must be {FORMAT}, got {data.get('format')!r}")
        return ModelRecord(JobConfig.from_dict(data["job"]), ClusterSpec.from_dict(data["cluster"]),
                           int(data["dataset_size"]), list(data.get("snapshots", [])), data.get("initial"))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a model record ({type(e).__name__}: {e})") from None


def resumed_record(run_dir: StoragePath, job: JobConfig, cluster: ClusterSpec,
                   dataset_size: int) -> ModelRecord:
    """The record a (re)started driver continues: the run's ``model.json`` when it is this job's
    and readable (its snapshots kept), else a new one."""
    try:
        old = load_model_record(run_dir)
    except ValueError:
        return ModelRecord(job, cluster, dataset_size)
    if old.job != job or old.dataset_size != dataset_size:
        return ModelRecord(job, cluster, dataset_size)
    return ModelRecord(job, cluster, dataset_size, old.snapshots, old.initial)


__all__ = ["MODEL_FILE", "ModelRecord", "load_model_record", "resumed_record"]
