"""Hyperband bracket arithmetic (Li et al. 2017), and how Tune's HyperBandScheduler fills it."""
from __future__ import annotations

import pytest

from jabasray.tuner import hyperband_brackets, hyperband_schedule


def test_r81_eta3_is_li_et_al_table():
    """s=4: (81,1),(27,3),(9,9),(3,27),(1,81); s=3: (34,3),(11,9),(3,27),(1,81);
    s=2: (15,9),(5,27),(1,81); s=1: (8,27),(2,81); s=0: (5,81)."""
    assert hyperband_brackets(R=81, eta=3) == [
        [(81, 1), (27, 3), (9, 9), (3, 27), (1, 81)],
        [(34, 3), (11, 9), (3, 27), (1, 81)],
        [(15, 9), (5, 27), (1, 81)],
        [(8, 27), (2, 81)],
        [(5, 81)],
    ]
    sched = hyperband_schedule(81, 3)
    assert [b.s for b in sched] == [4, 3, 2, 1, 0]
    assert [b.keep(i) for i in range(5) for b in sched[:1]] == [27, 9, 3, 1, 0]


def test_small_and_fractional_cases():
    assert hyperband_brackets(1, 3) == [[(1, 1)]]
    assert hyperband_brackets(9, 3) == [[(9, 1), (3, 3), (1, 9)], [(5, 3), (1, 9)], [(3, 9)]]
    # R not a power of eta: s_max = floor(log2 10) = 3, r = 10/8 = 1.25 (fractional units kept)
    assert hyperband_brackets(10, 2)[0] == [(8, 1.25), (4, 2.5), (2, 5), (1, 10)]
    # s_max is computed without floating-point logs: 3^5 = 243 exactly
    assert len(hyperband_brackets(243, 3)) == 6 and len(hyperband_brackets(242, 3)) == 5


def test_bad_arguments():
    with pytest.raises(ValueError, match="eta must be an integer >= 2, got 1"):
        hyperband_brackets(81, 1)
    with pytest.raises(ValueError, match="R must be an integer >= 1, got 0"):
        hyperband_brackets(0, 3)


def test_tune_hyperband_fills_li_et_al_brackets_in_reverse():
    """PackedHyperband sizes its search batches by Li et al.'s brackets in the order Tune's
    HyperBandScheduler fills them (s = 0 first): R = 81, eta = 3 -> 5, 8, 15, 34, 81."""
    from ray.tune.schedulers import HyperBandScheduler

    tune_sched = HyperBandScheduler(max_t=81, reduction_factor=3)
    tune_sizes = [tune_sched._get_n0(s) for s in range(tune_sched._s_max_1)]
    ours = [b.num_configs for b in reversed(hyperband_schedule(81, 3))]
    assert ours == tune_sizes == [5, 8, 15, 34, 81]


def _tune_rungs(max_t: int, eta: int) -> list[list[int]]:
    """Rung sizes of every bracket as Tune's own ``_Bracket.successive_halving`` keeps them
    (run on placeholder trials: the survivors of each halving are the next rung)."""
    from ray.tune.schedulers.hyperband import HyperBandScheduler, _Bracket

    sched = HyperBandScheduler(max_t=max_t, reduction_factor=eta)
    out = []
    for s in range(sched._s_max_1 - 1, -1, -1):
        b = _Bracket("training_iteration", sched._get_n0(s), sched._get_r0(s), max_t, eta, s)
        live = [object() for _ in range(sched._get_n0(s))]
        sizes = [len(live)]
        for _ in range(s):
            b._live_trials = {t: {"m": i} for i, t in enumerate(live)}
            live, _bad = b.successive_halving("m", 1.0)
            sizes.append(len(live))
        out.append(sizes)
    return out


def test_ceil_halving_is_tunes_and_floor_is_li_et_al():
    """R = 81, s = 3: Tune 34 -> 12 -> 4 -> 2, Li et al. 34 -> 11 -> 3 -> 1."""
    ceil = hyperband_schedule(81, 3, halving="ceil")
    assert [r.n for r in ceil[1].rungs] == [34, 12, 4, 2]
    assert [r.n for r in hyperband_schedule(81, 3)[1].rungs] == [34, 11, 3, 1]
    for R, eta in ((81, 3), (27, 3), (16, 2), (64, 4), (9, 3)):
        assert [[r.n for r in b.rungs] for b in hyperband_schedule(R, eta, halving="ceil")] == _tune_rungs(R, eta)
    with pytest.raises(ValueError, match="halving"):
        hyperband_schedule(81, 3, halving="round")
