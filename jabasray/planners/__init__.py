"""Pure planning algorithms over plain data (no torch, no ray).

JABAS planning lives here: the ONE plan policy for a global batch (:func:`solve_for_batch`,
:mod:`.plan_policy`, used by the driver, the auto-scaler and ``jabasray plan``), the iteration-time model (:mod:`.perf_model`, Eq. 1-6), the
configuration solver (:mod:`.config_solver`, Alg. 1) and the per-epoch auto-scaler
(:mod:`.autoscale`, section 6.3, cost model Eq. 8); a running job's use of them, with its caches
and the online correction, is :class:`.job_planner.JobPlanner`. Other planners (burst, libra, pack_opt,
learner_tuner) are imported from their own submodules.
"""
from __future__ import annotations

from .autoscale import (Allocation, AutoscaleDecision, CandidateEstimate, EpochTime,
                        choose_allocation, enumerate_allocations, epoch_time)
from .config_solver import (LocalBatchOutcome, SolverResult, explain_configuration,
                            solve_configuration, solve_configuration_detailed)
from .perf_model import IterationBreakdown, PerfModel, emulated_profiles
from .plan_policy import DEFAULT_TOLERANCE, NoPlanError, solve_for_batch

__all__ = ["solve_for_batch", "NoPlanError", "DEFAULT_TOLERANCE", "solve_configuration", "solve_configuration_detailed", "explain_configuration",
           "SolverResult", "LocalBatchOutcome", "PerfModel", "IterationBreakdown",
           "emulated_profiles", "Allocation", "AutoscaleDecision", "CandidateEstimate", "EpochTime",
           "choose_allocation", "enumerate_allocations", "epoch_time"]
