"""The ONE plan policy: which configuration runs for a requested global batch B_G.

Used by the driver (every interval), by the auto-scaler's epoch-time estimate
(:func:`jabasray.planners.autoscale.epoch_time`) and by ``jabasray plan``, so the plan an
allocation is chosen on is the plan that runs (DESIGN: "a plan computed is a plan executed").

Policy (:func:`solve_for_batch`), built on Alg. 1 of JABAS (the JABAS/IIDP paper,
section 5.2; :mod:`.config_solver`):

1. For every candidate B_L (``local_batches``, default min B_L, 2 min B_L, ... up to the
   largest B_L every GPU of the group runs, Alg. 1 line 6; stop once M < N_H, line 9) solve
   Alg. 1 restricted to that B_L (:func:`.config_solver.solve_local_batch`).
2. Among the per-B_L plans whose B_G* lies within ``tolerance * B_G`` of B_G take the fastest
   (ties: the smaller B_L); if none is that close, the plan with the closest B_G* (ties: faster).
3. If no B_L has a plan and B_G is below the smallest B_G the group can run
   (2 * N_H * min B_L), plan that floor instead; its ``requested_global_batch_size`` is the
   floor, so a caller sees the raise (the auto-scaler treats such a candidate as infeasible).
4. Otherwise raise :class:`NoPlanError` (a ``ValueError`` naming ``global_batch``).

Deviation from Alg. 1 (documented): the algorithm keeps the B_L of maximum throughput
F = B_G*/t, but B_G* = 2 B_L round(B_G / 2 B_L) can be far from B_G when B_G is a small
multiple of 2 B_L (B_G = 64 on one pair runs as 128 with B_L = 64), and a larger B_G* always
looks faster: that silently doubles the batch and the LR. The driver's ``tolerance`` is
alpha / 2 (half an adaptation step), so rounding never undoes or doubles a step of the
adaptive rule.

The work is bounded by construction: at most ``MAX_LOCAL_BATCH_CANDIDATES`` B_L are tried and
each is bounded by ``MAX_WORKERS_PER_GPU`` (see :mod:`.config_solver`); ``local_batches`` is
checked against the same bound.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Sequence

from ..types import Plan
from ..validation import check_float, check_int
from .config_solver import (MAX_LOCAL_BATCH_CANDIDATES, MAX_WORKERS_PER_GPU, LocalBatchOutcome, _validate,
                            local_batch_candidates, max_global_batch, num_workers_per_group,
                            solve_local_batch, unit_model)

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 0.05   # = JobConfig.alpha / 2 with the default alpha 0.1
MAX_SOLUTIONS = 512        # per-(B_L, M) answers a ``solutions`` memo keeps (oldest dropped first)


class NoPlanError(ValueError):
    """No configuration runs the requested global batch on the group (``reason`` says why)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"global_batch: {reason}")
        self.reason = reason


def check_min_local_batch(model: Any, gpu_types: Sequence[str], min_local_batch: int) -> None:
    """min B_L must fit on at least one GPU type (else no plan can ever exist): ValueError."""
    maxes = {t: int(model.max_local_batch(t)) for t in gpu_types}
    if min_local_batch > max(maxes.values()):
        raise ValueError(f"min_local_batch must be <= the largest local batch a GPU can run "
                         f"({max(maxes.values())}; per type {maxes}), got {min_local_batch}")


def _candidates(min_local_batch: int, max_bl: int, local_batches: Sequence[int] | None) -> list[int]:
    if local_batches is None:
        return list(local_batch_candidates(min_local_batch, max_bl))
    if isinstance(local_batches, (str, bytes)) or not hasattr(local_batches, "__iter__"):
        raise ValueError(f"local_batches must be a list of local batch sizes, got {local_batches!r}")
    out = sorted({check_int("local_batches[]", b, min_value=min_local_batch) for b in local_batches})
    if len(out) > MAX_LOCAL_BATCH_CANDIDATES:
        raise ValueError(f"local_batches must hold at most {MAX_LOCAL_BATCH_CANDIDATES} sizes, got {len(out)}")
    bad = [b for b in out if b % min_local_batch]
    if bad:
        raise ValueError(f"local_batches must be multiples of min_local_batch {min_local_batch}, got {bad}")
    return [b for b in out if b <= max_bl]


def _pick(plans: list[Plan], global_batch: int, tolerance: float) -> Plan:
    near = [p for p in plans if abs(p.global_batch_size - global_batch) <= tolerance * global_batch]
    if near:   # fastest; ties: the smaller B_L
        return max(near, key=lambda p: (p.throughput, -p.local_batch_size))
    return min(plans, key=lambda p: (abs(p.global_batch_size - global_batch), -p.throughput))


def solve_remembered(global_batch: int, gpus: list[str], model: Any, local_batch: int,
                     tables: dict | None = None, solutions: dict | None = None
                     ) -> tuple[Plan | None, LocalBatchOutcome]:
    """:func:`.config_solver.solve_local_batch` (no incumbent), its answers kept in
    ``solutions`` per (B_L, M): on one group and one model the answer depends on B_G only
    through M = round(B_G / 2 B_L) (Alg. 1 line 8) and the request the plan records, which is
    set to ``global_batch`` on a hit. ``solutions`` belongs to the caller, for ONE group H and
    ONE model (as ``tables``); it holds at most ``MAX_SOLUTIONS`` answers, the oldest dropped
    first. None: nothing kept."""
    if solutions is None:
        return solve_local_batch(global_batch, gpus, model, local_batch, tables=tables)
    key = (local_batch, num_workers_per_group(global_batch, local_batch))
    hit = solutions.get(key)
    if hit is None:
        while len(solutions) >= MAX_SOLUTIONS:
            solutions.pop(next(iter(solutions)))
        hit = solutions[key] = solve_local_batch(global_batch, gpus, model, local_batch, tables=tables)
    plan, outcome = hit
    if plan is not None and plan.requested_global_batch_size != global_batch:
        plan = replace(plan, requested_global_batch_size=global_batch, workers=list(plan.workers),
                       worker_weight_sync=list(plan.worker_weight_sync))
    return plan, outcome


def _solve(global_batch: int, gpus: list[str], model: Any, candidates: list[int],
           tolerance: float, tables: dict | None = None, solutions: dict | None = None
           ) -> tuple[Plan | None, list[str]]:
    plans, notes = [], []
    for bl in candidates:
        plan, outcome = solve_remembered(global_batch, gpus, model, bl, tables, solutions)
        if plan is not None:
            plans.append(plan)
        else:
            notes.append(f"B_L={bl}: {outcome.note}")
        if outcome.note.startswith("stop"):
            break      # Alg. 1 line 9: larger B_L cannot work either
    return (_pick(plans, global_batch, tolerance) if plans else None), notes


def solve_for_batch(global_batch: int, gpus: Sequence[str], model: Any, min_local_batch: int,
                    tolerance: float = DEFAULT_TOLERANCE,
                    local_batches: Sequence[int] | None = None, tables: dict | None = None,
                    solutions: dict | None = None) -> Plan:
    """The plan that runs B_G = ``global_batch`` on group H = ``gpus`` (module notes).

    Args:
        global_batch: requested B_G (>= 1).
        gpus: unit names of group H, one per identical pair or solo GPU
            (:mod:`.config_solver` notes); ``plan.workers[i]`` is ``gpus[i]``.
        model: iteration-time model (``PerfModel`` or any object with the solver's protocol),
            already describing the allocation (``for_allocation``).
        min_local_batch: min B_L; every B_L is a multiple of it.
        tolerance: fraction of B_G within which B_G* counts as "near" (>= 0).
        local_batches: restrict the candidate B_L (multiples of ``min_local_batch``).
        tables: the solver's per-type tables kept across calls on the same ``model``
            (:func:`.config_solver.cached_table`; None: computed for this call).
        solutions: the solver's answers per (B_L, M) kept across calls on the same group and
            ``model`` (:func:`solve_remembered`; None: not kept).
    Raises:
        NoPlanError (a ValueError) when no configuration exists; ValueError on bad input.
    """
    gg = _validate(global_batch, gpus, model, min_local_batch)
    model = unit_model(model)
    check_float("tolerance", tolerance, min_value=0)
    max_bl = min(int(model.max_local_batch(g)) for g in set(gg))
    if max_bl < min_local_batch:
        raise NoPlanError(f"min_local_batch {min_local_batch} exceeds the largest local batch that "
                          f"fits on every GPU of the group ({max_bl})")
    candidates = _candidates(min_local_batch, max_bl, local_batches)
    if not candidates:
        raise NoPlanError(f"no local batch of {list(local_batches or [])} fits on every GPU of the "
                          f"group (largest {max_bl})")
    limit = max_global_batch(len(gg), candidates[-1])
    if global_batch > limit:
        raise NoPlanError(f"{global_batch} is too large for {len(gg)} GPU unit(s): it must be <= {limit} "
                          f"(search bound: at most {MAX_WORKERS_PER_GPU} decoupled workers per GPU "
                          f"at B_L {candidates[-1]})")
    plan, notes = _solve(global_batch, gg, model, candidates, tolerance, tables, solutions)
    if plan is None:
        floor = 2 * len(gg) * candidates[0]
        if global_batch < floor:
            log.debug("B_G %d is too small for %d GPU units; running B_G %d", global_batch, len(gg), floor)
            plan, notes = _solve(floor, gg, model, candidates, tolerance, tables, solutions)
    if plan is None:
        raise NoPlanError(f"no configuration for global batch {global_batch} on GPUs {gg} "
                          f"(min_local_batch={min_local_batch}): {'; '.join(notes)}")
    return plan


__all__ = ["solve_for_batch", "solve_remembered", "NoPlanError", "DEFAULT_TOLERANCE", "MAX_SOLUTIONS",
           "check_min_local_batch"]
