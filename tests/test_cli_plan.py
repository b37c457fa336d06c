"""`jabasray plan` and `jabasray profile`: table / JSON output, auto allocation, and one-line
errors (never a traceback) for bad files and values."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jabasray import cli
from jabasray.planners import PerfModel, solve_for_batch
from jabasray.planners.config_solver import solve_local_batch
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


def test_plan_table_and_json_agree_with_the_plan_policy(files, capsys):
    """`jabasray plan` prints the plan policy's plan (what the driver runs), not plain Alg. 1."""
    args = ["plan", "--cluster", str(files / "cluster.yaml"), "--profile", str(files / "profiles.json"),
            "--global-batch", "512"]
    rc, out, err = run(args, capsys)
    assert rc == 0, err
    profiles = load_profiles([files / "profiles.json"])
    model = PerfModel(profiles).for_allocation(6, True)
    want = solve_for_batch(512, ["fast", "fast", "slow"], model, 8, tolerance=0.05)
    assert f"used {want.global_batch_size}" in out and f"B_L {want.local_batch_size}" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("n1 ", "n2 "))]
    assert [(r[1], int(r[2]), int(r[3])) for r in rows] == [tuple(w) for w in want.workers]
    rc, out, err = run(args + ["--json"], capsys)
    data = json.loads(out)
    assert Plan.from_dict(data["plan"]) == want
    assert data["group_gpus"] == ["fast", "fast", "slow"]
    assert data["allocation"]["node_gpus"] == {"n1": 4, "n2": 2}


def test_plan_auto_allocation_and_emulate(files, capsys):
    rc, out, err = run(["plan", "--cluster", str(files / "cluster.yaml"), "--profile", str(files / "fast.json"),
                        "--emulate", "--global-batch", "64", "--allocation", "auto", "--json",
                        "--dataset-size", "4096", "--adapt-interval", "10"], capsys)
    assert rc == 0, err
    data = json.loads(out)
    assert len(data["autoscale"]["candidates"]) == 14     # (4 + 1) * (2 + 1) - 1 GPU counts
    best = min(c["epoch_time"] for c in data["autoscale"]["candidates"] if c["epoch_time"] is not None)
    assert data["autoscale"]["epoch_time"] == pytest.approx(best)
    rc, out, err = run(["plan", "--cluster", str(files / "cluster.yaml"), "--profile", str(files / "profiles.json"),
                        "--global-batch", "64", "--allocation", "n2=2"], capsys)
    assert rc == 0 and "n2=2 GPU(s)" in out and "slow" in out
    rc, out, err = run(["plan", "--cluster", str(files / "cluster.yaml"), "--profile", str(files / "profiles.json"),
                        "--global-batch", "64", "--allocation", "n1=3"], capsys)
    assert rc == 0 and "n1=3 GPU(s)" in out and "fast/solo" in out


@pytest.mark.parametrize("extra, message", [
    (["--global-batch", "0"], "global_batch must be an integer >= 1, got 0"),
    (["--global-batch", "99999999999"], "global_batch: 99999999999 is too large for 3 GPU unit(s)"),
    (["--global-batch", "100000000"], "global_batch: 100000000 is too large for 3 GPU unit(s)"),
    (["--global-batch", "512", "--tolerance", "-1"], "tolerance must be"),
    (["--global-batch", "512", "--allocation", "n9=1"], "allocation must be"),
    (["--global-batch", "512", "--allocation", "n2=3"], r"node_gpus[n2] must be <= 2"),
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
        (["--cluster", str(files / "cluster.yaml"), "--profile", str(files / "fast.json")],
         "no profile for GPU type(s) ['slow']"),
        (["--cluster", str(files / "cluster.yaml"), "--profile", str(bad_prof)], "not a valid Profile"),
        (["--cluster", str(files / "cluster.yaml"), "--profile", str(files / "nope.json")], "nope.json"),
    ]
    for argv, message in cases:
        rc, out, err = run(["plan", "--global-batch", "512"] + argv, capsys)
        assert rc == 2 and err.count("\n") == 1 and message in err, (argv, err)
    # an odd GPU count is planned as it is; --drop-odd-gpu is a deprecated no-op
    rc, out, err = run(["plan", "--global-batch", "64", "--cluster", str(odd),
                        "--profile", str(files / "profiles.json")], capsys)
    assert rc == 0 and "a=3 GPU(s)" in out and "fast/solo" in out and err == ""
    rc2, out2, err = run(["plan", "--global-batch", "64", "--cluster", str(odd), "--drop-odd-gpu",
                          "--profile", str(files / "profiles.json")], capsys)
    assert rc2 == 0 and out2 == out and err.count("\n") == 1 and "deprecated" in err


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


def test_plan_tolerance(files, capsys):
    """--tolerance is the policy's: 0 keeps B_G* = B_G when some B_L gives it exactly (192 =
    2 * 8 * 12 on 3 pairs); 200 has no exact B_G* (B_G* = 2 B_L M, B_L a multiple of 8: 192 or
    208 at best), so the closest wins. Both equal solve_for_batch with that tolerance, the driver's function."""
    base = ["plan", "--cluster", str(files / "cluster.yaml"), "--profile", str(files / "profiles.json"),
            "--json", "--global-batch"]
    model = PerfModel(load_profiles([files / "profiles.json"])).for_allocation(6, True)
    for bg in (192, 200):
        rc, out, err = run(base + [str(bg), "--tolerance", "0"], capsys)
        assert rc == 0, err
        got = Plan.from_dict(json.loads(out)["plan"])
        assert got == solve_for_batch(bg, ["fast", "fast", "slow"], model, 8, tolerance=0.0)
        if bg == 192:
            assert got.global_batch_size == 192
        else:   # the closest B_G* any B_L reaches
            per_bl = [p for bl in (8, 16, 24, 32)
                      if (p := solve_local_batch(bg, ["fast", "fast", "slow"], model, bl)[0])]
            assert abs(got.global_batch_size - bg) == min(abs(p.global_batch_size - bg) for p in per_bl)


def test_plan_below_the_floor_runs_the_floor(files, capsys):
    """B_G 8 on 3 pairs (min B_L 8): the driver runs the smallest B_G the GPUs can (2*3*8 = 48);
    the CLI says so instead of failing."""
    rc, out, err = run(["plan", "--cluster", str(files / "cluster.yaml"), "--profile",
                        str(files / "profiles.json"), "--global-batch", "8"], capsys)
    assert rc == 0, err
    assert "used 48" in out and "below the smallest global batch" in out


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
