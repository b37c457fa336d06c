"""What one adaptation interval costs: Eq. 6 for its iterations plus the host terms around them.

JABAS (section 5.1) predicts an *iteration*; the driver runs and times an *interval* of p
iterations (one Ray call per actor, section 6.1's similarity at its end). On a cluster of fast
devices, or on CPU-emulated ones, the terms around the iterations are a large share of it (on
the README's job measured at 20-30 % of an interval). An interval's prediction is therefore the
sum of these named terms, each measured on the path it predicts:

* ``steps``      = n x t_iter, Eq. 6 (+ the profile's step overhead and, on emulated GPUs, the
  emulation's own cost, :class:`EmulationCost`) for the interval's n full iterations;
* ``ragged``     = the epoch's last iteration when fewer than B_G samples remain
  (:func:`ragged_iteration_time`): the engine runs it per VSW (micro-batches of unequal size
  cannot be batched: the VSWs run concurrently, on threads on CPU, on streams on a GPU, as
  IIDP's VSWs do), at about R / W samples each - Eq. 6 at the plan's VSWs and GA steps at
  B_L = ceil(R / W) - plus what such a step costs beyond that on the placed actors, measured
  (``ragged_fixed_s`` + ``ragged_per_worker_s`` per decoupled worker of the GPU: per-VSW
  passes instead of one batched one, first calls at new input shapes, the sample count's read);
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

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ..serialization import JsonMixin
from ..types import Plan, WorkerConfig, unit_gpu
from ..validation import check_float, check_int
from .config_solver import unit_model

# the named terms of an interval, in the order they are shown
TERMS = ("steps", "ragged", "loader", "similarity", "read", "call", "configure")


@dataclass(frozen=True)
class HostCosts(JsonMixin):
    """Seconds of the host terms of an interval, measured on the placed actors (module notes)."""

    call_s: float = 0.0               # fan-out call and replies, actor work excluded
    configure_s: float = 0.0          # applying a new plan (a collective configure call)
    loader_fixed_s: float = 0.0       # reading one iteration's batch: fixed part ...
    loader_per_sample_s: float = 0.0  # ... and per sample of the rank's batch
    similarity_s: float = 0.0         # the similarity collective and its cosine
    read_s: float = 0.0               # reading the interval's losses
    ragged_fixed_s: float = 0.0       # a ragged step beyond its Eq. 6: fixed part ...
    ragged_per_worker_s: float = 0.0  # ... and per decoupled worker of the GPU (both signed: the
                                      # model may also over-predict; :func:`ragged_iteration_time`)
    # the same per GPU type, (type, fixed, per worker), where the placement's types were timed
    # apart (a fast type's per-VSW passes cost less than a slow one's); a type not listed
    # (not placed when measured) takes the two fields above
    ragged_by_type: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("call_s", "configure_s", "loader_fixed_s", "loader_per_sample_s",
                     "similarity_s", "read_s"):
            check_float(name, getattr(self, name), min_value=0)
        check_float("ragged_fixed_s", self.ragged_fixed_s)
        check_float("ragged_per_worker_s", self.ragged_per_worker_s)
        for gpu, fixed, per_worker in self.ragged_by_type:
            check_float(f"ragged_by_type[{gpu}].fixed", fixed)
            check_float(f"ragged_by_type[{gpu}].per_worker", per_worker)

    def ragged_extra_s(self, workers: int, gpu: str | None = None) -> float:
        """What a ragged step of a GPU (of type ``gpu``) running ``workers`` decoupled workers
        costs beyond its Eq. 6 (:func:`ragged_iteration_time`): that type's line where it was
        measured, else the placement's."""
        fixed, per_worker = next(((f, w) for g, f, w in self.ragged_by_type if g == gpu),
                                 (self.ragged_fixed_s, self.ragged_per_worker_s))
        return fixed + per_worker * max(0, int(workers))

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
    fitted to the (model time, measured time) pairs (:func:`relative_line_fit`), and
    :class:`~.perf_model.PerfModel` adds ``t - t_model`` as the term ``t_emulation``. One line
    over all points, not a ratio per point: on two cores a step's time varies by +-20 % from
    one step to the next, and a per-point table would learn that noise. Real GPUs have none:
    their profile is measured in a task holding a GPU of the type.

    ``a`` may be negative: t_model holds the all-reduce (Eq. 3), which the emulation does not
    stretch, so a slope b > 1 over-counts it by (b - 1) t_comm, a fixed amount the intercept
    takes back. The line is fitted for the relative error (the model is judged by it, and the
    plans mostly run the small steps, where a plain least-squares line through points up to
    ten times larger put the smallest point 12-44 % above what it took). Such a line reaches
    zero at a small model time, so below the smallest model time it was fitted at (``x_min``) a
    line with a < 0 is continued in proportion to the model time instead (a step of no work
    takes no time): ragged steps and smaller B_L are predicted there.

    GA rounds (``round_b``): Eq. 6 charges each GA round t_vsw, the profile's forward and
    backward pass, but the engine's round also accumulates the gradients, reads its batch and
    runs the VSWs again after the previous round's cache traffic, and under emulation all of it
    is stretched by 1 / speed. So the actors also time one point with GA rounds (the first B_L at
    its most VSWs, :func:`jabasray.actors.interval_costs.probe_points`), and a round costs
    ``round_b`` x t_vsw, the ratio measured there: ``t = a + b (t_model - t_rounds) + round_b
    t_rounds`` with ``t_rounds = n_GA t_vsw``. The line alone, fitted at n_GA = 0, put a run at
    4 VSWs and one GA step (2 rounds) 34 % below what it took. None (no GA point probed, or its rounds timed at
    no cost, which is noise): rounds scale like the rest, ``round_b = b``.
    """

    a: float          # seconds per iteration (signed: class notes)
    b: float          # dimensionless, > 0
    round_b: float | None = None   # a GA round's measured time / its t_vsw (None: b)
    x_min: float = 0.0             # the smallest model time the line was fitted at (seconds)

    def __post_init__(self) -> None:
        check_float("emulation_cost.a", self.a)
        check_float("emulation_cost.b", self.b, min_value=0, min_exclusive=True)
        if self.round_b is not None:
            check_float("emulation_cost.round_b", self.round_b, min_value=0, min_exclusive=True)
        check_float("emulation_cost.x_min", self.x_min, min_value=0)
        if self.a < 0 and self.a + self.b * self.x_min <= 0:
            raise ValueError(f"emulation_cost: the line a + b x must be positive at x_min, got "
                             f"a={self.a}, b={self.b}, x_min={self.x_min}")

    def time(self, model_time: Any, round_time: Any = 0.0) -> Any:
        """The emulated iteration time ``f(t_model - t_rounds) + round_b t_rounds`` of an
        iteration whose model time ``model_time`` holds ``round_time`` = n_GA t_vsw of GA rounds
        (floats or numpy arrays): ``f(x) = a + b x``, below ``x_min`` for a < 0
        ``x (a + b x_min) / x_min`` (class notes)."""
        x = model_time - round_time
        line = self.a + self.b * x
        if self.a < 0:
            floor = x * (self.a / self.x_min + self.b)
            line = np.maximum(line, floor) if isinstance(line, np.ndarray) else max(line, floor)
        return line + self.rounds_b * round_time

    @property
    def rounds_b(self) -> float:
        """What a GA round's model time is multiplied by: ``round_b``, else ``b``."""
        return self.b if self.round_b is None else self.round_b

    def with_rounds(self, model_round: float, measured_round: float) -> "EmulationCost":
        """This line with ``round_b`` = ``measured_round / model_round`` (seconds of one GA round
        as timed on the actors and as Eq. 6 has it); unchanged where either is not positive (a
        round timed as the residual of a noisy step time can be)."""
        if model_round <= 0 or measured_round <= 0:
            return self
        return replace(self, round_b=float(measured_round) / float(model_round))

    @classmethod
    def through(cls, points: list[tuple[float, float]]) -> "EmulationCost":
        """:func:`relative_line_fit` over ``(model time, measured time)`` points; a pure offset
        (b = 1, ``a >= 0``) where it finds no positive slope (one model time, or noise), since the
        emulation never speeds a step up."""
        if not points:
            raise ValueError("emulation cost needs at least one (model time, measured time) point, got []")
        a, b = relative_line_fit(points)
        x_min = min(float(x) for x, _ in points)
        if b > 0 and a + b * x_min > 0:
            return cls(a=a, b=b, x_min=max(0.0, x_min))
        mx = sum(float(x) for x, _ in points) / len(points)
        my = sum(float(y) for _, y in points) / len(points)
        return cls(a=max(0.0, my - mx), b=1.0)


def relative_line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b x`` minimising the squared *relative* error
    ``sum(((a + b x - y) / y)^2)`` over points with y > 0 (weighted least squares, weights
    1 / y^2), intercept signed; one distinct x (or none) gives ``(weighted mean y, 0)``."""
    pts = [(float(x), float(y)) for x, y in points if float(y) > 0]
    if not pts:
        return 0.0, 0.0
    w = [1.0 / (y * y) for _, y in pts]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, pts)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, pts)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, pts))
    if sxx <= 0:
        return my, 0.0
    b = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, pts)) / sxx
    return my - b * mx, b


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
                   samples_per_rank: int = 0, configure: bool = False,
                   ragged_time: float | None = None, ragged_samples_per_rank: int = 0) -> dict[str, float]:
    """The predicted terms of one interval (module notes), seconds, keyed by :data:`TERMS`;
    without measured ``costs`` only ``steps`` (and ``ragged``) are non-zero (Eq. 6 alone).
    ``ragged_time``: the interval's last iteration is the epoch's ragged one and takes that long
    (:func:`ragged_iteration_time`), its busiest rank reading ``ragged_samples_per_rank``
    samples; None: every iteration is full. Their sum is the interval's prediction."""
    check_int("num_iterations", num_iterations, min_value=0)
    check_float("iteration_time", iteration_time, min_value=0)
    c = costs or HostCosts()
    n = int(num_iterations)
    ragged = n > 0 and ragged_time is not None
    return {"steps": (n - ragged) * float(iteration_time),
            "ragged": max(0.0, float(ragged_time)) if ragged else 0.0,
            "loader": (n - ragged) * c.loader_s(samples_per_rank)
            + (c.loader_s(ragged_samples_per_rank) if ragged else 0.0),
            "similarity": c.similarity_s if n else 0.0,
            "read": c.read_s if n else 0.0,
            "call": c.call_s if n else 0.0,
            "configure": c.configure_s if (configure and n) else 0.0}


def ragged_remainder(samples_left: int, num_iterations: int, global_batch: int) -> int:
    """Samples of the ragged last iteration of an interval of ``num_iterations`` iterations of
    ``global_batch`` samples when ``samples_left`` remain in the epoch: what is left for the
    last iteration when that is fewer than ``global_batch`` (the sampler then splits it over
    the workers, :mod:`jabasray.engine.sampler`), else 0 (every iteration full, or the
    interval ends before the epoch does)."""
    left = int(samples_left) - (int(num_iterations) - 1) * int(global_batch)
    return left if num_iterations > 0 and 0 < left < global_batch else 0


def ragged_step_time(model: Any, gpu: str, num_vsw: int, num_ga: int, size: int) -> float:
    """Eq. 6 of a ragged step on one GPU of type (or similarity unit, :class:`.config_solver.
    UnitModel`: a solo GPU runs twice the VSWs) ``gpu`` configured with ``num_vsw`` VSWs and
    ``num_ga`` GA steps whose micro-batches hold at most ``size`` samples: the engine's per-VSW
    execution runs the VSWs concurrently (as the profile's VSWs), GA round after GA round, so
    it is Eq. 6 at B_L = ``size`` (below the smallest profiled B_L the model's extrapolation,
    :class:`~.perf_model.PerfModel`); what the per-VSW passes cost beyond the batched ones the
    profile measured is the measured extra (:meth:`HostCosts.ragged_extra_s`)."""
    return float(unit_model(model).iteration_time(gpu, max(1, int(size)), max(1, int(num_vsw)),
                                                  max(0, int(num_ga))))


def ragged_micro_batch(plan: Plan, remainder: int) -> int:
    """The largest micro-batch of the epoch's ragged last iteration of ``remainder`` samples
    under ``plan``: the sampler splits them over its W = B_G* / B_L decoupled workers as evenly
    as it can (:func:`jabasray.engine.sampler.split_sizes`), ceil(R / W) samples at most."""
    workers = max(1, plan.global_batch_size // max(1, plan.local_batch_size))
    return -(-int(remainder) // workers)


def unit_workers(worker: WorkerConfig) -> int:
    """Decoupled workers a GPU of the unit runs: a solo GPU runs both groups' workers
    (:func:`jabasray.types.solo_unit`)."""
    return worker.num_workers * (2 if unit_gpu(worker.gpu)[1] else 1)


def distinct_workers(plan: Plan) -> list[WorkerConfig]:
    """The plan's distinct unit configurations (unit name, VSWs, GA steps), first occurrence
    first. Every per-GPU quantity of this module is a function of one unit's configuration, so
    a maximum over the plan's GPUs is the maximum over these: on a large cluster a few
    configurations stand for hundreds of GPUs (the solver gives the GPUs of a type alike)."""
    return list(dict.fromkeys(plan.workers))


def ragged_iteration_time(plan: Plan, remainder: int, model: Any, costs: HostCosts | None) -> float:
    """Seconds of the epoch's ragged last iteration of ``remainder`` samples under ``plan``: on
    each GPU unit :func:`ragged_step_time` at its VSWs and GA steps and
    :func:`ragged_micro_batch` samples, plus the measured extra for its decoupled
    workers (:func:`unit_workers`); the slowest GPU sets the pace. Deviation from the paper,
    which predicts full iterations only: on a short epoch the ragged step is a large share of
    the last interval (on the README's job it took 1.5-3.5x a full iteration)."""
    size, c = ragged_micro_batch(plan, remainder), costs or HostCosts()
    pace = max((ragged_step_time(model, w.gpu, w.num_vsw, w.num_ga, size)
                + c.ragged_extra_s(unit_workers(w), unit_gpu(w.gpu)[0]) for w in distinct_workers(plan)),
               default=0.0)
    return max(0.0, pace)


def host_costs_of(model: Any) -> HostCosts | None:
    """The measured host costs a model carries (``model.host_costs``), None for models without
    them (a given model of the solver's protocol, or before the first placement)."""
    costs = getattr(model, "host_costs", None)
    return costs if isinstance(costs, HostCosts) else None


def rank_samples(plan: Plan, micro_batch: int | None = None) -> int:
    """Samples per iteration of the plan's busiest GPU: B_L (or ``micro_batch``) x its
    decoupled workers (:func:`unit_workers`)."""
    size = plan.local_batch_size if micro_batch is None else int(micro_batch)
    return size * max((unit_workers(w) for w in distinct_workers(plan)), default=0)


def plan_interval_terms(plan: Plan, num_iterations: int, costs: HostCosts | None,
                        configure: bool = False, *, remainder: int = 0, model: Any = None
                        ) -> dict[str, float]:
    """:func:`interval_terms` of ``num_iterations`` iterations of ``plan`` (its predicted
    iteration time and busiest GPU's batch): what the driver records and the auto-scaler sums.
    ``remainder`` > 0: the last iteration is the epoch's ragged one of that many samples
    (:func:`ragged_remainder`), timed by ``model`` (:func:`ragged_iteration_time`; without a
    model a full iteration)."""
    ragged, ragged_samples = None, 0
    if remainder > 0 and num_iterations > 0:
        ragged = plan.iteration_time if model is None else \
            ragged_iteration_time(plan, remainder, model, costs)
        ragged_samples = rank_samples(plan, ragged_micro_batch(plan, remainder))
    return interval_terms(plan.iteration_time, num_iterations, costs, rank_samples(plan), configure,
                          ragged_time=ragged, ragged_samples_per_rank=ragged_samples)


__all__ = ["TERMS", "HostCosts", "EmulationCost", "line_fit", "relative_line_fit", "interval_terms", "host_costs_of", "rank_samples",
           "plan_interval_terms", "ragged_remainder", "ragged_micro_batch", "unit_workers", "distinct_workers",
           "ragged_step_time",
           "ragged_iteration_time"]
