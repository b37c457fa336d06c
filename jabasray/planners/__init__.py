"""Pure planning algorithms over plain data (no torch, no ray).

JABAS planning lives here: the iteration-time model (:mod:`.perf_model`, Eq. 1-6), the
configuration solver (:mod:`.config_solver`, Alg. 1) and the per-epoch auto-scaler
(:mod:`.autoscale`, section 6.3, cost model Eq. 8). Other planners (burst, libra, pack_opt,
learner_tuner) are imported from their own submodules.
"""
from __future__ import annotations

from .autoscale import (Allocation, AutoscaleDecision, CandidateEstimate, EpochTime,
                        choose_allocation, enumerate_allocations, epoch_time)
from .config_solver import (LocalBatchOutcome, SolverResult, explain_configuration,
                            solve_configuration, solve_configuration_detailed)
from .perf_model import IterationBreakdown, PerfModel, emulated_profiles

__all__ = ["solve_configuration", "solve_configuration_detailed", "explain_configuration",
           "SolverResult", "LocalBatchOutcome", "PerfModel", "IterationBreakdown",
           "emulated_profiles", "Allocation", "AutoscaleDecision", "CandidateEstimate", "EpochTime",
           "choose_allocation", "enumerate_allocations", "epoch_time"]
