"""SimiGrad's batch-size rule as JABAS uses it (JABAS section 6.1) and a small controller.

Rule (JABAS 6.1: "If the measured gradient similarity Phi is less (more) than gamma, JABAS
increases (decreases) current B_G by alpha to B'_G. In addition, B'_G must be satisfied with
[min B_G, max B_G]"). "By alpha" is multiplicative, as in SimiGrad's Algorithm 1 ("if Phi < gamma
the target batch size is B = 1.1 B, else B = 0.9 B" for alpha = 0.1, the value JABAS uses,
Table 4):

    Phi < gamma:  B' = B * (1 + alpha)          (grow)
    Phi > gamma:  B' = B * (1 - alpha)          (shrink)
    Phi = gamma:  B' = B                        (no change)
    B'_G = clamp(B', min B_G, max B_G)

Note the asymmetry SimiGrad has: a grow followed by a shrink lands at B (1 + alpha)(1 - alpha)
= B (1 - alpha^2), not at B. We keep it to stay faithful to the rule the paper evaluates.

Rounding (our choice, the papers work in real numbers): B' is rounded half up to an integer,
and a move that is not blocked by the clamp changes B by at least one sample, so that small
batches cannot get stuck (e.g. B = 4, alpha = 0.1: 4.4 would round back to 4). The
configuration solver later rounds B'_G to a multiple of 2 * B_L that the GPUs can run; the
controller then records the value actually applied (:meth:`AdaptiveBatchController.set_global_batch`).
alpha >= 1 is accepted (``JobConfig`` allows it): a shrink then lands on min B_G.

Deviation (documented) in the JABAS driver (:mod:`jabasray.actors.driver`): it keeps the
*requested* B_G (the rule's output) rather than the solver's rounded B_G*, i.e. it does not call
``set_global_batch``. Alg. 1 rounds B_G to a multiple of 2*B_L; with small batches a 10% step is
often rounded back (64 -> 70 -> 64 with B_L=8), which would freeze adaptation. The requested
value accumulates the steps; B_G* (what actually runs, and what the LR follows) is recorded per
interval in the metrics (``IntervalRecord.global_batch`` next to ``requested_global_batch``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from ..config import JobConfig
from ..serialization import JsonMixin
from ..validation import check_float, check_int
from .lr_scaling import scaled_lr

log = logging.getLogger(__name__)


def next_global_batch(current: int, phi: float, gamma: float, alpha: float,
                      min_batch: int, max_batch: int) -> int:
    """B'_G from B_G and the similarity Phi (module docstring: rule, rounding, clamp).

    Args:
        current: B_G now (integer >= 1; need not lie within the bounds, the result does).
        phi: measured cosine similarity of the two groups, in [-1, 1].
        gamma: similarity threshold, in [-1, 1].
        alpha: adaptive rate > 0 (JABAS uses 0.1).
        min_batch, max_batch: clamp bounds, 1 <= min_batch <= max_batch.

    Returns:
        The next global batch size, an integer in [min_batch, max_batch].
    """
    check_int("current", current, min_value=1)
    phi = check_float("phi", phi, min_value=-1.0 - 1e-9, max_value=1.0 + 1e-9)
    gamma = check_float("gamma", gamma, min_value=-1.0, max_value=1.0)
    alpha = check_float("alpha", alpha, min_value=0.0, min_exclusive=True)
    check_int("min_batch", min_batch, min_value=1)
    check_int("max_batch", max_batch, min_value=1)
    if min_batch > max_batch:
        raise ValueError(f"min_batch must be <= max_batch ({max_batch}), got {min_batch}")
    if phi < gamma:                                    # noisy gradient -> grow
        target = max(current + 1, _round_half_up(current * (1.0 + alpha)))
    elif phi > gamma:                                  # redundant gradient -> shrink
        target = min(current - 1, _round_half_up(current * (1.0 - alpha)))
    else:
        target = current
    return min(max(target, min_batch), max_batch)


def _round_half_up(x: float) -> int:
    # Python's round() rounds half to even (round(2.5) == 2); B_G wants the plain rule.
    return int(math.floor(x + 0.5))


@dataclass
class AdaptiveBatchState(JsonMixin):
    """Checkpointable state of :class:`AdaptiveBatchController` (plain JSON types only)."""

    global_batch: int                                    # B_G in effect now
    trajectories: list[list[int]] = field(default_factory=lambda: [[]])  # per epoch; last = current
    similarities: list[list[float]] = field(default_factory=lambda: [[]])  # Phi per window, per epoch
    num_updates: int = 0                                 # adaptations applied so far (all epochs)


class AdaptiveBatchController:
    """Holds B_G, applies :func:`next_global_batch` every p iterations, records the trajectory.

    The trajectory of an epoch has one value per completed window of p iterations: the B_G
    that was in effect during that window (so an epoch at constant B_G with w windows records
    w equal values). This is what the forecaster learns from and what the auto-scaler
    assumes per p iterations (JABAS 6.2-6.3).

    Typical use by the driver, every p iterations::

        target = ctl.update(phi)                  # rule -> B'_G (also logs the window)
        plan = solve_configuration(target, ...)   # may round B'_G
        ctl.set_global_batch(plan.global_batch_size)   # the JABAS driver does not: module notes
        lr = ctl.lr(iteration)

    and at the end of each epoch ``history = ctl.end_epoch()``. ``state_dict()`` /
    ``load_state_dict()`` round-trip the state through a plain dict for checkpoints.
    """

    def __init__(self, job_config: JobConfig) -> None:
        if not isinstance(job_config, JobConfig):
            raise ValueError(f"job_config must be a JobConfig, got {type(job_config).__name__}")
        self.job = job_config
        self._state = AdaptiveBatchState(global_batch=job_config.initial_global_batch)

    # --- read access ---------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        """B_G in effect now."""
        return self._state.global_batch

    @property
    def epoch(self) -> int:
        """0-based index of the epoch being recorded."""
        return len(self._state.trajectories) - 1

    @property
    def trajectory(self) -> list[int]:
        """B_G per completed window of the current epoch (a copy)."""
        return list(self._state.trajectories[-1])

    @property
    def completed_trajectories(self) -> list[list[int]]:
        """Trajectories of the finished epochs (what :class:`GBSForecaster` is fitted on)."""
        return [list(t) for t in self._state.trajectories[:-1]]

    @property
    def similarities(self) -> list[list[float]]:
        """Phi of every window, per epoch (current epoch last)."""
        return [list(s) for s in self._state.similarities]

    @property
    def num_updates(self) -> int:
        return self._state.num_updates

    # --- the rule ------------------------------------------------------------------------
    def propose(self, phi: float) -> int:
        """B'_G the rule gives for ``phi`` from the current B_G; changes nothing."""
        if not self.job.adaptive:
            return self.global_batch
        return next_global_batch(self.global_batch, phi, self.job.gamma, self.job.alpha,
                                 self.job.min_global_batch, self.job.max_global_batch)

    def update(self, phi: float) -> int:
        """Close a window of p iterations measured at similarity ``phi``; return the new B_G.

        Records the B_G used during the window and ``phi`` into the current epoch, then moves
        B_G by the rule (unless ``job_config.adaptive`` is False).
        """
        target = self.propose(phi)                   # validates phi
        self._state.trajectories[-1].append(self.global_batch)
        self._state.similarities[-1].append(float(phi))
        if target != self.global_batch:
            log.debug("epoch %d: Phi=%.4f gamma=%.3f -> B_G %d -> %d", self.epoch, phi,
                      self.job.gamma, self.global_batch, target)
        self._state.global_batch = target
        self._state.num_updates += 1
        return target

    def set_global_batch(self, batch: int) -> None:
        """Record the B_G actually applied (e.g. rounded by the solver to a multiple of 2*B_L)."""
        check_int("global_batch", batch, min_value=1)
        if not self.job.min_global_batch <= batch <= self.job.max_global_batch:
            log.warning("applied B_G %d lies outside [min_global_batch, max_global_batch] = [%d, %d]",
                        batch, self.job.min_global_batch, self.job.max_global_batch)
        self._state.global_batch = batch

    def end_epoch(self) -> list[int]:
        """Close the current epoch's trajectory and start the next; returns the closed one.

        An epoch shorter than p iterations has no completed window; it then records the B_G in
        effect once, so that every epoch contributes at least one point to the forecaster.
        """
        closed = self._state.trajectories[-1]
        if not closed:
            closed.append(self.global_batch)
        self._state.trajectories.append([])
        self._state.similarities.append([])
        return list(closed)

    def lr(self, iteration: int = 0) -> float:
        """Learning rate for the current B_G: ``scaled_lr(job.lr, job.initial_global_batch, B_G,
        job.lr_scaling, iteration, job.warmup_iterations)``."""
        return scaled_lr(self.job.lr, self.job.initial_global_batch, self.global_batch,
                         self.job.lr_scaling, iteration, self.job.warmup_iterations)

    # --- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain-dict state (JSON types only)."""
        return self._state.to_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; raises ``ValueError`` naming a bad field."""
        st = AdaptiveBatchState.from_dict(state)
        check_int("global_batch", st.global_batch, min_value=1)
        check_int("num_updates", st.num_updates, min_value=0)
        if not st.trajectories or len(st.trajectories) != len(st.similarities):
            raise ValueError("trajectories and similarities must be non-empty lists of the same "
                             f"length (one per epoch), got {len(st.trajectories)} and {len(st.similarities)}")
        for e, (t, s) in enumerate(zip(st.trajectories, st.similarities)):
            if len(s) > len(t):
                raise ValueError(f"similarities[{e}] must not be longer than trajectories[{e}], "
                                 f"got {len(s)} > {len(t)}")
        self._state = st

    @classmethod
    def from_state_dict(cls, job_config: JobConfig, state: dict) -> "AdaptiveBatchController":
        ctl = cls(job_config)
        ctl.load_state_dict(state)
        return ctl
