"""A run whose storage is ``s3://`` on a real S3-compatible server (moto's server mode, started
here on 127.0.0.1), on this module's own Ray instance (started after the AWS environment
variables are set, so the driver actor and the GPU actors reach the same endpoint):

* every run file goes to the bucket (nothing is written to a local ``./s3:`` folder);
* ``Result.checkpoint`` is a ``ray.train.Checkpoint`` on S3 whose ``as_directory()`` downloads
  it; ``Result.from_path(uri)`` and ``metrics_dataframe`` work from another process that only
  has the URI and the environment;
* resume on S3 equals the uninterrupted run (weights, momentum, B_G trajectory, LRs);
* the driver actor killed mid-epoch restarts, resumes from the checkpoint on S3 and ends like the
  uninterrupted run;
* a driver that cannot see the checkpoint Ray's key-value store names refuses in one line;
* a detached run's TensorBoard and CSV loggers (RunConfig.callbacks, run by the driver actor)
  end up in the run folder on S3, not in a local folder.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from actors_helpers import HeldRows, loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from s3_helpers import EnvVars, S3Server
from test_driver_actor import FAST
from test_trainer import assert_same_training, job
from jabasray.actors import run_client
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.actors.trainer import JabasTrainer
from jabasray.config import RunConfig
from jabasray.errors import StorageUnavailable
from jabasray.storage import resolve

pytestmark = pytest.mark.ray

STORAGE = "s3://bkt/runs"


@pytest.fixture(scope="module")
def s3(without_session_ray):
    ray = without_session_ray
    server = S3Server()
    try:
        with EnvVars(server.env()):
            server.make_bucket("bkt")
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     resources={"gpu_fast": 8}, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
            try:
                yield server
            finally:
                ray.shutdown()
    finally:
        server.stop()


def trainer(name: str, epochs: int, cluster=FAST, driver: str = "local", held_in=None,
            callbacks=()) -> JabasTrainer:
    """A run of ``job(epochs)`` on 200 digits; ``held_in`` (a local folder): its reads wait
    mid-epoch 1 (after 200 + 40 rows) until the test releases them; ``callbacks``: its
    ``RunConfig.callbacks``."""
    ds, val = tiny_data(200)
    if held_in is not None:
        ds = HeldRows(ds, held_in, after=200 + 40)
    return JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, job(epochs), cluster=cluster,
                        run_config=RunConfig(STORAGE, name, callbacks=list(callbacks)), val_dataset=val,
                        perf_model=perf_model(), options=DriverOptions(driver=driver))


@pytest.fixture(scope="module")
def reference(s3, tmp_path_factory):
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))    # a relative ./s3: folder would show up here
    try:
        result = trainer("ref", 2).fit()
        assert os.listdir(".") == []
    finally:
        os.chdir(cwd)
    return result


def test_every_run_file_is_in_the_bucket(s3, reference):
    r = reference
    assert r.path == "s3://bkt/runs/ref" and r.filesystem.type_name == "s3"
    assert str(r.metrics_path) == "s3://bkt/runs/ref/metrics.json"
    assert str(r.plot_path) == "s3://bkt/runs/ref/trajectory.png"
    assert r.plot_path.read_bytes()[:4] == b"\x89PNG"
    keys = s3.keys("bkt", "runs/ref/")
    want = {"runs/ref/metrics.json", "runs/ref/metrics.csv", "runs/ref/trajectory.png",
            "runs/ref/.jabasray_storage.json", "runs/ref/job.json",   # job.json: the job that wrote it
            "runs/ref/model.json",   # what the driver planned with (jabasray simulate --replay)
            "runs/ref/checkpoint_000002/model.pt", "runs/ref/checkpoint_000002/optimizer.pt",
            "runs/ref/checkpoint_000002/metadata.json"}
    want |= {f"runs/ref/checkpoints/epoch_000{e}/{f}" for e in (1, 2)   # CheckpointConfig.num_to_keep=2
             for f in ("worker.pt", "driver.json", "manifest.json")}
    assert set(keys) == want
    assert r.run_checkpoint.epochs_done == 2 and str(r.run_checkpoint.path) == \
        "s3://bkt/runs/ref/checkpoints/epoch_0002"
    assert list(r.metrics_dataframe["epoch"]) == [0, 1]


def test_result_checkpoint_as_directory_downloads_the_users_state_dicts(reference):
    r = reference
    assert r.checkpoint.path == "bkt/runs/ref/checkpoint_000002"
    assert r.checkpoint.filesystem.type_name == "s3"
    want = r.run_checkpoint.load_worker_state()
    with r.checkpoint.as_directory() as d:
        assert not d.startswith("bkt") and os.path.isdir(d)     # a local download
        assert sorted(os.listdir(d)) == ["metadata.json", "model.pt", "optimizer.pt"]
        model = torch.load(os.path.join(d, "model.pt"), weights_only=True)
        assert json.load(open(os.path.join(d, "metadata.json")))["epochs_done"] == 2
    assert model.keys() == want["model"].keys()
    assert all(torch.equal(model[k], want["model"][k]) for k in model)


_OTHER_MACHINE = textwrap.dedent("""
    import json, sys, torch
    from jabasray.actors.trainer import Result
    r = Result.from_path(sys.argv[1])
    with r.checkpoint.as_directory() as d:
        model = torch.load(d + "/model.pt", weights_only=True)
    print(json.dumps({"path": r.path, "epochs": list(r.metrics_dataframe["epoch"]),
                      "loss": list(r.metrics_dataframe["train_loss"]),
                      "checkpoint": r.checkpoint.path, "run_checkpoint": str(r.run_checkpoint.path),
                      "sum": float(sum(v.double().sum() for v in model.values()))}))
""")


def test_result_from_path_in_another_process(reference):
    """Another process (no Ray, nothing shared but the URI and the AWS environment) rebuilds
    the Result from S3: metrics, the exported checkpoint, the run checkpoint."""
    out = subprocess.run([sys.executable, "-c", _OTHER_MACHINE, "s3://bkt/runs/ref"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    r = reference
    model = r.run_checkpoint.load_worker_state()["model"]
    assert got == {"path": r.path, "epochs": [0, 1], "loss": list(r.metrics_dataframe["train_loss"]),
                   "checkpoint": r.checkpoint.path, "run_checkpoint": str(r.run_checkpoint.path),
                   "sum": float(sum(v.double().sum() for v in model.values()))}


def test_resume_on_s3_equals_uninterrupted(s3, reference):
    first = trainer("resumed", 1).fit()
    assert first.run_checkpoint.epochs_done == 1
    second = trainer("resumed", 2).fit()
    assert any(m.startswith("resumed from s3://bkt/runs/resumed/checkpoints/epoch_0001 after 1 epoch")
               for m in second.history.events)
    assert_same_training(second, reference)


def test_driver_actor_killed_mid_epoch_recovers_from_s3(s3, reference, tmp_path):
    name = "killed"
    run = trainer(name, 2, driver="actor", held_in=tmp_path)
    assert run.fit(wait=False) == name
    run.dataset.wait_held()                        # mid-epoch 1: the epoch-1 checkpoint exists
    st = run_client.status(name)
    assert st["run_dir"] == "s3://bkt/runs/killed"
    os.kill(st["pid"], signal.SIGKILL)
    run.dataset.release()
    result = run_client.follow(name)
    restart = [m for m in result.history.events if "driver actor restarted" in m]
    assert len(restart) == 1 and "resumed automatically from epoch_0001" in restart[0]
    assert [e.epoch for e in result.history.epochs] == [0, 1]
    assert_same_training(result, reference)
    assert result.path == "s3://bkt/runs/killed"


def test_driver_refuses_when_the_checkpoint_ray_recorded_is_not_visible(s3):
    """Ray's key-value store says epoch_0001 was committed; the storage the driver sees has
    no such checkpoint (here: its objects are gone): one line, never an older or fresh start."""
    def driver(epochs: int) -> JabasDriver:
        ds, val = tiny_data(200)
        return JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job(epochs), FAST,
                           resolve(f"{STORAGE}/unseen"), perf_model=perf_model())
    driver(1).run()
    resolve(f"{STORAGE}/unseen/checkpoints/epoch_0001").rmtree()
    with pytest.raises(StorageUnavailable) as e:
        driver(2).run()
    msg = str(e.value)
    assert msg.startswith("run 'unseen': Ray's key-value store records epoch_0001 as committed to "
                          "s3://bkt/runs/unseen, but the driver on node ")
    assert msg.endswith("sees no such checkpoint (newest it sees: epoch_0000); the storage is "
                        "unreachable from this node or not shared with it; refusing to start "
                        "from an older state") and "\n" not in msg


def test_detached_run_on_s3_writes_its_loggers_into_the_run_folder(s3, tmp_path, monkeypatch):
    from ray.tune.logger import CSVLoggerCallback, TBXLoggerCallback

    monkeypatch.chdir(tmp_path)         # a ./jabasray_logs folder would show up here
    name = "tracked"
    run = trainer(name, 1, driver="actor", callbacks=[TBXLoggerCallback(), CSVLoggerCallback()])
    assert run.fit(wait=False) == name
    result = run_client.follow(name, ())
    keys = {k[len(f"runs/{name}/"):] for k in s3.keys("bkt", f"runs/{name}/")}
    assert "progress.csv" in keys and any(k.startswith("events.out.tfevents.") for k in keys), keys
    csv_text = resolve(f"{STORAGE}/{name}/progress.csv").read_text()
    assert len(csv_text.strip().splitlines()) == 1 + len(result.history.intervals) + 1   # header, results
    assert os.listdir(tmp_path) == []
