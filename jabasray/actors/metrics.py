"""Metrics history of a JABAS run (plain dataclasses, JSON) and its PNG plots.

Per interval (p iterations, one Ray call): B_G requested/used, B_L, the plan, mean loss, measured
throughput, the gradient similarity Phi and the LR. Per epoch: the allocation, the actual B_G
trajectory and the one the forecaster predicted for it, validation accuracy, wall time and
GPU-seconds (sum over allocated GPUs of the epoch's wall time).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..serialization import JsonMixin, atomic_write_text
from ..types import Plan

log = logging.getLogger(__name__)


@dataclass
class IntervalRecord(JsonMixin):
    """One adaptation interval (<= p iterations, one Ray call per actor)."""

    epoch: int                       # 0-based epoch
    interval: int                    # 0-based interval within the epoch
    iteration: int                   # global iteration index of the interval's first iteration
    num_iterations: int              # iterations run (p, or fewer at the end of an epoch)
    cursor: int                      # samples of the epoch consumed before the interval
    requested_global_batch: int      # B_G asked for (adaptive rule output)
    global_batch: int                # B_G* the plan runs (Alg. 1 rounding)
    local_batch: int                 # B_L
    plan: Plan | None                # the solver's configuration on the current GPUs (None: burst)
    loss: float                      # mean training loss over the interval
    throughput: float                # measured samples / second
    phi: float | None                # gradient similarity of the two groups at the interval end
    lr: float                        # LR of the interval's last iteration
    time_s: float                    # wall time of the interval (driver side)
    samples: int = 0                 # samples trained in the interval (all actors)
    learners: list[int] = field(default_factory=list)  # sync="sma": learners per rank (else [])
    layout: list[int] = field(default_factory=list)    # decoupled workers per rank (sampler layout)
    predicted_time_s: float | None = None  # model's prediction of time_s: plan.iteration_time x iterations
    burst: dict | None = None        # parallelism="burst": per-layer GPU counts, planned vs measured
                                     # iteration time (actors.burst_host.burst_record)


@dataclass
class EpochRecord(JsonMixin):
    """One epoch: allocation, B_G trajectory (actual vs forecast), accuracy, time."""

    epoch: int
    allocation: dict[str, int]                # node -> GPU pairs
    gpu_types: list[str]                      # types of all allocated GPUs, rank order
    trajectory: list[int]                     # B_G requested per interval (actual)
    predicted_trajectory: list[float]         # forecast for this epoch (empty for epoch 0)
    train_loss: float
    val_accuracy: float | None
    time_s: float                             # wall time of the epoch (training + evaluation)
    gpu_seconds: float                        # len(gpu_types) * time_s
    samples: int
    throughput: float                         # samples / training second
    replaced: bool = False                    # actors were re-placed before this epoch
    note: str = ""                            # e.g. "restarted after actor failure"
    train_time_s: float = 0.0                 # measured: sum of the intervals' time_s
    predicted_train_time_s: float | None = None   # model: sum of the intervals' predicted_time_s
    predicted_time_s: float | None = None     # auto-scaler's estimate for the epoch (forecast B_G)

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured training time of the epoch (model error)."""
        if self.predicted_train_time_s is None or self.train_time_s <= 0:
            return None
        return (self.predicted_train_time_s - self.train_time_s) / self.train_time_s


@dataclass
class MetricsHistory(JsonMixin):
    """Everything ``fit()`` reports; saved as ``metrics.json`` in the run folder."""

    intervals: list[IntervalRecord] = field(default_factory=list)
    epochs: list[EpochRecord] = field(default_factory=list)
    events: list[str] = field(default_factory=list)   # re-placements, failures, resumes

    @property
    def final_val_accuracy(self) -> float | None:
        return self.epochs[-1].val_accuracy if self.epochs else None

    @property
    def total_gpu_seconds(self) -> float:
        return sum(e.gpu_seconds for e in self.epochs)

    @property
    def total_time_s(self) -> float:
        return sum(e.time_s for e in self.epochs)

    def truncate(self, epochs: int) -> "MetricsHistory":
        """The history of the first ``epochs`` epochs (what a checkpoint after them holds)."""
        return MetricsHistory(intervals=[r for r in self.intervals if r.epoch < epochs],
                              epochs=[e for e in self.epochs if e.epoch < epochs],
                              events=list(self.events))


def save_metrics(history: MetricsHistory, path: str | Path) -> Path:
    return atomic_write_text(path, history.to_json(indent=1))


def plot_history(history: MetricsHistory, path: str | Path) -> Path:
    """Write a PNG with (top) the B_G trajectory per interval, actual and forecast, epoch
    boundaries dashed, and (bottom) the allocation per epoch as GPUs per type, stacked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), gridspec_kw={"height_ratios": [3, 2]})
    x0 = 0
    labelled = set()
    for e in history.epochs:
        n = len(e.trajectory)
        xs = list(range(x0, x0 + n + 1))              # one more point closes the last step
        ax1.step(xs, list(e.trajectory) + e.trajectory[-1:], where="post", color="C0",
                 label=None if "a" in labelled else "B_G (actual)")
        labelled.add("a")
        if e.predicted_trajectory:
            m = len(e.predicted_trajectory)
            ax1.plot(list(range(x0, x0 + m)), e.predicted_trajectory, "--", color="C1",
                     label=None if "f" in labelled else "B_G (forecast)")
            labelled.add("f")
        ax1.axvline(x0 - 0.5, color="grey", lw=0.5, ls=":")
        x0 += n
    ax1.set_xlabel("adaptation interval (p iterations)")
    ax1.set_ylabel("global batch size")
    ax1.set_title("Global batch size trajectory")
    if labelled:
        ax1.legend(loc="best")
    types = sorted({t for e in history.epochs for t in e.gpu_types})
    bottom = [0] * len(history.epochs)
    xs = [e.epoch for e in history.epochs]
    for i, t in enumerate(types):
        counts = [e.gpu_types.count(t) for e in history.epochs]
        ax2.bar(xs, counts, bottom=bottom, label=t, color=f"C{i + 2}")
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("allocated GPUs")
    ax2.set_title("Allocation per epoch")
    if types:
        ax2.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
