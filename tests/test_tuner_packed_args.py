"""``packed()``'s arguments: a class Trainable whose resources admit ``trials_per_device``
trials per device, and one-line ValueErrors before any Ray work (Ray is not started)."""
from __future__ import annotations

import pytest

from jabasray.tuner import packed
from jabasray.tuner.digits import digits_mlp_spec

tune = pytest.importorskip("ray.tune")

SPEC = digits_mlp_spec(steps_per_unit=1)


def _cpu(trainable) -> float:
    """CPUs a trial of ``trainable`` reserves: a class trainable's resource request, or what
    ``tune.with_resources`` set on a function trainable (where packing does not pay)."""
    pgf = getattr(trainable, "_resources", None) or trainable.default_resource_request({})
    return pgf.required_resources.get("CPU", 0.0)


def test_packed_is_a_class_trainable_reserving_its_share_of_a_device():
    t = packed(SPEC, max_units=3, stream_batch=40, members_per_device=4, pack=True)
    assert isinstance(t, type) and issubclass(t, tune.Trainable)
    assert _cpu(t) == pytest.approx(1 / 4)
    more = packed(SPEC, max_units=3, stream_batch=40, members_per_device=4, trials_per_device=8, pack=True)
    assert _cpu(more) == pytest.approx(1 / 8)                   # 8 admitted, 4 seated per unit


def test_bad_arguments_are_one_line_value_errors():
    with pytest.raises(ValueError, match="trials_per_device must be an integer >= 4, got 2"):
        packed(SPEC, max_units=3, stream_batch=40, members_per_device=4, trials_per_device=2)
    with pytest.raises(ValueError, match="threads must be an integer >= 1, got 0"):
        packed(SPEC, max_units=3, stream_batch=40, members_per_device=4, threads=0)
    with pytest.raises(ValueError, match="spec must be a jabasray.tuner.TrainingSpec"):
        packed(object(), max_units=3, stream_batch=40)
    with pytest.raises(ValueError, match="stream_batch must be given"):
        packed(SPEC, max_units=3)
    with pytest.raises(ValueError, match="pack must be one of True, False, 'auto', got 'yes'"):
        packed(SPEC, max_units=3, stream_batch=40, pack="yes")
    with pytest.raises(ValueError, match="param_space must be given with pack='auto'"):
        packed(SPEC, max_units=3, stream_batch=40)
    with pytest.raises(ValueError, match="costs must be a jabasray.planners.pack_cost.PackCosts"):
        packed(SPEC, max_units=3, stream_batch=40, costs={"unit_alone_s": 1})
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1, got 0"):
        packed(SPEC, max_units=3, stream_batch=40, num_samples=0)


def _costs(unit_alone, per_member, start_alone=3.5, start_relay=1.7):
    """A cost table: a packed unit of k costs unit_alone * (1 + per_member * (k - 1))."""
    from jabasray.planners.pack_cost import PackCosts
    return PackCosts(start_alone, start_relay, start_alone, 0.01, unit_alone,
                     [unit_alone * (1 + per_member * (k - 1)) for k in range(1, 9)], 0.002)


def test_auto_decides_from_the_costs_pack_or_alone(caplog):
    """With ``pack="auto"`` the trainable follows the cost model's decision (the model itself
    is tested against brute force in test_pack_cost): 2.5 s units whose packed step gains pack
    (each trial reserving its share of a device); 25 ms units behind 3.5 core-s trial processes
    train alone, one CPU per trial, as Tune's own trials."""
    from jabasray.planners.pack_cost import decide, halving_units
    from jabasray.tuner.packed_trials import _ALONE_SWEEPS, _cluster_shape

    space = {"batch_size": tune.choice([20, 40])}
    cores, devices, slots = _cluster_shape(False, 1.0)
    units = halving_units(40, 9)                    # ASHA's units for 40 trials, R = 9, eta = 3
    pays, loses = _costs(2.5, 0.2), _costs(0.025, 0.9)
    k = decide(pays, units, cores, devices, slots).members_per_device
    assert k > 1 and not decide(loses, units, cores, devices, slots).pack
    with caplog.at_level("INFO", logger="jabasray.tuner.packed_trials"):
        t = packed(SPEC, max_units=9, param_space=space, num_samples=40, costs=pays)
        assert _cpu(t) == pytest.approx(1 / k)
        capped = packed(SPEC, max_units=9, param_space=space, num_samples=40, costs=pays, members_per_device=2)
        assert _cpu(capped) == pytest.approx(1 / 2)             # at most the members given
        before = set(_ALONE_SWEEPS)
        alone = packed(SPEC, max_units=9, param_space=space, num_samples=40, costs=loses)
        assert _cpu(alone) == pytest.approx(1.0)
        off = packed(SPEC, max_units=9, param_space=space, pack=False)
        assert _cpu(off) == pytest.approx(1.0)
    reasons = [r.getMessage() for r in caplog.records]
    assert sum("packing" in m and "per device" in m for m in reasons) == 2
    assert sum("every trial trains alone" in m for m in reasons) == 2
    new = [_ALONE_SWEEPS[t] for t in set(_ALONE_SWEEPS) - before]
    assert sorted(d["reason"].split(":")[0] for d in new) == ["every trial trains alone", "pack=False"]
    assert all(not d["pack"] for d in new)


def test_the_searchers_keep_the_listed_order_where_every_trial_trains_alone():
    """kNN groups serve packing only: given a trainable that trains alone, SimilaritySearch and
    PackedHyperband emit the configurations in the order listed (as Tune's own searcher over
    the same points); given a packing trainable, in similarity groups as without one."""
    from ray.tune.search import Searcher

    from jabasray.tuner import PackedHyperband, SimilaritySearch, trains_alone

    space = {"lr": tune.loguniform(1e-5, 1e-1), "optimizer": tune.choice(["sgd", "adam"])}
    near_a = [{"lr": 1e-5 * (1 + i / 10), "optimizer": "sgd"} for i in range(4)]
    near_b = [{"lr": 1e-1 / (1 + i / 10), "optimizer": "adam"} for i in range(4)]
    mixed = [c for pair in zip(near_a, near_b) for c in pair]           # sgd, adam, sgd, ...
    alone = packed(SPEC, max_units=3, stream_batch=40, pack=False)
    together = packed(SPEC, max_units=3, stream_batch=40, members_per_device=4, pack=True)
    assert trains_alone(alone) and not trains_alone(together)

    def emitted(search, n):
        search.set_search_properties("acc", "max", space)
        out = [search.suggest(str(i)) for i in range(n)]
        assert search.suggest(str(n)) == Searcher.FINISHED
        return out

    assert emitted(SimilaritySearch(group_size=4, batch_size=8, points=mixed, seed=3, trainable=alone), 8) == mixed
    grouped = emitted(SimilaritySearch(group_size=4, batch_size=8, points=mixed, seed=3, trainable=together), 8)
    assert grouped == emitted(SimilaritySearch(group_size=4, batch_size=8, points=mixed, seed=3), 8)
    assert [len({c["optimizer"] for c in half}) for half in (grouped[:4], grouped[4:])] == [1, 1]
    # R = 3, eta = 3: brackets of 3 and 2 configurations (Tune fills the 2 first)
    hb = PackedHyperband(3, 3, members_per_device=2, points=mixed[:5], trainable=alone)
    assert emitted(hb.search_alg, 5) == mixed[:5]
