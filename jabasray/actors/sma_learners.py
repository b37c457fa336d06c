"""Crossbow learner counts per rank for the driver (SMA mode, Crossbow section 3.4 / Alg. 2).

``JobConfig.sync == "sma"``: the driver keeps one
:class:`~jabasray.planners.learner_tuner.LearnerTuner` with one entry per adaptive-batching
*pair* (``"pair<p>"``): both GPUs of a pair always run the same learner count, so the two
similarity groups of JABAS's rule stay symmetric (the reasoning is in
:mod:`jabasray.planners.learner_tuner`); different pairs are tuned independently, as the paper
tunes every GPU (heterogeneous pairs peak at different counts). The plan still gives B_L and
n_GA per pair, but the number of learners of each rank (its ``num_vsw``) is the tuner's: it
starts at ``JobConfig.sma_learners`` (Alg. 2 line 1 starts at 1; ``sma_learners=1`` is exactly
that), and after every interval each rank's throughput t = samples / wall_time of its reply
(wall time INCLUDING the emulation sleep, so an emulated slower GPU measures slower) is fed to
the tuner - a pair's t is the sum of its two GPUs' - whose answer is the pair's learner count
for the next interval. Every interval's layout (and so the sampler's partition, exactly-once
per epoch) is built from these per-rank counts: ``layout[r] = m_r * (n_GA + 1)``,
B_G* = B_L * sum(layout); ``configure`` is called on ALL actors whenever any count changes (it
is collective: k, the total learner count, is summed). The LR rule (``JobConfig.lr_scaling``)
follows the plan's B_G* (what adaptive batching chose), not the tuned learner count: Crossbow
does not rescale the LR with the number of learners (each learner steps its own replica), and
under ``JobConfig.sma_restart="batch"`` a change of the LR's batch factor restarts SMA, which
would then happen at every probe.
Intervals that reach the epoch end are not fed to the tuner (their last iteration is ragged and
would look slower). The counts and the tuner's state are checkpointed with every rank's SMA
state (:mod:`.sma_state`): a resume or a re-placement onto the same GPUs continues them; a
placement onto other GPUs starts again at ``sma_learners`` with a fresh tuner.
``DriverOptions.sma_autotune=False`` keeps ``sma_learners`` fixed. Every interval's
``IntervalRecord.learners`` / ``layout`` record the counts it ran.

Placement (:func:`placement_learners`): every rank gets its own SMA state back
(:func:`.sma_state.restore_sma`), not rank 0's as in IIDP mode, and the counts and tuner continue
from it; a checkpoint packs every rank's state with the counts and the tuner
(:meth:`RankLearners.pack`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from ..planners.learner_tuner import GPULearnerState, LearnerTuner
from .sma_state import SMARestore, pack_sma, restore_sma

log = logging.getLogger(__name__)


def tuner_key(rank: int) -> str:
    """A rank's key in the throughputs handed to the tuner (one GPU)."""
    return f"rank{rank}"


def pair_key(pair: int) -> str:
    """The learner tuner's key of an adaptive-batching pair (one tuned unit)."""
    return f"pair{pair}"


class RankLearners:
    """Learner count of every rank of the current placement, and their tuner (None: fixed).

    ``pair_of_rank[r]`` is rank r's pair (``Slot.pair``); ``counts``/``tuner_json`` continue a
    checkpointed state (:mod:`.sma_state`), else every rank starts at ``start``.
    """

    def __init__(self, pair_of_rank: Sequence[int], start: int, autotune: bool, tau: float,
                 max_learners: int, relative: bool, counts: Sequence[int] | None = None,
                 tuner_json: str = "") -> None:
        self.counts = [int(m) for m in counts] if counts is not None else [start] * len(pair_of_rank)
        if len(self.counts) != len(pair_of_rank):
            raise ValueError(f"counts must have one entry per rank ({len(pair_of_rank)}), "
                             f"got {len(self.counts)}")
        self.pairs: dict[str, list[str]] = {}
        for r, p in enumerate(pair_of_rank):
            self.pairs.setdefault(pair_key(p), []).append(tuner_key(r))
        self.tuner: LearnerTuner | None = None
        if autotune and tuner_json:
            self.tuner = LearnerTuner.from_json(tuner_json)
        elif autotune:
            self.tuner = LearnerTuner(tau=tau, max_learners=max_learners, relative=relative,
                                      gpus={k: GPULearnerState(learners=start) for k in self.pairs})

    def tuner_json(self) -> str:
        """The tuner's state for a checkpoint ("" without a tuner)."""
        return self.tuner.to_json() if self.tuner is not None else ""

    def pack(self, rank_states: Sequence[dict], gpu_types: Sequence[str]) -> dict[str, Any]:
        """The checkpoint's worker state: every rank's state with the counts and the tuner
        (:func:`.sma_state.pack_sma`)."""
        return pack_sma(rank_states, self.counts, gpu_types, self.tuner_json())

    def observe(self, replies: Sequence[Any], used: Sequence[int],
                throughput: Callable[[int, int, Any], float]) -> None:
        """Feed each rank's throughput to the tuner, one decision per pair (both GPUs of a pair
        get its count); the answers are the next interval's counts."""
        if self.tuner is None:
            return
        ts = {tuner_key(r): float(throughput(r, used[r], reply)) for r, reply in enumerate(replies)}
        nxt = self.tuner.observe_pairs(ts, self.pairs)
        for r in range(len(replies)):
            m = nxt[tuner_key(r)]
            if m != used[r]:
                log.info("SMA learner tuner: rank %d %d -> %d learners (%.1f samples/s)", r,
                         used[r], m, ts[tuner_key(r)])
            self.counts[r] = m


def placement_learners(job: Any, options: Any, slots: Sequence[Any], worker_state: dict | None
                       ) -> tuple[SMARestore | None, RankLearners | None]:
    """What a placement onto ``slots`` (:class:`.placement.Slot`, rank order) loads in SMA mode:
    one state per rank from the checkpointed ``worker_state`` (None: fresh actors, nothing to
    load) and the learner counts and tuner it continues with (``options``: DriverOptions'
    ``sma_*``). ``(None, None)`` unless ``job.sync == "sma"``."""
    if job.sync != "sma":
        return None, None
    sma = None if worker_state is None else \
        restore_sma(worker_state, [s.gpu_type for s in slots], job.sma_learners)
    return sma, RankLearners([s.pair for s in slots], job.sma_learners, options.sma_autotune,
                             options.sma_tuner_tau, options.sma_max_learners,
                             options.sma_tuner_relative,
                             counts=sma.learners if sma is not None else None,
                             tuner_json=sma.tuner_json if sma is not None else "")


__all__ = ["RankLearners", "pair_key", "placement_learners", "tuner_key"]
