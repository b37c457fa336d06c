"""Normalised distances over Tune search spaces (continuous and mixed domains), the
similarity order, and the SimilaritySearch searcher -- pure logic, no Ray cluster."""
from __future__ import annotations

import math

import pytest

from jabasray.planners.pack_opt import TABLE3_SPACE, Feature, NormalisedSpace, knn_packing, similarity_order
from jabasray.tuner import SimilaritySearch
from jabasray.tuner.space import largest_value, normalised_space

tune = pytest.importorskip("ray.tune")
from ray.tune.search import Searcher  # noqa: E402

SPACE = {"lr": tune.loguniform(1e-5, 1e-1), "batch_size": tune.choice([20, 30, 40, 50, 60, 70]),
         "optimizer": tune.choice(["sgd", "adam"]), "width": tune.randint(8, 65),
         "momentum": tune.uniform(0.0, 0.9), "epochs": 3}


def test_every_tune_domain_becomes_a_feature():
    feats = {f.name: f for f in normalised_space(SPACE).features}
    assert set(feats) == {"lr", "batch_size", "optimizer", "width", "momentum"}   # constant: no distance
    assert feats["lr"].kind == "numeric" and feats["lr"].log and feats["lr"].hi == pytest.approx(0.1)
    assert feats["batch_size"].kind == "ordinal" and feats["batch_size"].values == [20, 30, 40, 50, 60, 70]
    assert feats["optimizer"].kind == "categorical"
    assert (feats["width"].lo, feats["width"].hi, feats["width"].log) == (8.0, 64.0, False)


def test_normalised_distance_worked_example():
    """lr 1e-4 vs 1e-2 on log [1e-5, 1e-1]: 2 decades of 4 = 0.5; batch 20 vs 70: index 0 vs 5
    of 5 = 1.0; sgd vs adam: 1; width 8 vs 36 of [8, 64]: 0.5; momentum 0.45 vs 0.45: 0.
    Sum (the paper's Manhattan combination): 3.0."""
    space = normalised_space(SPACE)
    a = {"lr": 1e-4, "batch_size": 20, "optimizer": "sgd", "width": 8, "momentum": 0.45}
    b = {"lr": 1e-2, "batch_size": 70, "optimizer": "adam", "width": 36, "momentum": 0.45}
    assert space.distance(a, b) == pytest.approx(3.0)
    assert space.distance(a, b, "euclidean") == pytest.approx(math.sqrt(0.25 + 1 + 1 + 0.25))
    assert space.distance(a, a) == 0.0


def test_paper_table3_example_normalised():
    """The paper's A = [20, SGD, 0.01, ReLU], B = [40, Adagrad, 0.01, ReLU]: index distance 4 of
    10 on batch size (normalised 0.4) + 1 for the optimizer = 1.4."""
    space = NormalisedSpace([Feature(d.name, "ordinal" if d.kind == "numeric" else "categorical",
                                     values=list(d.values) if d.kind == "numeric" else [])
                             for d in TABLE3_SPACE.dimensions])
    a = {"batch_size": 20, "optimizer": "sgd", "lr": 0.01, "activation": "relu"}
    b = {"batch_size": 40, "optimizer": "adagrad", "lr": 0.01, "activation": "relu"}
    assert space.distance(a, b) == pytest.approx(1.4)


def _two_clusters():
    near_a = [{"lr": 1e-5 * (1 + i / 10), "optimizer": "sgd"} for i in range(4)]
    near_b = [{"lr": 1e-1 / (1 + i / 10), "optimizer": "adam"} for i in range(4)]
    mixed = [near_a[0], near_b[0], near_a[1], near_b[1], near_a[2], near_b[2], near_a[3], near_b[3]]
    return mixed, normalised_space({"lr": tune.loguniform(1e-5, 1e-1), "optimizer": tune.choice(["sgd", "adam"])})


@pytest.mark.parametrize("seed", range(5))
def test_similarity_order_separates_far_clusters(seed):
    configs, space = _two_clusters()
    groups = similarity_order(configs, space, group_size=4, seed=seed)
    assert sorted(i for g in groups for i in g) == list(range(8))
    for g in groups:
        assert len({configs[i]["optimizer"] for i in g}) == 1          # never mixes the clusters
    plan = knn_packing(configs, space, lambda c: 1.0, 4.0, seed=seed)   # pack_opt on the same distance
    assert sorted(sorted(p) for p in plan.packs) == sorted(sorted(g) for g in groups)


def test_similarity_search_emits_each_point_once_in_similarity_order():
    configs, _ = _two_clusters()
    s = SimilaritySearch(group_size=4, batch_size=8, points=configs, seed=3)
    s.set_search_properties("acc", "max", {"lr": tune.loguniform(1e-5, 1e-1),
                                           "optimizer": tune.choice(["sgd", "adam"])})
    out = [s.suggest(str(i)) for i in range(8)]
    assert s.suggest("8") == Searcher.FINISHED
    assert sorted(map(repr, out)) == sorted(map(repr, configs))
    assert len({c["optimizer"] for c in out[:4]}) == 1 and len({c["optimizer"] for c in out[4:]}) == 1


@pytest.mark.parametrize("lifted_by", ["result", "complete"])
def test_first_wave_holds_the_rest_until_a_trial_reports_and_keeps_the_order(lifted_by, tmp_path):
    """``first_wave=3``: three trials, then None (Tune asks again) until a trial reports a result
    or ends; then the rest, in the same order as without the limit. The gate survives
    save/restore (an interrupted sweep restored before its first result)."""
    configs, _ = _two_clusters()
    space = {"lr": tune.loguniform(1e-5, 1e-1), "optimizer": tune.choice(["sgd", "adam"])}

    def search(**kw):
        s = SimilaritySearch(group_size=4, batch_size=8, points=configs, seed=3, **kw)
        s.set_search_properties("acc", "max", space)
        return s

    plain = search()
    reference = [plain.suggest(str(i)) for i in range(8)]
    s = search(first_wave=3)
    out = [s.suggest(str(i)) for i in range(3)]
    assert [s.suggest("3"), s.suggest("3")] == [None, None]
    s.save(str(tmp_path / "search.json"))
    restored = search(first_wave=3)
    restored.restore(str(tmp_path / "search.json"))
    assert restored.suggest("3") is None
    if lifted_by == "result":
        restored.on_trial_result("1", {"acc": 0.5})
    else:
        restored.on_trial_complete("1", None, error=True)
    out += [restored.suggest(str(i)) for i in range(3, 8)]
    assert out == reference
    assert restored.suggest("8") == Searcher.FINISHED
    with pytest.raises(ValueError, match="first_wave"):
        search(first_wave=0)


def test_similarity_search_samples_continuous_domains():
    s = SimilaritySearch(group_size=3, batch_size=6, seed=0)
    s.set_search_properties("acc", "max", SPACE)
    out = [s.suggest(str(i)) for i in range(12)]                       # two batches
    for c in out:
        assert 1e-5 <= c["lr"] <= 1e-1 and c["batch_size"] in (20, 30, 40, 50, 60, 70)
        assert 8 <= c["width"] <= 64 and 0.0 <= c["momentum"] <= 0.9 and c["epochs"] == 3
    assert len({c["lr"] for c in out}) == 12


def test_largest_batch_size_and_bad_spaces():
    assert largest_value(SPACE, "batch_size") == 70
    assert largest_value({"b": tune.randint(4, 33)}, "b") == 32
    with pytest.raises(ValueError, match="must hold the batch-size key 'bs'"):
        largest_value(SPACE, "bs")
    with pytest.raises(ValueError, match=r"param_space\['lr'\] must take positive integers"):
        largest_value(SPACE, "lr")
    with pytest.raises(ValueError, match="log range must be positive"):
        Feature("x", "numeric", 0.0, 1.0, log=True)
