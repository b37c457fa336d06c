"""Metrics history of a JABAS run (plain dataclasses, JSON) and its PNG plots.

Per interval (p iterations, one Ray call): B_G requested/used, B_L, the plan, mean loss, measured
throughput, the gradient similarity Phi and the LR. Per epoch: the allocation, the actual B_G
trajectory and the one the forecaster predicted for it, the validation metrics of the user's
``eval_fn`` (``val_metrics``; ``val_accuracy`` is its ``"accuracy"``), wall time and
GPU-seconds (sum over allocated GPUs of the epoch's wall time) and GPU-seconds of the nodes held.
Per run (:class:`RunHeld`): the GPU-seconds of the nodes held from the driver's start to the
run's end, before, inside, between and after the epochs.

Files (written through the run's filesystem, :mod:`jabasray.storage`): ``metrics.json`` (everything), ``metrics.csv`` (one row per epoch, flat columns - what
``pandas.read_csv`` and ``Result.metrics_dataframe`` read), and the PNG of :func:`plot_history`.
"""
from __future__ import annotations

import csv
import io
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..engine.sampler import add_digests, range_digest
from ..engine.train_metrics import merge_metric_sums, metric_means
from ..serialization import JsonMixin
from ..storage import StoragePath, as_storage_path
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
    predicted_time_s: float | None = None  # model's prediction of time_s: the sum of predicted_terms
    burst: dict | None = None        # parallelism="burst": per-layer GPU counts, planned vs measured
                                     # iteration time (actors.burst_host.burst_record)
    served_digest: int | None = None  # digest of the indices all ranks served (engine.sampler)
    served: list[int] | None = None   # the indices served, rank order (DriverOptions.record_samples)
    train_metric_sums: dict[str, float] = field(default_factory=dict)  # step_fn metrics, all ranks:
                                      # sum of mean x samples (float64)
    train_metric_counts: dict[str, int] = field(default_factory=dict)  # samples behind each sum
    predicted_terms: dict[str, float] = field(default_factory=dict)  # the prediction by term
                                      # (planners.interval_model.TERMS), seconds
    measured_terms: dict[str, float] = field(default_factory=dict)   # the same terms as they ran
                                      # (actors.interval_costs.measured_terms); time_s minus their
                                      # sum is the driver's own bookkeeping between the calls

    @property
    def train_metrics(self) -> dict[str, float]:
        """The interval's step_fn metrics: sample-weighted means over every rank's forwards."""
        return metric_means(self.train_metric_sums, self.train_metric_counts)


@dataclass
class EpochRecord(JsonMixin):
    """One epoch: allocation, B_G trajectory (actual vs forecast), accuracy, time."""

    epoch: int
    allocation: dict[str, int]                # node -> GPUs
    gpu_types: list[str]                      # types of all allocated GPUs, rank order
    trajectory: list[int]                     # B_G the adaptive rule requested, per interval
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
    served_exactly_once: bool | None = None   # the actors' digests add up to every sample once
                                              # (None: not checked, burst parallelism)

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured training time of the epoch (model error)."""
        if self.predicted_train_time_s is None or self.train_time_s <= 0:
            return None
        return (self.predicted_train_time_s - self.train_time_s) / self.train_time_s
    val_metrics: dict[str, float] = field(default_factory=dict)  # eval_fn's means, all shards
    lr: float | None = None                   # LR of the epoch's last iteration
    train_metrics: dict[str, float] = field(default_factory=dict)  # step_fn's metrics, sample-
                                              # weighted means over the epoch
    allreduce_fit: dict = field(default_factory=dict)  # the Eq. 3 fit the epoch's plans used:
                                              # source ("measured" on the placed actors or
                                              # "profiled"), span, world size, alpha, beta, K, N_G
                                              # (actors.allreduce_fit.fit_description); {}: one GPU
    decision: dict = field(default_factory=dict)  # the auto-scaler's choice made after this epoch
                                              # for the next one (decision_record); {}: none
    placement_s: float | None = None          # seconds placing the actors took before this epoch
                                              # (start, re-placement; None: the actors stayed)
    eval_s: float = 0.0                       # seconds of the epoch end: the actors' state read
                                              # for the checkpoint and the validation
    held_gpu_seconds: float | None = None     # GPU-seconds of the GPU nodes held during the epoch,
                                              # used or idle (actors.cluster_view, rule 6; a job
                                              # that follows Ray: every GPU node's lifetime, one
                                              # launched for its request from the request; a fixed
                                              # cluster: all of it; None: the GCS did not answer)
    start_s: float | None = None              # unix time the epoch's window started (it ends
                                              # time_s later: the window of held_gpu_seconds)

    def flat(self) -> dict[str, float | int | str | None]:
        """One flat row: scalar fields + ``val_<name>`` per validation metric (CSV, Result)."""
        row: dict = {"epoch": self.epoch, "train_loss": self.train_loss}
        row.update({f"train_{k}": v for k, v in self.train_metrics.items() if k != "loss"})
        row.update({f"val_{k}": v for k, v in self.val_metrics.items()})
        if "val_accuracy" not in row:
            row["val_accuracy"] = self.val_accuracy
        traj = self.trajectory or [0]
        row.update({"lr": self.lr, "global_batch_min": min(traj), "global_batch_max": max(traj),
                    "num_gpus": len(self.gpu_types), "samples": self.samples,
                    "throughput": self.throughput, "time_s": self.time_s,
                    "gpu_seconds": self.gpu_seconds, "held_gpu_seconds": self.held_gpu_seconds,
                    "replaced": self.replaced})
        return row


@dataclass
class RunHeld(JsonMixin):
    """GPU-seconds of the GPU nodes held over one run of the driver, from its start to its end
    (:mod:`.cluster_view`, rule 6: the same lifetimes as the epochs' ``held_gpu_seconds``), in
    parts that sum to ``total`` exactly (:func:`.cluster_view.held_parts`). Not counted: the
    nodes launched for the job are held after the run's end until Ray's autoscaler removes them
    (its idle timeout, the cluster's setting); ``launched_gpus_at_end`` of their GPUs were alive then."""

    start_s: float                    # unix time the run started (before profiling)
    end_s: float                      # unix time it ended (actors gone, the request cleared)
    before_first_epoch: float         # start-up: reconciliation, profiling, the first checkpoint
    inside_epochs: float              # the epochs' held_gpu_seconds, summed
    between_epochs: float             # epoch ends' decisions and checkpoints, epochs redone
    after_last_epoch: float           # the final checkpoint and metrics, actors released
    total: float                      # the four parts' sum
    epochs_counted: list[int] = field(default_factory=list)   # the epochs this run ran
    launched_gpus_at_end: int = 0     # GPUs of nodes launched for the job alive at end_s

    @property
    def outside_epochs(self) -> float:
        """GPU-seconds held in the run outside every epoch."""
        return self.before_first_epoch + self.between_epochs + self.after_last_epoch


@dataclass
class MetricsHistory(JsonMixin):
    """Everything ``fit()`` reports; saved as ``metrics.json`` in the run folder."""

    intervals: list[IntervalRecord] = field(default_factory=list)
    epochs: list[EpochRecord] = field(default_factory=list)
    events: list[str] = field(default_factory=list)   # re-placements, failures, resumes
    held: RunHeld | None = None   # GPU-seconds held over the last run of the driver, from its
                                  # start to its end (None: not ended yet, or the GCS did not answer)

    @property
    def final_val_accuracy(self) -> float | None:
        return self.epochs[-1].val_accuracy if self.epochs else None

    @property
    def total_gpu_seconds(self) -> float:
        return sum(e.gpu_seconds for e in self.epochs)

    @property
    def total_held_gpu_seconds(self) -> float:
        """GPU-seconds of the nodes held inside the epochs (epochs without the figure count 0);
        ``held.total`` is the whole run's."""
        return sum(e.held_gpu_seconds or 0.0 for e in self.epochs)

    @property
    def total_time_s(self) -> float:
        return sum(e.time_s for e in self.epochs)

    def truncate(self, epochs: int) -> "MetricsHistory":
        """The history of the first ``epochs`` epochs (what a checkpoint after them holds)."""
        return MetricsHistory(intervals=[r for r in self.intervals if r.epoch < epochs],
                              epochs=[e for e in self.epochs if e.epoch < epochs],
                              events=list(self.events))


@dataclass
class EpochTally:
    """What the intervals of one epoch add up to (the totals of its :class:`EpochRecord`)."""

    iterations: int = 0
    samples: int = 0
    loss_sum: float = 0.0            # sum over intervals of mean loss * iterations
    train_time: float = 0.0
    predicted_time: float = 0.0      # the model's prediction of train_time (interval by interval)
    lr: float | None = None          # LR of the last interval's last iteration
    served_digest: int | None = 0    # sum of the intervals' digests (None once one has none)
    metric_sums: dict[str, float] = field(default_factory=dict)   # step_fn metrics x samples
    metric_counts: dict[str, int] = field(default_factory=dict)

    @property
    def train_metrics(self) -> dict[str, float]:
        """The epoch's step_fn metrics: sum of mean x samples over sum of samples, all intervals."""
        return metric_means(self.metric_sums, self.metric_counts)

    def add(self, rec: IntervalRecord) -> None:
        self.lr = rec.lr
        merge_metric_sums(self.metric_sums, self.metric_counts, rec.train_metric_sums,
                          rec.train_metric_counts)
        self.served_digest = None if self.served_digest is None or rec.served_digest is None \
            else add_digests(self.served_digest, rec.served_digest)
        self.iterations += rec.num_iterations
        self.samples += rec.samples
        self.loss_sum += rec.loss * rec.num_iterations
        self.train_time += rec.time_s
        if rec.predicted_time_s is not None:
            self.predicted_time += rec.predicted_time_s

    @property
    def train_loss(self) -> float:
        """Mean training loss per iteration."""
        return self.loss_sum / max(1, self.iterations)

    @property
    def throughput(self) -> float:
        """Samples per second of training time (0 before any)."""
        return self.samples / self.train_time if self.train_time > 0 else 0.0

    def served_exactly_once(self, dataset_size: int) -> bool | None:
        """Whether the epoch's intervals served every sample of ``range(dataset_size)``
        exactly once, by the actors' own digests (:func:`jabasray.engine.sampler.sample_digest`);
        None when an interval reported no digest."""
        if self.served_digest is None:
            return None
        return self.samples == dataset_size and self.served_digest == range_digest(dataset_size)


def interval_record(replies: Sequence[Any], time_s: float, **fields: Any) -> IntervalRecord:
    """An interval's record from the actors' replies (``IntervalReply``; rank 0's iteration
    count, mean loss, Phi and LR, the samples of all ranks, throughput = samples / ``time_s``)
    and the driver-side wall time ``time_s``; ``fields``: the other fields."""
    done, first = sum(r.samples for r in replies), replies[0]
    digests = [getattr(r, "served_digest", None) for r in replies]
    served = [getattr(r, "served", None) for r in replies]
    msums: dict[str, float] = {}
    mcounts: dict[str, int] = {}
    for r in replies:
        merge_metric_sums(msums, mcounts, getattr(r, "metric_sums", {}), getattr(r, "metric_counts", {}))
    return IntervalRecord(num_iterations=first.num_iterations, loss=first.loss, phi=first.phi,
                          lr=first.lr, time_s=time_s, samples=done,
                          throughput=done / time_s if time_s > 0 else 0.0,
                          served_digest=None if None in digests else add_digests(*digests),
                          served=None if None in served else [i for s in served for i in s],
                          train_metric_sums=msums, train_metric_counts=mcounts, **fields)


def epoch_record(tally: EpochTally, *, epoch: int, allocation: dict[str, int],
                 gpu_types: list[str], trajectory: list[int], forecast: Sequence[float],
                 val_metrics: dict[str, float], replaced: bool, predicted_time_s: float | None,
                 time_s: float, dataset_size: int | None = None,
                 allreduce_fit: dict | None = None, placement_s: float | None = None,
                 eval_s: float = 0.0, held_gpu_seconds: float | None = None,
                 start_s: float | None = None) -> EpochRecord:
    """An epoch's record: its intervals' totals (``tally``), the B_G ``trajectory`` that ran and
    the ``forecast`` made for it, the auto-scaler's estimate ``predicted_time_s``, the wall time
    ``time_s``, GPU-seconds = ``time_s`` x the number of GPUs and, given ``dataset_size``,
    whether the actors served every sample exactly once (:meth:`EpochTally.served_exactly_once`),
    and ``allreduce_fit``, the Eq. 3 fit the plans used (:func:`.allreduce_fit.fit_description`);
    ``placement_s`` and ``eval_s``: the epoch's placement and epoch-end seconds;
    ``held_gpu_seconds``: the GPU-seconds of the nodes held (:meth:`.cluster_view.ClusterView.held_seconds`)
    from unix time ``start_s`` on, for ``time_s``."""
    return EpochRecord(epoch=epoch, allocation=dict(allocation), gpu_types=list(gpu_types),
                       trajectory=trajectory, predicted_trajectory=list(forecast),
                       train_loss=tally.train_loss, val_accuracy=val_metrics.get("accuracy"),
                       time_s=time_s, gpu_seconds=time_s * len(gpu_types), samples=tally.samples,
                       throughput=tally.throughput, replaced=replaced,
                       train_time_s=tally.train_time, predicted_train_time_s=tally.predicted_time,
                       predicted_time_s=predicted_time_s, val_metrics=val_metrics, lr=tally.lr,
                       train_metrics=tally.train_metrics,
                       served_exactly_once=None if dataset_size is None
                       else tally.served_exactly_once(dataset_size),
                       allreduce_fit=dict(allreduce_fit or {}), placement_s=placement_s,
                       eval_s=float(eval_s), held_gpu_seconds=held_gpu_seconds, start_s=start_s)


def decision_record(decision: Any, current: dict[str, int], switch_s: float) -> dict:
    """What the auto-scaler weighed (:class:`jabasray.planners.autoscale.AutoscaleDecision`),
    as plain JSON: the objective, the allocation the job ran, the re-placement charge, every
    candidate (allocation, predicted epoch seconds, seconds charged for moving to it and for
    launching its nodes, Eq. 8
    cost, GPUs, why it is infeasible where it is) and the allocation chosen with its predicted
    epoch time. The next epoch's record holds what then ran (its ``time_s``,
    ``predicted_time_s``), so every prediction sits beside its outcome."""
    return {"objective": decision.objective, "current": dict(current), "switch_s": float(switch_s),
            "chosen": dict(decision.allocation.node_gpus), "predicted_epoch_s": float(decision.epoch_time),
            "candidates": [{"allocation": dict(c.allocation.node_gpus), "num_gpus": c.allocation.num_gpus,
                            "epoch_time_s": c.epoch_time, "switch_s": c.switch_s,
                            "launch_s": c.launch_s, "cost": c.cost,
                            "reason": c.reason} for c in decision.candidates]}


def reduce_metrics(shards: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Combine per-shard means: ``sum_s n_s m_s / sum_s n_s`` for every metric (shards without
    samples are skipped). Exact for any per-sample mean (loss, accuracy, top-k)."""
    total = sum(n for _, n in shards if n > 0)
    if total == 0:
        return {}
    names = [k for m, n in shards if n > 0 for k in m]
    out = {}
    for k in dict.fromkeys(names):
        missing = [i for i, (m, n) in enumerate(shards) if n > 0 and k not in m]
        if missing:
            raise ValueError(f"eval_fn must return the same metric names on every shard; "
                             f"{k!r} is missing on shard(s) {missing}")
        out[k] = sum(m[k] * n for m, n in shards if n > 0) / total
    return out


def epoch_line(record: EpochRecord) -> str:
    """The one line printed per epoch: B_G range, allocation, throughput, every metric, and the
    iteration-time model's error on the epoch's training time."""
    alloc = ",".join(f"{k}:{v}" for k, v in record.allocation.items())
    traj = record.trajectory or [0]
    short = {"accuracy": "acc"}
    metrics = [f"train loss {record.train_loss:.4f}"]
    metrics += [f"train {short.get(k, k)} {v:.4f}" for k, v in record.train_metrics.items() if k != "loss"]
    metrics += [f"val {short.get(k, k)} {v:.4f}" for k, v in record.val_metrics.items()]
    if not record.val_metrics and record.val_accuracy is not None:
        metrics.append(f"val acc {record.val_accuracy:.4f}")
    if record.lr is not None:
        metrics.append(f"lr {record.lr:.4g}")
    line = (f"epoch {record.epoch + 1}: B_G {min(traj)}-{max(traj)}, allocation {alloc} "
            f"({len(record.gpu_types)} GPUs), {record.throughput:.0f} samples/s, "
            f"{', '.join(metrics)}, {record.time_s:.1f}s")
    if record.held_gpu_seconds is not None:
        line += f", {record.held_gpu_seconds / 3600:.3g} GPU-h held"
    if record.prediction_error is not None:
        line += (f", train {record.train_time_s:.1f}s vs predicted "
                 f"{record.predicted_train_time_s:.1f}s (error {100 * record.prediction_error:+.0f}%)")
    return line


def held_line(held: RunHeld) -> str:
    """The line printed when a run ends: the GPU-hours held over the run and the part outside
    the epochs, part by part, and the GPUs launched for the job still held at its end."""
    line = (f"GPU-hours held: {held.total / 3600:.3g} GPU-h in all, {held.outside_epochs / 3600:.3g} "
            f"outside the epochs (before the first {held.before_first_epoch / 3600:.3g}, between "
            f"{held.between_epochs / 3600:.3g}, after the last {held.after_last_epoch / 3600:.3g})")
    if held.launched_gpus_at_end:
        line += (f"; {held.launched_gpus_at_end} GPUs launched for the job are held on until Ray's "
                 f"autoscaler removes them (its idle timeout), not counted")
    return line


def metrics_csv(history: MetricsHistory) -> str:
    """One row per epoch (:meth:`EpochRecord.flat`), columns = union in first-seen order."""
    rows = [e.flat() for e in history.epochs]
    cols = list(dict.fromkeys(k for r in rows for k in r)) or ["epoch"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    return buf.getvalue()


def save_metrics(history: MetricsHistory, path: "str | Path | StoragePath") -> "StoragePath":
    """``metrics.json`` at ``path`` (a local path, URI or :class:`~jabasray.storage.StoragePath`)
    and ``metrics.csv`` next to it, each replaced atomically."""
    path = as_storage_path(path)
    (path.parent / (path.name.rsplit(".", 1)[0] + ".csv")).write_text(metrics_csv(history))
    return path.write_text(history.to_json(indent=1))


def plot_history(history: MetricsHistory, path: "str | Path | StoragePath") -> "StoragePath":
    """Write a PNG with (top) the B_G per interval - requested by the adaptive rule, run (the
    plan's B_G*, Alg. 1 rounding) and forecast before the epoch - epoch boundaries dotted,
    (middle) the allocation per epoch as GPUs per type, stacked, and (bottom) every numeric
    per-epoch metric (train loss, validation metrics)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = as_storage_path(path)
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 9.5),
                                        gridspec_kw={"height_ratios": [3, 2, 2.5]})
    x0 = 0
    labelled = set()
    for e in history.epochs:
        n = len(e.trajectory)
        xs = list(range(x0, x0 + n + 1))              # one more point closes the last step
        ax1.step(xs, list(e.trajectory) + e.trajectory[-1:], where="post", color="C0",
                 label=None if "a" in labelled else "B_G requested (adaptive rule)")
        labelled.add("a")
        ran = [r.global_batch for r in history.intervals if r.epoch == e.epoch]
        if len(ran) == n and ran != list(e.trajectory):
            ax1.step(xs, ran + ran[-1:], where="post", color="C2", lw=0.8,
                     label=None if "r" in labelled else "B_G run (plan's B_G*)")
            labelled.add("r")
        if e.predicted_trajectory:
            m = len(e.predicted_trajectory)
            ax1.plot(list(range(x0, x0 + m)), e.predicted_trajectory, "--", color="C1",
                     label=None if "f" in labelled else "B_G (forecast)")
            labelled.add("f")
        ax1.axvline(x0 - 0.5, color="grey", lw=0.5, ls=":")
        x0 += n
    ax1.set_xlabel("adaptation interval (p iterations)")
    ax1.set_ylabel("global batch size")
    ax1.set_title("Global batch size per adaptation interval")
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
    rows = [e.flat() for e in history.epochs]
    names = ["train_loss"] + list(dict.fromkeys(k for r in rows for k in r if k.startswith("val_")))
    for i, k in enumerate(names):
        pts = [(r["epoch"], r[k]) for r in rows if isinstance(r.get(k), (int, float))
               and not isinstance(r.get(k), bool) and math.isfinite(r[k])]
        if pts:
            ax3.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=k, color=f"C{i}")
    ax3.set_xlabel("epoch")
    ax3.set_title("Metrics per epoch")
    if ax3.lines:
        ax3.legend(loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=90, format="png")
    plt.close(fig)
    return path.write_bytes(buf.getvalue())
