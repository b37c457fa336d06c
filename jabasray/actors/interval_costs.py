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


def probe_points(model: Any, gpu_type: str) -> list[tuple[int, int]]:
    """The ``(B_L, n_vsw)`` points the placed actors time their step at: every profiled B_L at
    n_vsw = 1 and at its n_max (the two points of Eq. 1 the profile measured), in the profile's
    order; [] for a model without profiles."""
    profiles = getattr(model, "profiles", None)
    if not profiles or gpu_type not in profiles:
        return []
    points = []
    for b in profiles[gpu_type].batches:
        points += [(b.local_batch, 1)] + ([(b.local_batch, b.max_num_vsw)] if b.max_num_vsw > 1 else [])
    return points


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


def emulation_fits(replies: Sequence[dict], points: Sequence[tuple[int, int]],
                   model: Any) -> dict[str, EmulationCost]:
    """``{gpu_type: EmulationCost}`` from the probed steps: the line through every point's
    (``model.model_iteration_time`` there, measured iteration time) pair (the model retargeted
    to the placement); {} when nothing was probed or the model cannot say. The measured time is
    what an interval measures: on a placement of one GPU type, the slowest rank's mean pace
    (wall + sleep: each step ends with an all-reduce, so n ranks run at the pace of the
    slowest); on mixed types the pace of a fast type is the slow type's, so each type's own
    times are taken instead (per step the slowest rank of the type, the median over the steps)."""
    predict = getattr(model, "model_iteration_time", None)
    if not points or predict is None:
        return {}
    by_type: dict[str, list] = {}
    for r in replies:
        if len(r.get("steps") or []) == len(points):
            by_type.setdefault(r["gpu_type"], []).append(r["steps"])
    fits = {}
    for gpu, ranks in by_type.items():
        pairs = []
        for i, (bl, n) in enumerate(points):
            if len(by_type) == 1:
                measured = max(statistics.fmean(rank[i][1]) for rank in ranks)
            else:
                own = [rank[i][0] for rank in ranks]
                measured = statistics.median(max(float(o[k]) for o in own)
                                             for k in range(min(len(o) for o in own)))
            pairs.append((predict(gpu, bl, n, 0), measured))
        fits[gpu] = EmulationCost.through(pairs)
    return fits


def ragged_extra(replies: Sequence[dict], model: Any) -> tuple[float, float]:
    """``(HostCosts.ragged_fixed_s, ragged_per_worker_s)``: what a ragged step costs on the
    placed actors beyond its Eq. 6 (:func:`~jabasray.planners.interval_model.ragged_step_time`).
    Per probed ragged step (``reply["ragged"]``: ``[VSWs, size, pace seconds]``, no GA steps)
    the residual is the slowest rank's pace (the ranks step together) minus the slowest rank's
    prediction by ``model`` (the model that predicts them: the emulation's measured cost
    included); the line through the median residual at each VSW count (the probe has two: one
    VSW and the profile's most; a median, as one step is a sample of the shared cores' noise),
    signed (the model may also over-predict); one count: its median as the fixed part; (0, 0)
    when no ragged step was probed."""
    steps = [r.get("ragged") or [] for r in replies]
    count = min((len(s) for s in steps), default=0)
    by_workers: dict[int, list[float]] = {}
    for i in range(count):
        measured = max(float(s[i][2]) for s in steps)
        predicted = max(ragged_step_time(model, r["gpu_type"], int(s[i][0]), 0, int(s[i][1]))
                        for r, s in zip(replies, steps))
        by_workers.setdefault(int(steps[0][i][0]), []).append(measured - predicted)
    if not by_workers:
        return 0.0, 0.0
    medians = sorted((w, statistics.median(r)) for w, r in by_workers.items())
    (w0, r0), (w1, r1) = medians[0], medians[-1]
    per_worker = (r1 - r0) / (w1 - w0) if w1 > w0 else 0.0
    return r0 - per_worker * w0, per_worker


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
    parts += [f"{g} emulation t = {c.a * 1e3:.2f} ms + {c.b:.2f} t_model" for g, c in sorted(fits.items())]
    return "interval costs measured on the placed actors: " + ", ".join(parts)


__all__ = ["probe_points", "similarity_of", "host_costs", "emulation_fits", "ragged_extra", "measured_terms", "describe"]
