"""Auto-tuning the number of learners per GPU (Crossbow section 3.4, Algorithm 2).

Crossbow's Algorithm 2, per GPU g (throughput t in samples/s, tolerance tau):

    1  l_g <- 1;  t'_g <- 0                       (one learner per GPU to start)
    4  t <- current throughput of GPU g
    6  if t - t'_g > tau:            l_g <- l_g + 1
    7  elif t < t'_g and l_g > 1:    l_g <- l_g - 1
    8  t'_g <- t

Taken literally the loop never settles: after backing off (line 7) the throughput recovers, the
recovery exceeds tau, and line 6 adds the learner again (5, 4, 5, 4, ...). And on a plateau it
stops one learner past the plateau start (the extra learner gave no gain, but no drop either).
Crossbow states the intent in words: "increases the number of learners until there is no
increase in training throughput ... It then uses the number of learners that resulted in peak
throughput" (section 1) and section 5.4 picks the plateau start (m=4 for ResNet-32 on 1 GPU).
So this tuner is Algorithm 2 as a small state machine that settles (our deviation, explicit):

    PROBING at l learners, measured t (mean of ``samples_per_decision`` observations):
        gain = t - t'   (or (t - t') / t' when ``relative``)
        gain > tau and l < max_learners   -> l + 1, t' <- t                         (line 6)
        gain > tau and l = max_learners   -> SETTLED at l
        gain <= tau (no gain, or a drop)  -> SETTLED at l - 1 (the count that gave the peak
                                             throughput; line 7 backs off on a drop, and we
                                             also back off when the extra learner gained
                                             nothing, i.e. we stop at the plateau start)
        at l = 1 the first measurement compares with t' = 0 (line 1), so any throughput > tau
        probes a second learner.
    SETTLED: further observations are accepted and ignored, the count stays; ``reset(gpu)`` probes again
        (e.g. after the local batch size changed, which moves the optimum).

Every GPU is tuned independently (heterogeneous GPUs peak at different counts) - except the
two GPUs of a JABAS adaptive-batching pair, which ``observe_pairs`` tunes as ONE unit, so both
always run the same count (the reasoning follows). Pure Python: no torch, no ray. State is a
dataclass with a JSON round trip (``to_json``/``from_json``).

Why the two GPUs of a pair share one count (symmetric groups)
---------------------------------------------------------------
JABAS adapts B_G from the gradient similarity Phi = cos(G_0, G_1) of the two GPU groups (every
pair puts one GPU in each group); each G_i is the sum of the mean-loss gradients of the
micro-batches its GPUs processed in the iteration. In SMA mode a GPU's micro-batch count is
m * (n_GA + 1), so tuning the GPUs of a pair separately gives the groups different sizes n_0,
n_1. The rule's threshold gamma assumes two halves of one batch. Model each micro-batch
gradient as mu + noise (covariance sigma^2 I, independent): G_i = n_i mu + e_i with
|e_i|^2 ~ n_i sigma^2, so

    E[Phi] ~ |mu|^2 / sqrt((|mu|^2 + sigma^2/n_0) (|mu|^2 + sigma^2/n_1)).

Cosine is scale-invariant, so "normalising" the groups (dividing by n_i) changes nothing; what
differs is the noise each group carries. f(n) = log(|mu|^2 + sigma^2/n) is convex in n, so for
a fixed total n_0 + n_1 = 2n Jensen gives f(n_0) + f(n_1) >= 2 f(n): unequal groups make Phi
*lower* than equal halves of the same batch, and the rule (Phi < gamma grows B_G) would grow the
batch because of the learner tuner, not because of the gradients. A correction would need
sigma^2/|mu|^2, which Phi alone does not give. Keeping the groups symmetric removes the bias
instead: ``observe_pairs`` runs Alg. 2 once per pair on the pair's throughput (the sum of its
two GPUs' samples/s: both GPUs of a pair are of one type and run in lock-step, so the pair
gains or loses as one) and gives both GPUs its count. Different pairs may still settle at
different counts; group 0 and group 1 then still hold the same number of micro-batches, since
each pair contributes the same count to both.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..serialization import JsonMixin
from ..validation import check_float, check_int

log = logging.getLogger(__name__)


@dataclass
class GPULearnerState(JsonMixin):
    """Tuning state of one GPU."""

    learners: int = 1                  # l_g: learners to run now
    last_throughput: float = 0.0       # t'_g: throughput decided on at the previous count
    settled: bool = False              # True once the count is final (until reset)
    pending: list[float] = field(default_factory=list)   # observations at l_g not yet decided on
    history: list[tuple[int, float]] = field(default_factory=list)  # (learners, mean throughput) decisions


@dataclass
class LearnerTuner(JsonMixin):
    """Per-GPU learner-count tuner (module docstring: Algorithm 2 and the settling rule).

    ``observe(gpu, throughput)`` feeds one throughput measurement taken with the GPU's current
    count ``learners(gpu)`` and returns the count to use next. GPU keys are strings (actor or
    device names); a GPU is registered on its first observation.
    """

    tau: float = 0.0                   # tolerance: a gain must exceed it to add a learner
    max_learners: int = 8              # never more learners than this per GPU (memory bound)
    relative: bool = False             # tau as a fraction of the previous throughput
    samples_per_decision: int = 1      # observations averaged before each decision (noise)
    gpus: dict[str, GPULearnerState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tau = check_float("tau", self.tau, min_value=0.0)
        check_int("max_learners", self.max_learners, min_value=1)
        check_int("samples_per_decision", self.samples_per_decision, min_value=1)
        if not isinstance(self.relative, bool):
            raise ValueError(f"relative must be True or False, got {self.relative!r}")
        for name, st in self.gpus.items():
            check_int(f"gpus[{name}].learners", st.learners, min_value=1, max_value=self.max_learners)

    # --- queries -------------------------------------------------------------------------
    def learners(self, gpu: str) -> int:
        """Learners GPU ``gpu`` should run now (1 for a GPU not seen yet)."""
        st = self.gpus.get(self._key(gpu))
        return st.learners if st is not None else 1

    def is_settled(self, gpu: str) -> bool:
        st = self.gpus.get(self._key(gpu))
        return st is not None and st.settled

    @property
    def all_settled(self) -> bool:
        return bool(self.gpus) and all(st.settled for st in self.gpus.values())

    # --- Algorithm 2 ---------------------------------------------------------------------
    def observe(self, gpu: str, throughput: float) -> int:
        """Feed one throughput measurement of ``gpu`` (at its current count); return the next count."""
        key = self._key(gpu)
        t = check_float(f"throughput[{key}]", throughput, min_value=0.0)
        st = self.gpus.setdefault(key, GPULearnerState())
        if st.settled:                                        # the count is final until reset
            st.pending.clear()
            return st.learners
        st.pending.append(t)
        if len(st.pending) < self.samples_per_decision:
            return st.learners
        t = sum(st.pending) / len(st.pending)
        st.pending.clear()
        st.history.append((st.learners, t))
        gain = t - st.last_throughput
        if self.relative and st.last_throughput > 0:
            # relative gain; the first decision (t' = 0, line 1) has no base and stays absolute
            gain /= st.last_throughput
        if gain > self.tau:                                   # Alg. 2 line 6
            if st.learners < self.max_learners:
                st.learners += 1
                st.last_throughput = t
            else:
                st.settled = True
        else:                                                 # line 7 (+ plateau, see docstring)
            if st.learners > 1:
                st.learners -= 1
            st.settled = True
        if st.settled:
            log.debug("learner tuner: GPU %s settled at %d learners (history %s)", key,
                      st.learners, st.history)
        return st.learners

    def observe_all(self, throughputs: Mapping[str, float]) -> dict[str, int]:
        """One measurement per GPU (the ``for g`` loop of Alg. 2); returns the next counts."""
        return {self._key(g): self.observe(g, t) for g, t in throughputs.items()}

    def observe_pairs(self, throughputs: Mapping[str, float],
                      pairs: Mapping[str, Sequence[str]]) -> dict[str, int]:
        """Alg. 2 once per adaptive-batching pair (module notes): the pair's throughput is the
        sum of its GPUs' and every GPU of the pair gets the pair's count.

        ``throughputs`` maps each GPU key to its samples/s; ``pairs`` maps a pair key (the
        tuner's key for the pair's state) to its GPU keys. Every GPU must be in exactly one
        pair. Returns the next count of every GPU.
        """
        members = [g for gs in pairs.values() for g in gs]
        if sorted(members) != sorted(throughputs) or len(set(members)) != len(members):
            raise ValueError(f"pairs must list every GPU of throughputs exactly once, got pairs "
                             f"{dict(pairs)!r} for GPUs {sorted(throughputs)!r}")
        out: dict[str, int] = {}
        for key, gpus in pairs.items():
            if not gpus:
                raise ValueError(f"pairs[{key!r}] must list at least one GPU, got []")
            m = self.observe(key, sum(check_float(f"throughput[{g}]", throughputs[g], min_value=0.0)
                                      for g in gpus))
            out.update({g: m for g in gpus})
        return out

    def reset(self, gpu: str | None = None) -> None:
        """Probe again from one learner (one GPU, or all when ``gpu`` is None)."""
        keys = list(self.gpus) if gpu is None else [self._key(gpu)]
        for k in keys:
            self.gpus[k] = GPULearnerState()

    @staticmethod
    def _key(gpu: str) -> str:
        if not isinstance(gpu, str) or not gpu:
            raise ValueError(f"gpu must be a non-empty string key, got {gpu!r}")
        return gpu
