"""pack_opt (Pack paper 5.3/5.4): distance, kNN heuristic and the two baselines."""
from __future__ import annotations

import random

import pytest

from jabasray.planners.pack_opt import (TABLE3_SPACE, Dimension, PackingPlan, SearchSpace,
                                        batch_size_packing, knn_packing, pack_opt, random_packing)

A = {"batch_size": 20, "optimizer": "sgd", "lr": 0.01, "activation": "relu"}
B = {"batch_size": 40, "optimizer": "adagrad", "lr": 0.01, "activation": "relu"}


def _mem(c):
    """A modelled memory: grows with the batch size, Adam keeps two slots."""
    return 10.0 + c["batch_size"] / 10.0 + (2.0 if c["optimizer"] == "adam" else 0.0)


def _configs(n, seed=0):
    return TABLE3_SPACE.sample(n, random.Random(seed))


def _check_partition(plan: PackingPlan, configs, budget):
    flat = sorted(i for p in plan.packs for i in p)
    assert flat == list(range(len(configs)))                       # each config exactly once
    for p, m in zip(plan.packs, plan.pack_memory):
        assert m == pytest.approx(sum(_mem(configs[i]) for i in p))
        assert m <= budget


def test_paper_worked_distance_example_is_5():
    """Section 5.3: A vs B over Table 3 = |idx(20) - idx(40)| + [SGD != Adagrad] = 4 + 1."""
    assert TABLE3_SPACE.size == 1056                                # "1056 configurations in total"
    assert TABLE3_SPACE.distance(A, B) == 5.0
    assert TABLE3_SPACE.distance(B, A) == 5.0
    assert TABLE3_SPACE.distance(A, A) == 0.0
    assert TABLE3_SPACE.distance(A, B, metric="euclidean") == pytest.approx(17 ** 0.5)
    far = {"batch_size": 70, "optimizer": "adam", "lr": 1e-6, "activation": "sigmoid"}
    assert TABLE3_SPACE.distance(A, far) == 10 + 1 + 4 + 1


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("threshold", [None, 0.5, 2.0, 4.0])
def test_knn_is_a_packable_partition_within_threshold(seed, threshold):
    configs = _configs(40, seed)
    budget = 60.0
    plan = knn_packing(configs, TABLE3_SPACE, _mem, budget, threshold=threshold, seed=seed)
    _check_partition(plan, configs, budget)
    assert len(plan.centroids) == plan.num_packs
    for c, p in zip(plan.centroids, plan.packs):
        assert p[0] == c
        for j in p[1:]:
            d = TABLE3_SPACE.distance(configs[c], configs[j])
            assert threshold is None or d < threshold
    assert plan == knn_packing(configs, TABLE3_SPACE, _mem, budget, threshold=threshold, seed=seed)


def test_knn_threshold_zero_gives_singletons():
    configs = _configs(30) + [dict(A), dict(A)]                    # even identical configs
    plan = knn_packing(configs, TABLE3_SPACE, _mem, 1e9, threshold=0.0, seed=3)
    assert sorted(map(len, plan.packs)) == [1] * len(configs)


def test_knn_adds_nearest_first_and_fills_memory():
    """Exhaustive check on a small case: the centroid's pack is the nearest prefix (by
    distance, then index) that fits, skipping only members that do not fit."""
    space = SearchSpace.from_values({"bs": [1, 2, 3, 4, 5, 6], "act": ["relu", "tanh"]})
    configs = [space.config_at(i) for i in range(space.size)]      # all 12
    mem = lambda c: float(c["bs"])                                  # noqa: E731
    for seed in range(6):
        plan = knn_packing(configs, space, mem, 9.0, seed=seed)
        remaining = set(range(len(configs)))
        for c, p in zip(plan.centroids, plan.packs):
            remaining.discard(c)
            order = sorted(remaining, key=lambda j: (space.distance(configs[c], configs[j]), j))
            used, expect = mem(configs[c]), [c]
            for j in order:
                if used + mem(configs[j]) <= 9.0:
                    expect.append(j)
                    used += mem(configs[j])
            assert p == expect
            remaining -= set(p)


def test_no_threshold_and_large_budget_packs_everything_together():
    configs = _configs(12)
    plan = knn_packing(configs, TABLE3_SPACE, _mem, 1e9)
    assert plan.num_packs == 1 and sorted(plan.packs[0]) == list(range(12))
    assert knn_packing(configs, TABLE3_SPACE, _mem, 1e9, max_pack_size=5).num_packs == 3


def test_random_and_batch_size_baselines():
    configs = _configs(50, seed=7)
    budget = 45.0
    rnd = random_packing(configs, _mem, budget, seed=1)
    _check_partition(rnd, configs, budget)
    assert rnd.method == "random"
    bsp = batch_size_packing(configs, _mem, budget)
    _check_partition(bsp, configs, budget)
    for p in bsp.packs:
        assert len({configs[i]["batch_size"] for i in p}) == 1
    # greedy fill: a new pack of a batch size opens only when the next config did not fit
    for bs in {c["batch_size"] for c in configs}:
        ps = [p for p in bsp.packs if configs[p[0]]["batch_size"] == bs]
        for a, b in zip(ps, ps[1:]):
            assert sum(_mem(configs[i]) for i in a) + _mem(configs[b[0]]) > budget
    for a, b in zip(rnd.packs, rnd.packs[1:]):
        assert sum(_mem(configs[i]) for i in a) + _mem(configs[b[0]]) > budget
    assert pack_opt(configs, TABLE3_SPACE, _mem, budget, method="batch_size") == bsp
    assert pack_opt(configs, TABLE3_SPACE, _mem, budget, method="random", seed=1) == rnd


def test_plans_and_spaces_round_trip_json(tmp_path):
    configs = _configs(20)
    for plan in (knn_packing(configs, TABLE3_SPACE, _mem, 50.0, threshold=3.0),
                 random_packing(configs, _mem, 50.0), batch_size_packing(configs, _mem, 50.0)):
        assert PackingPlan.from_json(plan.to_json()) == plan
        assert PackingPlan.load(plan.save(tmp_path / f"{plan.method}.json")) == plan
    assert SearchSpace.from_json(TABLE3_SPACE.to_json()) == TABLE3_SPACE


def test_space_sampling_is_without_replacement():
    cfgs = TABLE3_SPACE.sample(200, random.Random(0))
    assert len({tuple(c.values()) for c in cfgs}) == 200
    small = SearchSpace.from_values({"a": [1, 2], "b": ["x"]})
    assert sorted(tuple(c.values()) for c in small.sample(10, random.Random(0))) == [(1, "x"), (2, "x")]


def test_bad_input_names_the_field():
    configs = _configs(5)
    with pytest.raises(ValueError, match=r"memory_budget must be >= the memory of every configuration"):
        knn_packing(configs, TABLE3_SPACE, _mem, 5.0)
    with pytest.raises(ValueError, match=r"memory_budget must be a number in \(0"):
        random_packing(configs, _mem, 0)
    bad = dict(A, lr=0.5)
    with pytest.raises(ValueError, match=r"configs\[1\]\['lr'\] must be one of 1e-06, .*got 0.5"):
        knn_packing([A, bad], TABLE3_SPACE, _mem, 100.0)
    with pytest.raises(ValueError, match=r"configs\[0\]\['optimizer'\] must be one of"):
        pack_opt([dict(A, optimizer="lbfgs")], TABLE3_SPACE, _mem, 100.0, method="random")
    with pytest.raises(ValueError, match="method must be one of"):
        pack_opt(configs, TABLE3_SPACE, _mem, 100.0, method="greedy")
    with pytest.raises(ValueError, match=r"layers values must be all numbers \(numeric\) or all strings"):
        SearchSpace.from_values({"layers": [[64], [64, 64]]})
    with pytest.raises(ValueError, match=r"mixed values must be all numbers"):
        SearchSpace.from_values({"mixed": [1, "two"]})
    with pytest.raises(ValueError, match=r"x.kind must be one of"):
        Dimension("x", [1, 2], "ordinal")
    with pytest.raises(ValueError, match=r"memory_fn\(configs\[0\]\) must be a number"):
        knn_packing(configs, TABLE3_SPACE, lambda c: float("nan"), 100.0)
    with pytest.raises(ValueError, match=r"threshold must be a number"):
        knn_packing(configs, TABLE3_SPACE, _mem, 100.0, threshold=-1)
