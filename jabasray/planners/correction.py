"""Online correction of the iteration-time model from measured iteration times (beyond the paper).

JABAS builds its model once from a profile (section 5.1); here every interval's measured time
feeds back, so the next plan and the next allocation decision use what was seen.

Model: a factor c_g per GPU type multiplies every predicted iteration time of a configuration on
g (:class:`CorrectedModel`). After an interval on an allocation with GPU types G, predicted
per-iteration time t_pred (the plan's, computed WITH the current factors) and measured t_meas,

    log c_g <- log c_g + w * log(t_meas / t_pred)      for every g in G

an exponentially weighted average in log space (w = ``smoothing``) that converges to
t_meas / t_base (t_base: the uncorrected model's time). Attribution is per interval, not per
GPU: the measured time of a synchronous iteration is the slowest GPU's plus communication, and
the actors do not report a clean per-GPU iteration time, so every type of the allocation shares
the update (a type seen only in heterogeneous allocations is corrected with them).

Re-profiling: ``needs_reprofile()`` is true once the uncorrected ratio t_meas / t_base of some
type is off by more than ``threshold`` (a factor, either way): the profile itself is then
suspect (measured under other load, or on another machine) and should be re-measured.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

from ..validation import check_float


class OnlineCorrection:
    """Per GPU type correction factors, updated from measured interval times (module notes)."""

    def __init__(self, smoothing: float = 0.5, threshold: float = 2.0) -> None:
        self.smoothing = check_float("correction_smoothing", smoothing, min_value=0, max_value=1,
                                     min_exclusive=True)
        self.threshold = check_float("reprofile_threshold", threshold, min_value=1, min_exclusive=True)
        self.log_factor: dict[str, float] = {}

    def factor(self, gpu: str) -> float:
        return math.exp(self.log_factor.get(gpu, 0.0))

    def observe(self, gpu_types: Iterable[str], predicted: float, measured: float) -> None:
        """One interval: per-iteration ``predicted`` (with the current factors) vs ``measured``."""
        if predicted <= 0 or measured <= 0:
            return
        step = self.smoothing * math.log(measured / predicted)
        for g in set(gpu_types):
            self.log_factor[g] = self.log_factor.get(g, 0.0) + step

    def needs_reprofile(self) -> bool:
        return any(abs(v) > math.log(self.threshold) for v in self.log_factor.values())

    def reset(self) -> None:
        self.log_factor.clear()

    def state_dict(self) -> dict[str, float]:
        return {g: self.factor(g) for g in self.log_factor}


class CorrectedModel:
    """An iteration-time model whose times are multiplied by the correction's current factors
    (read at call time: plans computed before an update are stale, the caller re-plans)."""

    def __init__(self, model: Any, correction: OnlineCorrection) -> None:
        self.model, self.correction = model, correction

    def iteration_time(self, gpu: str, local_batch: int, num_vsw: int, num_ga: int) -> float:
        return self.correction.factor(gpu) * self.model.iteration_time(gpu, local_batch, num_vsw, num_ga)

    def iteration_times(self, gpu: str, local_batch: int, num_vsw: int, num_ga: np.ndarray) -> np.ndarray:
        fn = getattr(self.model, "iteration_times", None)
        base = (np.asarray(fn(gpu, local_batch, num_vsw, num_ga), dtype=float) if fn is not None else
                np.array([self.model.iteration_time(gpu, local_batch, num_vsw, int(g)) for g in num_ga]))
        return self.correction.factor(gpu) * base

    def for_allocation(self, num_gpus: int, multi_node: bool) -> "CorrectedModel":
        fa = getattr(self.model, "for_allocation", None)
        return CorrectedModel(fa(num_gpus, multi_node) if callable(fa) else self.model, self.correction)

    def __getattr__(self, name: str) -> Any:   # max_local_batch, max_num_vsw, weight_sync_method ...
        return getattr(self.model, name)


__all__ = ["OnlineCorrection", "CorrectedModel"]
