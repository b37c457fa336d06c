"""Ray Train habits of JabasTrainer.fit(): RunConfig's checkpoint_config / failure_config /
callbacks, Ray's own RunConfig converted or refused, Ray's TBXLoggerCallback writing TensorBoard
files read back by TensorBoard's own reader, one console line per epoch, a compact Result repr."""
from __future__ import annotations

import os
import time

import pytest

from actors_helpers import KillOnce, loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.checkpoint import list_checkpoints
from jabasray.actors.driver import DriverCallback, DriverOptions
from jabasray.actors.metrics import MetricsHistory, held_line
from jabasray.actors.trainer import JabasTrainer
from jabasray.config import CheckpointConfig, FailureConfig, JobConfig, RunConfig, run_config_from_ray
from jabasray.types import ClusterSpec, NodeSpec

CLUSTER = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])
# fit()'s console, checkpoint schedule and TensorBoard output do not depend on the GPU count: one
# GPU actor (each is a Ray worker process importing torch) where no GPU is killed
ONE_GPU = ClusterSpec(nodes=[NodeSpec("n0", "fast", 1, speed=1.0)])
JOB = JobConfig(epochs=3, initial_global_batch=24, min_global_batch=16, max_global_batch=48,
                min_local_batch=4, adapt_interval=2, autoscale=False, lr=0.05, seed=3)


# ------------------------------------------------------------------ pure
def test_what_jabasray_changes_is_said_for_each_rule():
    from jabasray.actors.trainer import training_changes

    head = "jabasray changes in your training: "
    assert training_changes(JobConfig(adaptive=False, lr_scaling="linear"), "torch.optim.sgd.SGD", 0.1) == (
        head + "the global batch stays 64; SGD's LR 0.1 is scaled as 0.1 x (B_G / 64) (lr_scaling='linear')")
    assert training_changes(JobConfig(lr_scaling="sqrt", warmup_iterations=5, grad_clip_norm=2.0),
                            "torch.optim.adadelta.Adadelta", 1.0) == (
        head + "the global batch starts at 64 and moves between 32 and 512 every 10 iterations "
        "(adaptive=False keeps it); Adadelta's LR 1 is scaled as 1 x sqrt(B_G / 64) (lr_scaling='sqrt') "
        "- Adadelta adapts its own step size; lr_scaling='none' keeps its LR; a linear LR warm-up over "
        "5 iterations; the global gradient clipped to L2 norm 2")


def test_checkpoint_config_schedule_and_values():
    c = CheckpointConfig(checkpoint_frequency=2)
    assert [e for e in range(1, 6) if c.due(e, 5)] == [2, 4, 5]      # every 2, and the final
    assert [e for e in range(1, 4) if CheckpointConfig(checkpoint_frequency=0).due(e, 3)] == [3]
    with pytest.raises(ValueError, match="num_to_keep must be"):
        CheckpointConfig(num_to_keep=0)
    with pytest.raises(ValueError, match="checkpoint_frequency must be"):
        CheckpointConfig(checkpoint_frequency=-1)
    with pytest.raises(ValueError, match="interval_minutes must be"):
        CheckpointConfig(interval_minutes=-1.0)
    with pytest.raises(ValueError, match="callbacks: int is not a callback"):
        RunConfig(callbacks=[3])


def test_console_reporter_bar_counts_samples_and_prints_epoch_lines(capsys):
    """A terminal gets a tqdm bar of the epoch's samples (capped at the total; B_G, loss in its
    postfix) and the epoch line on stdout above it; elsewhere (stderr not a terminal) no bar,
    the same line printed; events go to stderr."""
    from types import SimpleNamespace

    from jabasray.actors.callbacks import ConsoleReporter
    from jabasray.actors.metrics import EpochRecord, epoch_line

    epoch = EpochRecord(epoch=0, allocation={"n0": 2}, gpu_types=["fast"] * 2, trajectory=[8, 16],
                        predicted_trajectory=[], train_loss=1.5, val_accuracy=0.5, time_s=2.0,
                        gpu_seconds=4.0, samples=10, throughput=5.0)
    interval = SimpleNamespace(samples=6, global_batch=8, local_batch=4, phi=0.5, loss=1.25, time_s=0.5)
    bar = ConsoleReporter(bar=True)
    bar.start(total=10)
    bar.on_interval(None, interval)
    assert bar.bar.n == 6 and "B_G=8" in str(bar.bar)
    bar.on_interval(None, interval)
    assert bar.bar.n == 10                                    # capped at the total
    bar.on_epoch(None, epoch)
    bar.on_event(None, "re-placing")
    bar.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [epoch_line(epoch)] and "re-placing" in err and "sample" in err
    # start-up: the phase is the bar's description until training starts; the bar's clock
    # (rate, time left) restarts at the first interval
    slow = ConsoleReporter(bar=True)
    slow.start(total=10)
    slow.on_phase(None, "placing 2 GPU actors")
    assert str(slow.bar).startswith("placing 2 GPU actors...")
    time.sleep(1.0)
    slow.on_phase(None, "training")
    assert slow.bar.desc == ""
    slow.on_interval(None, interval)      # the clock restarted as the interval's 0.5 s began
    assert slow.bar.n == 6 and 0.5 <= slow.bar.format_dict["elapsed"] < 0.9
    assert 9 < slow.bar.format_dict["rate"] < 12.1              # 6 samples in 0.5-0.6 s
    slow.on_phase(None, "placing 1 GPU actor")                # a re-placement: shown, and then
    assert str(slow.bar).startswith("placing 1 GPU actor...")
    time.sleep(0.3)
    slow.on_phase(None, "training")
    slow.on_interval(None, interval)                          # no second restart of the clock
    assert slow.bar.format_dict["elapsed"] >= 0.8 and slow.bar.desc == "" and slow.bar.n == 10
    slow.close()
    capsys.readouterr()
    plain = ConsoleReporter()                                 # capsys: stderr is not a terminal
    plain.start(total=10)
    plain.on_phase(None, "profiling the model")               # no bar: nothing printed
    plain.on_interval(None, interval)
    plain.on_epoch(None, epoch)
    assert plain.bar is None and plain.lines == [epoch_line(epoch)]
    out, err = capsys.readouterr()
    assert out.splitlines() == [epoch_line(epoch)] and err == ""


def test_trackers_of_a_run_on_remote_storage_write_into_the_run_folder(tmp_path, monkeypatch):
    """Ray's TensorBoard and CSV loggers of a run whose folder is on a remote filesystem (here
    a SubTreeFileSystem: pyarrow's own, not "local") write into a temporary folder that is
    uploaded into the run folder at every epoch end and at the end - not into the client's
    working folder - and the temporary folder is removed."""
    import csv

    import pyarrow.fs
    from ray.tune.logger import CSVLoggerCallback, TBXLoggerCallback

    from jabasray.actors.callbacks import tracker_callbacks
    from jabasray.actors.metrics import EpochRecord
    from jabasray.storage import resolve

    cwd, root = tmp_path / "cwd", tmp_path / "bucket"
    cwd.mkdir()
    root.mkdir()
    monkeypatch.chdir(cwd)
    run = resolve("runs/r", pyarrow.fs.SubTreeFileSystem(str(root), pyarrow.fs.LocalFileSystem()))
    assert not run.is_local
    user, trackers = tracker_callbacks([TBXLoggerCallback(), CSVLoggerCallback()], run, "r", JOB.to_dict())
    assert user == [] and trackers is not None
    trackers.start()
    staging = trackers.staging
    epochs = [EpochRecord(epoch=e, allocation={"n0": 1}, gpu_types=["fast"], trajectory=[24],
                          predicted_trajectory=[], train_loss=1.0 / (e + 1), val_accuracy=0.5,
                          time_s=1.0, gpu_seconds=1.0, samples=24, throughput=24.0) for e in range(2)]
    trackers.on_epoch(None, epochs[0])
    assert (root / "runs" / "r" / "progress.csv").is_file()      # uploaded at the epoch's end
    trackers.on_epoch(None, epochs[1])
    trackers.finish(failed=False)
    files = sorted(p.name for p in (root / "runs" / "r").iterdir())
    assert "progress.csv" in files and any(f.startswith("events.out.tfevents.") for f in files)
    with open(root / "runs" / "r" / "progress.csv") as f:
        assert [float(r["epoch/train_loss"]) for r in csv.DictReader(f)] == [1.0, 0.5]
    assert list(cwd.iterdir()) == [] and not os.path.exists(staging)


def test_a_detached_run_refuses_callbacks_it_cannot_send_before_any_work(tmp_path):
    import threading

    class Holding(DriverCallback):
        def __init__(self):
            self.lock = threading.Lock()        # cannot be pickled

    ds, _ = tiny_data(64)
    tr = JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, JOB, cluster=CLUSTER,
                      run_config=RunConfig(str(tmp_path), "held", callbacks=[Holding()]))
    with pytest.raises(ValueError, match=r"^callbacks: RunConfig.callbacks\[0\] \(Holding\) cannot be "
                                         r"sent to the driver actor of a detached run \(TypeError: "):
        tr.fit(wait=False)
    assert list(tmp_path.iterdir()) == []       # nothing done


def test_ray_run_configs_are_converted_or_refused_in_one_line():
    from ray import train, tune
    from ray.tune.logger import TBXLoggerCallback

    tbx = TBXLoggerCallback()
    rc = run_config_from_ray(train.RunConfig(
        name="x", storage_path="/tmp/somewhere",
        checkpoint_config=train.CheckpointConfig(num_to_keep=3),
        failure_config=train.FailureConfig(max_failures=2)))
    assert rc == RunConfig(storage_path="/tmp/somewhere", name="x",
                           checkpoint_config=CheckpointConfig(num_to_keep=3),
                           failure_config=FailureConfig(max_failures=2))
    # Ray's defaults mean Ray's defaults (keep all, no retries); its ~/ray_results is not ours;
    # Tune's RunConfig carries the logger callbacks (Ray Train v2's takes only UserCallbacks)
    rc = run_config_from_ray(tune.RunConfig(callbacks=[tbx], checkpoint_config=tune.CheckpointConfig(
        checkpoint_frequency=2)))
    assert (rc.storage_path, rc.name, rc.checkpoint_config, rc.failure_config, rc.callbacks) == (
        "jabasray_runs", None, CheckpointConfig(num_to_keep=None, checkpoint_frequency=2),
        FailureConfig(max_failures=0), (tbx,))
    ds, _ = tiny_data(64)
    for bad, named in ((tune.RunConfig(stop={"epoch": 2}), "stop"),
                       (train.RunConfig(checkpoint_config=train.CheckpointConfig(
                           checkpoint_score_attribute="acc")), "checkpoint_score_attribute")):
        with pytest.raises(ValueError) as e:        # at construction, before any work
            JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, JOB, cluster=CLUSTER, run_config=bad)
        assert "\n" not in str(e.value) and named in str(e.value)
        assert str(e.value).startswith(f"run_config: {type(bad).__module__}.RunConfig sets ")
    tr = JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, JOB, cluster=CLUSTER,
                      run_config=train.RunConfig(storage_path="/tmp/x"))
    assert tr.run_config.name.startswith("ray_train_run-")    # Ray Train v2 names its runs
    assert tr.run_config.storage_path == "/tmp/x"


# ------------------------------------------------------------------ fit() on Ray
@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
def test_fit_console_checkpoints_and_tensorboard(tmp_path, capsys):
    """Three epochs, a checkpoint every 2 epochs (and the final), all kept; Ray's
    TBXLoggerCallback from RunConfig.callbacks; fit() prints what it changes in the training
    once, then one line per epoch, then the GPU-hours held over the run."""
    from ray.tune.logger import TBXLoggerCallback
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ds, val = tiny_data(120)
    rc = RunConfig(str(tmp_path), "habits", callbacks=[TBXLoggerCallback()],
                   checkpoint_config=CheckpointConfig(num_to_keep=None, checkpoint_frequency=2))
    capsys.readouterr()
    result = JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, JOB, cluster=ONE_GPU,
                          run_config=rc, val_dataset=val, perf_model=perf_model(),
                          options=DriverOptions(driver="local")).fit()
    out = capsys.readouterr().out.splitlines()
    epochs = result.history.epochs
    # console: what jabasray changes in the training, once, then exactly one line per epoch, in
    # order (no bar: stderr is not a terminal), and the run's GPU-hours held (metrics.json's)
    assert out[0] == ("jabasray changes in your training: the global batch starts at 24 and moves "
                      "between 16 and 48 every 2 iterations (adaptive=False keeps it); SGD's LR 0.05 "
                      "is kept whatever the batch (lr_scaling='none')")
    assert [ln.split(":")[0] for ln in out[1:-1]] == ["epoch 1", "epoch 2", "epoch 3"]
    assert out[-1] == held_line(result.history.held) and result.history.held.epochs_counted == [0, 1, 2]
    assert MetricsHistory.from_json(result.metrics_path.read_text()).held == result.history.held
    # checkpoints: the start (epoch 0), every 2nd epoch and the final one; nothing pruned
    assert [c.epochs_done for c in list_checkpoints(result.storage)] == [0, 2, 3]
    # a compact repr: the last metrics, the path, the checkpoint - not the history
    text = repr(result)
    assert len(text) < 700 and text.startswith("Result(metrics={'epoch': 2, ")
    assert f"path={result.path!r}" in text and "checkpoint_000003" in text and "intervals" not in text
    # TensorBoard files in the run folder, read back with TensorBoard's own reader
    acc = EventAccumulator(str(result.storage.local_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"ray/tune/epoch/train_loss", "ray/tune/epoch/val_accuracy", "ray/tune/interval/loss",
            "ray/tune/interval/global_batch"} <= tags
    got = [e.value for e in acc.Scalars("ray/tune/epoch/train_loss")]
    assert got == pytest.approx([e.train_loss for e in epochs], rel=1e-6)
    got = [e.value for e in acc.Scalars("ray/tune/epoch/val_accuracy")]
    assert got == pytest.approx([e.val_accuracy for e in epochs], rel=1e-6)
    ivs = result.history.intervals
    loss = acc.Scalars("ray/tune/interval/loss")
    assert [e.value for e in loss] == pytest.approx([r.loss for r in ivs], rel=1e-6)
    assert [e.step for e in loss] == [r.iteration + r.num_iterations for r in ivs]   # global iteration
    assert [e.value for e in acc.Scalars("ray/tune/interval/global_batch")] == [r.global_batch for r in ivs]


class _StopAt(DriverCallback):
    """Raise in on_interval at (epoch, interval): an interrupted run."""

    def __init__(self, epoch: int, interval: int) -> None:
        self.at = (epoch, interval)

    def on_interval(self, driver, record):
        if (record.epoch, record.interval) == self.at:
            raise KeyboardInterrupt("stopped mid-epoch by the test")


MID_JOB = JobConfig(epochs=2, initial_global_batch=24, min_global_batch=16, max_global_batch=48,
                    min_local_batch=4, adapt_interval=1, alpha=0.25, gamma=0.9, autoscale=False,
                    lr=0.05, warmup_iterations=3, seed=4)


def _mid_fit(root, name, callbacks=(), minutes=None, failure=None):
    """``fit()`` of MID_JOB on the pair, in this process (the callbacks run here)."""
    ds, val = tiny_data(160)
    rc = RunConfig(str(root), name, checkpoint_config=CheckpointConfig(interval_minutes=minutes),
                   failure_config=failure or FailureConfig())
    return JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, MID_JOB, cluster=CLUSTER, run_config=rc,
                        val_dataset=val, perf_model=perf_model(), callbacks=list(callbacks),
                        options=DriverOptions(driver="local", record_samples=True)).fit()


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory):
    """MID_JOB run uninterrupted, without mid-epoch checkpoints: what every interrupted run of
    this module must end equal to."""
    return _mid_fit(tmp_path_factory.mktemp("uninterrupted"), "ref")


def _assert_same_training(ref, got) -> None:
    """Bit-identical weights and optimizer state; the same B_G trajectory, LRs and interval
    positions."""
    import torch

    wa, wb = (r.run_checkpoint.load_worker_state() for r in (ref, got))
    for k in wa["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k
    for sa, sb in zip(wa["optimizer"]["state"].values(), wb["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert [e.trajectory for e in got.history.epochs] == [e.trajectory for e in ref.history.epochs]
    assert [r.lr for r in got.history.intervals] == [r.lr for r in ref.history.intervals]
    assert [(r.epoch, r.interval, r.cursor) for r in got.history.intervals] == \
        [(r.epoch, r.interval, r.cursor) for r in ref.history.intervals]


@pytest.mark.ray
def test_mid_epoch_checkpoint_resume_equals_uninterrupted(uninterrupted, tmp_path):
    """CheckpointConfig(interval_minutes=0): a checkpoint at every interval boundary; a run
    stopped within epoch 2 and fit() again resumes at the interval after the last mid-epoch
    checkpoint and ends with the weights, optimizer state, B_G trajectory and LRs of the
    uninterrupted run, each sample served once per epoch (the restored tally included)."""
    from actors_helpers import assert_each_sample_once_per_epoch

    with pytest.raises(KeyboardInterrupt):
        _mid_fit(tmp_path, "cut", [_StopAt(epoch=1, interval=3)], minutes=0)
    resumed = _mid_fit(tmp_path, "cut", minutes=0)
    assert any("resumed within epoch 2 at sample" in m for m in resumed.history.events)
    assert not (resumed.storage / "checkpoints" / "mid_epoch").exists()     # dropped at epoch end
    _assert_same_training(uninterrupted, resumed)
    assert_each_sample_once_per_epoch(resumed.history, 160)
    assert [e.served_exactly_once for e in resumed.history.epochs] == [True, True]


@pytest.mark.ray
def test_actor_failure_mid_epoch_resumes_from_the_mid_epoch_checkpoint(uninterrupted, tmp_path):
    """A GPU actor killed within epoch 2, after a mid-epoch checkpoint (interval_minutes=0: one
    at every interval boundary): the run restarts at that checkpoint's sample, not at the epoch
    start - no interval is redone, the epoch's served indices (as the actors report them) are
    every sample exactly once. Retried on the same GPUs (drop_gpu_after=-1) the run ends with
    the weights, optimizer state, B_G trajectory and LRs of the uninterrupted run; with the GPU
    dropped (drop_gpu_after=1) it continues on one GPU from the same sample."""
    from actors_helpers import assert_each_sample_once_per_epoch

    ref = uninterrupted
    at = next(r.cursor for r in ref.history.intervals if (r.epoch, r.interval) == (1, 3))
    for name, drop_after in (("same", -1), ("dropped", 1)):
        got = _mid_fit(tmp_path, name, [KillOnce(epoch=1, rank=1, interval=2)], minutes=0,
                       failure=FailureConfig(max_failures=1, drop_gpu_after=drop_after))
        events = got.history.events
        failed = next(i for i, m in enumerate(events) if m.startswith("GPU actor failure: rank 1"))
        assert events[failed + 1] == (f"resumed within epoch 2 at sample {at} from "
                                      f"{got.storage / 'checkpoints' / 'mid_epoch'}"), events
        # no interval redone: after the kill the epoch goes on at interval 3, sample `at`
        pos = [(r.epoch, r.interval) for r in got.history.intervals]
        assert pos == sorted(set(pos)) and (1, 3) in pos
        assert next(r.cursor for r in got.history.intervals if (r.epoch, r.interval) == (1, 3)) == at
        assert_each_sample_once_per_epoch(got.history, 160)
        if drop_after == 1:
            assert got.history.epochs[1].gpu_types == ["fast"]
            continue
        assert got.history.epochs[1].gpu_types == ["fast", "fast"]
        _assert_same_training(ref, got)
