"""The per-configuration ResultGrid of packed Hyperband, built from recorded histories.

No Ray cluster and no training: the records below are what the searcher would have collected
for four configurations of one bracket (R=3, eta=3: rung 0 at 1 unit, rung 1 at 3 units):

    id  rung 0 acc  rung 1 acc   survives?
    0   0.50        0.80         yes
    1   0.70        -            no
    2   0.90        0.80         yes (ties config 0 at the last rung -> 0 wins, lower id)
    3   (never reported: no row)
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytest.importorskip("ray.tune")
from ray.tune import Result, ResultGrid  # noqa: E402

from jabasray.tuner.result_grid import PackedResultGrid, build_result_grid  # noqa: E402
from jabasray.tuner.state import ConfigRecord  # noqa: E402


def _row(acc, loss, rung, steps):
    return {"accuracy": acc, "train_loss": loss, "steps": steps, "rung": rung,
            "resource": 3 ** rung, "bracket": 1, "pack": f"s1_r{rung}_p0", "pack_size": 3}


def _records(tmp_path):
    def ckpt(cid, steps):
        d = tmp_path / "members" / f"member_{cid}_step{steps}"
        d.mkdir(parents=True)
        torch.save({"steps": steps, "cid": cid}, d / "member.pt")
        return str(d / "member.pt")

    return [
        ConfigRecord(0, 1, {"lr": 0.1, "batch_size": 20},
                     [_row(0.5, 2.0, 0, 2), _row(0.8, 1.0, 1, 6)], ckpt(0, 6)),
        ConfigRecord(1, 1, {"lr": 0.01, "batch_size": 40}, [_row(0.7, 1.5, 0, 2)], ckpt(1, 2)),
        ConfigRecord(2, 1, {"lr": 0.001, "batch_size": 20},
                     [_row(0.9, 0.5, 0, 2), _row(0.8, 0.4, 1, 6)], ckpt(2, 6)),
        ConfigRecord(3, 1, {"lr": 1.0, "batch_size": 40}),
    ]


@pytest.fixture
def grid(tmp_path):
    return build_result_grid(_records(tmp_path), experiment_path=str(tmp_path / "exp"),
                             metric="accuracy", mode="max")


def test_one_row_per_reported_configuration(grid, tmp_path):
    assert isinstance(grid, ResultGrid) and isinstance(grid, PackedResultGrid)
    assert len(grid) == 3 and grid.num_errors == 0 and grid.errors == [] and grid.num_terminated == 3
    assert [r.config["config_id"] for r in grid] == [0, 1, 2]
    assert all(isinstance(r, Result) for r in grid)
    row = grid[2]
    assert row.config == {"lr": 0.001, "batch_size": 20, "config_id": 2}
    assert row.metrics["accuracy"] == 0.8 and row.metrics["train_loss"] == 0.4
    assert row.metrics["training_iteration"] == 2 and row.metrics["done"] is True
    assert row.metrics["resource"] == 3 and row.metrics["trial_id"] == "config_2"
    df = row.metrics_dataframe
    assert list(df["accuracy"]) == [0.9, 0.8] and list(df["training_iteration"]) == [1, 2]
    assert list(df["config/lr"]) == [0.001, 0.001]                 # flattened as Tune does
    assert len(grid[1].metrics_dataframe) == 1
    assert grid.experiment_path == str(tmp_path / "exp")


def test_checkpoint_is_the_member_directory(grid, tmp_path):
    ck = grid[0].checkpoint
    assert ck is not None
    with ck.as_directory() as d:
        state = torch.load(os.path.join(d, "member.pt"), weights_only=False)
    assert state == {"steps": 6, "cid": 0}
    assert grid[0].best_checkpoints[0][0].path == ck.path


def test_get_best_result_follows_resultgrid_rules(grid):
    assert grid.get_best_result().config["config_id"] == 0            # tie at 0.8 -> lower id
    assert grid.get_best_result(metric="train_loss", mode="min").config["config_id"] == 2
    assert grid.get_best_result(scope="all").config["config_id"] == 2  # 0.9 at rung 0
    assert grid.get_best_result(scope="avg").config["config_id"] == 2  # mean 0.85
    assert grid.get_best_result(metric="accuracy", mode="min").config["config_id"] == 1
    with pytest.raises(ValueError, match="scope must be one of"):
        grid.get_best_result(scope="first")
    with pytest.raises(RuntimeError, match="No best trial found for the given metric: nope"):
        grid.get_best_result(metric="nope")


def test_nan_metrics_are_filtered(tmp_path):
    recs = _records(tmp_path)
    recs[0].history[-1]["accuracy"] = float("nan")
    g = build_result_grid(recs, experiment_path=str(tmp_path / "exp"), metric="accuracy", mode="max")
    assert g.get_best_result().config["config_id"] == 2
    assert math.isnan(g[0].metrics["accuracy"])


def test_dataframe_and_files_on_disk(grid, tmp_path):
    df = grid.get_dataframe()
    assert list(df["config/config_id"]) == [0, 1, 2] and list(df["accuracy"]) == [0.8, 0.7, 0.8]
    best = grid.get_dataframe(filter_metric="accuracy", filter_mode="max")
    assert list(best["accuracy"]) == [0.8, 0.7, 0.9]
    row_dir = tmp_path / "exp" / "config_2"
    lines = [json.loads(x) for x in (row_dir / "result.json").read_text().splitlines()]
    assert [x["accuracy"] for x in lines] == [0.9, 0.8]
    assert json.loads((row_dir / "params.json").read_text())["config_id"] == 2
    again = Result.from_path(str(row_dir))                            # Tune can read the row back
    assert again.metrics["accuracy"] == 0.8 and again.config["lr"] == 0.001


def test_no_files_and_single_row(tmp_path):
    recs = _records(tmp_path)[:1]
    g = build_result_grid(recs, experiment_path=str(tmp_path / "none"), metric=None, mode=None,
                          write_files=False)
    assert not (tmp_path / "none").exists()
    assert g.get_best_result().config["config_id"] == 0               # one row: no metric needed
    g2 = build_result_grid(_records(tmp_path / "b"), experiment_path=str(tmp_path / "b" / "exp"),
                           metric=None, mode=None)
    with pytest.raises(ValueError, match="No metric is provided"):
        g2.get_best_result()
