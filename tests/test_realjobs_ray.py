"""Real jobs end to end on the session Ray instance: a dataset of 1000 sample files built on each
actor and read by DataLoader workers trains EXACTLY like the same samples in memory - through
forced re-placement every epoch and through an interruption + resume - while the driver never
reads a sample; Ray Train's Result conventions; the user's LR and hooks checked before training."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model
from jabasray.actors.checkpoint import latest_checkpoint
from jabasray.actors.driver import DriverOptions
from jabasray.actors.trainer import JabasTrainer, Result
from jabasray.config import JobConfig, RunConfig
from jabasray.types import ClusterSpec, NodeSpec
from realjobs_helpers import FileDataset, cosine_scheduler as scheduler, in_memory_copy, write_sample_files

# every run on the session's Ray (its emulated GPU resources, started once): a fit() before the
# first test that asks for ray_session would start a Ray of its own, which ray_session then
# shuts down and starts again
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

CLUSTER = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])
# where what a test proves does not depend on the GPU count: one GPU actor instead of two (each
# is a Ray worker process importing torch: most of a run's time here)
ONE_GPU = ClusterSpec(nodes=[NodeSpec("n0", "fast", 1, speed=1.0)])
N, NVAL = 1000, 200


def job(epochs: int, **kw) -> JobConfig:
    return JobConfig(epochs=epochs, initial_global_batch=48, min_global_batch=32, max_global_batch=192,
                     min_local_batch=8, adapt_interval=3, alpha=0.25, gamma=0.9, autoscale=False,
                     lr_scaling="sqrt", warmup_iterations=3, seed=7, **kw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples")
    return write_sample_files(root / "train", N, seed=0), write_sample_files(root / "val", NVAL, seed=1)


def fit(tmp_path, name, epochs, folders=None, **kw) -> Result:
    """In memory when ``folders`` is None, else dataset_fn/val_dataset_fn over the files (a
    sample read in THIS process raises). The driver runs in this process (the driver actor's
    own path is tested in test_driver_actor.py): one worker process fewer per run."""
    data = {"dataset": in_memory_copy(N), "val_dataset": in_memory_copy(NVAL, seed=1)}
    if folders is not None:
        pid = os.getpid()
        train, val = folders
        data = {"dataset_fn": lambda: FileDataset(train, forbidden_pid=pid),
                "val_dataset_fn": lambda: FileDataset(val, forbidden_pid=pid),
                "num_data_workers": 1}
    opts = {"driver": "local", **kw.pop("options", {})}
    return JabasTrainer(model_fn, optimizer_fn=optimizer_fn, loss_fn=loss_fn, job_config=job(epochs),
                        cluster=CLUSTER, run_config=RunConfig(str(tmp_path), name),
                        lr_scheduler_fn=scheduler, perf_model=perf_model(),
                        options=DriverOptions(**opts), **data, **kw).fit()


def assert_same(a: Result, b: Result) -> None:
    wa, wb = a.run_checkpoint.load_worker_state(), b.run_checkpoint.load_worker_state()
    for k in wa["model"]:
        torch.testing.assert_close(wa["model"][k], wb["model"][k], rtol=1e-6, atol=1e-7)
    assert wa["lr_scheduler"] == wb["lr_scheduler"]
    assert [r.lr for r in a.history.intervals] == pytest.approx([r.lr for r in b.history.intervals])
    assert [e.trajectory for e in a.history.epochs] == [e.trajectory for e in b.history.epochs]
    for ea, eb in zip(a.history.epochs, b.history.epochs):
        assert ea.val_metrics == pytest.approx(eb.val_metrics, rel=1e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("ref"), "ref", 2)


@pytest.fixture(scope="module")
def files_run(folders, tmp_path_factory):
    """The 2-epoch run over the files, re-placing every actor at each epoch."""
    return fit(tmp_path_factory.mktemp("files"), "files", 2, folders, options={"force_replacement": True})


def test_file_dataset_with_forced_replacement_trains_exactly_like_in_memory(reference, files_run):
    """Same samples in the same order (identical weights, B_G trajectory, LR, val metrics): the
    DataLoader path serves every sample once per epoch, also after re-placing every actor."""
    files = files_run
    assert [e.replaced for e in files.history.epochs] == [False, True]
    for e in (0, 1):
        assert sum(r.samples for r in files.history.intervals if r.epoch == e) == N
    assert len({r.global_batch for r in files.history.intervals}) > 1        # B_G adapted
    assert_same(files, reference)


def test_file_dataset_resume_equals_uninterrupted(reference, files_run, folders, tmp_path):
    """A run over the files stopped after epoch 1 (the files run's folder without its epoch-2
    checkpoint: what such a run leaves) and fit() again with the same job resumes there and
    ends like the uninterrupted in-memory run."""
    shutil.copytree(files_run.path, tmp_path / "resume")
    shutil.rmtree(tmp_path / "resume" / "checkpoints" / "epoch_0002")
    first = latest_checkpoint(tmp_path / "resume")
    assert first.epochs_done == 1
    second = fit(tmp_path, "resume", 2, folders)
    assert any(m.startswith("resumed from") and "epoch_0001" in m for m in second.history.events)
    assert_same(second, reference)


def test_result_follows_ray_train_conventions(reference):
    """Result.checkpoint is a ray.train.Checkpoint whose model.pt / optimizer.pt load with plain
    torch (weights_only) into the user's model and optimizer; metrics, metrics_dataframe, path,
    from_path; every metric per epoch in the CSV, the JSON and the plot."""
    import ray.train

    r = reference
    assert isinstance(r.checkpoint, ray.train.Checkpoint) and isinstance(r.path, str)
    with r.checkpoint.as_directory() as d:
        model = model_fn()
        model.load_state_dict(torch.load(os.path.join(d, "model.pt"), weights_only=True))
        opt = optimizer_fn(model.parameters())
        opt.load_state_dict(torch.load(os.path.join(d, "optimizer.pt"), weights_only=True))
        sched = scheduler(opt)
        sched.load_state_dict(torch.load(os.path.join(d, "lr_scheduler.pt"), weights_only=True))
    w = r.run_checkpoint.load_worker_state()["model"]
    assert all(torch.equal(v, w[k]) for k, v in model.state_dict().items())
    df = r.metrics_dataframe
    assert list(df["epoch"]) == [0, 1]
    assert {"train_loss", "val_loss", "val_accuracy", "lr", "time_s"} <= set(df.columns)
    assert df["val_accuracy"].iloc[-1] == pytest.approx(r.metrics["val_accuracy"])
    assert r.metrics["val_loss"] == r.history.epochs[-1].val_metrics["loss"]
    assert 0.0 <= r.metrics["val_accuracy"] <= 1.0 and r.metrics["val_accuracy"] > 0.3
    again = Result.from_path(r.path)
    assert again.metrics == r.metrics and again.checkpoint.path == r.checkpoint.path
    assert r.plot_path.read_bytes()[:4] == b"\x89PNG"


def test_the_optimizers_lr_is_the_lr_at_the_initial_global_batch(tmp_path):
    """No scheduler, no warm-up, B_G fixed at initial_global_batch: every interval trains at the
    optimizer's own LR (0.0375), and a disagreeing JobConfig.lr is a one-line error naming both.
    One GPU: the LR follows the global batch (48, above the profile's largest local batch 32,
    so the local batch differs from it on one GPU as on two)."""
    r = JabasTrainer(model_fn, in_memory_copy(240), lambda p: torch.optim.SGD(p, lr=0.0375),
                     loss_fn, JobConfig(epochs=1, initial_global_batch=48, min_global_batch=32,
                                        max_global_batch=192, min_local_batch=8, adaptive=False,
                                        autoscale=False, adapt_interval=2),
                     cluster=ONE_GPU, run_config=RunConfig(str(tmp_path), "lr"),
                     perf_model=perf_model(), options=DriverOptions(driver="local")).fit()
    assert {i.global_batch for i in r.history.intervals} == {48}
    assert {i.local_batch for i in r.history.intervals} != {48}
    assert len(r.history.intervals) > 1 and {i.lr for i in r.history.intervals} == {0.0375}
    with pytest.raises(ValueError, match=r"^lr: JobConfig.lr = 0.05 disagrees with the LR of the "
                                         r"optimizer optimizer_fn builds \(0.0375\)"):
        JabasTrainer(model_fn, in_memory_copy(240), lambda p: torch.optim.SGD(p, lr=0.0375), loss_fn,
                     JobConfig(lr=0.05, max_global_batch=192), cluster=CLUSTER,
                     run_config=RunConfig(str(tmp_path), "bad"),
                     perf_model=perf_model()).fit()
    # refused before any actor or checkpoint (the run folder itself is probed for writability first)
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_bad_dataset_fn_fails_before_any_actor_with_one_line(folders, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"^dataset_fn returned an empty dataset \(len 0\)$"):
        JabasTrainer(model_fn, dataset_fn=lambda: FileDataset(empty), optimizer_fn=optimizer_fn,
                     job_config=job(1), cluster=CLUSTER, run_config=RunConfig(str(tmp_path), "e"),
                     perf_model=perf_model()).fit()
    with pytest.raises(ValueError, match=r"^step_fn must return a scalar loss tensor, got a tensor"):
        JabasTrainer(model_fn, dataset_fn=lambda: FileDataset(folders[0]), optimizer_fn=optimizer_fn,
                     step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"),
                     job_config=job(1), cluster=CLUSTER, run_config=RunConfig(str(tmp_path), "s"),
                     perf_model=perf_model()).fit()


def test_sma_learners_train_every_sample_once_and_run_the_users_step_fn(tmp_path):
    """sync="sma": the GPU actors host SMAWorker (same actor surface, validation included in the
    first run): one epoch on one pair serves every sample once, every interval measures Phi,
    and the central model z moved away from its initialisation in every parameter. The
    learners call the user's step_fn and take the LR from the user's optimizer: a step
    returning 2 x cross-entropy with the optimizer's LR halved moves every learner exactly like
    the default step at the full LR (SMA's update is w -= lr g - alpha (w - z)), so the central
    model z must come out equal - it would not if either were ignored. (The first run is also
    the SMA run test_trainer.py once made on its own.)"""
    from actors_helpers import assert_each_sample_once_per_epoch

    base = JobConfig(epochs=1, sync="sma", initial_global_batch=24, min_global_batch=16,
                     max_global_batch=48, min_local_batch=4, adapt_interval=3, autoscale=False, seed=2)
    ds = in_memory_copy(120)
    common = dict(job_config=base, cluster=CLUSTER, perf_model=perf_model(), loss_fn=loss_fn,
                  options=DriverOptions(driver="local", record_samples=True))

    def double_step(model, batch):
        x, y = batch
        return 2.0 * F.cross_entropy(model(x), y)

    a = JabasTrainer(model_fn, ds, optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.05),
                     val_dataset=in_memory_copy(NVAL, seed=1),
                     run_config=RunConfig(str(tmp_path), "a"), **common).fit()
    b = JabasTrainer(model_fn, ds, optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.025),
                     step_fn=double_step, run_config=RunConfig(str(tmp_path), "b"), **common).fit()
    for r in (a, b):
        assert_each_sample_once_per_epoch(r.history, len(ds))
        assert all(i.phi is not None and -1 <= i.phi <= 1 for i in r.history.intervals)
    # SMA checkpoints hold every rank's state (actors/sma_state.py); z is the same on every rank
    za, zb = (r.run_checkpoint.load_worker_state()["sma_ranks"][0]["z"] for r in (a, b))
    for k in za:
        torch.testing.assert_close(za[k], zb[k], rtol=1e-5, atol=1e-6)
    torch.manual_seed(2)
    init = model_fn().state_dict()
    assert set(za) == set(init)
    assert any(not torch.allclose(za[k], init[k]) for k in init)
    assert all(not torch.equal(za[k], init[k]) for k in init), "the SMA central model did not train"
    assert sum(i.samples for i in b.history.intervals) == len(ds)


def test_file_dataset_survives_actor_loss_without_losing_or_repeating_samples(ray_session, folders, tmp_path):
    """A pair reads the files through DataLoaders; rank 1 is killed mid-epoch 0 (interval 1
    of >= 3). The driver restarts epoch 0 from the initial checkpoint on the remaining GPU:
    the failed attempt's intervals are dropped, each epoch is trained once, completely."""
    from actors_helpers import KillOnce
    from jabasray.actors.driver import JabasDriver
    from jabasray.actors.hooks import JobHooks

    pid = os.getpid()
    # no loader worker processes: each would reserve a CPU in its GPU's placement bundle, beside
    # the module's other runs on the session's 2 CPUs (the reservation is tested in
    # test_cluster_faults)
    hooks = JobHooks(dataset_fn=lambda: FileDataset(folders[0], forbidden_pid=pid), num_data_workers=0)
    drv = JabasDriver(model_fn, None, optimizer_fn, loss_fn, job(2), CLUSTER, tmp_path / "run",
                      perf_model=perf_model(), hooks=hooks, dataset_size=N,
                      options=DriverOptions(failure_grace_s=10), callbacks=[KillOnce(epoch=0, rank=1)])
    hist = drv.run()
    # the dead actor costs only its own GPU: epoch 0 is redone on the other one
    assert [len(e.gpu_types) for e in hist.epochs] == [1, 1]
    assert sum("failure" in m for m in hist.events) == 1
    for e in (0, 1):
        ep = [r for r in hist.intervals if r.epoch == e]
        assert sum(r.samples for r in ep) == N and [r.interval for r in ep] == list(range(len(ep)))
