"""The packing cost model and its decision (pure: no Ray, no torch), against brute force on
small cost tables."""
from __future__ import annotations

import itertools
import random

import pytest

from jabasray.planners.pack_cost import (ALONE, PackCosts, alone_time, decide, halving_units,
                                         packed_time)


def _costs(unit_packed, unit_alone=0.01, start_alone=3.5, start_relay=1.7, start_coord=3.0,
           load=0.005, relay=0.002):
    return PackCosts(start_alone, start_relay, start_coord, load, unit_alone, list(unit_packed), relay)


def _simulated_pack(costs, units, cores, k, devices):
    """Brute force: the sweep unit by unit. At each unit index the members still training are
    cut into packs of k (the last one smaller); every pack is one packed unit of work; the
    devices share the work, and the longest trial (one unit after the other, alone in a pack
    at best) bounds it. Fixed costs are added term by term."""
    remaining = list(units)
    work, longest = 0.0, 0.0
    while any(remaining):
        alive = [i for i, r in enumerate(remaining) if r > 0]
        for lo in range(0, len(alive), k):
            work += costs.unit_packed_s[len(alive[lo:lo + k]) - 1]
        longest += costs.unit_packed_s[0]
        for i in alive:
            remaining[i] -= 1
    train = max(work / devices, longest)
    start = (devices * costs.start_coordinator_s + min(len(units), k * devices) * costs.start_relay_s) / cores
    return start + train + len(units) * costs.load_s / devices + sum(units) * costs.relay_s / cores


def _simulated_alone(costs, units, cores, slots):
    """Brute force for trials alone: every assignment of trials to the ``slots`` processes;
    the sweep's training lasts as long as the busiest process (the model's bound
    max(sum / slots, max) is reached by the best assignment when it is tight, and never beaten)."""
    a = min(slots, len(units))
    best = min(max(sum(u for u, p in zip(units, assign) if p == s) for s in range(a))
               for assign in itertools.product(range(a), repeat=len(units)))
    return max(1.0, a / cores) * costs.start_alone_s, best * costs.unit_alone_s


def test_halving_units_follow_successive_halving_rungs():
    # R = 81, eta = 3, 81 trials: 54 stop at 1 unit, 18 at 3, 6 at 9, 2 at 27, 1 trains 81
    u = halving_units(81, 81)
    assert [u.count(x) for x in (1, 3, 9, 27, 81)] == [54, 18, 6, 2, 1] and len(u) == 81
    assert halving_units(9, 9) == [9, 3, 3, 1, 1, 1, 1, 1, 1]
    assert halving_units(2, 27) == [1, 1]                    # nobody promoted out of 2 at eta 3
    assert halving_units(5, 1) == [1] * 5                    # max_t = grace: every trial trains 1
    # brute force: walk the rungs with a list of live trials
    for n, R, eta, grace in [(49, 27, 3, 1), (30, 16, 2, 1), (10, 12, 3, 2)]:
        live, out, r = list(range(n)), {}, grace
        while r < R and live:
            keep = live[:len(live) // eta]
            for t in live[len(keep):]:
                out[t] = r
            live, r = keep, r * eta
        for t in live:
            out[t] = R
        assert halving_units(n, R, eta, grace) == sorted(out.values(), reverse=True)


def test_packed_time_equals_a_unit_by_unit_simulation():
    rng = random.Random(0)
    for _ in range(150):
        kmax = rng.randint(1, 5)
        c = _costs(sorted(rng.uniform(0.001, 0.1) for _ in range(kmax)), load=rng.uniform(0, 0.1),
                   relay=rng.uniform(0, 0.01), start_coord=rng.uniform(0, 5), start_relay=rng.uniform(0, 3))
        units = [rng.randint(1, 9) for _ in range(rng.randint(1, 8))]
        cores, devices, k = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, kmax)
        assert packed_time(c, units, cores, k, devices) == pytest.approx(
            _simulated_pack(c, units, cores, k, devices), rel=1e-12)


def test_alone_time_is_the_best_assignment_where_the_bound_is_tight():
    c = _costs([0.01])
    for units, slots in [([3, 3, 2, 2, 1, 1], 2), ([9, 1, 1], 2), ([1, 1, 1, 1], 3), ([4, 2, 2], 2)]:
        start, train = _simulated_alone(c, units, 2, slots)
        model = alone_time(c, units, 2, slots) - len(units) * c.load_s / min(slots, len(units))
        assert model <= start + train + 1e-12                 # never above the best schedule
    # where sum/slots or max is achievable the model IS the best schedule
    for units in ([3, 3, 2, 2, 1, 1], [9, 1, 1], [4, 2, 2]):
        start, train = _simulated_alone(c, units, 2, 2)
        assert alone_time(c, units, 2, 2) == pytest.approx(start + train + len(units) * c.load_s / 2)


def _brute_force_decision(costs, units, cores, devices, margin):
    """Every option priced by the simulations; the least; a pack only if margin faster."""
    alone = alone_time(costs, units, cores, cores)
    packs = {k: _simulated_pack(costs, units, cores, k, devices) for k in range(1, costs.max_members + 1)}
    k = min(packs, key=lambda k: (packs[k], k))
    return (k, packs[k]) if packs[k] <= (1 - margin) * alone else (ALONE, alone)


def test_decision_is_the_brute_force_optimum_on_random_small_cost_tables():
    rng = random.Random(1)
    seen = set()
    for _ in range(300):
        kmax = rng.randint(1, 6)
        single = rng.uniform(0.001, 0.5)
        # a packed unit of k costs between one unit and k units alone (Pack 4.3: sublinear)
        packed_units = [single * (1 + (k - 1) * rng.uniform(0.1, 1.2)) for k in range(1, kmax + 1)]
        c = _costs(packed_units, unit_alone=single, start_alone=rng.uniform(0.5, 4),
                   start_relay=rng.uniform(0.2, 2), start_coord=rng.uniform(0.5, 4), load=rng.uniform(0, 0.05))
        units = halving_units(rng.randint(1, 30), rng.choice([1, 3, 9, 27]))
        cores, devices, margin = rng.randint(1, 4), rng.randint(1, 2), rng.choice([0.0, 0.1])
        d = decide(c, units, cores, devices, margin=margin)
        k, t = _brute_force_decision(c, units, cores, devices, margin)
        assert (d.members_per_device, d.pack) == (k, k != ALONE)
        assert d.predicted_s == pytest.approx(t, rel=1e-12)
        assert d.trials_at_once == (k * devices if d.pack else min(cores, len(units)))
        seen.add(d.members_per_device)
    assert ALONE in seen and len(seen) >= 4              # the tables exercise both outcomes, several k


def test_small_units_and_costly_trial_processes_train_alone():
    """25 ms units, 49 trials of Table 3 under ASHA (R = 27) on 2 cores: the extra processes and
    coordinators of packing cost more than the packed step saves."""
    c = _costs([0.025, 0.045, 0.066, 0.088, 0.11, 0.13, 0.15, 0.17], unit_alone=0.025,
               start_alone=3.5, start_relay=1.8, start_coord=3.0, load=0.02, relay=0.004)
    d = decide(c, halving_units(49, 27), cores=2, devices=2)
    assert not d.pack and d.members_per_device == ALONE and d.trials_at_once == 2
    assert d.predicted_s == d.alone_s == d.options["alone"] < min(v for k, v in d.options.items() if k != "alone")
    assert "alone" in d.reason


def test_large_units_pack_as_many_as_the_step_gains_from():
    """2.5 s units whose packed step stops gaining beyond 4 members (the device saturates:
    P[k] grows by a full unit per member past 4): 4 per device, 8 trials at once on 2 devices.
    (Alone: 129 units x 2.5 s / 2 = 161 s + 3.5 s; 4 per device: the packed work of 49, 16, 4
    and 1 members per level over 2 devices, about 85 s, + 8.3 s of starts.)"""
    s = 2.5
    p = [s, 1.2 * s, 1.4 * s, 1.6 * s, 2.6 * s, 3.6 * s, 4.6 * s, 5.6 * s]
    d = decide(_costs(p, unit_alone=s), halving_units(49, 27), cores=2, devices=2)
    assert d.pack and d.members_per_device == 4 and d.trials_at_once == 8 and d.devices == 2
    assert d.predicted_s < 0.9 * d.alone_s and "packing 4 per device" in d.reason


def test_a_pack_barely_faster_than_alone_is_not_chosen_within_the_margin():
    c = _costs([0.1, 0.19], unit_alone=0.1, start_alone=0.0, start_relay=0.0, start_coord=0.0,
               load=0.0, relay=0.0)
    units = [4, 4, 4, 4]
    # alone on 1 core: 16 units x 0.1; packed by 2 on 1 device: 2 packs x 4 levels x 0.19
    assert alone_time(c, units, 1, 1) == pytest.approx(1.6)
    assert packed_time(c, units, 1, 2, 1) == pytest.approx(1.52)
    assert not decide(c, units, 1, 1, margin=0.1).pack
    assert decide(c, units, 1, 1, margin=0.0).members_per_device == 2


def test_bad_input_is_a_one_line_value_error_naming_the_field():
    c = _costs([0.1, 0.2])
    with pytest.raises(ValueError, match="unit_packed_s"):
        PackCosts(1, 1, 1, 0, 0.1, [])
    with pytest.raises(ValueError, match="load_s"):
        PackCosts(1, 1, 1, -1, 0.1, [0.1])
    with pytest.raises(ValueError, match="units"):
        decide(c, [], 2, 1)
    with pytest.raises(ValueError, match=r"units\[1\]"):
        decide(c, [1, 0], 2, 1)
    with pytest.raises(ValueError, match="max_members"):
        decide(c, [1], 2, 1, max_members=3)
    with pytest.raises(ValueError, match="margin"):
        decide(c, [1], 2, 1, margin=1.0)
    with pytest.raises(ValueError, match="num_trials"):
        halving_units(0, 3)


def test_costs_and_decisions_round_trip_through_json():
    c = _costs([0.1, 0.15])
    assert PackCosts.from_json(c.to_json()) == c
    d = decide(c, [3, 1, 1], 2, 1)
    assert type(d).from_json(d.to_json()) == d
