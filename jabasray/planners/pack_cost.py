"""When packing pays: a cost model of packed trials and the decision made from it (Pack paper,
sections 4.2, 4.6 and 5.2).

Pure planning code (no torch, no ray). Pack compares the step time of a packed model with the
sum of its members' step times (section 4.2, Eq. 1-2: ``T_s(Pack)`` against ``T_s(Seq)``),
counts the switching overhead of loading and unloading members (section 4.6), and notes that
the singleton partitioning -- every configuration trained alone -- is always feasible and may
be the optimum (section 5.2). In a Ray Tune sweep the fixed costs around the step matter as
much as the step itself: every admitted trial is a process (a Ray worker importing Ray Tune,
plus torch and the data when it trains alone), a packed device needs a coordinator, each
member is loaded and freed, and every unit a packed trial reports is relayed through one more
Ray call. This module sums those measured terms into a predicted time to finish a sweep, for
training every trial alone (as Tune runs it) and for packing ``k`` members per device, and
picks the cheapest.

Model (every term a measured cost of :class:`PackCosts`; ``u_i`` the units trial ``i``
trains, ``N`` trials, ``C`` cores, ``D`` packed devices, ``S`` one unit alone, ``P[k]`` one
packed unit of ``k`` members):

* alone, ``A`` trials at once (``A = C`` on CPU: one CPU per trial; one per GPU on GPUs), each
  trial process reused across trials (``reuse_actors``)::

      T_alone = max(1, A / C) * start_alone + max(sum(u) * S / A, max(u) * S) + N * load / A

* packed, ``k`` members per device, ``k D`` trials admitted at once::

      T_pack(k) = (D * start_coord + min(N, k D) * start_relay) / C
                  + max(sum_j level_j(k) / D, max(u) * P[1]) + N * load / D + sum(u) * relay / C

  where level ``j`` (the ``j``-th unit of every trial that trains more than ``j`` units: the
  ``n_j`` members alive there) is ``n_j // k`` full packed units and one of the ``n_j % k``
  left: ``level_j(k) = (n_j // k) P[k] + P[n_j % k]`` (``P[0] = 0``). Members of a
  successive-halving sweep leave at the rungs, so the packs shrink level by level; the
  devices share the packed work, and the longest trial, a unit at a time, bounds it from
  below -- the same two bounds as training alone, so neither option is favoured by the form
  of the model.

The decision (:func:`decide`) is the option of least predicted time; a pack is chosen only when
it is predicted at least ``margin`` faster than training alone (the model's error must not
make a sweep slower than Tune's own). Which configurations share a pack is the kNN order of
:mod:`jabasray.planners.pack_opt` (section 5.3) in groups of the chosen ``k``.

The units each trial trains are not known before the sweep; :func:`halving_units` gives the
successive-halving estimate (ASHA and Hyperband keep ``1 / eta`` of a rung).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

from jabasray.serialization import JsonMixin
from jabasray.validation import check_float, check_int

log = logging.getLogger(__name__)

__all__ = ["PackCosts", "PackDecision", "halving_units", "alone_time", "packed_time", "level_time",
           "decide", "ALONE"]

ALONE = 0            # ``members_per_device`` of the option "every trial trains alone"


@dataclass
class PackCosts(JsonMixin):
    """Measured costs of packed and unpacked trials on one machine (seconds; "core-s": CPU
    seconds that share the machine's cores)."""
    start_alone_s: float          # core-s to start a trial process that trains alone (Ray worker,
                                  # Ray Tune, torch, the model and data)
    start_relay_s: float          # core-s to start a packed trial's process (Ray worker, Ray Tune)
    start_coordinator_s: float    # core-s to start one device's coordinator (torch, data)
    load_s: float                 # one member's load (build, state) plus its free, on its device
    unit_alone_s: float           # one unit of one configuration trained alone
    unit_packed_s: list[float]    # unit_packed_s[k - 1]: one unit of a pack of k members
    relay_s: float = 0.0          # core-s per member-unit to relay it through the coordinator

    def __post_init__(self) -> None:
        for name in ("start_alone_s", "start_relay_s", "start_coordinator_s", "load_s",
                     "unit_alone_s", "relay_s"):
            check_float(name, getattr(self, name), min_value=0.0)
        if not self.unit_packed_s:
            raise ValueError("unit_packed_s must list the packed unit time of 1..K members, got []")
        self.unit_packed_s = [check_float(f"unit_packed_s[{i}]", v, min_value=0.0)
                              for i, v in enumerate(self.unit_packed_s)]

    @property
    def max_members(self) -> int:
        return len(self.unit_packed_s)

    def packed_unit(self, k: int) -> float:
        """``P[k]``: one packed unit of ``k`` members (``P[0] = 0``)."""
        return 0.0 if k == 0 else self.unit_packed_s[k - 1]


@dataclass
class PackDecision(JsonMixin):
    """What :func:`decide` chose and why."""
    pack: bool                    # False: every trial trains alone in its own trial process
    members_per_device: int       # members of one packed model (0 when alone)
    trials_at_once: int           # trials admitted at once (processes alive)
    devices: int                  # packed devices (coordinators; 0 when alone)
    predicted_s: float            # predicted time to finish of the choice
    alone_s: float                # predicted time to finish with every trial alone
    options: dict[str, float] = field(default_factory=dict)   # "alone" / "k=<k>" -> predicted s
    reason: str = ""


def halving_units(num_trials: int, max_units: int, eta: int = 3, grace: int = 1) -> list[int]:
    """Units each of ``num_trials`` trials trains under successive halving (ASHA with
    ``grace_period=grace``, ``reduction_factor=eta``, ``max_t=max_units``): rung ``i`` is at
    ``grace * eta^i`` units; ``n_{i+1} = floor(n_i / eta)`` of the ``n_i`` trials that reach it
    go on; the rest stop there; those past the last rung train ``max_units``. Longest first.

    >>> halving_units(9, 9)        # rungs 1, 3: 6 trials stop at 1, 2 at 3, 1 trains 9
    [9, 3, 3, 1, 1, 1, 1, 1, 1]
    """
    check_int("num_trials", num_trials, min_value=1)
    check_int("max_units", max_units, min_value=1)
    check_int("eta", eta, min_value=2)
    check_int("grace", grace, min_value=1)
    out: list[int] = []
    n, r = num_trials, grace
    while r < max_units and n > 0:
        go_on = n // eta
        out += [r] * (n - go_on)
        n, r = go_on, r * eta
    out += [max_units] * n
    return sorted(out, reverse=True)


def _check_sweep(units: Sequence[int], cores: int) -> None:
    if not units:
        raise ValueError("units must list the units of at least one trial, got []")
    for i, u in enumerate(units):
        check_int(f"units[{i}]", u, min_value=1)
    check_int("cores", cores, min_value=1)


def alone_time(costs: PackCosts, units: Sequence[int], cores: int, slots: int) -> float:
    """``T_alone`` of the module docstring: ``slots`` trials alone at once on ``cores`` cores."""
    _check_sweep(units, cores)
    check_int("slots", slots, min_value=1)
    a = min(slots, len(units))
    start = max(1.0, a / cores) * costs.start_alone_s
    train = max(sum(units) * costs.unit_alone_s / a, max(units) * costs.unit_alone_s)
    return start + train + len(units) * costs.load_s / a


def level_time(costs: PackCosts, alive: int, k: int) -> float:
    """``level_j(k)`` of the module docstring: the packed work of one unit of ``alive``
    members, packed ``k`` at a time."""
    return (alive // k) * costs.packed_unit(k) + costs.packed_unit(alive % k)


def packed_time(costs: PackCosts, units: Sequence[int], cores: int, k: int, devices: int) -> float:
    """``T_pack(k)`` of the module docstring."""
    _check_sweep(units, cores)
    check_int("k", k, min_value=1, max_value=costs.max_members)
    check_int("devices", devices, min_value=1)
    n = len(units)
    start = (devices * costs.start_coordinator_s + min(n, k * devices) * costs.start_relay_s) / cores
    by_level = sorted(units)                # n_j = #{u_i > j}
    work, i = 0.0, 0
    for j in range(max(units)):
        while i < n and by_level[i] <= j:
            i += 1
        work += level_time(costs, n - i, k)
    train = max(work / devices, max(units) * costs.packed_unit(1))
    return start + train + n * costs.load_s / devices + sum(units) * costs.relay_s / cores


def decide(costs: PackCosts, units: Sequence[int], cores: int, devices: int, slots: int | None = None,
           max_members: int | None = None, margin: float = 0.1) -> PackDecision:
    """Pack or not, and how many members per device: the option of least predicted time (module
    docstring) among training alone (``slots`` trials at once, default ``cores``) and packing
    ``k = 1 .. max_members`` members on each of ``devices`` devices (``max_members`` defaults
    to what ``costs`` measured). A pack must be predicted at least ``margin`` (a fraction)
    faster than alone to be chosen."""
    _check_sweep(units, cores)
    check_int("devices", devices, min_value=1)
    check_float("margin", margin, min_value=0.0, max_value=1.0, max_exclusive=True)
    slots = cores if slots is None else check_int("slots", slots, min_value=1)
    kmax = costs.max_members if max_members is None else check_int(
        "max_members", max_members, min_value=1, max_value=costs.max_members)
    alone = alone_time(costs, units, cores, slots)
    options = {"alone": alone}
    best_k, best = ALONE, math.inf
    for k in range(1, kmax + 1):
        t = packed_time(costs, units, cores, k, devices)
        options[f"k={k}"] = t
        if t < best:
            best_k, best = k, t
    pays = best <= (1.0 - margin) * alone
    summary = (f"{len(units)} trials, {sum(units)} units; a unit alone {costs.unit_alone_s * 1e3:.1f} ms, "
               f"packed x{best_k} {costs.packed_unit(best_k) * 1e3:.1f} ms; trial start "
               f"{costs.start_alone_s:.2f} core-s alone, {costs.start_relay_s:.2f} packed")
    if pays:
        reason = (f"packing {best_k} per device on {devices} device(s) is predicted {best:.1f} s against "
                  f"{alone:.1f} s alone ({alone / best:.2f}x): {summary}")
        return PackDecision(True, best_k, best_k * devices, devices, best, alone, options, reason)
    reason = (f"every trial trains alone: predicted {alone:.1f} s, the best pack ({best_k} per device) "
              f"{best:.1f} s, not {margin:.0%} faster: {summary}")
    return PackDecision(False, ALONE, min(slots, len(units)), 0, alone, alone, options, reason)
