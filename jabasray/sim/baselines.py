"""The time of the baselines' steps: equal local batches on every GPU, the slowest sets the pace.

SimiGrad, Pollux and static data parallelism give every GPU the same local batch (JABAS
section 7.1, "Baselines": the paper runs them without WDP, whose unequal local batches cost
accuracy). Their iteration on a heterogeneous allocation therefore takes as long as its slowest
GPU (the straggler effect of section 2.2). In the terms of the iteration-time model:

* N GPUs run B_G: each runs k = ceil(B_G / (N * b_max)) decoupled workers in sequence (one
  worker plus k - 1 gradient-accumulation steps), b_max the largest local batch that fits on
  EVERY allocated GPU (the smallest memory sets it), and the local batch is
  b = max(min B_L, ceil(B_G / (N * k))), so B_G* = N * k * b >= B_G (the rounding Pollux and
  SimiGrad make). ``min B_L`` is the job's (``JobConfig.min_local_batch``), the bound JABAS's
  plans keep too: every policy runs the same job, so a baseline on many GPUs runs a larger
  global batch than asked rather than smaller local batches than the job allows;
* the iteration time is max over the allocated GPU types of Eq. 6 at (b, n_vsw = 1,
  n_GA = k - 1): ``model.iteration_time`` of :class:`jabasray.planners.perf_model.PerfModel`,
  all-reduce of the allocation's N_G included;
* the result is a :class:`jabasray.types.Plan` (one worker per GPU unit), so that its interval
  is charged the same host terms as a JABAS interval
  (:func:`jabasray.planners.interval_model.plan_interval_terms`). A solo GPU (a node's odd GPU)
  runs both similarity groups' workers, i.e. twice the steps: an equal-batch baseline on odd
  nodes is charged for that as JABAS is.

Pollux's goodput (Pollux, section 3; JABAS section 2.1): throughput(M) x efficiency(M), the
batch M chosen from a grid (:func:`batch_grid`) to maximise it.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..types import Plan, WorkerConfig, unit_gpu, units_num_gpus
from ..validation import check_int


def equal_batch_plan(global_batch: int, units: Sequence[str], model: Any, min_local_batch: int = 1) -> Plan:
    """The plan of an equal-local-batch baseline for B_G = ``global_batch`` on the GPU units
    ``units`` (group H, :func:`jabasray.actors.placement.group_gpus`) with ``model`` retargeted
    to the allocation, no local batch below ``min_local_batch`` (module notes). ValueError when
    ``min_local_batch`` does not fit some GPU."""
    check_int("global_batch", global_batch, min_value=1)
    check_int("min_local_batch", min_local_batch, min_value=1)
    units = list(units)
    if not units:
        raise ValueError("units must list at least one GPU unit, got []")
    num_gpus = units_num_gpus(units)
    types = sorted({unit_gpu(u)[0] for u in units})
    b_max = min(int(model.max_local_batch(g)) for g in types)
    if b_max < min_local_batch:
        raise ValueError(f"min_local_batch {min_local_batch} does not fit on every GPU type of "
                         f"{types} (largest common local batch {b_max})")
    k = max(1, math.ceil(global_batch / (num_gpus * b_max)))
    b = max(min_local_batch, math.ceil(global_batch / (num_gpus * k)))
    t = max(model.iteration_time(g, b, 1, k - 1) for g in types)
    return Plan(global_batch_size=num_gpus * k * b, local_batch_size=b,
                workers=[WorkerConfig(u, 1, k - 1) for u in units], iteration_time=float(t),
                requested_global_batch_size=int(global_batch))


def batch_grid(min_batch: int, max_batch: int, ratio: float = 1.1) -> list[int]:
    """Candidate global batches for a goodput search: ``min_batch`` times powers of ``ratio``
    (the JABAS rate alpha = 0.1 by default) up to ``max_batch``, which is included."""
    check_int("min_batch", min_batch, min_value=1)
    check_int("max_batch", max_batch, min_value=min_batch)
    out, b = [min_batch], float(min_batch)
    while True:
        b *= ratio
        nxt = int(round(b))
        if nxt >= max_batch:
            break
        if nxt > out[-1]:
            out.append(nxt)
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


def goodput(plan: Plan, efficiency: float, seconds: float | None = None) -> float:
    """Pollux's goodput of ``plan``: samples per second times the statistical efficiency of its
    batch (progress per second, in samples at the reference batch). ``seconds``: the time of
    one iteration with its host terms (default: the plan's iteration time)."""
    t = plan.iteration_time if seconds is None else seconds
    return plan.global_batch_size / t * efficiency if t > 0 else 0.0


__all__ = ["equal_batch_plan", "batch_grid", "goodput"]
