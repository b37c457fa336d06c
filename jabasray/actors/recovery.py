"""Recovery and resume of a run: where the driver starts (a fresh start or the run's newest
checkpoint, :func:`restore_or_start`), where it restarts after a GPU actor died, what it tells
the user, and whether a checkpointed run may be resumed with this job.

Start (:func:`restore_or_start`): a run folder with an intact checkpoint is resumed from the
newest one (its job must match, :func:`check_resumable`; the adaptive controller, metrics
history and worker state continue from it); otherwise the run starts afresh with the
allocation the driver chooses for the initial phase, and the driver checkpoints that start at
once (worker state None: the actors build the model from ``model_fn`` with the job's seed), so a
GPU actor lost during start-up, placement or the first epoch is recovered like a later loss.

Fault model (the project's; the JABAS paper has none): a GPU actor that dies surfaces from the
fan-out as :class:`.fanout.ActorFailure` naming the dead ranks. The driver then releases every
actor and :func:`restart_point` gives it

1. the newest checkpoint that verifies (corrupt newer ones are skipped, one line each; every
   epoch writes one, and a fresh start writes one before any actor starts, so the failed epoch's
   start is always there),
2. its driver state on the cluster left (:func:`failed_gpus`, the failure policy of
   :class:`jabasray.config.FailureConfig`): every GPU of a Ray node that is gone
   (:func:`.placement.drop_dead_nodes`); a single dead actor on a live node costs its GPU
   (:func:`.placement.drop_gpus`, one GPU: any GPU count runs, so its partner stays in use) once
   that GPU has failed ``drop_gpu_after`` times; several actors dead at once on live nodes (a
   collective abort such as an NCCL watchdog's, which kills many ranks for one fault) drop
   nothing: the epoch is retried on the same GPUs.

The driver re-chooses the allocation on that cluster (:func:`restart`) and redoes the epoch:
no completed epoch is lost. When the run also holds a mid-epoch checkpoint of that epoch
(``CheckpointConfig.interval_minutes``), it is newer and the epoch continues from it
(:func:`adopt_mid_epoch`, as a resume does): a fault loses at most the intervals since then. When no checkpoint or no GPU is left, :class:`JobFailed` says what happened in one line
(:func:`describe_failure`) and how to continue (:func:`resume_hint`).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import FailureConfig
from ..errors import JobFailed
from ..types import ClusterSpec
from .checkpoint import Checkpoint, DriverState, latest_checkpoint, mid_epoch_checkpoint
from .fanout import ActorFailure
from .placement import Slot, alive_ray_nodes, drop_dead_nodes, drop_gpus


def dead_slots(slots: Sequence[Slot], failure: ActorFailure) -> list[Slot]:
    """The slots of ``failure``'s dead ranks among the placed ``slots`` (rank order)."""
    return [slots[r] for r in failure.dead_ranks if 0 <= r < len(slots)]


def describe_failure(failure: ActorFailure, dropped: Sequence[Slot]) -> str:
    """``GPU actor failure: rank 1 (fast on f0) (ActorDiedError)`` for ``failure``'s dead ranks
    (``dropped``: their slots, see :func:`dead_slots`; empty: the rank numbers only)."""
    what = ", ".join(f"rank {s.rank} ({s.gpu_type} on {s.node})" for s in dropped) or \
        f"ranks {failure.dead_ranks}"
    if not failure.dead_ranks and getattr(failure, "failed_ranks", None):   # hung / no rendezvous
        return f"GPU actor failure: {failure.cause} ({type(failure.cause).__name__})"
    return f"GPU actor failure: {what} ({type(failure.cause).__name__})"


def resume_hint(run_dir: str | Path) -> str:
    """Where the run can be continued from: its newest intact checkpoint, or that there is none."""
    cp = latest_checkpoint(run_dir)
    if cp is None:
        return f"no intact checkpoint in {run_dir}"
    return (f"last checkpoint {cp.path} ({cp.epochs_done} epoch(s) done; continue with "
            f"`jabasray train --resume` or fit() on the same run folder)")


def give_up(failure: ActorFailure, slots: Sequence[Slot], restarts: int, max_failures: int,
            run_dir: str | Path) -> JobFailed:
    """The one-line error once ``restarts`` exceeds ``max_failures`` (``slots``: still placed)."""
    return JobFailed(f"giving up after {restarts} GPU actor failures (max_failures={max_failures}); "
                     f"the last: {describe_failure(failure, dead_slots(slots, failure))}; "
                     f"{resume_hint(run_dir)}")


def latest_intact_checkpoint(run_dir: str | Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies, and one line per corrupt newer one (the caller
    reports them as events once the checkpoint's metrics history is in place)."""
    skipped: list[str] = []
    return latest_checkpoint(run_dir, skipped), skipped


def gpu_key(slot: Slot) -> str:
    """A GPU's identity across placements: ``<node>/<index on the node>``."""
    return f"{slot.node}/{2 * slot.local_pair + max(slot.group, 0)}"


def failed_gpus(dead: Sequence[Slot], alive_nodes: set[str], strikes: dict[str, int],
                policy: FailureConfig) -> tuple[list[Slot], str]:
    """Which of the ``dead`` actors' GPUs the run leaves out (module notes, step 2), and why in
    a few words. ``strikes`` (GPU key -> failures so far, updated in place) counts the single
    failures of GPUs on live nodes. Actors on a node that left the cluster are not returned:
    :func:`.placement.drop_dead_nodes` removes their whole node."""
    if not dead:   # hung or unable to join (alive, no rank dead): nothing to drop
        return [], "retrying on the same GPUs"
    live = [s for s in dead if s.ray_node_id is None or s.ray_node_id in alive_nodes]
    gone = len(dead) - len(live)
    if len(live) > 1:
        return [], (f"{len(live)} ranks failed at once on live nodes (a collective abort): "
                    f"retrying on the same GPUs")
    if not live:
        return [], f"{gone} rank(s) on a node that left the cluster: dropping that node"
    key = gpu_key(live[0])
    strikes[key] = strikes.get(key, 0) + 1
    if policy.drop_gpu_after != -1 and strikes[key] >= policy.drop_gpu_after:
        return live, "without that GPU"
    limit = "no limit" if policy.drop_gpu_after == -1 else f"dropped after {policy.drop_gpu_after}"
    return [], f"GPU {key} kept (failure {strikes[key]}; {limit})"


def restart_point(run_dir: str | Path, failure: ActorFailure, dropped: Sequence[Slot],
                  alive_nodes: set[str] | None = None, policy: FailureConfig | None = None,
                  strikes: dict[str, int] | None = None
                  ) -> tuple[Checkpoint, DriverState, list[str]]:
    """(checkpoint, its driver state on the cluster left, skipped-checkpoint lines) after
    ``failure`` killed the actors of ``dropped`` (module notes). ``alive_nodes``: the live Ray
    node ids (None: asked from Ray); ``policy``/``strikes``: see :func:`failed_gpus` (None: the
    default policy, fresh counts). Raises :class:`JobFailed` (one line) when no intact
    checkpoint or no GPU is left."""
    what = describe_failure(failure, dropped)
    cp, skipped = latest_intact_checkpoint(run_dir)
    if cp is None:
        raise JobFailed(f"{what}; no intact checkpoint in {run_dir} to restart from") from failure.cause
    state = cp.load_driver_state()
    cluster = state.cluster
    alive_nodes = alive_ray_nodes() if alive_nodes is None else alive_nodes
    lost, _ = failed_gpus(dropped, alive_nodes, {} if strikes is None else strikes,
                          policy or FailureConfig())
    for s in lost:   # one GPU per failed actor the policy drops
        cluster = drop_gpus(cluster, s.node)
        if cluster is None:
            raise JobFailed(f"{what}: no GPU left; {resume_hint(run_dir)}") from failure.cause
    cluster = drop_dead_nodes(cluster, alive_nodes)
    if cluster is None:   # a lost Ray node: all its GPUs
        raise JobFailed(f"{what}: no GPU left on the live Ray nodes; "
                        f"{resume_hint(run_dir)}") from failure.cause
    return cp, replace(state, cluster=cluster), skipped


def restart(run_dir: str | Path, failure: ActorFailure, dropped: Sequence[Slot], ctl: Any,
            choose_allocation: Callable[[ClusterSpec, Sequence[float] | None], dict[str, int]],
            alive_nodes: set[str] | None = None, policy: FailureConfig | None = None,
            strikes: dict[str, int] | None = None) -> tuple[Checkpoint, DriverState, list[str]]:
    """(checkpoint, driver state, events) the driver continues from after ``failure``:
    :func:`restart_point`, with ``ctl`` (the adaptive controller) restored from it and the
    allocation re-chosen on the cluster left (``choose_allocation(cluster, forecast or None)``);
    the events: the skipped-checkpoint lines, then what happened and where it restarts."""
    alive_nodes = alive_ray_nodes() if alive_nodes is None else alive_nodes
    strikes = {} if strikes is None else strikes
    _, why = failed_gpus(dropped, alive_nodes, dict(strikes), policy or FailureConfig())
    cp, state, events = restart_point(run_dir, failure, dropped, alive_nodes, policy, strikes)
    ctl.load_state_dict(state.adaptive)
    try:
        allocation = choose_allocation(state.cluster, state.forecast or None)
    except ValueError as e:   # e.g. SMA with no GPU pair left
        raise JobFailed(f"{describe_failure(failure, dropped)}: {e}; {resume_hint(run_dir)}") from failure.cause
    state = replace(state, allocation=allocation)
    events.append(f"{describe_failure(failure, dropped)}; restarting epoch {state.epochs_done + 1} "
                  f"from {cp.path.name} {why}, allocation {state.allocation}")
    return cp, state, events


def adopt_mid_epoch(run_dir: str | Path, cp: Checkpoint | None, state: DriverState, ctl: Any
                    ) -> tuple[Checkpoint | None, DriverState, str | None]:
    """Continue within the epoch when the run's mid-epoch slot (``CheckpointConfig.
    interval_minutes``, :func:`.checkpoint.mid_epoch_checkpoint`) holds a checkpoint taken
    inside the epoch that follows ``cp`` (the epoch-boundary checkpoint a resume or a restart
    after an actor failure starts from): it is newer, so the epoch goes on from its cursor
    instead of being redone. Returns (the checkpoint to load the worker state from, ``state``
    with the mid-epoch checkpoint's iteration count, adaptive controller - ``ctl`` is restored
    from it -, metrics history, epoch position and all-reduce fits measured by then, the event
    line); unchanged with None for
    the event when there is no such checkpoint. ``state``'s cluster and allocation are kept
    (a restart re-chose them on the GPUs left); the worker state of either checkpoint loads
    onto any allocation (IIDP: rank 0's; SMA: every rank's, redistributed)."""
    mid = mid_epoch_checkpoint(run_dir, state.epochs_done) if cp is not None else None
    if mid is None:
        return cp, state, None
    mid_state = mid.load_driver_state()
    state = replace(state, iteration=mid_state.iteration, adaptive=mid_state.adaptive,
                    metrics=mid_state.metrics, mid_epoch=mid_state.mid_epoch,
                    allreduce_fits={**state.allreduce_fits, **mid_state.allreduce_fits})
    ctl.load_state_dict(state.adaptive)
    return mid, state, (f"resumed within epoch {state.epochs_done + 1} at sample "
                        f"{state.mid_epoch['cursor']} from {mid.path}")


def restore_or_start(run_dir: str | Path, job: Any, cluster: ClusterSpec, ctl: Any,
                     choose_allocation: Callable[[ClusterSpec, None], dict[str, int]],
                     force: bool = False) -> tuple[Checkpoint | None, DriverState, list[str]]:
    """(checkpoint, driver state, events) a run starts from (module notes). Resume: the newest
    intact checkpoint and its state, checked against ``job`` (:func:`check_resumable`), with
    ``ctl`` (the adaptive controller) restored from it; the events: the skipped-checkpoint lines
    and where it resumed. Fresh start: checkpoint None and epoch 0's state on ``cluster`` with
    ``choose_allocation(cluster, None)`` (the initial phase) and ``ctl``'s state; the events:
    the skipped-checkpoint lines."""
    cp, events = latest_intact_checkpoint(run_dir)
    if cp is None:
        state = DriverState(epochs_done=0, iteration=0, cluster=cluster,
                            allocation=choose_allocation(cluster, None), adaptive=ctl.state_dict(),
                            job_config=job.to_dict())
        return None, state, events
    state = cp.load_driver_state()
    if force:   # RunConfig(resume="force"): the run continues as this job
        state = replace(state, job_config=job.to_dict())
    check_resumable(state, job.to_dict())
    ctl.load_state_dict(state.adaptive)
    events.append(f"resumed from {cp.path} after {state.epochs_done} epoch(s)")
    return cp, state, events


def check_resumable(state: DriverState, job_config: dict[str, Any]) -> None:
    """Everything but ``epochs`` of ``job_config`` (``JobConfig.to_dict()``) must match the
    checkpointed job (else results would mix; :func:`jabasray.config.changed_job_fields`):
    ValueError naming the fields that differ."""
    from ..config import changed_job_fields

    diff = changed_job_fields(dict(state.job_config), dict(job_config))
    if diff:
        raise ValueError(f"job_config differs from the checkpointed run in {diff}; "
                         f"use another run name or the same configuration to resume")


__all__ = ["adopt_mid_epoch", "gpu_key", "failed_gpus", "dead_slots", "describe_failure", "resume_hint", "give_up", "latest_intact_checkpoint",
           "restart_point", "restart", "restore_or_start", "check_resumable"]
