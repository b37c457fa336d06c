"""Crossbow Algorithm 2 (learner auto-tuning) driven by synthetic throughput curves.

A curve maps the learner count m to the GPU's throughput; the test plays the GPU: it measures
the curve at the count the tuner asks for, feeds it back, until the tuner settles.
Expected counts are the plateau start / peak (Crossbow 5.4: "the throughput grows until m=4 and
then decreases" -> m=4).
"""
from __future__ import annotations

import random

import pytest

from jabasray.planners.learner_tuner import GPULearnerState, LearnerTuner


def drive(tuner: LearnerTuner, curves: dict, max_rounds: int = 100, noise=None) -> dict[str, int]:
    for _ in range(max_rounds):
        if tuner.all_settled and len(tuner.gpus) == len(curves):
            break
        obs = {}
        for g, curve in curves.items():
            t = curve(tuner.learners(g))
            obs[g] = t + (noise() if noise else 0.0)
        tuner.observe_all(obs)
    assert tuner.all_settled, "tuner did not settle"
    return {g: tuner.learners(g) for g in curves}


def peak_at_4(m):          # grows until m=4, then decreases (ResNet-32, 1 GPU, Crossbow 5.4)
    return {1: 100.0, 2: 180.0, 3: 240.0, 4: 270.0, 5: 250.0, 6: 220.0}.get(m, 200.0)


def plateau_from_4(m):     # grows until m=4, then flat within noise (tiny gains < tau)
    return 270.0 + 0.5 * (m - 4) if m >= 4 else 70.0 * m


def test_settles_on_peak():
    tuner = LearnerTuner(tau=5.0)
    assert drive(tuner, {"gpu0": peak_at_4}) == {"gpu0": 4}
    # probed 1..5, backed off after the drop at 5
    assert [m for m, _ in tuner.gpus["gpu0"].history] == [1, 2, 3, 4, 5]


def test_settles_on_plateau_start_not_after_it():
    tuner = LearnerTuner(tau=5.0)
    assert drive(tuner, {"gpu0": plateau_from_4}) == {"gpu0": 4}


def test_drop_backs_off_and_stays_settled():
    """Alg. 2 line 7: a drop removes the learner; unlike the literal loop we do not re-add it."""
    tuner = LearnerTuner(tau=1.0)
    seq = []
    for _ in range(8):
        m = tuner.learners("g")
        seq.append(m)
        tuner.observe("g", {1: 100.0, 2: 150.0, 3: 120.0}[m])
    assert seq == [1, 2, 3, 2, 2, 2, 2, 2]
    assert tuner.is_settled("g")


def test_literal_algorithm2_would_oscillate():
    """Why we settle: the literal update rule on the same curve keeps flipping 2 <-> 3."""
    curve = {1: 100.0, 2: 150.0, 3: 120.0}
    l, t_prev, seq = 1, 0.0, []
    for _ in range(8):
        t = curve[l]
        seq.append(l)
        if t - t_prev > 1.0:
            l += 1
        elif t < t_prev and l > 1:
            l -= 1
        t_prev = t
    assert seq[3:] == [2, 3, 2, 3, 2]


def test_gpus_are_independent():
    fast = lambda m: 100.0 * min(m, 3)            # plateau from 3
    slow = lambda m: 100.0 * min(m, 6) - 20.0 * max(0, m - 6)   # peak at 6
    flat = lambda m: 50.0                          # one learner saturates
    tuner = LearnerTuner(tau=2.0)
    got = drive(tuner, {"a": fast, "b": slow, "c": flat})
    assert got == {"a": 3, "b": 6, "c": 1}


def test_max_learners_caps_growth():
    tuner = LearnerTuner(tau=1.0, max_learners=3)
    assert drive(tuner, {"g": lambda m: 100.0 * m}) == {"g": 3}
    assert max(m for m, _ in tuner.gpus["g"].history) == 3


def test_tau_controls_what_counts_as_a_gain():
    diminishing = lambda m: {1: 100.0, 2: 160.0, 3: 190.0, 4: 200.0, 5: 204.0}.get(m, 205.0)
    assert drive(LearnerTuner(tau=0.0), {"g": diminishing}) == {"g": 6}     # any gain counts (max 8: 205=205 stops)
    assert drive(LearnerTuner(tau=15.0), {"g": diminishing}) == {"g": 3}    # +10 at m=4 is not enough
    # relative tau: 10 % of the previous throughput
    assert drive(LearnerTuner(tau=0.1, relative=True), {"g": diminishing}) == {"g": 3}


def test_samples_per_decision_averages_noise():
    rng = random.Random(0)
    noise = lambda: rng.uniform(-8.0, 8.0)
    tuner = LearnerTuner(tau=5.0, samples_per_decision=20)
    assert drive(tuner, {"g": peak_at_4}, max_rounds=400, noise=noise) == {"g": 4}


def test_reset_probes_again():
    tuner = LearnerTuner(tau=1.0)
    drive(tuner, {"g": peak_at_4})
    tuner.reset("g")
    assert tuner.learners("g") == 1 and not tuner.is_settled("g")
    assert drive(tuner, {"g": lambda m: 100.0 * min(m, 2)}) == {"g": 2}


def test_json_round_trip_mid_tuning():
    tuner = LearnerTuner(tau=5.0, max_learners=6, samples_per_decision=2)
    for t in (100.0, 104.0, 180.0):
        tuner.observe("gpu0", t)
    tuner.observe("gpu1", 50.0)
    back = LearnerTuner.from_json(tuner.to_json())
    assert back == tuner
    assert isinstance(back.gpus["gpu0"], GPULearnerState)
    # both continue identically
    for t in (181.0, 170.0, 171.0):
        assert back.observe("gpu0", t) == tuner.observe("gpu0", t)
    assert back == tuner


@pytest.mark.parametrize("kwargs,field", [
    (dict(tau=-1.0), "tau"), (dict(max_learners=0), "max_learners"),
    (dict(samples_per_decision=0), "samples_per_decision"), (dict(tau=float("nan")), "tau"),
])
def test_bad_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LearnerTuner(**kwargs)


def test_bad_observation():
    tuner = LearnerTuner()
    with pytest.raises(ValueError, match="throughput"):
        tuner.observe("g", -1.0)
    with pytest.raises(ValueError, match="gpu"):
        tuner.observe(3, 10.0)


# ---------------------------------------------------------------- symmetric pairs (JABAS groups)

def test_pair_tuning_keeps_both_gpus_of_a_pair_at_one_count():
    """Two pairs of GPUs; the GPUs of pair A have different curves (one peaks at 2 learners,
    the other at 4). Tuned per GPU they would end at 2 and 4 (unequal similarity groups);
    tuned per pair they move together on the sum of their throughputs, and at every step
    group 0 (first GPU of each pair) and group 1 hold the same number of learners."""
    curves = {"a0": lambda m: {1: 100.0, 2: 150.0}.get(m, 140.0),       # peak at 2
              "a1": peak_at_4,                                           # peak at 4
              "b0": peak_at_4, "b1": peak_at_4}
    per_gpu = LearnerTuner(tau=5.0)
    assert drive(per_gpu, curves) == {"a0": 2, "a1": 4, "b0": 4, "b1": 4}

    pairs = {"pairA": ["a0", "a1"], "pairB": ["b0", "b1"]}
    tuner = LearnerTuner(tau=5.0)
    counts = {g: 1 for g in curves}
    seen = []
    for _ in range(20):
        seen.append(dict(counts))
        counts = tuner.observe_pairs({g: curves[g](counts[g]) for g in curves}, pairs)
    assert all(c["a0"] == c["a1"] and c["b0"] == c["b1"] for c in seen + [counts])
    assert all(c["a0"] + c["b0"] == c["a1"] + c["b1"] for c in seen)
    # pair A's sum: m=1 200, 2 330, 3 380 (140 + 240), 4 410 (140 + 270), 5 390 -> settles at 4
    assert counts == {"a0": 4, "a1": 4, "b0": 4, "b1": 4}
    assert [m for m, _ in tuner.gpus["pairA"].history] == [1, 2, 3, 4, 5]
    assert tuner.gpus["pairA"].history[1] == (2, 330.0)
    assert tuner.all_settled and LearnerTuner.from_json(tuner.to_json()) == tuner


def test_pair_tuning_rejects_gpus_outside_or_in_two_pairs():
    tuner = LearnerTuner()
    with pytest.raises(ValueError, match="pairs must list every GPU"):
        tuner.observe_pairs({"a": 1.0, "b": 1.0}, {"p": ["a"]})
    with pytest.raises(ValueError, match="pairs must list every GPU"):
        tuner.observe_pairs({"a": 1.0, "b": 1.0}, {"p": ["a", "b"], "q": ["b"]})
    with pytest.raises(ValueError, match=r"throughput\[b\]"):
        tuner.observe_pairs({"a": 1.0, "b": -1.0}, {"p": ["a", "b"]})
