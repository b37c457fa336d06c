"""Run identity: a default run name is unique per run, every run folder records the job that
wrote it (job.json), fit() on an existing folder resumes only that job (else one line naming the
differing fields), and a finished run asked again returns its result and says so."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.checkpoint import DriverState, save_checkpoint
from jabasray.actors.driver import DriverOptions
from jabasray.actors.job_identity import (JOB_FILE, callable_identity, check_run, differences,
                                          job_identity, model_signature, optimizer_identity,
                                          read_identity)
from jabasray.actors.trainer import JabasTrainer
from jabasray.config import JobConfig, RunConfig
from jabasray.models import MLP
from jabasray.storage import as_storage_path
from jabasray.types import ClusterSpec, NodeSpec

CLUSTER = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])
# the fits: run identity holds for any GPU count, and each GPU actor is a Ray worker importing torch
ONE_GPU = ClusterSpec(nodes=[NodeSpec("n0", "fast", 1, speed=1.0)])


def job(**kw) -> JobConfig:
    base = dict(epochs=1, initial_global_batch=24, min_global_batch=16, max_global_batch=48,
                min_local_batch=4, adapt_interval=2, autoscale=False, lr=0.05, seed=1)
    return JobConfig(**{**base, **kw})


def identity(width: int = 32, lr: float = 0.05, **job_kw) -> dict:
    model = MLP(64, (width,), 10)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return job_identity(job(lr=lr, **job_kw), model_signature(model), optimizer_identity(opt),
                        {"model_fn": model_fn, "optimizer_fn": optimizer_fn, "loss_fn": loss_fn},
                        200)


# ------------------------------------------------------------------ pure (no Ray)
def test_differences_name_each_changed_field():
    base = identity()
    assert differences(base, identity()) == []
    assert differences(base, identity(epochs=5)) == []          # more epochs continue a run
    assert differences(base, identity(width=64)) == ["model: net.0.weight [32, 64] float32 -> [64, 64] float32"]
    lr = differences(base, identity(lr=0.1))
    assert lr == ["job_config.lr: 0.05 -> 0.1", "optimizer.lr: 0.05 -> 0.1"]
    assert differences(base, identity(alpha=0.5)) == ["job_config.alpha: 0.1 -> 0.5"]
    other = {**base, "hooks": {**base["hooks"], "loss_fn": callable_identity(torch.nn.CrossEntropyLoss())},
             "dataset_size": 100}
    assert differences(base, other) == [
        f"hooks.loss_fn: {callable_identity(loss_fn)} -> torch.nn.modules.loss.CrossEntropyLoss()",
        "dataset_size: 200 -> 100"]
    # the record is plain JSON and survives a round trip
    assert differences(json.loads(json.dumps(base)), base) == []


def test_a_record_written_before_a_field_existed_counts_it_at_its_default():
    """A run recorded by an earlier version (its job_config lacks a field added since) resumes
    while the new field is at its default and is refused, naming it, when it is not; a recorded
    field JobConfig no longer has is ignored. The run record and the checkpoint's job check
    follow the same rule."""
    from dataclasses import replace

    from jabasray.actors.recovery import check_resumable

    base = identity()
    older = json.loads(json.dumps(base))
    del older["job_config"]["cuda_graphs"]
    older["job_config"]["retired_option"] = 3
    assert differences(older, identity()) == []
    assert differences(older, identity(cuda_graphs="off")) == ["job_config.cuda_graphs: auto -> off"]
    state = DriverState(epochs_done=1, iteration=4, cluster=CLUSTER, allocation={"n0": 2},
                        adaptive={}, job_config=older["job_config"])
    check_resumable(state, job().to_dict())
    with pytest.raises(ValueError, match=r"differs from the checkpointed run in \['cuda_graphs'\]"):
        check_resumable(state, job(cuda_graphs="off").to_dict())
    with pytest.raises(ValueError, match=r"in \['lr'\]"):
        check_resumable(replace(state, job_config=job(lr=0.2).to_dict()), job().to_dict())


def test_callable_identity_forms():
    assert callable_identity(loss_fn) == "actors_helpers.loss_fn"
    assert callable_identity(MLP) == "jabasray.models.MLP"
    assert callable_identity(torch.nn.MSELoss()) == "torch.nn.modules.loss.MSELoss()"
    assert callable_identity(functools.partial(MLP, 64, hidden=(8,))) == \
        "functools.partial(jabasray.models.MLP, 64, hidden=[8])"
    assert callable_identity(None) is None


def _checkpointed(run, ident, epochs_done: int, metrics: bool = True) -> None:
    save_checkpoint(run, DriverState(epochs_done, 0, CLUSTER, {"fast": 2}), {"w": torch.zeros(2)})
    (as_storage_path(run) / JOB_FILE).write_text(json.dumps({"identity": ident}))
    if metrics:
        (as_storage_path(run) / "metrics.json").write_text("{}")


def test_check_run_new_resume_refuse_force_finished(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    ident = identity()
    assert check_run(run, ident, "r", "auto", 2).kind == "new"          # records the job
    assert read_identity(run) == ident
    _checkpointed(run, ident, 1)
    start = check_run(run, ident, "r", "auto", 2)
    assert (start.kind, start.checkpoint.epochs_done) == ("resume", 1)
    # another job on that folder: one line naming the fields and both ways out
    with pytest.raises(ValueError) as e:
        check_run(run, identity(width=64, lr=0.1), "r", "auto", 2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"name: run {run} holds another job's checkpoints")
    assert "model: net.0.weight [32, 64]" in msg and "optimizer.lr: 0.05 -> 0.1" in msg
    assert "leave RunConfig.name unset" in msg and "resume='force'" in msg
    assert read_identity(run) == ident                                  # nothing changed
    # forced: resumed, and the folder now records the new job
    changed = identity(lr=0.1)
    assert check_run(run, changed, "r", "force", 2).kind == "resume"
    assert read_identity(run) == changed
    # finished: a checkpoint of >= epochs epochs and its metrics
    fin = check_run(run, changed, "r", "auto", 1)
    assert fin.kind == "finished" and "already finished (1 epoch(s)" in fin.message
    with pytest.raises(ValueError, match="resume must be one of 'auto', 'force', got 'yes'"):
        check_run(run, changed, "r", "yes", 1)


def test_run_config_names_and_resume_values():
    a, b = RunConfig().named(), RunConfig().named()
    assert a.name != b.name and a.name.startswith("JabasTrainer_")
    assert RunConfig(name="x").named().name == "x"
    with pytest.raises(ValueError, match="name: this RunConfig has no run name yet"):
        RunConfig().path
    with pytest.raises(ValueError, match="resume must be one of 'auto', 'force', got 'always'"):
        RunConfig(resume="always")


# ------------------------------------------------------------------ fit() on Ray
@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
def test_default_names_never_share_and_changed_job_is_refused(tmp_path, capsys):
    """Two different jobs (model widths) with default RunConfigs in one storage folder get two
    run folders, each recording its own job; the first asked again returns its own result and
    says so; a changed LR or width on its name is refused naming the field."""
    ds, val = tiny_data(200)

    def trainer(width: int, lr: float = 0.05, name: str | None = None, **kw) -> JabasTrainer:
        opt = functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)
        return JabasTrainer(functools.partial(MLP, 64, (width,), 10), ds, opt, loss_fn,
                            job(lr=lr), cluster=ONE_GPU, val_dataset=val, perf_model=perf_model(),
                            run_config=RunConfig(str(tmp_path), name), **kw)

    narrow = trainer(32, options=DriverOptions(driver="local")).fit()
    wide = trainer(48).fit()                                   # the actor driver
    assert narrow.path != wide.path
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        sorted([narrow.storage.name, wide.storage.name])
    for result, width in ((narrow, 32), (wide, 48)):
        rec = read_identity(result.storage)
        assert rec["model"]["tensors"][0] == ["net.0.weight", [width, 64], "float32"]
        w = result.run_checkpoint.load_worker_state()["model"]["net.0.weight"]
        assert tuple(w.shape) == (width, 64)
    capsys.readouterr()
    again = trainer(32, name=narrow.storage.name).fit()
    out = capsys.readouterr().out
    assert f"run {narrow.path} already finished (1 epoch(s) of this job); returning its result" in out
    assert again.history.to_dict() == narrow.history.to_dict()
    assert again.run_checkpoint.path == narrow.run_checkpoint.path
    quiet = trainer(32, name=narrow.storage.name, verbose=0).fit()     # Ray's verbose=0: silent
    assert capsys.readouterr().out == "" and quiet.history.to_dict() == narrow.history.to_dict()
    for changed, field in ((trainer(32, lr=0.1, name=narrow.storage.name), "optimizer.lr: 0.05 -> 0.1"),
                           (trainer(48, name=narrow.storage.name), "model: net.0.weight [32, 64]")):
        with pytest.raises(ValueError, match="holds another job's checkpoints") as e:
            changed.fit()
        assert field in str(e.value)


def test_forced_resume_passes_the_drivers_job_check(tmp_path):
    """resume='force' reaches the driver: a checkpoint of another JobConfig is resumed as this
    job (its state records the new JobConfig); without force the driver refuses it."""
    from jabasray.actors.recovery import restore_or_start
    from jabasray.adaptive import AdaptiveBatchController

    old, new = job(alpha=0.1), job(alpha=0.5)
    state = DriverState(1, 9, CLUSTER, {"fast": 2}, adaptive=AdaptiveBatchController(old).state_dict(),
                        job_config=old.to_dict())
    save_checkpoint(tmp_path, state, {"w": torch.zeros(2)})

    def choose(cluster, forecast):
        return {"fast": 2}

    with pytest.raises(ValueError, match=r"job_config differs from the checkpointed run in \['alpha'\]"):
        restore_or_start(tmp_path, new, CLUSTER, AdaptiveBatchController(new), choose)
    cp, resumed, events = restore_or_start(tmp_path, new, CLUSTER, AdaptiveBatchController(new),
                                           choose, force=True)
    assert (cp.epochs_done, resumed.iteration, resumed.job_config) == (1, 9, new.to_dict())
    assert events == [f"resumed from {cp.path} after 1 epoch(s)"]
