"""`jabasray plan` and `jabasray profile`: table / JSON output, auto allocation, and one-line
errors (never a traceback) for bad files and values."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jabasray import cli
from jabasray.planners import PerfModel, solve_configuration
from jabasray.profiler.profile import load_profiles, save_profiles, synthetic_profile
from jabasray.types import Plan

CLUSTER = """nodes:
  - {name: n1, gpu_type: fast, num_gpus: 4, speed: 1.0, tflops: 14.1}
  - {name: n2, gpu_type: slow, num_gpus: 2, speed: 0.5, tflops: 9.5}
"""


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    base = synthetic_profile("fast", min_local_batch=8, num_batches=4)
    save_profiles([base, base.scaled(0.5, "slow")], tmp_path / "profiles.json")
    base.save(tmp_path / "fast.json")
    return tmp_path


def run(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_table_and_json_agree_with_solver(files, capsys):
    args = ["plan", "--cluster", str(files / "cluster.yaml"), "--profile", str(files / "profiles.json"),
            "--global-batch", "512"]
    rc, out, err = run(args, capsys)
    assert rc == 0, err
    profiles = load_profiles([files / "profiles.json"])
    model = PerfModel(profiles).for_allocation(6, True)
    want = solve_configuration(512, ["fast", "fast", "slow"], model, 8)
    assert f"used {want.global_batch_size}" in out and f"B_L {want.local_batch_size}" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("n1 ", "n2 "))]
    assert [(r[1], int(r[2]), int(r[3])) for r in rows] == [tuple(w) for w in want.workers]
    rc, out, err = run(args + ["--json"], capsys)
    data = json.loads(out)
    assert Plan.from_dict(data["plan"]) == want
    assert data["group_gpus"] == ["fast", "fast", "slow"]
    assert data["allocation"]["node_pairs"] == {"n1": 2, "n2": 1}


def test_plan_auto_allocation_and_emulate(files, capsys):
    rc, out, err = run(["plan", "--cluster", str(files / "cluster.yaml"), "--profile", str(files / "fast.json"),
                        "--emulate", "--global-batch", "64", "--allocation", "auto", "--json",
                        "--dataset-size", "4096", "--adapt-interval", "10"], capsys)
    assert rc == 0, err
    data = json.loads(out)
    assert len(data["autoscale"]["candidates"]) == 5
    best = min(c["epoch_time"] for c in data["autoscale"]["candidates"] if c["epoch_time"] is not None)
    assert data["autoscale"]["epoch_time"] == pytest.approx(best)
    rc, out, err = run(["plan", "--cluster", str(files / "cluster.yaml"), "--profile", str(files / "profiles.json"),
                        "--global-batch", "64", "--allocation", "n2=1"], capsys)
    assert rc == 0 and "n2=1 pair(s)" in out and "slow" in out


@pytest.mark.parametrize("extra, message", [
    (["--global-batch", "0"], "global_batch must be an integer >= 1, got 0"),
    (["--global-batch", "8"], "too small for 3 GPUs per group"),
    (["--global-batch", "512", "--allocation", "n9=1"], "allocation must be"),
    (["--global-batch", "512", "--allocation", "n2=2"], r"node_pairs[n2] must be <= 1"),
    (["--global-batch", "512", "--min-local-batch", "0"], "min_local_batch must be"),
    (["--global-batch", "512", "--objective", "time_under_budget", "--allocation", "auto"], "cost_budget"),
])
def test_plan_bad_values_one_line(files, capsys, extra, message):
    rc, out, err = run(["plan", "--cluster", str(files / "cluster.yaml"), "--profile",
                        str(files / "profiles.json")] + extra, capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("jabasray plan: error: ") and message in err


def test_plan_bad_files_one_line(files, capsys):
    bad_yaml = files / "bad.yaml"
    bad_yaml.write_text("nodes: [ {name: a")
    odd = files / "odd.yaml"
    odd.write_text("nodes:\n  - {name: a, gpu_type: fast, num_gpus: 3}\n")
    bad_prof = files / "bad.json"
    bad_prof.write_text(json.dumps({"gpu_type": "fast"}))
    cases = [
        (["--cluster", str(files / "missing.yaml"), "--profile", str(files / "profiles.json")], "missing.yaml"),
        (["--cluster", str(bad_yaml), "--profile", str(files / "profiles.json")], "not valid YAML"),
        (["--cluster", str(odd), "--profile", str(files / "profiles.json")], "nodes[a].num_gpus must be even"),
        (["--cluster", str(files / "cluster.yaml"), "--profile", str(files / "fast.json")],
         "no profile for GPU type(s) ['slow']"),
        (["--cluster", str(files / "cluster.yaml"), "--profile", str(bad_prof)], "not a valid Profile"),
        (["--cluster", str(files / "cluster.yaml"), "--profile", str(files / "nope.json")], "nope.json"),
    ]
    for argv, message in cases:
        rc, out, err = run(["plan", "--global-batch", "512"] + argv, capsys)
        assert rc == 2 and err.count("\n") == 1 and message in err, (argv, err)
    # --drop-odd-gpu makes the odd cluster usable
    rc, out, err = run(["plan", "--global-batch", "64", "--cluster", str(odd), "--drop-odd-gpu",
                        "--profile", str(files / "profiles.json")], capsys)
    assert rc == 0 and "fast" in out


def test_errors_are_one_line_as_a_command(files):
    proc = subprocess.run([sys.executable, "-m", "jabasray.cli", "plan", "--cluster", str(files / "x.yaml"),
                           "--profile", str(files / "profiles.json"), "--global-batch", "64"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("jabasray plan: error: cluster file")


def test_profile_command_writes_emulated_profiles(tmp_path, capsys):
    out_file = tmp_path / "p.json"
    rc, out, err = run(["profile", "--out", str(out_file), "--min-local-batch", "16", "--max-local-batch", "32",
                        "--repeats", "1", "--max-num-vsw", "2", "--no-allreduce",
                        "--emulate", "fast=1", "--emulate", "slow=0.5"], capsys)
    assert rc == 0, err
    profs = load_profiles([out_file])
    assert sorted(profs) == ["fast", "slow"]
    assert profs["fast"].local_batches == [16, 32]
    assert profs["slow"].batches[0].compute_time_1 == pytest.approx(2 * profs["fast"].batches[0].compute_time_1)
    rc, out, err = run(["profile", "--out", str(out_file), "--emulate", "slow"], capsys)
    assert rc == 2 and "emulate must be TYPE=SPEED" in err
    rc, out, err = run(["profile", "--out", str(out_file), "--model-script", str(tmp_path / "none.py")], capsys)
    assert rc == 2 and "model_script" in err


def test_plan_max_deviation(files, capsys):
    base = ["plan", "--cluster", str(files / "cluster.yaml"), "--profile", str(files / "profiles.json"),
            "--json", "--global-batch"]
    rc, out, err = run(base + ["192", "--max-deviation", "0"], capsys)
    assert rc == 0, err
    assert json.loads(out)["plan"]["global_batch_size"] == 192
    # 200 = 2 * B_L * M has no solution with B_L a multiple of 8 and 3 GPUs: reason printed
    rc, out, err = run(base + ["200", "--max-deviation", "0"], capsys)
    assert rc == 2 and "B_L=8: skipped: B_G*=208 deviates" in err and err.count("\n") == 1
    rc, out, err = run(base + ["192", "--max-deviation", "-0.5"], capsys)
    assert rc == 2 and "max_deviation must be" in err


def test_profile_command_with_model_script(tmp_path, capsys):
    script = tmp_path / "my_model.py"
    script.write_text(
        "import torch\n"
        "from jabasray.models import MLP\n"
        "def build_model():\n"
        "    return MLP(64, (16,), 10)\n"
        "def sample_batch(n):\n"
        "    return torch.randn(n, 64), torch.randint(0, 10, (n,))\n")
    out_file = tmp_path / "mlp.json"
    rc, out, err = run(["profile", "--out", str(out_file), "--model-script", str(script), "--gpu-type", "tiny",
                        "--min-local-batch", "8", "--max-local-batch", "16", "--repeats", "1",
                        "--max-num-vsw", "1", "--no-allreduce"], capsys)
    assert rc == 0, err
    prof = load_profiles([out_file])["tiny"]
    assert prof.local_batches == [8, 16] and [b.max_num_vsw for b in prof.batches] == [1, 1]
    assert prof.param_bytes == (64 * 16 + 16 + 16 * 10 + 10) * 4
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('oops')\n")
    rc, out, err = run(["profile", "--out", str(out_file), "--model-script", str(broken)], capsys)
    assert rc == 2 and err.count("\n") == 1 and "failed to load: RuntimeError: oops" in err
