"""One run per run folder (lock with stale detection), the writability probe, and the CLI's
one-line errors before any work: run names, file-system problems, batch bounds, scripts, odd GPUs.
No Ray is started here: every error comes before it."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from jabasray.actors.run_folder import RunLock, RunLockedError, probe_run_folder
from jabasray.cli import main
from jabasray.config import JobConfig, RunConfig
from jabasray.data import load_digits_split

N_DIGITS = len(load_digits_split()[0])     # the embedded job's training set

_HOLD = textwrap.dedent("""
    import sys, time
    from jabasray.actors.run_folder import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(600)
""")


def _holder(run_dir):
    """A process that holds the lock of ``run_dir`` (like a running `jabasray train`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.stdout.readline().strip() == "locked"
    return p


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.fixture(autouse=True)
def _ray_calls(monkeypatch):
    """Records calls of ensure_ray (the first expensive step of `jabasray train`); the tests
    here expect none. (Ray may be up from other test files, so ray.is_initialized() says nothing.)"""
    calls = []
    monkeypatch.setattr("jabasray.actors.trainer.ensure_ray",
                        lambda *a, **k: calls.append(a) or False)
    return calls


def _no_ray_started(calls):
    return calls == []


def test_second_run_on_same_folder_is_refused_while_other_names_work(tmp_path, capsys, _ray_calls):
    holder = _holder(tmp_path / "same")
    try:
        with pytest.raises(RunLockedError, match=rf"in use by pid {holder.pid} on "
                                                 rf"{socket.gethostname()} \(started "):
            RunLock(tmp_path / "same").acquire()
        # a different name under the same storage path runs side by side
        with RunLock(tmp_path / "other") as other:
            assert other.held and json.loads(other.path.read_text())["pid"] == os.getpid()
        assert not (tmp_path / "other" / ".lock").exists()      # released
        # the CLI: one line, exit 2, before Ray starts
        assert main(["train", "--storage-path", str(tmp_path), "--name", "same"]) == 2
        line = _one_line(capsys)
        assert line.startswith(f"jabasray train: error: run folder {tmp_path / 'same'} is in use "
                               f"by pid {holder.pid}") and _no_ray_started(_ray_calls)
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_killed_run_is_taken_over(tmp_path, caplog):
    holder = _holder(tmp_path / "r")
    os.kill(holder.pid, signal.SIGKILL)          # the driver dies without cleaning up
    holder.wait()
    assert json.loads((tmp_path / "r" / ".lock").read_text())["pid"] == holder.pid
    with caplog.at_level("WARNING"), RunLock(tmp_path / "r") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert f"taking over the stale lock of pid {holder.pid}" in caplog.text


def test_lock_is_reentrant_in_one_process_and_released_by_the_last(tmp_path):
    a, b = RunLock(tmp_path), RunLock(tmp_path)
    a.acquire()
    b.acquire()                                  # the CLI locks, then fit() locks again
    b.release()
    assert (tmp_path / ".lock").exists()
    a.release()
    assert not (tmp_path / ".lock").exists()


def test_lock_written_by_another_host_is_refused_with_the_path_to_remove(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "elsewhere",
                                                "started": "2026-01-01T00:00:00+00:00"}))
    with pytest.raises(RunLockedError, match=r"locked by pid 1 on elsewhere .*remove .*\.lock$"):
        RunLock(tmp_path).acquire()


def test_probe_finds_file_system_problems(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"storage path .*file is a file, not a folder"):
        probe_run_folder(tmp_path / "file" / "run")
    (tmp_path / "r" / "metrics.json").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"metrics.json is a folder but must be a file"):
        probe_run_folder(tmp_path / "r")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "checkpoints").write_text("x")
    with pytest.raises(ValueError, match=r"checkpoints is a file but must be a folder"):
        probe_run_folder(tmp_path / "c")
    for code, text in ((errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied"),
                       (errno.ENOSPC, "No space left on device")):
        def refuse(folder, code=code):
            raise OSError(code, os.strerror(code))
        # root ignores permission bits here, so the kernel's answer is simulated at the write
        monkeypatch.setattr("jabasray.actors.run_folder._write_probe", refuse)
        with pytest.raises(ValueError, match=rf"^folder {tmp_path / 'ok'} is not writable: {text}$"):
            probe_run_folder(tmp_path / "ok")
    monkeypatch.undo()
    assert probe_run_folder(tmp_path / "ok").local_path == tmp_path / "ok"
    assert os.listdir(tmp_path / "ok") == []                  # the probe file is gone


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_probe_on_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="is not writable: Permission denied"):
            probe_run_folder(ro)
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../up", ".hidden", "", "a\\b"])
def test_run_names_are_plain_folder_names(name, tmp_path, capsys):
    with pytest.raises(ValueError, match="^name must be a plain folder name"):
        RunConfig(str(tmp_path), name)
    assert main(["train", "--storage-path", str(tmp_path), "--name", name]) == 2
    assert _one_line(capsys).startswith("jabasray train: error: name must be a plain folder name")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("setup, argv, message", [
    ("file", [], "is a file, not a folder"),
    ("metrics_dir", ["--name", "r"], "metrics.json is a folder but must be a file"),
])
def test_cli_file_system_errors_are_one_line_before_ray(setup, argv, message, tmp_path, capsys, _ray_calls):
    storage = tmp_path / "runs"
    if setup == "file":
        storage.write_text("not a folder")
    else:
        (storage / "r" / "metrics.json").mkdir(parents=True)
    assert main(["train", "--storage-path", str(storage), *argv]) == 2
    line = _one_line(capsys)
    assert line.startswith("jabasray train: error: ") and message in line and _no_ray_started(_ray_calls)


def test_cli_disk_full_is_one_line(tmp_path, capsys, monkeypatch):
    """ENOSPC while a checkpoint is written (the real kernel error, from /dev/full) ends the
    command with one line naming the run, exit 2."""
    from jabasray.actors import trainer as trainer_mod
    from jabasray.actors.checkpoint import save_checkpoint
    from test_checkpoint_safety import _state, _worker

    def fit(self):   # training reaches its first checkpoint on a full disk
        return save_checkpoint(self.run_config.path, _state(0), _worker(0))

    monkeypatch.setattr(trainer_mod.JabasTrainer, "fit", fit)
    monkeypatch.setattr("jabasray.actors.checkpoint._open_for_write",
                        lambda path: open("/dev/full", "wb"))
    monkeypatch.setattr("jabasray.actors.trainer.ensure_ray", lambda *a, **k: False)
    assert main(["train", "--storage-path", str(tmp_path), "--name", "full", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"jabasray train: error: no space left on the device of "
                       f"{tmp_path / 'full' / 'checkpoints'} while writing checkpoint epoch_0000; "
                       f"the previous checkpoints are intact")


@pytest.mark.parametrize("argv, message", [
    (["--initial-global-batch", "4096", "--max-global-batch", "4096"],
     f"initial_global_batch must be <= the training set size ({N_DIGITS} samples), got 4096"),
    (["--max-global-batch", "100000000"],
     f"max_global_batch must be <= the training set size ({N_DIGITS} samples), got 100000000"),
    (["--max-global-batch", "1e8"],
     f"max_global_batch must be <= the training set size ({N_DIGITS} samples), got 100000000"),
    (["--max-global-batch", "2.5"], "argument --max-global-batch: max_global_batch must be int, got '2.5'"),
])
def test_batch_bounds_beyond_the_dataset_fail_before_any_work(argv, message, tmp_path, capsys, _ray_calls):
    try:
        rc = main(["train", "--storage-path", str(tmp_path), *argv])
    except SystemExit as e:      # argparse's own errors
        rc = e.code
    assert rc == 2
    line = _one_line(capsys)
    assert line.startswith("jabasray train: error: ") and line.endswith(message)
    assert _no_ray_started(_ray_calls) and os.listdir(tmp_path) == []


def test_job_config_dataset_bound_names_the_field():
    job = JobConfig(initial_global_batch=64, min_global_batch=32, max_global_batch=512)
    job.check_dataset_size(512)
    with pytest.raises(ValueError, match=r"^max_global_batch must be <= the training set size "
                                         r"\(511 samples\), got 512$"):
        job.check_dataset_size(511)
    with pytest.raises(ValueError, match=r"^min_global_batch must be <= the training set size"):
        job.check_dataset_size(31)


@pytest.mark.parametrize("body, line, text", [
    ("def model_fn(:\n    pass\n", 1, "syntax error: "),
    ("import torch\n\nx = 1 / 0\n", 3, "(running it): ZeroDivisionError: division by zero"),
    ("def model_fn():\n    pass\n\ndef dataset():\n    raise RuntimeError('no data here')\n", 5,
     "(dataset()): RuntimeError: no data here"),
])
def test_script_errors_name_file_and_line(body, line, text, tmp_path, capsys):
    script = tmp_path / "job.py"
    script.write_text(body)
    assert main(["train", "--script", str(script), "--storage-path", str(tmp_path / "s")]) == 2
    got = _one_line(capsys)
    assert got.startswith(f"jabasray train: error: script {script} line {line}") and text in got


def test_one_gpu_sma_is_refused_and_drop_odd_gpu_is_deprecated(tmp_path, capsys, _ray_calls):
    """Any GPU count trains with IIDP; Crossbow SMA needs GPU pairs and says so in one line
    before Ray starts; --drop-odd-gpu only prints that it is deprecated."""
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - {name: a0, gpu_type: fast, num_gpus: 1, speed: 1.0}\n")
    assert main(["train", "--cluster", str(cluster), "--storage-path", str(tmp_path), "--sync", "sma"]) == 2
    line = _one_line(capsys)
    assert "sync='sma' (Crossbow) needs two GPUs" in line and "sync='iidp'" in line
    assert main(["train", "--cluster", str(cluster), "--storage-path", str(tmp_path), "--sync", "sma",
                 "--drop-odd-gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--drop-odd-gpu is deprecated" in err[0] and "needs two GPUs" in err[1]
    assert _no_ray_started(_ray_calls)


_WRITER = textwrap.dedent("""
    import json, sys
    from jabasray.serialization import atomic_write_text
    for i in range(150):
        atomic_write_text(sys.argv[1], json.dumps({"writer": sys.argv[2], "i": i,
                                                   "pad": "x" * 200000}))
""")


def test_shared_profile_cache_file_is_never_seen_half_written(tmp_path):
    """Two runs (different names, one storage path) writing the same profile cache entry while
    a third reads it: every read parses (temp file + rename), never a torn file."""
    path = tmp_path / ".profiles" / "model-cpu-v1.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"writer": "seed", "i": -1, "pad": ""}))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), w], env=env)
               for w in ("a", "b")]
    while any(w.poll() is None for w in writers):
        assert json.loads(path.read_text())["writer"] in ("seed", "a", "b")   # never torn
    assert [w.wait() for w in writers] == [0, 0]
    assert json.loads(path.read_text())["i"] == 149
    assert [p.name for p in path.parent.iterdir()] == [path.name]   # no temp files left
