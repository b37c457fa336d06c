"""Packed trials inside Ray Tune's own Tuner, end to end on a tiny space (session Ray fixture).

Each configuration is its own Tune trial reporting every unit; trials of one device train in
one packed model; schedulers, stop, callbacks, checkpoints, FailureConfig and Tuner.restore
behave as with any function trainable."""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys

import cloudpickle
import pytest
import torch
from torch import nn

from jabasray.tuner import PackedHyperband, SimilaritySearch, coordinator_stats, packed
from jabasray.tuner.digits import digits_mlp_spec
from jabasray.tuner.training import build_member

tune = pytest.importorskip("ray.tune")
from ray.tune.schedulers import ASHAScheduler  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SPACE = {"batch_size": tune.choice([20, 40]), "optimizer": tune.choice(["adam", "sgd", "momentum"]),
         "lr": tune.loguniform(1e-3, 1e-1), "activation": tune.choice(["relu", "tanh"])}
SPEC = digits_mlp_spec(steps_per_unit=2)


class _Recorder(tune.Callback):
    def __init__(self):
        self.results = []           # (trial id, training_iteration, pack_size, units) per report
        self.saves = []             # trial id per checkpoint Tune took

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.results.append((trial.trial_id, result["training_iteration"], result.get("pack_size"),
                             result["units"]))

    def on_trial_save(self, iteration, trials, trial, **info):
        self.saves.append(trial.trial_id)


@pytest.fixture(scope="module")
def ray_session(without_session_ray):
    """This module's own Ray instance (overrides the session one): Tune schedules trials on the
    2 CPUs, which must not be held by what earlier modules' runs leave behind."""
    ray = without_session_ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def _tuner(trainable, tmp_path, name, tune_config, **run):
    return tune.Tuner(trainable, param_space=SPACE, tune_config=tune_config,
                      run_config=tune.RunConfig(name=name, storage_path=str(tmp_path), verbose=0, **run))


def test_asha_trials_report_every_unit_from_one_pack(ray_session, tmp_path):
    rec = _Recorder()
    # 10 s units that pack well (a packed unit of k costs 1 + 0.1 (k - 1) units): the cost model
    # decides to pack (at most the 3 members given) on this module's 2 CPUs (2 devices)
    from jabasray.planners.pack_cost import decide, halving_units

    pays = _costs(10.0, 0.1)
    k = decide(pays, halving_units(6, 4, 2), 2, 2, 2, max_members=3).members_per_device
    assert k > 1
    trainable = packed(SPEC, max_units=4, param_space=SPACE, members_per_device=3, costs=pays,
                       num_samples=6, reduction_factor=2)
    assert trainable.default_resource_request({}).required_resources["CPU"] == pytest.approx(1 / k)
    grid = _tuner(trainable, tmp_path, "asha",
                  tune.TuneConfig(metric="accuracy", mode="max", num_samples=6, max_concurrent_trials=6,
                                  reuse_actors=True,         # reset_config swaps the member
                                  scheduler=ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2),
                                  search_alg=SimilaritySearch(group_size=3, batch_size=6, seed=1)),
                  callbacks=[rec], stop={"training_iteration": 3},
                  checkpoint_config=tune.CheckpointConfig(num_to_keep=2, checkpoint_at_end=True)).fit()
    assert len(grid) == 6 and grid.num_errors == 0
    df = grid.get_dataframe()
    assert (df["training_iteration"] == df["units"]).all()          # one report per unit
    assert df["units"].max() == 3                                    # RunConfig.stop honoured
    assert max(p for _, _, p, _ in rec.results) > 1                     # trials really shared a pack
    # the callback saw every report of every trial: iterations 1..n per trial
    per_trial = {}
    for tid, it, _, _ in rec.results:
        per_trial.setdefault(tid, []).append(it)
    assert all(its == list(range(1, len(its) + 1)) for its in per_trial.values())
    # the coordinators' bookkeeping: every member-unit trained was reported once, discarded, or
    # is still unclaimed (a member set aside whose trial Tune ended without its free)
    stats = coordinator_stats(release=True)
    assert stats and all(not s["members"] for s in stats.values())
    # this sweep's coordinators (sweeps of earlier tests that trained alone are listed as alone/...)
    packs = {name: s for name, s in stats.items() if name.startswith("pack/")}
    assert packs and all(s["decision"]["pack"] and s["decision"]["members_per_device"] == k
                         for s in packs.values())
    trained = sum(s["member_units"] for s in stats.values())
    lost = sum(s["units_discarded"] + s["units_unclaimed"] for s in stats.values())
    assert trained - lost == len(rec.results)
    # ASHA never pauses: the only checkpoints are the ends (checkpoint_at_end), one per trial
    assert sorted(rec.saves) == sorted({tid for tid, _, _, _ in rec.results})
    for r in grid:                                                   # per-configuration progress.csv
        assert len(r.metrics_dataframe) == r.metrics["units"]
        assert os.path.exists(os.path.join(r.path, "progress.csv"))
    best = grid.get_best_result()
    with best.checkpoint.as_directory() as d:                        # the user's own state_dicts
        state = torch.load(os.path.join(d, "member.pt"), weights_only=True)
    model, opt = build_member(SPEC, best.config)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    assert state["units"] == best.metrics["units"] and state["steps"] == best.metrics["steps"]
    assert float(SPEC.metric_fn(model, SPEC.data_fn()[1])) == pytest.approx(best.metrics["accuracy"])


def _costs(unit_alone, per_member, start_alone=3.5, start_relay=1.7):
    """A cost table: a packed unit of k costs unit_alone * (1 + per_member * (k - 1))."""
    from jabasray.planners.pack_cost import PackCosts
    return PackCosts(start_alone, start_relay, start_alone, 0.01, unit_alone,
                     [unit_alone * (1 + per_member * (k - 1)) for k in range(1, 9)], 0.002)


class _ByConfig(tune.Callback):
    """Every report's (units, accuracy, train_loss, steps), by configuration."""

    def __init__(self):
        self.rows = {}

    def on_trial_result(self, iteration, trials, trial, result, **info):
        key = tuple(sorted((k, str(trial.config[k])) for k in ("batch_size", "optimizer", "lr", "activation")))
        self.rows.setdefault(key, []).append((result["units"], result["accuracy"], result["train_loss"],
                                              result["steps"]))


def test_where_packing_cannot_pay_every_trial_trains_alone_exactly_as_tunes_own(ray_session, tmp_path):
    """25 ms units behind 3.5 core-s trial processes: the cost model decides that every trial
    trains alone: the trainable is a plain class trainable, one CPU per trial. No coordinator
    starts, every configuration reports exactly what Tune's own function trial of it (the same
    seed) reports, and the RunConfig a packed sweep takes (``checkpoint_at_end``, which Tune
    refuses for a function trainable) serves it: each trial's last checkpoint holds its
    max_units."""
    from ray.tune.search import BasicVariantGenerator

    from jabasray.tuner import make_trainable

    points = [{"batch_size": 20, "optimizer": "adam", "lr": 0.01, "activation": "relu"},
              {"batch_size": 40, "optimizer": "sgd", "lr": 0.05, "activation": "tanh"},
              {"batch_size": 40, "optimizer": "momentum", "lr": 0.003, "activation": "relu"}]
    alone = packed(SPEC, max_units=2, param_space=SPACE, costs=_costs(0.025, 0.9), num_samples=3)
    assert inspect.isclass(alone) and alone.default_resource_request({}).required_resources == {"CPU": 1.0}
    runs = {}
    for name, trainable in (("alone", alone), ("tune", tune.with_resources(
            make_trainable(SPEC, stream_batch=40, max_units=2), {"cpu": 1}))):
        rec = _ByConfig()
        at_end = {"checkpoint_config": tune.CheckpointConfig(checkpoint_at_end=True)} if name == "alone" else {}
        grid = _tuner(trainable, tmp_path, name,
                      tune.TuneConfig(metric="accuracy", mode="max", num_samples=3, reuse_actors=True,
                                      search_alg=BasicVariantGenerator(points_to_evaluate=points)),
                      callbacks=[rec], **at_end).fit()
        assert grid.num_errors == 0 and len(grid) == 3
        runs[name] = rec.rows
        if name == "alone":
            for result in grid:
                with result.checkpoint.as_directory() as d:
                    state = torch.load(os.path.join(d, "member.pt"), weights_only=True)
                assert state["units"] == 2 and state["steps"] == 2 * SPEC.steps_per_unit
            stats = coordinator_stats(release=True)
            assert not [n for n in stats if n.startswith("pack/")]             # no coordinator
            (decision,) = [s["decision"] for n, s in stats.items() if n.startswith("alone/")]
            assert not decision["pack"] and decision["reason"].startswith("every trial trains alone")
    assert len(runs["tune"]) == 3
    assert runs["alone"] == runs["tune"]                     # every unit's metrics, bit for bit


def _model(config):
    if config.get("explode"):
        return _Exploding(config["explode"])
    return digits_mlp_spec().model_fn(config)


class _Exploding(nn.Module):
    def __init__(self, marker):
        super().__init__()
        self.lin = nn.Linear(64, 10)
        self.marker = marker

    def forward(self, x):
        if os.path.exists(self.marker):                 # fails while the marker file exists
            raise RuntimeError("boom")
        return self.lin(x)


def test_failing_member_fails_only_its_trial_and_restore_resumes_it(ray_session, tmp_path):
    marker = tmp_path / "marker"
    marker.write_text("1")
    spec = dataclasses.replace(SPEC, model_fn=_model)
    space = {**SPACE, "explode": tune.grid_search(["", "", str(marker)])}
    trainable = packed(spec, max_units=3, param_space=space, members_per_device=3, pack=True)
    tuner = tune.Tuner(trainable, param_space=space,
                       tune_config=tune.TuneConfig(metric="accuracy", mode="max", num_samples=1),
                       run_config=tune.RunConfig(name="fail", storage_path=str(tmp_path), verbose=0,
                                                 failure_config=tune.FailureConfig(max_failures=0)))
    grid = tuner.fit()
    assert grid.num_errors == 1 and len(grid) == 3
    ok = [r for r in grid if r.error is None]
    assert [r.metrics["units"] for r in ok] == [3, 3]
    marker.unlink()                                               # the fault is gone: restore
    path = os.path.join(str(tmp_path), "fail")
    assert tune.Tuner.can_restore(path)
    grid2 = tune.Tuner.restore(path, trainable=trainable, resume_errored=True).fit()
    assert grid2.num_errors == 0 and len(grid2) == 3
    assert sorted(r.metrics["units"] for r in grid2) == [3, 3, 3]


def _bn_model(config):
    return nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))


def test_unpackable_spec_falls_back_to_plain_trials(ray_session, tmp_path):
    spec = dataclasses.replace(SPEC, model_fn=_bn_model)
    grid = _tuner(packed(spec, max_units=2, param_space=SPACE, members_per_device=2, pack=True), tmp_path, "plain",
                  tune.TuneConfig(metric="accuracy", mode="max", num_samples=2),
                  checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=True)).fit()
    assert grid.num_errors == 0
    for r in grid:
        assert r.metrics["units"] == 2 and "pack_size" not in r.metrics      # trained unpacked
        assert r.checkpoint is not None


def test_packed_hyperband_pauses_and_resumes_members(ray_session, tmp_path):
    """R = 3, eta = 3 on Tune's HyperBandScheduler: it PAUSES trials at its milestones (their
    member leaves the pack) and resumes them later from their checkpoint (the member joins a
    pack again with its state): every trial's units must run 1, 2, ... without a restart.

    The results are read from a callback (what the scheduler saw), not from the trial's
    result.json: Tune re-downloads that file from the storage path when a paused trial starts
    again, and a row written after the last upload is lost there (Tune's own behaviour for any
    paused function trainable, seen on Ray 2.60)."""
    rec = _Recorder()
    hb = PackedHyperband(R=3, eta=3, members_per_device=3, seed=2)
    assert hb.bracket_sizes == [2, 3] and hb.num_samples == 5
    pauses = []
    decide = hb.scheduler.on_trial_result

    def counting(controller, trial, result):
        action = decide(controller, trial, result)
        if action == "PAUSE":
            pauses.append((trial.trial_id, result["units"]))
        return action
    hb.scheduler.on_trial_result = counting
    grid = _tuner(packed(SPEC, max_units=3, param_space=SPACE, members_per_device=3, pack=True), tmp_path, "hb",
                  hb.tune_config("accuracy", "max"), callbacks=[rec],
                  checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False)).fit()
    assert grid.num_errors == 0 and len(grid) == 5
    per_trial: dict[str, list[tuple[int, int]]] = {}
    for tid, it, _, units in rec.results:
        per_trial.setdefault(tid, []).append((it, units))
    assert len(per_trial) == 5
    for tid, seq in per_trial.items():
        assert seq == [(i, i) for i in range(1, len(seq) + 1)], (tid, seq)     # no restart, no gap
    assert sorted(len(seq) for seq in per_trial.values()) == sorted(r.metrics["units"] for r in grid)
    # Li et al.'s brackets for R = 3, eta = 3: 3 trials start at 1 unit and one of them goes on
    # to 3; 2 trials start at 3 units. So 2 trials run 1 unit, 3 trials run 3 (one was paused).
    assert sorted(len(seq) for seq in per_trial.values()) == [1, 1, 3, 3, 3]
    # a checkpoint only when Tune asks: at a pause (no checkpoint_frequency, at_end off; the
    # ASHA test checks one per end with checkpoint_at_end). Tune may drop a pause's save when
    # the bracket stops the trial while it saves; every trial that resumed was saved.
    paused = [tid for tid, _ in pauses]
    assert pauses and set(rec.saves) <= set(paused) and len(rec.saves) <= len(paused)
    # Whether a paused trial resumes depends on the order in which Tune processes the rung's
    # results (the rung's last trial to report may go on without a pause); every paused trial
    # that did resume must have been saved.
    resumed = [tid for tid, u in pauses if len(per_trial[tid]) > u]
    assert all(tid in rec.saves for tid in resumed)


def test_coordinator_actor_with_a_set_aside_member_exits_when_idle(ray_session):
    """The real exit path (``ray.actor.exit_actor`` of a detached named actor) with a short
    idle timeout: b is set aside and its trial never frees it; after a's free the actor is
    gone within a bounded time."""
    import time

    import ray

    from jabasray.tuner.coordinator import PackCoordinator
    from jabasray.tuner.packed_trials import COORDINATOR_NAMESPACE

    name = "pack/test-idle-exit"
    h = ray.remote(PackCoordinator).options(name=name, namespace=COORDINATOR_NAMESPACE, lifetime="detached",
                                            num_cpus=0, max_concurrency=100).remote(
        cloudpickle.dumps(SPEC), 40, 4, None, 1, None, 0.2, 0.5, 50, 1, True)
    a = {"batch_size": 20, "optimizer": "adam", "lr": 1e-2, "activation": "relu"}
    b = {"batch_size": 40, "optimizer": "sgd", "lr": 1e-2, "activation": "relu"}
    ray.get([h.load.remote("a", a), h.load.remote("b", b)])
    ray.get([h.unit.remote("a"), h.unit.remote("b")])
    ray.get(h.unit.remote("a"))                                  # b never claims again
    deadline = time.monotonic() + 30
    while ray.get(h.stats.remote())["set_aside"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ray.get(h.free.remote("a"))
    freed = time.monotonic()
    while True:
        try:
            ray.get_actor(name, namespace=COORDINATOR_NAMESPACE)
        except ValueError:
            break
        assert time.monotonic() - freed < 15, "the coordinator did not exit"
        time.sleep(0.1)
