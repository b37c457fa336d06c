"""benchmarks/gpu_campaign.py on CPU: the plan (--dry-run), the budget arithmetic, the summary
table; the GPU run itself needs a GPU (it refuses without one)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_campaign as gc  # noqa: E402


def test_dry_run_lists_every_step_within_the_budget(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gc, "ray_problem", lambda: None)      # as on a GPU machine with Ray
    out = tmp_path / "campaign"
    assert gc.main([str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert not out.exists()                                    # nothing written
    runs = [l for l in text if l.startswith("run ")]
    skips = [l for l in text if l.startswith("skip")]
    assert len(runs) + len(skips) == len(gc.STEPS)
    names = [l.split()[1].rstrip(":") for l in runs + skips]
    assert sorted(names) == sorted(s.name for s in gc.STEPS)
    limits = [int(l.split("(limit ")[1].split(" s;")[0]) for l in runs]
    assert limits == [s.timeout_s for s, why in gc.plan(None) if why is None]
    # what decides the open goals comes first (the engine's, then the packed trials' where Ray
    # is importable) and fits the budget even if each step runs to its limit
    decisive = ["engine_gpu_checks", "engine_ddp", "engine_resnet18", "engine_overhead", "tune_evidence_mlp"]
    assert [l.split()[1] for l in runs[:5]] == decisive
    assert sum(limits[:3]) <= gc.BUDGET_S - gc.RESERVE_S
    checks = [l for l in runs if l.split()[1] == "engine_gpu_checks"][0]
    assert "-m cuda" in checks and "tests/test_cuda.py" in checks
    ddp = [l for l in runs if l.split()[1] == "engine_ddp"][0]
    assert "benchmarks/engine.py --device cuda --parts ddp" in ddp and f"{out}/engine_ddp.json" in ddp
    tests = [l for l in runs if l.split()[1] == "cuda_tests"][0]
    assert "-m cuda" in tests and str(out) in tests
    engine = [l for l in runs if l.split()[1] == "engine_resnet18"][0]
    assert "benchmarks/engine.py --device cuda --parts batched" in engine and "--vsw 1,2,4,8 " in engine
    assert f"{out}/engine_resnet18.json" in engine


def test_plan_skips_ray_steps_without_ray_and_honours_only():
    missing = "Ray Tune does not import: ImportError: pydantic is missing"
    p = dict((s.name, why) for s, why in gc.plan(missing))
    ray_steps = {"train", "tune", "tune_evidence_mlp"}
    assert all(p[n] == missing for n in ray_steps)
    optional = {s.name for s in gc.STEPS if s.optional}
    assert optional == {"tune_evidence_cnn"}
    assert all(p[n] == "optional: name it in --only" for n in optional)
    assert all(why is None for n, why in p.items() if n not in ray_steps | optional)
    assert gc.plan(None)[4] == (gc.STEPS[4], None) and gc.STEPS[4].name == "tune_evidence_mlp"
    p = dict((s.name, why) for s, why in gc.plan(None, only={"tune_evidence_mlp"}))
    assert p["tune_evidence_mlp"] is None and p["tune_evidence_cnn"] == "not in --only"
    p = dict((s.name, why) for s, why in gc.plan(None, only={"packing"}))
    assert p["packing"] is None and all(why == "not in --only" for n, why in p.items() if n != "packing")


def test_ray_problem_names_what_keeps_ray_tune_from_importing(monkeypatch):
    import subprocess
    assert gc.ray_problem() is None                       # this machine: Ray Tune imports
    monkeypatch.setattr(gc.importlib.util, "find_spec", lambda name: None)
    assert gc.ray_problem() == "Ray is not importable"
    monkeypatch.undo()
    failed = subprocess.CompletedProcess([], 1, "", "Traceback ...\nImportError: `ray.train.v2` requires "
                                         "the pydantic package, which is missing.\n")
    monkeypatch.setattr(gc.subprocess, "run", lambda *a, **kw: failed)
    assert gc.ray_problem() == ("Ray Tune does not import: ImportError: `ray.train.v2` requires the "
                                "pydantic package, which is missing.")


def test_step_timeout():
    R, M = gc.RESERVE_S, gc.MIN_STEP_S
    for nominal in (20, 60, 200):
        for remaining in range(0, 300, 7):
            t = gc.step_timeout(nominal, remaining)
            want = min(nominal, remaining - R)
            assert t == (int(want) if want >= M else None)


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gc.main([str(tmp_path), "--only", "engine,packing"])
    assert e.value.code == 2
    assert "--only must name steps among engine_gpu_checks, engine_ddp, engine_resnet18" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gc.main([str(tmp_path), "--budget", "5"])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(tmp_path, capsys):
    assert gc.main([str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_campaign: no CUDA device") and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_headlines_and_summary_table(tmp_path):
    doc = {"batched_vs_plain": [
        {"model": "resnet18", "local_batch": 32, "num_vsw": 4, "batched_over_plain_median": 1.02,
         "batched_graph_over_plain_graph_median": 0.97}],
        "overhead": [{"batch": 32, "ratio": 1.05}]}
    (tmp_path / "engine_resnet18.json").write_text(json.dumps(doc))
    (tmp_path / "cuda_tests.log").write_text("....\n===== 41 passed, 2 failed, 3 skipped in 12.0s =====\n")
    (tmp_path / "packing.json").write_text("{not json")
    steps = {s.name: s for s in gc.STEPS}
    assert gc.headline(steps["engine_resnet18"], tmp_path) == \
        "resnet18 B_L32 n4: eager 1.02, graph 0.97; 1 VSW / plain at batch 32: 1.05"
    assert gc.headline(steps["cuda_tests"], tmp_path) == "41 passed, 2 failed, 3 skipped"
    assert gc.headline(steps["packing"], tmp_path).startswith("(no headline")
    (tmp_path / "packing.json").write_text(json.dumps({"rows": [
        {"model": "mlp", "optimizers": "mixed", "K": 8, "IMPV_median_of_rounds": 0.5,
         "graph_speedup_median_of_rounds": 1.75},
        {"model": "cnn", "optimizers": "same", "K": 2, "IMPV_median_of_rounds": -0.25}]}))
    assert gc.headline(steps["packing"], tmp_path) == \
        "mlp/mixed K8: IMPV +0.50, graphed/eager x1.75; cnn/same K2: IMPV -0.25"
    assert gc.headline(steps["multiplex"], tmp_path) == ""
    (tmp_path / "engine_ddp.json").write_text(json.dumps({"ddp": {"rows": [
        {"model": "resnet18", "num_vsw": 4, "jabasray_over_ddp_median": 1.25,
         "jabasray_over_ddp_wall_median": 1.5, "jabasray_graphed_over_ddp_graph_median": 0.75}]}}))
    assert gc.headline(steps["engine_ddp"], tmp_path) == \
        "resnet18 n4: jabasray/ddp 1.25, jabasray_graphed/ddp_graph 0.75"
    (tmp_path / "engine_host.json").write_text(json.dumps({"rows": [
        {"model": "resnet18", "num_vsw": 2, "kernel_ops_per_step": {"plain": 184, "engine": 172},
         "engine_over_plain_median": 1.03}]}))
    assert gc.headline(steps["engine_host"], tmp_path) == "resnet18 n2: kernels 172/184, host x1.03"
    (tmp_path / "profiling.json").write_text(json.dumps(
        {"mean_rel_error": 0.5, "mean_rel_error_by_cuda_graphs": {"auto": 0.125, "off": 0.0625}}))
    assert gc.headline(steps["profiling"], tmp_path) == \
        "cuda_graphs=auto: mean error 12.5 %; cuda_graphs=off: mean error 6.2 %"
    (tmp_path / "tune.json").write_text(json.dumps({"summary": {
        "tune_asha/packed_asha wall_s": {"per_round": [1.5], "median": 1.5},
        "tune_asha/packed_asha time_to_within_1pt_s": {"per_round": [2.25], "median": 2.25},
        "tune_asha_shared/packed_asha wall_s": {"per_round": [3.0], "median": 3.0},
        "packed_asha best_accuracy": [0.5]}}))
    assert gc.headline(steps["tune"], tmp_path) == ("tune_asha/packed_asha: finish 1.50x, within 1 pt "
                                                    "2.25x; tune_asha_shared/packed_asha: finish 3.00x")
    outcomes = [gc.Outcome("cuda_tests", ["pytest"], "ok", 12.3, 0, headline="41 passed", limit_s=120),
                gc.Outcome("packing", ["x"], "failed", 3.0, 1, limit_s=45),
                gc.Outcome("engine_transformer", ["x"], "timeout", 60.0, None, limit_s=60),
                gc.Outcome("tune", ["x"], "skipped", note="Ray is not importable")]
    table = gc.summary_table(outcomes, "GPU X", 75.3).splitlines()
    rows = [l for l in table if l.startswith("| ") and not l.startswith("| step")]
    assert rows == ["| cuda_tests | ok | 12 | 120 | 41 passed |",
                    "| packing | failed (rc 1) | 3 | 45 |  |",
                    "| engine_transformer | timeout | 60 | 60 |  |",
                    "| tune | skipped: Ray is not importable | 0 |  |  |"]
    # a sweep cut at its limit (no summary yet): each contender that finished, with its figures
    (tmp_path / "tune_evidence_mlp.json").write_text(json.dumps({"rounds": [{"packed_asha": {
        "wall_s": 61.4, "best_accuracy": 0.5, "units_trained": 250}}]}))
    assert gc.headline(steps["tune_evidence_mlp"], tmp_path) == \
        "packed_asha (cut run): finish 61 s, best 0.5000, 250 units"
