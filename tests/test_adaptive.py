"""Adaptive batching: SimiGrad rule table, similarity vs reference formulas, LR rules, controller.

The rule (JABAS 6.1 with SimiGrad's multiplicative alpha): Phi < gamma -> B*(1+alpha),
Phi > gamma -> B*(1-alpha), Phi = gamma -> B, rounded half up, at least one sample per move,
clamped to [min B_G, max B_G].
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from jabasray.adaptive import (AdaptiveBatchController, cosine_similarity, group_similarity,
                               next_global_batch, scaled_lr)
from jabasray.config import JobConfig

# --- rule table -----------------------------------------------------------------------------
# (current, phi, gamma, alpha, min, max) -> expected
RULE_TABLE = [
    ((100, 0.2, 0.5, 0.1, 32, 512), 110),     # grow: 100 * 1.1
    ((100, 0.8, 0.5, 0.1, 32, 512), 90),      # shrink: 100 * 0.9
    ((100, 0.5, 0.5, 0.1, 32, 512), 100),     # equal: unchanged
    ((500, 0.0, 0.5, 0.1, 32, 512), 512),     # grow clamped at max (550 -> 512)
    ((512, 0.0, 0.5, 0.1, 32, 512), 512),     # at max, grow stays
    ((34, 0.9, 0.5, 0.1, 32, 512), 32),       # shrink clamped at min (30.6 -> 32)
    ((32, 0.9, 0.5, 0.1, 32, 512), 32),       # at min, shrink stays
    ((64, -1.0, 0.1, 0.25, 8, 1024), 80),     # alpha = 0.25: 64 * 1.25
    ((64, 1.0, 0.1, 0.25, 8, 1024), 48),      # 64 * 0.75
    ((45, 0.0, 0.5, 0.1, 8, 1024), 50),       # 49.5 rounds half up to 50 (round() would give 50 too)
    ((25, 0.0, 0.5, 0.1, 8, 1024), 28),       # 27.5 -> 28 (banker's rounding would give 28; 22.5 below)
    ((25, 1.0, 0.5, 0.1, 8, 1024), 23),       # 22.5 -> 23 (round() would give 22)
    ((4, 0.0, 0.5, 0.1, 1, 1024), 5),         # 4.4 would round back to 4: at least +1
    ((4, 1.0, 0.5, 0.1, 1, 1024), 3),         # 3.6 -> 4 would not move: at least -1
    ((1, 1.0, 0.5, 0.1, 1, 1024), 1),         # cannot go below min = 1
    ((100, 1.0, 0.5, 1.5, 10, 1000), 10),     # alpha >= 1: shrink lands on the minimum
    ((5, 0.0, 0.5, 0.1, 32, 512), 32),        # a current value outside the bounds is clamped
]


@pytest.mark.parametrize("args,expected", RULE_TABLE)
def test_rule_table(args, expected):
    assert next_global_batch(*args) == expected


def test_rule_matches_reference_formula_exhaustively():
    """Against an independent restatement of the rule over a grid of inputs."""
    def reference(b, phi, gamma, alpha, lo, hi):
        if phi < gamma:
            t = max(b + 1, int(math.floor(b * (1 + alpha) + 0.5)))
        elif phi > gamma:
            t = min(b - 1, int(math.floor(b * (1 - alpha) + 0.5)))
        else:
            t = b
        return min(max(t, lo), hi)

    for b in range(1, 300, 7):
        for phi in (-0.5, 0.0, 0.3, 0.5, 0.7, 1.0):
            for alpha in (0.05, 0.1, 0.3):
                got = next_global_batch(b, phi, 0.5, alpha, 8, 256)
                assert got == reference(b, phi, 0.5, alpha, 8, 256)
                assert 8 <= got <= 256


@pytest.mark.parametrize("kwargs,field", [
    (dict(current=0), "current"), (dict(phi=1.5), "phi"), (dict(phi=float("nan")), "phi"),
    (dict(gamma=2.0), "gamma"), (dict(alpha=0.0), "alpha"), (dict(min_batch=0), "min_batch"),
    (dict(min_batch=600), "min_batch"), (dict(current=2.5), "current"),
])
def test_rule_bad_input_names_field(kwargs, field):
    args = dict(current=100, phi=0.2, gamma=0.5, alpha=0.1, min_batch=32, max_batch=512)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        next_global_batch(**args)


# --- similarity -----------------------------------------------------------------------------
def _ref_cos(a, b):
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_similarity_equals_reference_numpy_and_torch():
    rng = np.random.default_rng(0)
    for _ in range(5):
        a = rng.normal(size=(7, 13))
        b = 0.3 * a.ravel() + rng.normal(size=91)
        ref = _ref_cos(a, b)
        assert cosine_similarity(a, b) == pytest.approx(ref, rel=1e-12)
        ta, tb = torch.from_numpy(a).float(), torch.from_numpy(b).float()
        # torch path (float32 inputs, float64 reduction) vs torch's own function
        expected = torch.nn.functional.cosine_similarity(ta.reshape(-1).double(), tb.double(), dim=0)
        assert cosine_similarity(ta, tb) == pytest.approx(float(expected), rel=1e-9)
        assert cosine_similarity(ta, b) == pytest.approx(ref, rel=1e-6)      # mixed types
    assert cosine_similarity([1, 0], [0, 1]) == 0.0
    assert cosine_similarity([1, 2], [2, 4]) == pytest.approx(1.0)
    assert cosine_similarity([1, 2], [-2, -4]) == pytest.approx(-1.0)


def test_similarity_edge_cases():
    assert cosine_similarity([0.0, 0.0], [1.0, 2.0]) == 0.0          # undefined -> 0 like torch
    with pytest.raises(ValueError, match="same number of elements"):
        cosine_similarity([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="non-empty"):
        cosine_similarity([], [])
    with pytest.raises(ValueError, match="finite"):
        cosine_similarity([1.0, float("nan")], [1.0, 2.0])


def test_group_similarity_is_cosine_of_group_sums():
    """Local grads are per-device SUMS over its workers; a group's gradient is their sum."""
    rng = np.random.default_rng(1)
    a = [rng.normal(size=50) for _ in range(3)]
    b = [rng.normal(size=50) for _ in range(2)]
    ref = _ref_cos(np.sum(a, axis=0), np.sum(b, axis=0))
    assert group_similarity(a, b) == pytest.approx(ref, rel=1e-12)
    assert group_similarity([torch.from_numpy(x) for x in a], b) == pytest.approx(ref, rel=1e-12)
    with pytest.raises(ValueError, match="group_a"):
        group_similarity([], b)


# --- learning-rate rules --------------------------------------------------------------------
@pytest.mark.parametrize("rule,batch,expected", [
    ("linear", 256, 0.2), ("linear", 64, 0.05), ("sqrt", 512, 0.2), ("sqrt", 32, 0.05),
    ("none", 1024, 0.1), ("linear", 128, 0.1), ("sqrt", 128, 0.1),
])
def test_lr_rules(rule, batch, expected):
    # base: lr 0.1 at B = 128
    assert scaled_lr(0.1, 128, batch, rule) == pytest.approx(expected)


def test_lr_warmup_is_linear_and_ends_at_target():
    target = scaled_lr(0.1, 128, 512, "linear")                  # 0.4 = 0.1 * 512 / 128
    assert target == pytest.approx(0.4)
    lrs = [scaled_lr(0.1, 128, 512, "linear", iteration=i, warmup_iterations=4) for i in range(6)]
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    assert lrs[3] == pytest.approx(target)


@pytest.mark.parametrize("kwargs,field", [
    (dict(rule="cubic"), "rule"), (dict(base_lr=0.0), "base_lr"), (dict(batch=0), "batch"),
    (dict(base_batch=0), "base_batch"), (dict(iteration=-1), "iteration"),
    (dict(warmup_iterations=-2), "warmup_iterations"),
])
def test_lr_bad_input(kwargs, field):
    args = dict(base_lr=0.1, base_batch=128, batch=256, rule="sqrt")
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        scaled_lr(**args)


# --- controller -----------------------------------------------------------------------------
def _job(**kw):
    base = dict(initial_global_batch=100, min_global_batch=50, max_global_batch=130,
                min_local_batch=1, alpha=0.1, gamma=0.5, lr=0.1, lr_scaling="linear")
    base.update(kw)
    return JobConfig(**base)


def test_controller_applies_rule_and_records_windows():
    ctl = AdaptiveBatchController(_job())
    seq = [ctl.update(phi) for phi in (0.1, 0.1, 0.1, 0.9)]
    # 100 -> 110 -> 121 -> 130 (133.1 clamped) -> 117
    assert seq == [110, 121, 130, 117]
    assert ctl.trajectory == [100, 110, 121, 130]            # B_G in effect during each window
    assert ctl.similarities[-1] == [0.1, 0.1, 0.1, 0.9]
    assert ctl.global_batch == 117
    assert ctl.lr() == pytest.approx(0.1 * 117 / 100)
    assert ctl.end_epoch() == [100, 110, 121, 130]
    assert ctl.epoch == 1 and ctl.trajectory == []
    ctl.set_global_batch(112)                                # solver rounded B'_G
    ctl.update(0.5)                                          # equal: unchanged
    assert ctl.end_epoch() == [112]
    assert ctl.end_epoch() == [112]                          # empty epoch records B_G once
    assert ctl.completed_trajectories == [[100, 110, 121, 130], [112], [112]]
    assert ctl.num_updates == 5


def test_controller_not_adaptive_keeps_batch():
    ctl = AdaptiveBatchController(_job(adaptive=False))
    assert [ctl.update(p) for p in (0.0, 1.0, 0.0)] == [100, 100, 100]
    assert ctl.trajectory == [100, 100, 100]


def test_controller_round_trip_through_plain_dict():
    ctl = AdaptiveBatchController(_job())
    for phi in (0.1, 0.9, 0.2):
        ctl.update(phi)
    ctl.end_epoch()
    ctl.update(0.3)
    state = json.loads(json.dumps(ctl.state_dict()))         # plain JSON types only
    back = AdaptiveBatchController.from_state_dict(_job(), state)
    assert back.state_dict() == ctl.state_dict()
    # both continue identically
    assert [back.update(p) for p in (0.1, 0.7)] == [ctl.update(p) for p in (0.1, 0.7)]
    assert back.state_dict() == ctl.state_dict()


def test_controller_bad_state_and_input():
    ctl = AdaptiveBatchController(_job())
    with pytest.raises(ValueError, match="global_batch"):
        ctl.load_state_dict({"global_batch": 0, "trajectories": [[]], "similarities": [[]]})
    with pytest.raises(ValueError, match="trajectories"):
        ctl.load_state_dict({"global_batch": 5, "trajectories": [[], []], "similarities": [[]]})
    with pytest.raises(ValueError, match="phi"):
        ctl.update(3.0)
    with pytest.raises(ValueError, match="job_config"):
        AdaptiveBatchController({"gamma": 0.5})
