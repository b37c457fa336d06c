"""What one adaptation interval costs: Eq. 6 for its iterations plus the host terms around them.

JABAS (section 5.1) predicts an *iteration*; the driver runs and times an *interval* of p
iterations (one Ray call per actor, section 6.1's similarity at its end). On a cluster of fast
devices, or on CPU-emulated ones, the terms around the iterations are a large share of it (on
the README's job measured at 20-30 % of an interval). An interval's prediction is therefore the
sum of these named terms, each measured on the path it predicts:

* ``steps``      = n x t_iter, Eq. 6 (+ the profile's step overhead and, on emulated GPUs, the
  emulation's own cost, :class:`EmulationCost`) for the interval's n iterations;
* ``loader``     = n x (a_l + b_l x samples per rank and iteration): reading and splitting each
  iteration's batch on the actor (:class:`HostCosts`, ``loader_fixed_s`` and ``loader_per_sample_s``);
* ``similarity`` = the two-group similarity collective of section 6.1 and its cosine, once per
  interval (``similarity_s``);
* ``read``       = reading the interval's losses once from the device (``read_s``);
* ``call``       = the driver's fan-out call to every actor and their replies, the actors' own
  work excluded (``call_s``);
* ``configure``  = applying a new plan on the actors (``configure_s``), only when the plan
  changed since the last interval.

The host terms are measured on the placed actors right after a placement
(:meth:`jabasray.actors.gpu_actor.GPUActor.probe_costs`) and recorded in ``metrics.json`` per
interval beside the same terms measured while training (``IntervalRecord.predicted_terms`` and
``measured_terms``), so a wrong term shows at once. Deviation from the paper (which has no such
terms): they cost nothing on the multi-hour GPU runs of section 7, but decide the plans of short
intervals, and the auto-scaler weighs them for every candidate (:func:`.autoscale.epoch_time`),
at the values measured on the current placement (they hardly depend on the GPU count).

Pure: no torch, no ray.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..serialization import JsonMixin
from ..types import Plan, unit_gpu
from ..validation import check_float, check_int

# the named terms of an interval, in the order they are shown
TERMS = ("steps", "loader", "similarity", "read", "call", "configure")


@dataclass(frozen=True)
class HostCosts(JsonMixin):
    """Seconds of the host terms of an interval, measured on the placed actors (module notes)."""

    call_s: float = 0.0               # fan-out call and replies, actor work excluded
    configure_s: float = 0.0          # applying a new plan (a collective configure call)
    loader_fixed_s: float = 0.0       # reading one iteration's batch: fixed part ...
    loader_per_sample_s: float = 0.0  # ... and per sample of the rank's batch
    similarity_s: float = 0.0         # the similarity collective and its cosine
    read_s: float = 0.0               # reading the interval's losses

    def __post_init__(self) -> None:
        for name in ("call_s", "configure_s", "loader_fixed_s", "loader_per_sample_s",
                     "similarity_s", "read_s"):
            check_float(name, getattr(self, name), min_value=0)

    def loader_s(self, samples_per_rank: int) -> float:
        """Seconds to read one iteration's batch of ``samples_per_rank`` samples."""
        return self.loader_fixed_s + self.loader_per_sample_s * max(0, int(samples_per_rank))


@dataclass(frozen=True)
class EmulationCost(JsonMixin):
    """What a CPU-emulated GPU type's iteration takes against the model: ``t = a + b t_model``.

    Why (a measured deviation from the profile's numbers): a GPU emulated at speed s takes its
    step's compute CPU seconds over s ("wait" emulation, :mod:`jabasray.actors.emulation`), and
    the ranks of a placement step together. The profile measures compute in a hot loop on an
    idle core; on the placed actors a step costs more: after every emulation sleep the caches
    are cold, and the ranks' all-reduce waits for the last of them, which the shared cores
    delay - a cost per step (``a``) and one that grows with the step (``b``). So the placed
    actors time their steps at every profiled point (each B_L at n_vsw = 1 and at n_max) as
    training runs them (:meth:`jabasray.actors.gpu_actor.GPUActor.probe_costs`), this line is
    fitted to the (model time, measured time) pairs by least squares, and
    :class:`~.perf_model.PerfModel` adds ``t - t_model`` as the term ``t_emulation``. One line
    over all points, not a ratio per point: on two cores a step's time varies by +-20 % from
    one step to the next, and a per-point table would learn that noise. Real GPUs have none:
    their profile is measured in a task holding a GPU of the type.
    """

    a: float          # seconds per iteration, >= 0
    b: float          # dimensionless, > 0

    def __post_init__(self) -> None:
        check_float("emulation_cost.a", self.a, min_value=0)
        check_float("emulation_cost.b", self.b, min_value=0, min_exclusive=True)

    def time(self, model_time: float) -> float:
        """The emulated iteration time ``a + b t_model``."""
        return self.a + self.b * model_time

    @classmethod
    def through(cls, points: list[tuple[float, float]]) -> "EmulationCost":
        """:func:`line_fit` over ``(model time, measured time)`` points (``a >= 0``: a step never
        costs less than nothing); a pure offset (b = 1) where it finds no positive slope (one
        model time, or noise), since the emulation never speeds a step up."""
        if not points:
            raise ValueError("emulation cost needs at least one (model time, measured time) point, got []")
        a, b = line_fit(points)
        if b > 0:
            return cls(a=a, b=b)
        mx = sum(float(x) for x, _ in points) / len(points)
        my = sum(float(y) for _, y in points) / len(points)
        return cls(a=max(0.0, my - mx), b=1.0)


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b x`` with ``a, b >= 0`` (a cost never falls with
    its size): one distinct x gives ``(mean y, 0)``."""
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    if b <= 0:
        return max(0.0, my), 0.0
    a = my - b * mx
    if a < 0:                        # through the origin instead
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, b


def interval_terms(iteration_time: float, num_iterations: int, costs: HostCosts | None,
                   samples_per_rank: int = 0, configure: bool = False) -> dict[str, float]:
    """The predicted terms of one interval (module notes), seconds, keyed by :data:`TERMS`;
    without measured ``costs`` only ``steps`` is non-zero (Eq. 6 alone). Their sum is the
    interval's prediction."""
    check_int("num_iterations", num_iterations, min_value=0)
    check_float("iteration_time", iteration_time, min_value=0)
    c = costs or HostCosts()
    n = int(num_iterations)
    return {"steps": n * float(iteration_time),
            "loader": n * c.loader_s(samples_per_rank),
            "similarity": c.similarity_s if n else 0.0,
            "read": c.read_s if n else 0.0,
            "call": c.call_s if n else 0.0,
            "configure": c.configure_s if (configure and n) else 0.0}


def host_costs_of(model: Any) -> HostCosts | None:
    """The measured host costs a model carries (``model.host_costs``), None for models without
    them (a given model of the solver's protocol, or before the first placement)."""
    costs = getattr(model, "host_costs", None)
    return costs if isinstance(costs, HostCosts) else None


def rank_samples(plan: Plan) -> int:
    """Samples per iteration of the plan's busiest GPU: B_L x its decoupled workers (a solo GPU
    runs both groups' workers, :func:`jabasray.types.solo_unit`)."""
    return plan.local_batch_size * max(
        (w.num_workers * (2 if unit_gpu(w.gpu)[1] else 1) for w in plan.workers), default=0)


def plan_interval_terms(plan: Plan, num_iterations: int, costs: HostCosts | None,
                        configure: bool = False) -> dict[str, float]:
    """:func:`interval_terms` of ``num_iterations`` iterations of ``plan`` (its predicted
    iteration time and busiest GPU's batch): what the driver records and the auto-scaler sums."""
    return interval_terms(plan.iteration_time, num_iterations, costs, rank_samples(plan), configure)


__all__ = ["TERMS", "HostCosts", "EmulationCost", "line_fit", "interval_terms", "host_costs_of", "rank_samples",
           "plan_interval_terms"]
