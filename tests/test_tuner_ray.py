"""Packed Hyperband on Ray Tune, end to end on a tiny space (uses the session Ray fixture)."""
from __future__ import annotations

import os

import pytest
import torch

from jabasray.tuner import HyperbandConfig, PackedHyperbandTuner, make_trainable
from jabasray.tuner.digits import digits_mlp_spec

tune = pytest.importorskip("ray.tune")

SPACE = {"batch_size": tune.choice([20, 40]), "optimizer": tune.choice(["adam", "sgd", "momentum"]),
         "lr": tune.choice([1e-3, 1e-2, 1e-1]), "activation": ["relu", "tanh"]}


def _tuner(tmp_path, method, name):
    return PackedHyperbandTuner(
        digits_mlp_spec(steps_per_unit=2), param_space=SPACE,
        hyperband=HyperbandConfig(R=3, eta=3, memory_budget=1e9, pack_method=method, seed=3),
        run_config=tune.RunConfig(name=name, storage_path=str(tmp_path)))


def test_packed_and_unpacked_search_select_the_same_best(ray_session, tmp_path):
    packed = _tuner(tmp_path, "knn", "packed")
    grid = packed.fit()
    res = packed.search_result
    assert max(len(p["members"]) for p in res.packs) > 1            # it really packed
    # one ResultGrid row per sampled configuration (3 + 2 for R=3, eta=3)
    assert len(grid) == len(res.records) == 5 and grid.num_errors == 0
    ids = sorted(r.config["config_id"] for r in grid)
    assert ids == list(range(5))
    best = grid.get_best_result()
    assert best.config["config_id"] == res.best_config_id
    assert {k: best.config[k] for k in SPACE} == res.best_config
    assert best.checkpoint is not None
    with best.checkpoint.as_directory() as d:                          # the member's own state
        state = torch.load(os.path.join(d, "member.pt"), weights_only=False)
    assert state["steps"] == best.metrics["steps"]
    from ray.tune import ResultGrid
    assert isinstance(grid, ResultGrid)
    assert packed._max_concurrent() == 2                            # 2 CPUs / 1 CPU per pack
    packed.hb.max_concurrent_packs = 1
    assert packed._max_concurrent() == 1
    for row in grid:
        rec = res.records[row.config["config_id"]]
        assert len(row.metrics_dataframe) == len(rec.history)      # one reported row per rung
        assert row.metrics["accuracy"] == pytest.approx(rec.last["accuracy"])

    unpacked = _tuner(tmp_path, "none", "unpacked")
    ures = unpacked.fit(result_grid=False)
    assert max(len(p["members"]) for p in ures.packs) == 1
    assert [r.config for r in ures.records] == [r.config for r in res.records]
    assert ures.best_config_id == res.best_config_id
    for a, b in zip(res.records, ures.records):                     # same trajectories
        assert [h["resource"] for h in a.history] == [h["resource"] for h in b.history]
        assert [h["accuracy"] for h in a.history] == pytest.approx([h["accuracy"] for h in b.history], abs=1e-9)
        assert [h["train_loss"] for h in a.history] == pytest.approx([h["train_loss"] for h in b.history], rel=1e-5)

    # an ordinary one-configuration Tune trial of the same spec follows the same trajectory
    from ray.tune.search import BasicVariantGenerator
    top = [r for r in res.records if r.last["resource"] == 3][:2]
    spec = digits_mlp_spec(steps_per_unit=2)
    plain = tune.Tuner(
        tune.with_resources(                                        # as a user writes it: each
            make_trainable(spec, stream_batch=40, max_units=3, checkpoint_units=[3]),   # trial loads data
            {"cpu": 1}),
        param_space={k: tune.choice(v.categories if hasattr(v, "categories") else v) for k, v in SPACE.items()},
        tune_config=tune.TuneConfig(search_alg=BasicVariantGenerator(points_to_evaluate=[r.config for r in top]),
                                    num_samples=len(top)),
        run_config=tune.RunConfig(name="plain", storage_path=str(tmp_path), verbose=0)).fit()
    assert plain.num_errors == 0
    for row in plain:
        rec = next(r for r in top if r.config == {k: row.config[k] for k in SPACE})
        df = row.metrics_dataframe.set_index("training_iteration")
        for h in rec.history:
            assert df.loc[int(h["resource"]), "accuracy"] == pytest.approx(h["accuracy"], abs=1e-9)


def test_bad_search_spaces_and_settings():
    spec = digits_mlp_spec()
    with pytest.raises(ValueError, match=r"param_space\['lr'\] must be a discrete choice"):
        PackedHyperbandTuner(spec, param_space={**SPACE, "lr": tune.loguniform(1e-4, 1e-1)})
    with pytest.raises(ValueError, match=r"param_space\['hidden'\]: hidden values must be all numbers"):
        PackedHyperbandTuner(spec, param_space={**SPACE, "hidden": tune.choice([[64], [64, 64]])})
    with pytest.raises(ValueError, match="eta must be an integer >= 2, got 1"):
        HyperbandConfig(eta=1)
    with pytest.raises(ValueError, match="pack_method must be one of"):
        HyperbandConfig(pack_method="greedy")
    t = PackedHyperbandTuner(spec, param_space=SPACE, hyperband=HyperbandConfig(R=3, memory_budget=10.0))
    with pytest.raises(ValueError, match="memory_budget must be >= the memory of every configuration"):
        t.make_state()
