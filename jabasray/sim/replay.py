"""Re-simulate a recorded run: the simulator against what really ran.

:class:`RecordedRun` reads a run folder (``model.json``, :mod:`jabasray.actors.model_record`;
``metrics.json``) and gives the simulator (:func:`.loop.simulate`, JABAS policy) what the run's
driver had: the model that planned each epoch (profiles, measured all-reduce fits, host costs,
emulation fits), the similarity every interval measured (so B_G moves as it moved), the seconds
each placement and each epoch's end took, and the re-placement charge of each auto-scaling
decision. Everything else - every plan, allocation, forecast and the time of every interval - the
simulator computes. :func:`replay` then sets the two side by side, per epoch: the allocation
and the plans (equal when the simulator decides as the driver did), the simulated and the
recorded time, and the time to a target.

A run whose model changed inside an epoch (re-profiled at an epoch end with the online
correction on, whose factors are not recorded) replays with the recorded snapshots only: its
decisions can then differ, and the report says where.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..actors.metrics import MetricsHistory
from ..actors.model_record import load_model_record
from ..planners.perf_model import PerfModel
from ..storage import StoragePath, as_storage_path
from .convergence import ReplaySimilarity
from .loop import SimRun, reaches, simulate
from .policies import JabasPolicy


class RecordedRun:
    """A run folder as the simulator's :class:`.loop.Recorded` (module notes)."""

    def __init__(self, run_dir: str | StoragePath) -> None:
        self.run_dir = as_storage_path(run_dir)
        self.record = load_model_record(self.run_dir)
        path = self.run_dir / "metrics.json"
        if not path.exists():
            raise ValueError(f"run folder {run_dir}: no metrics.json (a run writes it after its first epoch)")
        try:
            self.history = MetricsHistory.from_dict(json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a metrics history ({type(e).__name__}: {e})") from None
        if not self.history.epochs:
            raise ValueError(f"run folder {run_dir}: metrics.json records no epoch")
        if self.record.initial is None or not self.record.snapshots:
            raise ValueError(f"run folder {run_dir}: model.json records no model (the run was given "
                             f"an iteration-time model that cannot say what it is built from)")
        self._models: dict[int, PerfModel] = {}
        self.similarities = ReplaySimilarity({(r.epoch, r.interval): r.phi for r in self.history.intervals})

    @property
    def job(self):
        return self.record.job

    def model(self, epochs_done: int | None) -> Any:
        rec = self.record.initial if epochs_done is None else self.record.model_at(epochs_done)
        rec = rec if rec is not None else self.record.initial
        key = id(rec)
        if key not in self._models:
            self._models[key] = PerfModel.from_record(rec)
        return self._models[key]

    def _epoch(self, epoch: int):
        return self.history.epochs[epoch] if epoch < len(self.history.epochs) else None

    def placement_s(self, epoch: int) -> float | None:
        e = self._epoch(epoch)
        return e.placement_s if e is not None else None

    def eval_s(self, epoch: int) -> float:
        e = self._epoch(epoch)
        return e.eval_s if e is not None else 0.0

    def switch_s(self, epoch: int) -> float | None:
        e = self._epoch(epoch)
        return e.decision.get("switch_s") if e is not None and e.decision else None

    def val_metrics(self, epoch: int) -> dict[str, float]:
        e = self._epoch(epoch)
        return dict(e.val_metrics) if e is not None else {}


@dataclass
class EpochComparison:
    """One epoch, simulated beside recorded."""

    epoch: int
    allocation_recorded: dict[str, int]
    allocation_simulated: dict[str, int]
    plans_equal: bool                 # every interval ran the same plan at the same B_G
    time_recorded_s: float
    time_simulated_s: float

    @property
    def error(self) -> float:
        """(simulated - recorded) / recorded epoch time."""
        return (self.time_simulated_s - self.time_recorded_s) / self.time_recorded_s \
            if self.time_recorded_s > 0 else 0.0


@dataclass
class ReplayReport:
    """:func:`replay`'s result."""

    run: str
    epochs: list[EpochComparison]
    simulated: SimRun
    time_to_target_recorded_s: float | None = None
    time_to_target_simulated_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def same_decisions(self) -> bool:
        return all(e.plans_equal and e.allocation_recorded == e.allocation_simulated for e in self.epochs)

    @property
    def median_abs_error(self) -> float:
        return statistics.median(abs(e.error) for e in self.epochs)

    def to_dict(self) -> dict:
        return {"run": self.run, "same_decisions": self.same_decisions,
                "median_abs_epoch_error": self.median_abs_error,
                "time_recorded_s": sum(e.time_recorded_s for e in self.epochs),
                "time_simulated_s": sum(e.time_simulated_s for e in self.epochs),
                "time_to_target_recorded_s": self.time_to_target_recorded_s,
                "time_to_target_simulated_s": self.time_to_target_simulated_s,
                "notes": self.notes,
                "epochs": [{"epoch": e.epoch, "allocation_recorded": e.allocation_recorded,
                            "allocation_simulated": e.allocation_simulated, "plans_equal": e.plans_equal,
                            "time_recorded_s": e.time_recorded_s, "time_simulated_s": e.time_simulated_s,
                            "error": e.error} for e in self.epochs]}

    def lines(self) -> list[str]:
        """The per-epoch table ``jabasray simulate --replay`` prints."""
        out = [f"{'epoch':>5}  {'recorded s':>10}  {'simulated s':>11}  {'error':>7}  same plans  allocation"]
        for e in self.epochs:
            same = "yes" if e.plans_equal and e.allocation_recorded == e.allocation_simulated else "NO"
            alloc = ",".join(f"{k}:{v}" for k, v in e.allocation_recorded.items())
            if e.allocation_simulated != e.allocation_recorded:
                alloc += " (simulated " + ",".join(f"{k}:{v}" for k, v in e.allocation_simulated.items()) + ")"
            out.append(f"{e.epoch + 1:>5}  {e.time_recorded_s:>10.2f}  {e.time_simulated_s:>11.2f}  "
                       f"{100 * e.error:>+6.1f}%  {same:>10}  {alloc}")
        tot_r = sum(e.time_recorded_s for e in self.epochs)
        tot_s = sum(e.time_simulated_s for e in self.epochs)
        out.append(f"total: recorded {tot_r:.2f} s, simulated {tot_s:.2f} s "
                   f"({100 * (tot_s - tot_r) / tot_r:+.1f}%), median |epoch error| "
                   f"{100 * self.median_abs_error:.1f}%; decisions "
                   f"{'the same' if self.same_decisions else 'DIFFER'}")
        if self.time_to_target_recorded_s is not None or self.time_to_target_simulated_s is not None:
            out.append(f"time to target: recorded {_s(self.time_to_target_recorded_s)}, "
                       f"simulated {_s(self.time_to_target_simulated_s)}")
        out.extend(self.notes)
        return out


def _s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.2f} s"


def _time_to_target(history: MetricsHistory, target: float | None) -> float | None:
    """End of the first epoch whose validation accuracy reaches ``target`` (epoch times summed)."""
    if target is None:
        return None
    clock = 0.0
    for e in history.epochs:
        clock += e.time_s
        if reaches(e.val_metrics.get("accuracy", e.val_accuracy), target):
            return clock
    return None


def _plans(history: MetricsHistory, epoch: int) -> list[tuple]:
    return [(r.requested_global_batch, r.global_batch, r.local_batch,
             [tuple(w) for w in r.plan.workers] if r.plan is not None else None)
            for r in history.intervals if r.epoch == epoch]


def replay(run_dir: str | StoragePath, target: float | None = None) -> ReplayReport:
    """Re-simulate the JABAS run in ``run_dir`` and compare it epoch by epoch (module notes);
    ``target``: a validation accuracy to time (the recorded run's metrics are replayed)."""
    rec = RecordedRun(run_dir)
    recorded = rec.history
    job = rec.job
    if job.epochs != len(recorded.epochs):   # an unfinished run: replay the epochs it ran
        from dataclasses import replace
        job = replace(job, epochs=len(recorded.epochs))
    sim = simulate(JabasPolicy(), job, rec.record.cluster, rec.record.dataset_size, None,
                   recorded=rec, similarities=rec.similarities, target=target)
    rows = []
    for r, s in zip(recorded.epochs, sim.history.epochs):
        rows.append(EpochComparison(r.epoch, {k: v for k, v in r.allocation.items() if v},
                                    {k: v for k, v in s.allocation.items() if v},
                                    _plans(recorded, r.epoch) == _plans(sim.history, s.epoch),
                                    r.time_s, s.time_s))
    notes = []
    if job.autoscale and any(not e.decision for e in recorded.epochs[:-1]):
        notes.append("some epochs record no auto-scaling decision (no auto-scaling, or a run older "
                     "than the decision records): the simulator decided those itself")
    return ReplayReport(as_storage_path(run_dir).name, rows, sim,
                        _time_to_target(recorded, target), sim.time_to_target_s, notes)


__all__ = ["RecordedRun", "EpochComparison", "ReplayReport", "replay"]
