"""Run storage on a real S3-compatible server (moto's server mode, started here on 127.0.0.1),
without Ray: the storage layer, checkpoints committed manifest-last and verified on S3, an
interrupted upload skipped with one line, keep-N pruning of the stored objects, the lease that
locks a run folder where there is no flock, and the one-line errors for an unknown scheme,
unreachable storage, a missing bucket and unknown credentials - all before any actor starts.
The Ray side (a run on S3, its driver killed, resume, the Result from another process) is in
test_storage_s3_ray.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict

import pytest
import torch

from s3_helpers import EnvVars, S3Server, free_port
from jabasray.actors.checkpoint import (DriverState, latest_checkpoint, list_checkpoints,
                                        save_checkpoint)
from jabasray.actors.lease import LEASE_NAME, S3Lease
from jabasray.actors.run_folder import RunLockedError, probe_run_folder, run_lock
from jabasray.storage import CHUNK, resolve, sha256_of, write_probe
from jabasray.types import ClusterSpec


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    try:
        with EnvVars(server.env()):
            server.make_bucket("bkt")
            yield server
    finally:
        server.stop()


def _state(e: int) -> DriverState:
    cl = ClusterSpec.emulated({"fast": (1, 2, 1.0)})
    return DriverState(epochs_done=e, iteration=10 * e, cluster=cl, allocation={cl.nodes[0].name: 1})


def _worker(e: int, n: int = 3) -> dict:
    return {"model": OrderedDict(w=torch.full((n,), float(e))), "step": e}


def test_storage_path_streams_large_files_and_round_trips_the_uri(s3):
    run = resolve("s3://bkt/streams")
    assert str(run) == "s3://bkt/streams" and run.fs_path == "bkt/streams" and not run.is_local
    assert resolve(str(run)) == run                   # the URI names the same place again
    data = os.urandom(2 * CHUNK + 12345)              # a multipart upload, read in 3 chunks
    with (run / "big.bin").open_output() as f:
        for i in range(0, len(data), 1 << 20):
            f.write(data[i:i + (1 << 20)])
    assert (run / "big.bin").size() == len(data)
    assert [len(c) for c in (run / "big.bin").chunks()] == [CHUNK, CHUNK, 12345]
    assert sha256_of(run / "big.bin")[1] == __import__("hashlib").sha256(data).hexdigest()
    (run / "small.json").write_text('{"a": 1}')
    assert json.loads((run / "small.json").read_text()) == {"a": 1}
    assert [p.name for p in run.iterdir()] == ["big.bin", "small.json"]
    run.rmtree()
    assert s3.keys("bkt", "streams/") == []


def test_checkpoints_on_s3_commit_verify_prune_and_load(s3):
    run = resolve("s3://bkt/cps")
    for e in (1, 2, 3, 4):
        save_checkpoint(run, _state(e), _worker(e), keep=2)
    assert [c.epochs_done for c in list_checkpoints(run)] == [3, 4]
    # keep-N pruning really removed the objects of epochs 1 and 2
    assert s3.keys("bkt", "cps/") == [f"cps/checkpoints/epoch_000{e}/{f}" for e in (3, 4)
                                      for f in ("driver.json", "manifest.json", "worker.pt")]
    cp = latest_checkpoint(run)
    assert str(cp.path) == "s3://bkt/cps/checkpoints/epoch_0004"
    assert cp.load_driver_state() == _state(4)
    assert torch.equal(cp.load_worker_state()["model"]["w"], torch.full((3,), 4.0))
    # a flipped byte in the stored worker.pt: skipped with one line, the one before is taken
    c = s3.client()
    body = bytearray(c.get_object(Bucket="bkt", Key="cps/checkpoints/epoch_0004/worker.pt")["Body"].read())
    body[len(body) // 2] ^= 0xFF
    c.put_object(Bucket="bkt", Key="cps/checkpoints/epoch_0004/worker.pt", Body=bytes(body))
    skipped: list[str] = []
    assert latest_checkpoint(run, skipped).epochs_done == 3
    assert len(skipped) == 1 and "epoch_0004" in skipped[0] and "does not match its SHA-256" in skipped[0]
    # a redone epoch 4 loses the old manifest first and is committed again
    save_checkpoint(run, _state(4), _worker(4), keep=2)
    assert latest_checkpoint(run).epochs_done == 4
    run.rmtree()


_INTERRUPTED_UPLOAD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from test_storage_s3 import _state, _worker
    from jabasray.actors.checkpoint import DriverState, save_checkpoint
    from jabasray.storage import resolve
    def die(self, **kwargs):           # worker.pt is uploaded; the manifest never will be
        os.kill(os.getpid(), signal.SIGKILL)
    DriverState.to_json = die
    save_checkpoint(resolve(sys.argv[1]), _state(2), _worker(2, n=300000))
""")


def test_interrupted_upload_without_manifest_is_skipped_with_one_line(s3):
    """A driver killed mid-commit on S3 (SIGKILL, no clean-up): epoch_0002's worker.pt (a
    multipart upload of 1.2 MB) is stored but no manifest; the checkpoint is never taken, one
    line says why, and redoing the epoch commits it."""
    run = resolve("s3://bkt/interrupted")
    save_checkpoint(run, _state(1), _worker(1))
    p = subprocess.run([sys.executable, "-c", _INTERRUPTED_UPLOAD, str(run), os.path.dirname(__file__)],
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == -signal.SIGKILL
    assert s3.keys("bkt", "interrupted/checkpoints/epoch_0002/") == [
        "interrupted/checkpoints/epoch_0002/worker.pt"]
    skipped: list[str] = []
    cp = latest_checkpoint(run, skipped)
    assert cp.epochs_done == 1 and torch.equal(cp.load_worker_state()["model"]["w"], torch.full((3,), 1.0))
    assert skipped == ["checkpoint epoch_0002 is unusable (no manifest: an interrupted write or "
                       "upload); trying the previous one"]
    save_checkpoint(run, _state(2), _worker(2))
    assert latest_checkpoint(run).epochs_done == 2
    run.rmtree()


# ---------------------------------------------------------------------- the lease
_HOLDER = textwrap.dedent("""
    import sys, time
    from jabasray.actors.lease import S3Lease
    from jabasray.storage import resolve
    S3Lease(resolve(sys.argv[1]), ttl_s=float(sys.argv[2])).acquire()
    print("locked", flush=True)
    time.sleep(600)
""")


def _holder(uri: str, ttl_s: float = 60.0) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, uri, str(ttl_s)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.stdout.readline().strip() == "locked"
    return p


def test_lease_refuses_a_second_run_and_is_renewed(s3, monkeypatch):
    """A run (another process: its lease) holds s3://bkt/leased/r; fit() on the same folder is
    refused in one line before Ray starts, also after the holder's lease would have expired
    had it not renewed it."""
    run = resolve("s3://bkt/leased/r")
    holder = _holder(str(run), ttl_s=1.5)
    key = f"leased/r/{LEASE_NAME}"
    try:
        first = json.loads(s3.client().get_object(Bucket="bkt", Key=key)["Body"].read())
        assert first["pid"] == holder.pid
        msg = _fit("s3://bkt/leased", monkeypatch)
        assert msg.startswith(f"run folder s3://bkt/leased/r is in use by pid {holder.pid} on ")
        assert msg.endswith("wait for it to finish or choose another --name")
        time.sleep(2.0)                       # > ttl: the live holder renewed it meanwhile
        again = json.loads(s3.client().get_object(Bucket="bkt", Key=key)["Body"].read())
        assert again["owner"] == first["owner"] and again["expires"] > first["expires"]
        with pytest.raises(RunLockedError):
            run_lock(run).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_expired_lease_of_a_dead_run_is_taken_over_and_release_deletes_it(s3, caplog):
    run = resolve("s3://bkt/expired")
    holder = _holder(str(run), ttl_s=0.6)
    holder.kill()                             # dies without releasing: the lease expires
    holder.wait()
    time.sleep(0.8)
    with caplog.at_level("WARNING"):
        lock = run_lock(run).acquire()
    assert f"taking over the expired lease of pid {holder.pid}" in caplog.text
    assert json.loads(s3.client().get_object(Bucket="bkt", Key=f"expired/{LEASE_NAME}")["Body"].read())["pid"] == os.getpid()
    same = run_lock(run).acquire()            # re-entrant in one process (CLI, then fit())
    same.release()
    assert s3.keys("bkt", f"expired/{LEASE_NAME}") != []
    lock.release()
    assert s3.keys("bkt", f"expired/{LEASE_NAME}") == []


def test_lease_taken_over_while_this_run_stalled_stops_its_next_checkpoint(s3):
    """Another run replaced the lease (this one did not renew in time): the next renewal finds
    it, the lease is lost, the driver refuses to commit its next checkpoint, and releasing does
    not delete the other run's lease."""
    from jabasray.actors.driver import JabasDriver

    run = resolve("s3://bkt/stalled")
    lease = S3Lease(run, ttl_s=0.9).acquire()
    s3.client().put_object(Bucket="bkt", Key=f"stalled/{LEASE_NAME}", Body=b'{"owner": "other"}')
    deadline = time.monotonic() + 10
    while not lease.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lease.lost

    class Driver:                 # what JabasDriver._save reads
        lock, run_dir = lease, run
    with pytest.raises(RunLockedError) as e:
        JabasDriver._save(Driver(), _state(1), {"w": torch.zeros(1)})
    assert str(e.value).startswith("run folder s3://bkt/stalled: another run took over its lease")
    assert list_checkpoints(run) == []
    lease.release()
    body = s3.client().get_object(Bucket="bkt", Key=f"stalled/{LEASE_NAME}")["Body"].read()
    assert json.loads(body) == {"owner": "other"}


# ---------------------------------------------------------------------- bad input, one line
def _fit(storage_path: str, monkeypatch, **run_kw):
    """JabasTrainer.fit() up to the first expensive step (ensure_ray), recorded."""
    from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
    from jabasray.actors.driver import DriverOptions
    from jabasray.actors.trainer import JabasTrainer
    from jabasray.config import JobConfig, RunConfig

    calls = []
    monkeypatch.setattr("jabasray.actors.trainer.ensure_ray", lambda *a, **k: calls.append(a) or False)
    ds, _ = tiny_data(64)
    job = JobConfig(epochs=1, initial_global_batch=16, min_global_batch=8, max_global_batch=32,
                    min_local_batch=4)
    with pytest.raises(ValueError) as e:
        JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, job, run_config=RunConfig(storage_path, "r", **run_kw),
                     perf_model=perf_model(), options=DriverOptions(driver="local")).fit()
    assert calls == [], "an actor or Ray was started before the storage error"
    assert "\n" not in str(e.value)
    return str(e.value)


def test_unknown_scheme_unreachable_endpoint_missing_bucket_and_bad_credentials_fail_in_one_line(
        s3, monkeypatch):
    import pyarrow.fs

    assert _fit("s5://bkt/runs", monkeypatch).startswith("storage_path has the unknown URI scheme 's5'")
    assert _fit("s3://nobucket/runs", monkeypatch).startswith(
        "cannot create folder s3://nobucket/runs/r: Bucket 'nobucket' not found")
    # nothing listens on this port; one attempt (the default retries take seconds)
    dead = pyarrow.fs.S3FileSystem(endpoint_override=f"127.0.0.1:{free_port()}", scheme="http",
                                   region="us-east-1", access_key="testing", secret_key="testing",
                                   retry_strategy=pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=1))
    msg = _fit("bkt/runs", monkeypatch, storage_filesystem=dead)
    assert msg.startswith("cannot create folder s3://bkt/runs/r: ") and "Could not connect" in msg
    assert msg.endswith("(check the endpoint and the network: AWS_ENDPOINT_URL, the region)")
    # a server that checks credentials: the key is unknown to it
    strict = S3Server(auth=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", strict.endpoint)
        msg = _fit("s3://bkt/runs", monkeypatch)
        assert msg.startswith("cannot create folder s3://bkt/runs/r: ") and "ACCESS_DENIED" in msg
        assert "(check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY" in msg
    finally:
        strict.stop()


def test_probe_on_s3_leaves_nothing_behind(s3):
    run = resolve("s3://bkt/probe/r")
    assert probe_run_folder(run, extra_dirs=(run.parent / ".profiles",)) == run
    write_probe(run)
    assert not any(k.rsplit("/", 1)[-1].startswith(".probe_") for k in s3.keys("bkt", "probe/"))
