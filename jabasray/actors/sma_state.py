"""Per-rank SMA state in a run's checkpoint (Crossbow learners survive re-placement and resume).

In IIDP mode every rank holds the same model and optimizer state, so the driver checkpoints
rank 0's worker state and loads it into every rank. In SMA mode each rank holds its own
learners' replicas (and, hierarchical, its own reference model): copying rank 0's state to
every rank would silently turn every rank's learners into rank 0's. So in SMA mode the
checkpoint's (opaque) ``worker_state`` is::

    {"sma_ranks":     [state of rank 0, state of rank 1, ...],   # SMAWorker.state_dict()
     "sma_learners":  [m_0, m_1, ...],                           # learners per rank next
     "sma_gpu_types": ["a", "a", ...],                           # GPU type per rank
     "sma_tuner":     "<LearnerTuner JSON>" or ""}               # Alg. 2 state ("" = none)

:func:`restore_sma` turns it into one state per rank of a (possibly different) placement:

* the same GPU types in the same rank order (e.g. a re-placement onto the same GPUs, or a
  resume): every rank gets its own state back as saved (with the learners it ran), and the
  counts for the next interval (``sma_learners``, the tuner's latest decision, applied by the
  driver's next ``configure`` exactly as without the stop) and the tuner's state are kept -
  the run continues as if it had not stopped;
* anything else: every rank starts at ``JobConfig.sma_learners`` learners with a fresh tuner
  (the old counts were tuned for other GPUs), and the learners are mapped by identity with
  :func:`jabasray.engine.sma.redistribute_sma_states` (a learner keeps its global position, so
  its place in the micro-batch order; new learners and reference models start from z).

A checkpoint of the older single-state form (one ``SMAWorker.state_dict()``, rank 0's) is
read as a one-rank placement, so its learners go to rank 0 and the other ranks start from z
rather than all becoming copies of rank 0's learners.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

log = logging.getLogger(__name__)

KEYS = ("sma_ranks", "sma_learners", "sma_gpu_types", "sma_tuner")


@dataclass
class SMARestore:
    """What a placement loads: one worker state per rank, the learner counts, the tuner."""

    states: list[dict]          # SMAWorker.load_state_dict input of each rank
    learners: list[int]         # learners per rank for the next interval
    tuner_json: str             # LearnerTuner JSON to continue with ("" = start a fresh tuner)


def pack_sma(rank_states: Sequence[dict], learners: Sequence[int], gpu_types: Sequence[str],
             tuner_json: str = "") -> dict[str, Any]:
    """The checkpoint's ``worker_state`` in SMA mode (module docstring); states in rank order."""
    if not rank_states or len(rank_states) != len(learners) or len(learners) != len(gpu_types):
        raise ValueError(f"rank_states, learners and gpu_types must have one entry per rank, got "
                         f"{len(rank_states)}, {len(learners)} and {len(gpu_types)}")
    return {"sma_ranks": list(rank_states), "sma_learners": [int(m) for m in learners],
            "sma_gpu_types": [str(t) for t in gpu_types], "sma_tuner": str(tuner_json or "")}


def is_packed_sma(worker_state: Any) -> bool:
    return isinstance(worker_state, dict) and "sma_ranks" in worker_state


def restore_sma(worker_state: dict, gpu_types: Sequence[str], default_learners: int) -> SMARestore:
    """One state per rank of a placement with ``gpu_types`` (rank order); module docstring."""
    from ..engine.sma import redistribute_sma_states

    if is_packed_sma(worker_state):
        states = list(worker_state["sma_ranks"])
        same = list(worker_state["sma_gpu_types"]) == list(gpu_types)
        if same:
            return SMARestore(states, [int(m) for m in worker_state["sma_learners"]],
                              str(worker_state.get("sma_tuner") or ""))
        log.info("SMA state of %d ranks (%s) mapped onto %d ranks (%s) by learner identity",
                 len(states), worker_state["sma_gpu_types"], len(gpu_types), list(gpu_types))
    else:
        states = [worker_state]        # older single-state checkpoint: rank 0's learners
        log.warning("checkpoint holds one SMA worker state (rank 0's); the other ranks' learners "
                    "start from the central model")
    learners = [int(default_learners)] * len(gpu_types)
    return SMARestore(redistribute_sma_states(states, learners), learners, "")
