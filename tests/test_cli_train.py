"""`jabasray train`: end to end in a subprocess (tiny config, profile cache pre-filled so no
profiling runs), and bad JobConfig values as one-line errors with exit code 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from actors_helpers import profile
from jabasray.actors.metrics import RunHeld, held_line
from jabasray.cli import main
from jabasray.data import load_digits_split
from jabasray.models import DigitsCNN
from jabasray.profiler import model_signature
from jabasray.profiler.cluster import driver_cache_key


def _prefill_profile_cache(storage, min_local_batch: int = 8) -> None:
    """The driver profiles the CPU once as type "cpu" and caches it under
    <storage>/.profiles; a ready profile there skips the measurement."""
    sig = model_signature(DigitsCNN())
    p = replace(profile("cpu", 1.0, min_local_batch=min_local_batch, max_local_batch=32),
                model_signature=sig)
    key = driver_cache_key(sig, device="cpu", emulate=True, min_local_batch=min_local_batch,
                           weight_sync="auto", bucket_cap_mb=25.0)
    p.save(storage / ".profiles" / f"{key}.json")


def test_train_end_to_end_writes_metrics_and_plot(tmp_path, capsys, monkeypatch):
    _prefill_profile_cache(tmp_path)
    (tmp_path / "cluster.yaml").write_text(
        "nodes:\n  - {name: f0, gpu_type: fast, num_gpus: 1, speed: 1.0}\n"
        "  - {name: s0, gpu_type: slow, num_gpus: 2, speed: 0.5}\n")   # an odd count trains too
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "jabasray.cli", "train", "--cluster", str(tmp_path / "cluster.yaml"),
           "--storage-path", str(tmp_path), "--name", "t", "--epochs", "1", "--initial-global-batch", "32",
           "--min-global-batch", "16", "--max-global-batch", "64", "--adapt-interval", "20",
           "--num-cpus", "1", "--ray-address", "local"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("epoch 1:")]
    assert len(lines) == 1 and "val acc" in lines[0] and "allocation" in lines[0]
    run = tmp_path / "t"
    metrics = json.loads((run / "metrics.json").read_text())
    assert len(metrics["epochs"]) == 1
    assert metrics["epochs"][0]["samples"] == len(load_digits_split()[0])   # one full epoch
    # the run's GPU-hours held, printed: the fixed spec's 3 GPUs from the run's start to its end
    held = RunHeld.from_dict(metrics["held"])
    assert held.total == pytest.approx(3 * (held.end_s - held.start_s), rel=0, abs=1e-5)
    assert held_line(held) in out.stdout.splitlines()
    assert (run / "trajectory.png").read_bytes()[:4] == b"\x89PNG"
    assert (run / "checkpoints" / "epoch_0001" / "worker.pt").exists()
    assert "sample" in out.stderr            # the tqdm bar went to stderr
    # the same name again without --resume is refused in one line (before Ray is touched)
    assert main(cmd[3:]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jabasray train: error: name: run")
    assert err[0].endswith("pass --resume to continue it or choose another --name")
    # --resume with a changed job (another LR) is refused naming the field; the same job
    # asked again returns the finished run's result and says so - both without starting Ray
    import jabasray.actors.trainer as trainer_mod   # (the command imports ensure_ray from it)

    def no_ray(*a, **kw):
        raise AssertionError("Ray was started for a run that needs no actor")
    monkeypatch.setattr(trainer_mod, "ensure_ray", no_ray)
    assert main(cmd[3:] + ["--resume", "--lr", "0.05", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds another job's checkpoints (job_config.lr: 0.1 -> 0.05; " \
        "optimizer.lr: 0.1 -> 0.05)" in err[0] and "resume='force'" in err[0]
    assert main(cmd[3:] + ["--resume", "--no-progress"]) == 0
    assert f"run {run} already finished (1 epoch(s) of this job)" in capsys.readouterr().out


def test_bad_job_value_in_subprocess_is_one_line_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jabasray.cli", "train", "--adapt-interval", "0",
                          "--storage-path", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "jabasray train: error: adapt_interval must be an integer >= 1, got 0"]


@pytest.mark.parametrize("argv, field", [
    (["--min-global-batch", "600", "--max-global-batch", "500"], "min_global_batch"),
    (["--alpha", "0"], "alpha"),
    (["--alpha", "-0.5"], "alpha"),
    (["--min-local-batch", "64", "--min-global-batch", "32"], "min_local_batch"),
    (["--lr-scaling", "cubic"], "lr_scaling"),
    (["--epochs", "0"], "epochs"),
])
def test_bad_job_values_are_one_line_errors(argv, field, tmp_path, capsys):
    assert main(["train", "--storage-path", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"jabasray train: error: {field} must")


def test_script_without_model_fn_is_refused(tmp_path, capsys):
    script = tmp_path / "job.py"
    script.write_text("def dataset():\n    return []\n")
    assert main(["train", "--script", str(script), "--storage-path", str(tmp_path)]) == 2
    assert "must define model_fn()" in capsys.readouterr().err


def test_script_job_and_options_are_read(tmp_path):
    """--script provides the job's callables; JobConfig options override JobConfig defaults
    (the embedded defaults only apply to the built-in digits job)."""

    from jabasray.cli import build_parser
    from jabasray.commands.train import EMBEDDED_DEFAULTS, job_config_from_args, load_script
    from jabasray.config import JobConfig

    script = tmp_path / "job.py"
    script.write_text("import torch\n"
                      "def model_fn():\n    return torch.nn.Linear(4, 2)\n"
                      "def dataset():\n    return torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))\n"
                      "def loss_fn(o, y):\n    return torch.nn.functional.cross_entropy(o, y)\n")
    ns = load_script(str(script))
    assert isinstance(ns["model_fn"](), torch.nn.Linear) and len(ns["dataset"]()) == 8
    assert callable(ns["loss_fn"]) and "optimizer_fn" not in ns
    args = build_parser().parse_args(["train", "--script", str(script), "--epochs", "3", "--no-adaptive",
                                      "--gamma", "0.7"])
    job = job_config_from_args(args, embedded=False)
    assert job == JobConfig(epochs=3, adaptive=False, gamma=0.7)
    embedded = job_config_from_args(build_parser().parse_args(["train"]), embedded=True)
    assert embedded == JobConfig(**EMBEDDED_DEFAULTS)


@pytest.mark.parametrize("arg, device, expected", [
    (None, "cpu", "emulated"), (None, "cuda", None), ("ray", "cpu", None), ("ray", "cuda", None),
    ("file", "cuda", "file"), ("file", "cpu", "file")])
def test_the_cluster_is_the_ray_clusters_gpus_on_cuda_and_the_emulated_default_on_cpu(
        tmp_path, arg, device, expected):
    """On --device cuda without --cluster, a run starts on the GPUs Ray has (one is enough),
    not on the emulated 8-GPU default; a cluster file is used as given on either device."""
    from jabasray.commands.train import cluster_for, default_cluster
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes:\n  - {name: n0, gpu_type: A100, num_gpus: 1, speed: 1.0}\n")
    got = cluster_for(str(path) if arg == "file" else arg, device)
    if expected is None:
        assert got is None
    elif expected == "emulated":
        assert got == default_cluster() and sum(n.num_gpus for n in got.nodes) == 8
    else:
        assert got.gpu_types == ["A100"] and [n.num_gpus for n in got.nodes] == [1]
