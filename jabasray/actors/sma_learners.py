"""Crossbow learner counts per rank for the driver (SMA mode, Crossbow section 3.4 / Alg. 2).

``JobConfig.sync == "sma"``: the driver keeps one
:class:`~jabasray.planners.learner_tuner.LearnerTuner` with one entry per rank (``"rank<r>"``:
per GPU, as the paper tunes every GPU independently; per GPU *type* would force one count on
GPUs that are straggling differently). The plan still gives B_L and n_GA per pair, but the
number of learners of each rank (its ``num_vsw``) is the tuner's: it starts at
``JobConfig.sma_learners`` (Alg. 2 line 1 starts at 1; ``sma_learners=1`` is exactly that),
and after every interval each rank's throughput t = samples / wall_time of its reply (wall time
INCLUDING the emulation sleep, so an emulated slower GPU measures slower) is fed to the tuner,
whose answer is that rank's learner count for the next interval. Every interval's layout (and
so the sampler's partition, exactly-once per epoch) is built from these per-rank counts:
``layout[r] = m_r * (n_GA + 1)``, B_G* = B_L * sum(layout); ``configure`` is called on ALL
actors whenever any count changes (it is collective: k, the total learner count, is summed).
The LR rule (``JobConfig.lr_scaling``) follows the plan's B_G* (what adaptive batching chose),
not the tuned learner count: Crossbow does not rescale the LR with the number of learners (each
learner steps its own replica), and an LR change restarts SMA (section 3.2), which would happen
at every probe otherwise. Intervals that reach the epoch end are not fed to the tuner (their
last iteration is ragged and would look slower). The tuner restarts probing after every
(re-)placement (new ranks/GPUs); it is not checkpointed, so a resumed run probes again.
``DriverOptions.sma_autotune=False`` keeps ``sma_learners`` fixed.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from ..planners.learner_tuner import GPULearnerState, LearnerTuner

log = logging.getLogger(__name__)


def tuner_key(rank: int) -> str:
    """The learner tuner's key of a rank (one tuned GPU)."""
    return f"rank{rank}"


class RankLearners:
    """Learner count of every rank of the current placement, and their tuner (None: fixed)."""

    def __init__(self, world_size: int, start: int, autotune: bool, tau: float, max_learners: int,
                 relative: bool) -> None:
        self.counts = [start] * world_size
        self.tuner: LearnerTuner | None = None
        if autotune:
            self.tuner = LearnerTuner(tau=tau, max_learners=max_learners, relative=relative,
                                      gpus={tuner_key(r): GPULearnerState(learners=start)
                                            for r in range(world_size)})

    def observe(self, replies: Sequence[Any], used: Sequence[int],
                throughput: Callable[[int, int, Any], float]) -> None:
        """Feed each rank's throughput to the tuner; its answers are the next interval's counts."""
        if self.tuner is None:
            return
        for r, reply in enumerate(replies):
            t = float(throughput(r, used[r], reply))
            m = self.tuner.observe(tuner_key(r), t)
            if m != used[r]:
                log.info("SMA learner tuner: rank %d %d -> %d learners (%.1f samples/s)", r, used[r], m, t)
            elif self.tuner.is_settled(tuner_key(r)):
                log.debug("SMA learner tuner: rank %d settled at %d learners", r, m)
            self.counts[r] = m


__all__ = ["RankLearners", "tuner_key"]
