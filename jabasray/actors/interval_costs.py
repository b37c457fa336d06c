"""The host terms of an interval and the emulation's cost, measured on the placed GPU actors.

After every placement the driver asks each actor to time the terms of an interval that Eq. 6
leaves out (:meth:`jabasray.actors.gpu_actor.GPUActor.probe_costs`, one collective call) and
turns the answers into what the iteration-time model carries
(:mod:`jabasray.planners.interval_model`): a :class:`HostCosts` and, on CPU-emulated GPUs, one
:class:`EmulationCost` per GPU type. The same terms are measured again in every interval the
actors train (``IntervalReply.terms``) and recorded beside the prediction
(:func:`measured_terms`), so that a wrong term shows at once.

Pure functions over the replies (no Ray): the driver makes the call.
"""
from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

from ..planners.interval_model import TERMS, EmulationCost, HostCosts, line_fit, ragged_step_time


# GA rounds of the one probed point with rounds (:func:`probe_points`): two, so that what the
# rounds add to the step is twice one round's against the noise of the step's time
PROBE_GA_ROUNDS = 2


def probe_points(model: Any, gpu_type: str) -> list[tuple[int, int, int]]:
    """The ``(B_L, n_vsw, n_GA)`` points the placed actors time their step at: every profiled
    B_L at n_vsw = 1 and at its n_max (the two points of Eq. 1 the profile measured) without GA
    rounds, in the profile's order, then the first B_L at its n_max with
    :data:`PROBE_GA_ROUNDS` rounds (what a round costs, :meth:`.EmulationCost.with_rounds`);
    [] for a model without profiles."""
    profiles = getattr(model, "profiles", None)
    if not profiles or gpu_type not in profiles:
        return []
    points = []
    for b in profiles[gpu_type].batches:
        points += [(b.local_batch, 1, 0)] + ([(b.local_batch, b.max_num_vsw, 0)] if b.max_num_vsw > 1 else [])
    first = profiles[gpu_type].batches[0]
    return points + [(first.local_batch, first.max_num_vsw, PROBE_GA_ROUNDS)]


def similarity_of(per_rank: Iterable[float]) -> float:
    """The similarity collective's seconds in an interval from each rank's time in it: the
    least. Each rank enters it when its last step (and the emulation's sleep) ends, so a rank
    that ends early also waits there for the others; the rank that arrives last waits for
    nobody, and its step is the one the slowest rank's ``steps`` term already holds. Its time
    is the collective's own, and ``steps`` (slowest rank) + ``similarity`` (least) is when the
    interval's last rank is done, where the slowest rank's similarity would count the wait
    twice."""
    return min(per_rank, default=0.0)


def host_costs(replies: Sequence[dict], call_s: float) -> HostCosts:
    """:class:`HostCosts` from every rank's :meth:`probe_costs` answer and the seconds the
    driver waited for the call: each term is the slowest rank's (an interval ends with its last
    rank), the similarity collective's the least of the ranks' (:func:`similarity_of`); the
    call's own cost is its wait beyond the slowest rank's work; a configure is a call of its own
    plus the slowest rank's configure."""
    slowest = max(float(r["work_s"]) for r in replies)
    call = max(0.0, float(call_s) - slowest)
    by_size: dict[int, float] = {}
    for r in replies:
        for samples, secs in r["loader"]:
            by_size[int(samples)] = max(by_size.get(int(samples), 0.0), float(secs))
    fixed, per_sample = line_fit(sorted(by_size.items()))
    return HostCosts(call_s=call,
                     configure_s=call + max(float(r["configure_s"]) for r in replies),
                     loader_fixed_s=fixed, loader_per_sample_s=per_sample,
                     similarity_s=similarity_of(float(r["similarity_s"]) for r in replies),
                     read_s=max(float(r["read_s"]) for r in replies))


def own_pace(own: Sequence[float], pace: Sequence[float], mine: Sequence[bool]) -> float:
    """One step of a placement of mixed GPU types as the ranks marked ``mine`` (one type) would
    pace it: the slowest of their own times (:meth:`~jabasray.actors.gpu_actor.GPUActor.
    _own_step_time`) plus the step's tail, from the end of the slowest rank's own time to the
    end of the step (``max(pace) - max(own)``: the all-reduce after the last rank arrives,
    which every type pays). The pace of a fast type is the slow type's, so its own time is what
    tells what it costs; the tail is what its own time leaves out. For the slowest type it is the
    step's pace."""
    tail = max(0.0, max(float(p) for p in pace) - max(float(o) for o in own))
    return max(float(o) for o, m in zip(own, mine) if m) + tail


def emulation_fits(replies: Sequence[dict], points: Sequence[tuple[int, int, int]],
                   model: Any) -> dict[str, EmulationCost]:
    """``{gpu_type: EmulationCost}`` from the probed steps: the line through every point's
    without GA rounds (``model.model_iteration_time`` there, measured iteration time) pair (the
    model retargeted to the placement), then a GA round's ratio from the point with rounds: its
    time beyond the line's at the same point without rounds (:meth:`EmulationCost.with_rounds`;
    the line, fitted over every point, is steadier than any one point's time); {} when nothing was
    probed or the model cannot say. The measured time is what an interval measures: on a
    placement of one GPU type, the slowest rank's mean pace (wall + sleep: each step ends with
    an all-reduce, so n ranks run at the pace of the slowest); on mixed types each type's own
    pace (:func:`own_pace`, the median over the steps)."""
    predict = getattr(model, "model_iteration_time", None)
    if not points or predict is None:
        return {}
    probed = [r for r in replies if len(r.get("steps") or []) == len(points)]
    types = sorted({r["gpu_type"] for r in probed})

    def measured(gpu: str, i: int) -> float:
        if len(types) == 1:
            return max(statistics.fmean(r["steps"][i][1]) for r in probed)
        mine = [r["gpu_type"] == gpu for r in probed]
        return statistics.median(own_pace([r["steps"][i][0][k] for r in probed],
                                          [r["steps"][i][1][k] for r in probed], mine)
                                 for k in range(min(len(r["steps"][i][0]) for r in probed)))

    fits = {}
    for gpu in types:
        times = [measured(gpu, i) for i in range(len(points))]
        fit = EmulationCost.through([(predict(gpu, bl, n, 0), times[i])
                                     for i, (bl, n, ga) in enumerate(points) if not ga])
        line = fit
        for i, (bl, n, ga) in enumerate(points):
            if ga:
                x0 = predict(gpu, bl, n, 0)
                fit = fit.with_rounds((predict(gpu, bl, n, ga) - x0) / ga, (times[i] - line.time(x0)) / ga)
        fits[gpu] = fit
    return fits


def _ragged_line(residuals: dict[int, list[float]]) -> tuple[float, float]:
    """``(fixed, per worker)``: the line through the median residual at each VSW count (the
    fewest and the most), a single count's median as the fixed part; (0, 0) for none."""
    if not residuals:
        return 0.0, 0.0
    medians = sorted((w, statistics.median(r)) for w, r in residuals.items())
    (w0, r0), (w1, r1) = medians[0], medians[-1]
    per_worker = (r1 - r0) / (w1 - w0) if w1 > w0 else 0.0
    return r0 - per_worker * w0, per_worker


def ragged_extra(replies: Sequence[dict], model: Any) -> dict[str, Any]:
    """The :class:`HostCosts` fields of a ragged step's cost on the placed actors beyond its
    Eq. 6 (:func:`~jabasray.planners.interval_model.ragged_step_time`): ``ragged_fixed_s``,
    ``ragged_per_worker_s`` and ``ragged_by_type``. Per probed ragged step (``reply["ragged"]``:
    ``[VSWs, size, pace seconds, own seconds]``, no GA steps) the residual is the measured time
    minus the prediction by ``model`` (the model that predicts them: the emulation's measured
    cost included); the line through the median residual at each VSW count (the probe has two:
    one VSW and the profile's most; a median, as one step is a sample of the shared cores'
    noise), signed (the model may also over-predict). The placement's line: the slowest rank's
    pace (the ranks step together) against the slowest rank's prediction. Per type: on mixed
    types each type's own pace (:func:`own_pace`) against its own prediction, as
    :func:`emulation_fits` takes them; on one type none (the placement's line is that type's).
    All zero when no ragged step was probed."""
    steps = [r.get("ragged") or [] for r in replies]
    count = min((len(s) for s in steps), default=0)
    types = sorted({r["gpu_type"] for r in replies})
    placement: dict[int, list[float]] = {}
    by_type: dict[str, dict[int, list[float]]] = {g: {} for g in types}
    for i in range(count):
        workers, size = int(steps[0][i][0]), int(steps[0][i][1])
        predicted = {g: ragged_step_time(model, g, workers, 0, size) for g in types}
        placement.setdefault(workers, []).append(max(float(s[i][2]) for s in steps) - max(predicted.values()))
        if len(types) > 1:
            for g in types:
                paced = own_pace([s[i][3] for s in steps], [s[i][2] for s in steps],
                                 [r["gpu_type"] == g for r in replies])
                by_type[g].setdefault(workers, []).append(paced - predicted[g])
    fixed, per_worker = _ragged_line(placement)
    lines = {g: _ragged_line(by_type[g]) for g in types} if len(types) > 1 and placement else {}
    return {"ragged_fixed_s": fixed, "ragged_per_worker_s": per_worker,
            "ragged_by_type": tuple((g, f, w) for g, (f, w) in sorted(lines.items()))}


def measured_terms(replies: Sequence[Any], call_s: float, configure_s: float) -> dict[str, float]:
    """The terms of an interval as it ran (:data:`TERMS`, seconds): each of the actors' own
    terms (``IntervalReply.terms``: steps with the emulation's sleep, loader, similarity, read)
    at its slowest rank, the similarity the least of the ranks' (:func:`similarity_of`), as
    :func:`host_costs` takes the probe's (``ragged``: the epoch's ragged last step, when the
    interval ends with it); the train call's wait beyond the slowest rank's whole call; and the
    configure call."""
    own = [getattr(r, "terms", None) or {} for r in replies]
    out = {t: max(float(o.get(t, 0.0)) for o in own) for t in TERMS}
    out["similarity"] = similarity_of(float(o.get("similarity", 0.0)) for o in own)
    out["call"] = max(0.0, float(call_s) - max(r.wall_time for r in replies))
    out["configure"] = float(configure_s)
    return out


def describe(costs: HostCosts, fits: dict[str, EmulationCost]) -> str:
    """One log line of what was measured."""
    parts = [f"call {costs.call_s * 1e3:.1f} ms", f"configure {costs.configure_s * 1e3:.1f} ms",
             f"loader {costs.loader_fixed_s * 1e3:.2f} ms + {costs.loader_per_sample_s * 1e6:.1f} us/sample",
             f"similarity {costs.similarity_s * 1e3:.1f} ms", f"read {costs.read_s * 1e3:.2f} ms",
             f"ragged step {costs.ragged_fixed_s * 1e3:+.1f} ms {costs.ragged_per_worker_s * 1e3:+.1f} ms/worker "
             "beyond Eq. 6"]
    parts += [f"{g} ragged step {f * 1e3:+.1f} ms {w * 1e3:+.1f} ms/worker" for g, f, w in costs.ragged_by_type]
    parts += [f"{g} emulation t = {c.a * 1e3:.2f} ms + {c.b:.2f} t_model, GA rounds x{c.rounds_b:.2f}"
              for g, c in sorted(fits.items())]
    return "interval costs measured on the placed actors: " + ", ".join(parts)


__all__ = ["PROBE_GA_ROUNDS", "probe_points", "own_pace", "similarity_of", "host_costs", "emulation_fits", "ragged_extra", "measured_terms", "describe"]
