"""Recovery and resume of a run: where the driver restarts after a GPU actor died, what it tells
the user, and whether a checkpointed run may be resumed with this job.

Fault model (the project's; the JABAS paper has none): a GPU actor that dies surfaces from the
fan-out as :class:`.fanout.ActorFailure` naming the dead ranks. The driver then releases every
actor and :func:`restart_point` gives it

1. the newest checkpoint that verifies (corrupt newer ones are skipped, one line each; every
   epoch writes one, and a fresh start writes one before any actor starts, so the failed epoch's
   start is always there),
2. its driver state on the cluster left: one pair dropped per dead pair (:func:`.placement.drop_pair`),
   then every GPU of a Ray node that is gone (:func:`.placement.drop_dead_nodes`).

The driver re-chooses the allocation on that cluster and redoes the epoch: no completed epoch
is lost. When no checkpoint or no pair is left, :class:`JobFailed` says what happened in one line
(:func:`describe_failure`) and how to continue (:func:`resume_hint`).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from ..errors import JobFailed
from .checkpoint import Checkpoint, DriverState, latest_checkpoint
from .fanout import ActorFailure
from .placement import Slot, alive_ray_nodes, drop_dead_nodes, drop_pair


def dead_slots(slots: Sequence[Slot], failure: ActorFailure) -> list[Slot]:
    """The slots of ``failure``'s dead ranks among the placed ``slots`` (rank order)."""
    return [slots[r] for r in failure.dead_ranks if 0 <= r < len(slots)]


def describe_failure(failure: ActorFailure, dropped: Sequence[Slot]) -> str:
    """``GPU actor failure: rank 1 (fast on f0) (ActorDiedError)`` for ``failure``'s dead ranks
    (``dropped``: their slots, see :func:`dead_slots`; empty: the rank numbers only)."""
    what = ", ".join(f"rank {s.rank} ({s.gpu_type} on {s.node})" for s in dropped) or \
        f"ranks {failure.dead_ranks}"
    return f"GPU actor failure: {what} ({type(failure.cause).__name__})"


def resume_hint(run_dir: str | Path) -> str:
    """Where the run can be continued from: its newest intact checkpoint, or that there is none."""
    cp = latest_checkpoint(run_dir)
    if cp is None:
        return f"no intact checkpoint in {run_dir}"
    return (f"last checkpoint {cp.path} ({cp.epochs_done} epoch(s) done; continue with "
            f"`jabasray train --resume` or fit() on the same run folder)")


def give_up(failure: ActorFailure, slots: Sequence[Slot], restarts: int, max_restarts: int,
            run_dir: str | Path) -> JobFailed:
    """The one-line error once ``restarts`` exceeds ``max_restarts`` (``slots``: still placed)."""
    return JobFailed(f"giving up after {restarts} GPU actor failures (max_restarts={max_restarts}); "
                     f"the last: {describe_failure(failure, dead_slots(slots, failure))}; "
                     f"{resume_hint(run_dir)}")


def latest_intact_checkpoint(run_dir: str | Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies, and one line per corrupt newer one (the caller
    reports them as events once the checkpoint's metrics history is in place)."""
    skipped: list[str] = []
    return latest_checkpoint(run_dir, skipped), skipped


def restart_point(run_dir: str | Path, failure: ActorFailure, dropped: Sequence[Slot],
                  alive_nodes: set[str] | None = None
                  ) -> tuple[Checkpoint, DriverState, list[str]]:
    """(checkpoint, its driver state on the cluster left, skipped-checkpoint lines) after
    ``failure`` killed the actors of ``dropped`` (module notes). ``alive_nodes``: the live Ray
    node ids (None: asked from Ray). Raises :class:`JobFailed` (one line) when no intact
    checkpoint or no GPU pair is left."""
    what = describe_failure(failure, dropped)
    cp, skipped = latest_intact_checkpoint(run_dir)
    if cp is None:
        raise JobFailed(f"{what}; no intact checkpoint in {run_dir} to restart from") from failure.cause
    state = cp.load_driver_state()
    cluster = state.cluster
    for node in dict.fromkeys((s.node, s.pair) for s in dropped):   # one pair per dead pair
        cluster = drop_pair(cluster, node[0])
        if cluster is None:
            raise JobFailed(f"{what}: no GPU pair left; {resume_hint(run_dir)}") from failure.cause
    cluster = drop_dead_nodes(cluster, alive_ray_nodes() if alive_nodes is None else alive_nodes)
    if cluster is None:   # a lost Ray node: all its GPUs
        raise JobFailed(f"{what}: no GPU pair left on the live Ray nodes; "
                        f"{resume_hint(run_dir)}") from failure.cause
    return cp, replace(state, cluster=cluster), skipped


def check_resumable(state: DriverState, job_config: dict[str, Any]) -> None:
    """Everything but ``epochs`` of ``job_config`` (``JobConfig.to_dict()``) must match the
    checkpointed job (else results would mix): ValueError naming the fields that differ."""
    old, new = dict(state.job_config), dict(job_config)
    old.pop("epochs", None)
    new.pop("epochs", None)
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if diff:
        raise ValueError(f"job_config differs from the checkpointed run in {diff}; "
                         f"use another run name or the same configuration to resume")


__all__ = ["dead_slots", "describe_failure", "resume_hint", "give_up", "latest_intact_checkpoint",
           "restart_point", "check_resumable"]
