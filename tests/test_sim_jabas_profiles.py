"""JABAS's published quick-start profiles (ResNet-50, V100 + P100) converted into our Profiles:
the model's predictions against numbers computed by hand from the raw files, n_max against the
memory profiles, Eq. 3's fit against the comm points, one-line errors for broken folders, and
the configuration solver on a V100 + P100 group. No Ray, no torch (the conversion is plain data).

Raw numbers used below (ms, from jabasray/sim/profiles/jabas_resnet50):

V100 (node0) update_time of its six compute files: 5.97092514567905, 4.552518028683132,
4.773419713973999, 4.256266662809584, 4.306862915886773, 4.293777057859633
-> t_optim = median = (4.306862915886773 + 4.552518028683132) / 2 = 4.4296904722849525.
V100 copy_time / (n - 1): 4.451511123445299 / 2 (B_L 32, n 3), 2.1967633763949075 / 1 (B_L 64,
n 2) -> t_copy = median = (2.2257555617226495 + 2.1967633763949075) / 2 = 2.2112594690587785.
"""
from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys

import numpy as np
import pytest

from jabasray.planners.config_solver import solve_configuration
from jabasray.planners.perf_model import PerfModel
from jabasray.profiles import Profile
from jabasray.sim.jabas_profiles import (QUICKSTART_COMM_BANDWIDTH, QUICKSTART_RESNET50, jabas_cluster,
                                         load_jabas_profiles, quickstart_profiles, read_comm_profile)

V100, P100 = "Tesla V100-PCIE-16GB", "Tesla P100-PCIE-16GB"
NODE = {V100: "node0", P100: "node1"}
MIB = 2 ** 20


def raw(gpu: str, local_batch: int, n: int) -> dict:
    path = (QUICKSTART_RESNET50 / "cluster_comp_profile_data" / str(local_batch) / NODE[gpu]
            / f"resnet50_{local_batch}_{n}_comp_profile.json")
    return json.loads(path.read_text())


def comm_raw(kind: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [line.split(",") for line in
            (QUICKSTART_RESNET50 / "comm_profile_data" / f"{kind}_comm_profile_data.txt").read_text().split()]
    return np.array([float(r[0]) for r in rows]), np.array([float(r[1]) for r in rows])


@pytest.fixture(scope="module")
def profiles() -> dict[str, Profile]:
    return quickstart_profiles()


def test_quickstart_loads(profiles):
    assert set(profiles) == {V100, P100}
    assert profiles[V100].local_batches == [32, 64, 96, 128]
    assert profiles[P100].local_batches == [32, 64, 96, 128, 160]
    for p in profiles.values():
        assert p.min_local_batch == 32 and p.device == "cuda" and p.bucket_cap_mb == 25.0
        # bucket_size_distribution [7.81, 30.04, 25.04, 25.25, 9.2] MiB, backward order
        assert p.bucket_sizes == [round(v * MIB) for v in (7.81, 30.04, 25.04, 25.25, 9.2)]
        assert p.param_bytes == sum(p.bucket_sizes)
        assert p.allreduce_inter is not None
        assert Profile.from_json(p.to_json()) == p       # plain data: a simulator can cache it
    cluster = jabas_cluster(QUICKSTART_RESNET50)
    assert {n: (c.gpu_type, c.num_gpus) for n, c in cluster.items()} == {"node0": (V100, 4), "node1": (P100, 4)}
    assert cluster["node0"].inter_bandwidth == 12.5e9 and cluster["node0"].tflops == 14.13


def test_v100_at_n_max_is_the_measured_round_plus_eq5(profiles):
    """V100, B_L 32, n_vsw 3 = n_max, n_GA 0, one GPU (no all-reduce), SWS (tau = 1).

    Raw (resnet50_32_3): data 11.468772262997097, fwd 87.00839801364475, bwd 173.58126186794703.
    Eq. 1 goes through n_max, so Eq. 2 gives the measured round:
      t_vsw = 11.468772262997097 + 87.00839801364475 + 173.58126186794703 = 272.0584321445889 ms
    Eq. 5: t_update = 4.4296904722849525 + 2.2112594690587785 * (3 - 1) = 8.852209410402509 ms
    Eq. 6: t = 0 + zeta t_vsw + max((1 - zeta) t_vsw, 0) + t_update = 280.9106415549914 ms
    (the file's total_time, 281.06246129671734 ms, is within 0.06 %).
    """
    m = PerfModel(profiles, num_gpus=1, weight_sync="sws")
    d = raw(V100, 32, 3)
    t_vsw = (d["data_time"] + d["fwd_time"] + d["bwd_time"]) / 1000
    assert math.isclose(t_vsw, 0.2720584321445889, rel_tol=1e-12)
    assert math.isclose(m.vsw_time(V100, 32, 3), t_vsw, rel_tol=1e-12)
    t_optim = statistics.median(raw(V100, b, n)["update_time"]
                                for b, n in [(32, 1), (32, 3), (64, 1), (64, 2), (96, 1), (128, 1)]) / 1000
    t_copy = statistics.median([raw(V100, 32, 3)["copy_time"] / 2, raw(V100, 64, 2)["copy_time"] / 1]) / 1000
    assert math.isclose(t_optim, 4.4296904722849525e-3, rel_tol=1e-12)
    assert math.isclose(t_copy, 2.2112594690587785e-3, rel_tol=1e-12)
    expected = t_vsw + t_optim + t_copy * 2
    assert math.isclose(expected, 0.2809106415549914, rel_tol=1e-12)
    assert math.isclose(m.iteration_time(V100, 32, 3, 0), expected, rel_tol=1e-12)
    assert abs(expected / (d["total_time"] / 1000) - 1) < 0.001


def test_p100_between_profiled_vsw_counts_follows_eq1(profiles):
    """P100, B_L 32, n_vsw 2 (profiled, but not one of Eq. 1's two points n = 1 and n_max = 4).

    t(1) = 3.917291376325819 + 50.29739006890191 + 106.0622556898329 = 160.27693713506064 ms
    t(4) = 15.689776399400499 + 180.21234503851997 + 384.1701561821832 = 580.0722776201037 ms
    Eq. 1: thp(n) = thp(1) + (thp(4) - thp(1)) ln n / ln 4, and ln 2 / ln 4 = 1/2, so
      thp(2) = (32 / 0.16027693713506064 + 128 / 0.5800722776201037) / 2
             = (199.65 + 220.66) / 2 = 210.16 samples/s
    Eq. 2: t_vsw(2) = 32 * 2 / thp(2) = 0.30453 s; the measured round (data 7.883411900202433 +
    fwd 92.7860119289822 + bwd 196.05975324842666 = 296.73 ms) is 2.6 % below: Eq. 1's error.
    """
    m = PerfModel(profiles, num_gpus=1, weight_sync="sws")
    t1 = (3.917291376325819 + 50.29739006890191 + 106.0622556898329) / 1000
    t4 = (15.689776399400499 + 180.21234503851997 + 384.1701561821832) / 1000
    thp2 = (32 / t1 + 128 / t4) / 2
    assert math.isclose(m.vsw_time(P100, 32, 2), 64 / thp2, rel_tol=1e-12)
    assert math.isclose(64 / thp2, 0.30453, rel_tol=1e-4)
    d = raw(P100, 32, 2)
    measured = (d["data_time"] + d["fwd_time"] + d["bwd_time"]) / 1000
    assert 0.02 < 64 / thp2 / measured - 1 < 0.03


def test_multi_node_iteration_with_ga_and_ows(profiles):
    """V100, B_L 64, n_vsw 2 = n_max, n_GA 1, 8 GPUs on 2 nodes, OWS.

    t_vsw = (16.68730985853407 + 117.12130771213107 + 231.6313486735026) / 1000 = 0.36543997 s,
    zeta = (16.68730985853407 + 117.12130771213107) / 365.43996624416775 = 0.366158 (n_max file).
    Eq. 3 across nodes, fitted as JABAS does (least squares of the file's ms columns, y = a x + b,
    np.polyfit), the inter file's x being d * 4 (8 - 1) / 8 / 7e9 * 1000 ms for d bytes:
      t_comm = sum_i (a * b_i * 3.5 / 7e9 * 1000 + b) / 1000 over the 5 buckets b_i (Eq. 4)
             = 0.0560 s < (1 - zeta) t_vsw = 0.2316 s: backward hides it.
    Eq. 5 with tau = b_5 / W = 9.2 / 97.34: t_update = tau (t_optim + t_copy (2 - 1)).
    Eq. 6: t = t_vsw * 1 + zeta t_vsw + max((1 - zeta) t_vsw, t_comm) + t_update = 0.7316 s.
    """
    m = PerfModel(profiles, num_gpus=8, multi_node=True, weight_sync="ows")
    d = raw(V100, 64, 2)
    t_vsw = (d["data_time"] + d["fwd_time"] + d["bwd_time"]) / 1000
    zeta = (d["data_time"] + d["fwd_time"]) / 1000 / t_vsw
    x, y = comm_raw("inter")
    a, b = np.polyfit(x, y, 1)
    buckets = [round(v * MIB) for v in (7.81, 30.04, 25.04, 25.25, 9.2)]
    t_comm = sum(a * s * 3.5 / 7e9 * 1000 + b for s in buckets) / 1000
    assert math.isclose(m.comm_time(V100), t_comm, rel_tol=1e-9)
    assert math.isclose(t_comm, 0.0560, abs_tol=5e-4)
    tau = buckets[-1] / sum(buckets)
    t_update = tau * (4.4296904722849525e-3 + 2.2112594690587785e-3 * 1)
    expected = t_vsw * 1 + zeta * t_vsw + max((1 - zeta) * t_vsw, t_comm) + t_update
    assert math.isclose(m.iteration_time(V100, 64, 2, 1), expected, rel_tol=1e-9)
    assert math.isclose(expected, 0.7316, abs_tol=5e-4)


def test_predictions_match_every_measured_total(profiles):
    """Every compute file, one GPU, SWS, n_GA 0: Eq. 6 = t_vsw + t_optim + t_copy (n - 1) against
    the file's total_time (data + fwd + bwd + update + copy of the same run). The error is the
    median optimizer time (at most 1.5 %, V100 B_L 32 n 1, whose update_time is 5.97 ms) and
    Eq. 1 at P100 n 2 (2.6 %); elsewhere under 0.2 %."""
    m = PerfModel(profiles, num_gpus=1, weight_sync="sws")
    errors = {}
    for gpu, node in NODE.items():
        for path in sorted((QUICKSTART_RESNET50 / "cluster_comp_profile_data").glob(f"*/{node}/*.json")):
            d = json.loads(path.read_text())
            pred = m.iteration_time(gpu, d["lbs"], d["num_models"], 0)
            errors[(gpu, d["lbs"], d["num_models"])] = pred / (d["total_time"] / 1000) - 1
    assert len(errors) == 14
    assert max(abs(e) for e in errors.values()) < 0.03
    assert abs(errors[(P100, 32, 2)]) > 0.02 and abs(errors[(V100, 32, 1)]) > 0.01
    others = [abs(e) for k, e in errors.items() if k not in {(P100, 32, 2), (V100, 32, 1)}]
    assert max(others) < 0.002
    # without the input copy the model under-predicts by its share (~4 %)
    bare = PerfModel(quickstart_profiles(include_data_time=False), num_gpus=1, weight_sync="sws")
    d = raw(P100, 128, 1)
    assert math.isclose(bare.vsw_time(P100, 128, 1), (d["fwd_time"] + d["bwd_time"]) / 1000, rel_tol=1e-12)


def test_max_num_vsw_is_the_memory_profile(profiles):
    m = PerfModel(profiles, num_gpus=1)
    files = sorted((QUICKSTART_RESNET50 / "cluster_mem_profile_data").glob("*/*/max_memory_profile_info.json"))
    assert len(files) == 9
    for path in files:
        d = json.loads(path.read_text())
        assert m.max_num_vsw(d["gpu_type"], d["lbs"]) == d["max_num_models"]
        assert profiles[d["gpu_type"]].batch(d["lbs"]).max_num_vsw == d["max_num_models"]
    assert m.max_num_vsw(V100, 160) == 0          # V100 has no B_L 160 profile: max B_L^g = 128


@pytest.mark.parametrize("kind, max_abs_ms, rms_ms", [("intra", 6.0, 3.0), ("inter", 4.5, 2.1)])
def test_allreduce_fit_reproduces_the_comm_points(profiles, kind, max_abs_ms, rms_ms):
    """Eq. 3 is one least-squares line per file. Residuals (predicted - measured, ms) at
    1, 5, 10, 15, 20, 25, 50, 100, 150 MiB:
      intra (N 4): -1.59 -1.11 -0.84 -0.34 +0.65 -0.90 +3.00 +5.81 -4.67 (RMS 2.8; the 150 MiB
                   point bends the line, so the small sizes are under-predicted by up to 52 %)
      inter (N 8): -0.10 +1.24 +0.01 -2.76 -0.31 -0.08 +0.36 +4.40 -2.76 (RMS 2.0)
    The fit equals JABAS's own (np.polyfit of the file's ms columns): alpha = slope, beta =
    intercept / 1000, with K = the bandwidth the file was written with."""
    comm = read_comm_profile(QUICKSTART_RESNET50, kind, QUICKSTART_COMM_BANDWIDTH[kind])
    fit = getattr(profiles[V100], f"allreduce_{kind}")
    assert fit == comm.fit() == getattr(profiles[P100], f"allreduce_{kind}")
    assert comm.num_gpus == (4 if kind == "intra" else 8) and fit.bandwidth == QUICKSTART_COMM_BANDWIDTH[kind]
    # the x column is the theoretical time of whole MiB tensors (the profiling script's sizes)
    assert [round(s / MIB, 9) for s in comm.sizes] == [1, 5, 10, 15, 20, 25, 50, 100, 150]
    x, y = comm_raw(kind)
    a, b = np.polyfit(x, y, 1)
    assert math.isclose(fit.alpha, a, rel_tol=1e-9) and math.isclose(fit.beta, b / 1000, rel_tol=1e-9)
    res = np.array([fit.time(s, comm.num_gpus) for s in comm.sizes]) * 1000 - y
    assert abs(res.sum()) < 1e-9 and abs((res * x).sum()) < 1e-6      # the normal equations
    assert np.abs(res).max() < max_abs_ms and math.sqrt((res ** 2).mean()) < rms_ms


def test_cluster_info_bandwidth_reads_the_inter_slope_smaller():
    """Read with cluster_info's 12.5e9 B/s (as JABAS's runtime does), the same inter points give
    tensors 7 / 12.5 times as large, so a real tensor's predicted time has 0.56 times the slope."""
    default = load_jabas_profiles(QUICKSTART_RESNET50)[V100].allreduce_inter
    right = quickstart_profiles()[V100].allreduce_inter
    d = 25 * MIB
    slope = lambda f: f.time(d, 8) - f.beta
    assert math.isclose(slope(default) / slope(right), 7 / 12.5, rel_tol=1e-9)
    assert math.isclose(default.beta, right.beta, rel_tol=1e-9)


def test_solver_plans_a_v100_p100_group(profiles):
    """4 V100 (node0) + 4 P100 (node1): group H = one GPU of each pair, N_G = 8 across nodes.
    The V100 computes B_L 32 in 103 ms against the P100's 160 ms, so it takes at least as many
    decoupled workers n_vsw (n_GA + 1); its VSW count alone can be lower (the P100 fits 4 VSWs
    at B_L 32, the V100 3, and the solver gives the V100 GA steps instead)."""
    m = PerfModel(profiles, num_gpus=8, multi_node=True)
    for bg in (256, 512, 1024, 2048, 4096):
        plan = solve_configuration(bg, [V100, V100, P100, P100], m, min_local_batch=32)
        assert plan is not None and plan.global_batch_size == bg
        v, p = plan.workers[0], plan.workers[2]
        assert (v.gpu, p.gpu) == (V100, P100)
        assert v.num_workers >= p.num_workers
        assert math.isclose(plan.iteration_time,
                            max(m.iteration_time(w.gpu, plan.local_batch_size, w.num_vsw, w.num_ga)
                                for w in plan.workers), rel_tol=1e-12)
    plan = solve_configuration(2048, [V100, V100, P100, P100], m, min_local_batch=32)
    assert plan.workers[0].num_workers > plan.workers[2].num_workers


def test_solver_reproduces_the_quickstart_result(profiles):
    """The quick start's E1 (its README): B_G 128 on the V100 node -> B_L 32, 1 VSW, 0 GA steps
    on every GPU. (Its weight sync, "overlap", comes from IIDP's threshold 1.5 on the mean of the
    buckets but the last; our default rule is the paper's 0.5 on all buckets: SWS.)"""
    m = PerfModel(profiles, num_gpus=4, multi_node=False)
    plan = solve_configuration(128, [V100, V100], m, min_local_batch=32)
    assert (plan.global_batch_size, plan.local_batch_size) == (128, 32)
    assert [(w.num_vsw, w.num_ga) for w in plan.workers] == [(1, 0), (1, 0)]


# ---------------------------------------------------------------------------- broken folders
@pytest.fixture
def folder(tmp_path):
    dst = tmp_path / "jabas"
    shutil.copytree(QUICKSTART_RESNET50, dst)
    return dst


def _error(folder) -> str:
    with pytest.raises(ValueError) as e:
        load_jabas_profiles(folder)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_memory_profile(folder):
    path = folder / "cluster_mem_profile_data" / "64" / "node1" / "max_memory_profile_info.json"
    path.unlink()
    assert _error(folder) == f"JABAS profile file {path} is missing"
    path.parent.rmdir()
    assert _error(folder) == (f"JABAS profile file {path} is missing (compute profiles of node "
                              f"'node1' at local batch 64 have no memory profile)")


def test_missing_compute_profile_at_n_max(folder):
    (folder / "cluster_comp_profile_data" / "32" / "node1" / "resnet50_32_4_comp_profile.json").unlink()
    msg = _error(folder)
    assert str(folder / "cluster_comp_profile_data" / "32" / "node1") in msg
    assert "'num_models' = 4" in msg and "max_memory_profile_info.json" in msg


def test_malformed_json_and_fields(folder):
    path = folder / "cluster_comp_profile_data" / "96" / "node0" / "resnet50_96_1_comp_profile.json"
    good = json.loads(path.read_text())
    path.write_text("{not json")
    assert _error(folder).startswith(f"JABAS profile file {path} is not valid JSON")
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "fwd_time"}))
    assert _error(folder) == f"JABAS profile file {path}: field 'fwd_time' is missing"
    path.write_text(json.dumps({**good, "bwd_time": -1.0}))
    assert _error(folder).startswith(f"JABAS profile file {path}: field 'bwd_time' must be")
    path.write_text(json.dumps({**good, "gpu_type": "Tesla T4"}))
    assert _error(folder).startswith(f"JABAS profile file {path}: field 'gpu_type' is 'Tesla T4'")


def test_missing_or_bad_comm_bucket_and_cluster_files(folder):
    comm = folder / "comm_profile_data" / "intra_comm_profile_data.txt"
    lines = comm.read_text().splitlines()
    comm.write_text("\n".join(lines[:3] + ["1.0;2.0"] + lines[4:]))
    assert _error(folder) == (f"JABAS profile file {comm}: line 4 must be 'theoretical ms,measured ms', "
                              f"got '1.0;2.0'")
    comm.unlink()
    assert _error(folder) == f"JABAS profile file {comm} is missing"
    (folder / "comm_profile_data" / "inter_comm_profile_data.txt").unlink()
    shutil.copytree(QUICKSTART_RESNET50 / "comm_profile_data", folder / "comm_profile_data", dirs_exist_ok=True)
    bucket = folder / "bucket_profile_data" / "resnet50_bucket_size_profile.json"
    bucket.write_text(json.dumps({"model": "resnet50", "bucket_size_distribution": []}))
    assert _error(folder).startswith(f"JABAS profile file {bucket}: field 'bucket_size_distribution' must be")
    info = folder / "cluster_info.json"
    info.write_text(json.dumps({"node0": {"type": V100, "number": 4}}))
    assert _error(folder).startswith(f"JABAS profile file {info}: field node0.intra_network_bandwidth must be")
    info.unlink()
    assert _error(folder) == f"JABAS profile file {info} is missing"


def test_without_inter_file_there_is_no_inter_fit(folder):
    (folder / "comm_profile_data" / "inter_comm_profile_data.txt").unlink()
    profiles = load_jabas_profiles(folder)
    assert all(p.allreduce_inter is None for p in profiles.values())


def test_no_ray_or_torch_import():
    code = ("import sys, jabasray.sim.jabas_profiles as j; j.quickstart_profiles(); "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
