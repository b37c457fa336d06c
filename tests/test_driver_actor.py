"""The driver as a restartable, detached Ray actor, on the session Ray instance.

* Killing the driver actor's process mid-epoch: Ray restarts it, it resumes from the last
  checkpoint by itself and the run ends with every completed epoch and the same weights, B_G
  trajectory and LRs as an uninterrupted in-process run (training is deterministic).
* ``jabasray train --detach`` in a subprocess that then exits (a client that disconnects); this
  process (a second client) sees the run with ``status``, follows it, stops it cleanly.
* Bad input: a running name is refused; status/attach/stop of unknown runs name the runs.
* No leftovers after a restart or a stop: the old incarnation's GPU actors and placement groups
  are gone and every emulated GPU resource is free again. Checked with the GCS-level APIs
  (``list_named_actors``, ``placement_group_table``, ``available_resources``): the
  ``ray.util.state`` API needs the dashboard, which the test Ray instance does not start.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from actors_helpers import HeldRows, loss_fn, model_fn, optimizer_fn, perf_model, profile, tiny_data
from jabasray.actors import run_client
from jabasray.actors.driver import DriverCallback, DriverOptions
from jabasray.actors.driver_actor import NAMESPACE, gpu_actor_prefix, kv_get
from jabasray.actors.trainer import JabasTrainer
from jabasray.cli import main
from jabasray.config import JobConfig, RunConfig
from jabasray.types import ClusterSpec, NodeSpec
from test_trainer import assert_same_training, job

pytestmark = pytest.mark.ray

# one GPU: the driver actor's restart, detaching and following hold for any GPU count, and each
# GPU actor is one more Ray worker process (~4 s of CPU) per placement
FAST = ClusterSpec(nodes=[NodeSpec("n0", "fast", 1, speed=1.0)])


class Recorder(DriverCallback):
    def __init__(self) -> None:
        self.intervals, self.epochs, self.events, self.phases = [], [], [], []
        self.drivers = set()

    def on_phase(self, driver, phase):
        self.phases.append((phase, len(self.intervals)))    # and how many intervals came before

    def on_interval(self, driver, record):
        self.intervals.append((record.epoch, record.interval))
        self.drivers.add(type(driver).__name__)

    def on_epoch(self, driver, record):
        self.epochs.append(record.epoch)

    def on_event(self, driver, message):
        self.events.append(message)


def trainer(tmp_path, name, epochs, cluster=FAST, driver="actor", callbacks=(), held=False,
            run_callbacks=()):
    """A run of ``job(epochs)`` on 200 digits; ``held``: its reads wait mid-epoch 1 (after
    200 + 40 rows) until the test releases them (``trainer(...).dataset.release()``);
    ``run_callbacks``: its ``RunConfig.callbacks``."""
    ds, val = tiny_data(200)
    if held:
        ds = HeldRows(ds, tmp_path, after=200 + 40)
    return JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, job(epochs), cluster=cluster,
                        run_config=RunConfig(str(tmp_path), name, callbacks=list(run_callbacks)),
                        val_dataset=val,
                        perf_model=perf_model(), options=DriverOptions(driver=driver),
                        callbacks=callbacks)


def wait_for(cond, what, timeout=120.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


def our_named_actors(ray) -> list[str]:
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == NAMESPACE]


def assert_no_leftovers(ray) -> None:
    """No driver or GPU actor of ours alive, no placement group left, every resource free."""
    total = ray.cluster_resources()

    def clean():
        free = ray.available_resources()
        pgs = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        return (not our_named_actors(ray) and not pgs and
                all(free.get(k, 0) == v for k, v in total.items() if k.startswith("gpu_")))
    wait_for(clean, "actors and placement groups to be released", timeout=60)


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    return trainer(tmp_path_factory.mktemp("ref"), "ref", 2, driver="local").fit()


def test_killed_driver_process_restarts_and_finishes_like_an_uninterrupted_run(ray_session, reference, tmp_path):
    ray = ray_session
    name = "killed"
    run = trainer(tmp_path, name, 2, held=True)
    assert run.fit(wait=False) == name
    assert name in run_client.running_runs()
    # held mid-epoch 1 (the epoch-1 checkpoint exists) until the driver is killed
    run.dataset.wait_held()
    st = run_client.status(name)
    old_gpu = [n for n in our_named_actors(ray) if n.startswith(gpu_actor_prefix(name))]
    old_pgs = kv_get(name, "pgs").decode().split()
    assert len(old_gpu) == 1 and len(old_pgs) == 1 and st["incarnation"] == 1
    os.kill(st["pid"], signal.SIGKILL)
    run.dataset.release()

    seen = Recorder()
    bare = []          # a callback with only some hooks (no on_phase): what it has is called
    plain = SimpleNamespace(on_interval=lambda d, r: bare.append(r.interval),
                            on_epoch=lambda d, r: None, on_event=lambda d, m: None)
    result = run_client.follow(name, [seen, plain])   # reattach: follows the restarted driver
    assert [e.epoch for e in result.history.epochs] == [0, 1]
    restart = [m for m in result.history.events if "driver actor restarted" in m]
    assert len(restart) == 1 and "incarnation 2" in restart[0]
    assert "resumed automatically from epoch_0001" in restart[0]
    assert_same_training(result, reference)        # weights, momentum, B_G trajectory, LRs
    assert result.run_checkpoint.epochs_done == 2
    # the restarted incarnation redid epoch 1 from its start; the client saw it and its events
    assert seen.epochs == [1] and seen.intervals[0] == (1, 0) and seen.drivers == {"RemoteDriver"}
    assert bare == [i for _, i in seen.intervals]
    # what the restarted driver did before its first interval reached the client as phases
    assert [p for p, _ in seen.phases][-2:] == ["placing 1 GPU actor", "training"]
    assert all(n == 0 for _, n in seen.phases)       # no re-placement after it
    assert any("driver actor restarted" in m for m in seen.events)
    # nothing of the old incarnation survives; after the end nothing at all
    assert all(n not in our_named_actors(ray) for n in old_gpu)
    table = ray.util.placement_group_table()
    assert all(table[h]["state"] == "REMOVED" for h in old_pgs)
    assert_no_leftovers(ray)
    with pytest.raises(ValueError, match=r"^run 'killed' has no running driver .*; running runs: none$"):
        run_client.status(name)


def test_detached_run_feeds_its_loggers_in_the_run_folder_and_follow_prints_epochs(ray_session, tmp_path, capsys):
    """``fit(wait=False)`` with Ray's TensorBoard and CSV loggers in RunConfig.callbacks: they
    run in the driver actor (no client follows the run while it trains) and write into the
    run folder; ``run_client.follow(name)`` without callbacks prints the epoch lines."""
    import csv

    from ray.tune.logger import CSVLoggerCallback, TBXLoggerCallback
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name = "tracked"
    run = trainer(tmp_path, name, 2, run_callbacks=[TBXLoggerCallback(), CSVLoggerCallback()])
    assert run.fit(wait=False) == name
    capsys.readouterr()
    result = run_client.follow(name)
    out = capsys.readouterr().out
    epochs, intervals = result.history.epochs, result.history.intervals
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("epoch ")] == ["epoch 1", "epoch 2"]
    folder = tmp_path / name
    acc = EventAccumulator(str(folder))
    acc.Reload()
    got = [e.value for e in acc.Scalars("ray/tune/epoch/train_loss")]
    assert got == pytest.approx([e.train_loss for e in epochs], rel=1e-6)
    loss = acc.Scalars("ray/tune/interval/loss")
    assert [e.value for e in loss] == pytest.approx([r.loss for r in intervals], rel=1e-6)
    with open(folder / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    # one row per result (every interval, then its epoch); the first result (an interval) set
    # the columns, so the rows of intervals carry their loss
    assert [int(r["training_iteration"]) for r in rows] == list(range(1, len(intervals) + len(epochs) + 1))
    assert [float(r["interval/loss"]) for r in rows if r["interval/loss"]] == \
        pytest.approx([r.loss for r in intervals], rel=1e-6)
    assert not (tmp_path / "jabasray_logs").exists() and not os.path.exists("jabasray_logs")
    assert_no_leftovers(ray_session)


SCRIPT = '''
import torch
from jabasray.data import load_digits_split
from jabasray.models import MLP

def model_fn():
    return MLP(64, (32,), 10)

def dataset():
    X, y = load_digits_split(image=False)[0].tensors
    return torch.utils.data.TensorDataset(X[:200], y[:200])

def optimizer_fn(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
'''


def test_detached_cli_run_second_client_status_attach_stop(ray_session, tmp_path, capsys):
    """`jabasray train --detach` in a subprocess that exits; this process is the second client."""
    ray = ray_session
    from jabasray.models import MLP
    from jabasray.profiler import model_signature
    from jabasray.profiler.cluster import driver_cache_key

    sig = model_signature(MLP(64, (32,), 10))
    p = replace(profile("cpu", 1.0, min_local_batch=4, max_local_batch=32), model_signature=sig)
    # under the key the driver looks up (the job's settings are part of it): no profiling
    key = driver_cache_key(sig, device="cpu", emulate=True, min_local_batch=4, weight_sync="auto",
                           bucket_cap_mb=25.0)
    p.save(tmp_path / ".profiles" / f"{key}.json")
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"nodes": [{"name": "n0", "gpu_type": "fast", "num_gpus": 1, "speed": 0.05}]}))
    cmd = [sys.executable, "-m", "jabasray.cli", "train", "--detach", "--script", str(tmp_path / "job.py"),
           "--cluster", str(tmp_path / "cluster.json"), "--storage-path", str(tmp_path), "--name", "det",
           "--epochs", "50", "--initial-global-batch", "24", "--min-global-batch", "16",
           "--max-global-batch", "48", "--min-local-batch", "4", "--adapt-interval", "2",
           "--no-autoscale", "--ray-address", ray.get_runtime_context().gcs_address]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "run det started in the background" in out.stdout
    assert "det" in run_client.running_runs()       # the client left; the run goes on

    # a second client: status, then follow the progress while another call stops the run
    wait_for(lambda: run_client.status("det")["samples"] > 0, "the first interval")
    capsys.readouterr()
    assert main(["status", "det"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("run det: running, epoch ") and "/50 (" in text and "1 GPU actors" in text

    # bad input while it runs: the same name again is refused in one line
    with pytest.raises(ValueError, match=r"^name: run 'det' is already running \(driver actor 'driver:det'\)"):
        trainer(tmp_path, "det", 2).fit(wait=False)

    # two followers at once: the Python API and `jabasray attach`; both get the outcome
    seen, box = Recorder(), {}
    follower = threading.Thread(target=lambda: box.update(result=run_client.follow("det", [seen])))
    attacher = threading.Thread(target=lambda: box.update(attach_rc=main(["attach", "det"])))
    follower.start()
    attacher.start()
    wait_for(lambda: len(seen.epochs) >= 1, "the follower to see an epoch end")
    assert main(["stop", "det"]) == 0
    follower.join(timeout=120)
    attacher.join(timeout=120)
    out = capsys.readouterr().out
    result = box["result"]
    done = len(result.history.epochs)
    assert "run det: stopped" in out and box["attach_rc"] == 0
    assert "\nepoch 1: B_G " in out and f"det: {done} epoch(s) done" in out   # attach's lines
    assert 1 <= done < 50 and result.run_checkpoint.epochs_done == done
    assert [e.epoch for e in result.history.epochs] == list(range(done))
    assert {r.epoch for r in result.history.intervals} == set(range(done))   # partial epoch not kept
    assert any(m.startswith("stopped on request") for m in result.history.events)
    assert seen.intervals[0] == (0, 0)               # the follower saw the run from its start
    assert_no_leftovers(ray)

    # unknown or finished runs: one line naming the runs that exist
    for sub in ("status", "attach", "stop"):
        assert main([sub, "det"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"jabasray {sub}: error: run 'det' has no running driver (unknown or finished); "
                       f"running runs: none"]


def test_driver_option_and_wait_false_input_checks():
    with pytest.raises(ValueError, match=r"^driver must be one of 'actor', 'local', got 'remote'$"):
        DriverOptions(driver="remote")
    with pytest.raises(ValueError, match=r"^driver_max_restarts must be an integer >= -1"):
        DriverOptions(driver_max_restarts=-2)
    ds, _ = tiny_data(16)
    small = JobConfig(initial_global_batch=16, min_global_batch=8, max_global_batch=16, min_local_batch=4)
    tr = JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, small, options=DriverOptions(driver="local"))
    with pytest.raises(ValueError, match=r"^wait=False needs DriverOptions\(driver='actor'\), got driver='local'$"):
        tr.fit(wait=False)
