"""Iteration-time model (JABAS Eq. 1-6) vs real IIDP runs on this machine, in one run.

1. Profile a digits CNN (32 channels, 128 hidden) with ``profile_model`` (IIDP engine, B_L in
   {16, 32, 48}, n_max <= 4, all-reduce fit from a 2-process gloo group).
2. Run real ``IIDPWorker`` steps for several configurations - single device (N_G = 1) and a
   2-process gloo group on 127.0.0.1 (N_G = 2), with a fast (speed 1) and an emulated slow GPU
   type (speed 0.5: after each step the worker sleeps (1/speed - 1) x (compute + update time),
   i.e. the emulated GPU is uniformly slower, which is what ``Profile.scaled`` assumes) - and
   measure the time per iteration (median wall time of N steps, emulation sleep included).
3. Predict each with ``PerfModel`` (profiles: measured, and ``scaled(0.5)`` for the slow type;
   a 2-GPU configuration's time is the max over its GPUs, as in the solver) and report the
   relative error next to the paper's 5.9 % average (Table 6).

    python benchmarks/perf_model.py [--device cpu|cuda] [--steps 20]

On CUDA only the single-device configurations run (one GPU; the 2-process group needs two
devices), once per execution (``--cuda-graphs auto,off``): replayed CUDA graphs and the eager
batched step, each profiled AND run that way (the profiler is given the worker's
``cuda_graphs``: a profile of eager steps says nothing about graph replays, which on an H200 ran
10x faster). Writes <tmp>/jabasray_bench/perf_model.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import default_out, write_json
from jabasray.engine.graphs import GRAPH_WARMUP_STEPS
from jabasray.models import DigitsCNN
from jabasray.planners.perf_model import PerfModel
from jabasray.profiler.measure import profile_model

SPEEDS = {"fast": 1.0, "slow": 0.5}
# name, B_L, [(gpu type, n_vsw, n_ga) per device]
SINGLE = [
    ("A", 16, [("fast", 1, 0)]),
    ("B", 32, [("fast", 2, 1)]),
    ("C", 48, [("fast", 4, 0)]),
    ("D", 16, [("slow", 3, 1)]),
    ("E", 24, [("fast", 2, 2)]),        # B_L between profiled sizes: interpolated
]
DIST = [
    ("F", 16, [("fast", 2, 0), ("fast", 2, 0)]),
    ("G", 32, [("fast", 1, 3), ("fast", 1, 3)]),
    ("H", 16, [("fast", 2, 1), ("slow", 1, 1)]),
]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return DigitsCNN(channels=32, hidden=128)


def batch(n: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 1, 8, 8, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device))


STAT = {"median": statistics.median, "min": min}


def run_config(worker, local_batch: int, gpu: str, n_vsw: int, n_ga: int, steps: int, warmup: int,
               device: str, stat: str = "median") -> float:
    """Steady-state seconds per iteration of (n_vsw, n_GA, B_L) with speed emulation. A worker
    that replays CUDA graphs first runs its graph warm-up and capture (not timed)."""
    worker.configure(n_vsw, n_ga, local_batch)
    if worker.graph_fallback_reason() is None:
        warmup = max(warmup, GRAPH_WARMUP_STEPS + 2)
    micro = [batch(local_batch, device, i) for i in range(n_vsw * (n_ga + 1))]
    slow = 1.0 / SPEEDS[gpu] - 1.0

    def step() -> float:
        t0 = time.perf_counter()
        st = worker.train_step(micro)
        if slow > 0:
            time.sleep(slow * (st.compute_time + st.update_time))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    for _ in range(warmup):
        step()
    # median (or min) per-step wall time: robust to interference from other processes
    return STAT[stat]([step() for _ in range(steps)])


def optimizer(ps):
    return torch.optim.SGD(ps, lr=0.01, momentum=0.9)


def child(rank: int, cfg: dict) -> None:
    """One rank of the 2-process runs."""
    import torch.distributed as dist
    from jabasray.engine import IIDPWorker
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=2)
    out: dict[str, list[float]] = {name: [] for name, _, _ in DIST}
    w = IIDPWorker(make_model(), optimizer, F.cross_entropy, process_group=dist.group.WORLD)
    for _ in range(cfg["rounds"]):
        for name, bl, layout in DIST:
            gpu, nv, ga = layout[rank]
            out[name].append(run_config(w, bl, gpu, nv, ga, cfg["steps"], cfg["warmup"], "cpu", cfg["stat"]))
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def run_dist(steps: int, warmup: int, stat: str, rounds: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"init": os.path.join(tmp, "init"), "out": os.path.join(tmp, "out.json"),
               "steps": steps, "warmup": warmup, "stat": stat, "rounds": rounds}
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs = [subprocess.Popen([sys.executable, __file__, "--child", str(r), json.dumps(cfg)], env=env)
                 for r in range(2)]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError("2-process run failed")
        return json.loads(Path(cfg["out"]).read_text())


def measure_mode(args, mode: str, on_cuda: bool) -> dict:
    """Profile, run and predict every configuration with the worker's ``cuda_graphs=mode``."""
    t0 = time.perf_counter()
    prof = profile_model(make_model, lambda n: batch(n, "cpu", 99), optimizer_fn=optimizer,
                         device=args.device, gpu_type="fast", min_local_batch=16, max_local_batch=48,
                         max_num_vsw=4, warmup=2, repeats=args.repeats, allreduce=not on_cuda,
                         statistic=args.statistic,
                         engine_options={"per_sample_loss": True, "cuda_graphs": mode})
    print(f"[cuda_graphs={mode}] profiled ({prof.execution}) in {time.perf_counter() - t0:.1f} s: "
          f"B_L {prof.local_batches}, n_max {[b.max_num_vsw for b in prof.batches]}, "
          f"zeta {[round(b.zeta, 2) for b in prof.batches]}, buckets {prof.bucket_sizes}, "
          f"all-reduce alpha={prof.allreduce_intra.alpha:.3g} beta={prof.allreduce_intra.beta * 1e3:.3g} ms")
    profiles = {"fast": prof, "slow": prof.scaled(SPEEDS["slow"], "slow")}

    from jabasray.engine import IIDPWorker
    runs: dict[str, list[float]] = {name: [] for name, _, _ in SINGLE}
    w = IIDPWorker(make_model(), optimizer, F.cross_entropy, device=args.device, cuda_graphs=mode)
    for _ in range(args.rounds):
        for name, bl, layout in SINGLE:
            gpu, nv, ga = layout[0]
            runs[name].append(run_config(w, bl, gpu, nv, ga, args.steps, args.warmup, args.device,
                                         args.statistic))
    w.close()
    configs = list(SINGLE)
    if not on_cuda:
        runs.update(run_dist(args.steps, args.warmup, args.statistic, args.rounds))
        configs += DIST
    real = {k: statistics.mean(v) for k, v in runs.items()}
    spread = {k: (max(v) - min(v)) / statistics.mean(v) for k, v in runs.items()}

    rows, errors = [], []
    print(f"\n{'cfg':<4} {'N_G':>3} {'B_L':>4} {'layout':<28} {'real ms':>9} {'pred ms':>9} {'error':>7} "
          f"{'spread':>7}")
    for name, bl, layout in configs:
        model = PerfModel(profiles, num_gpus=len(layout), multi_node=False)
        pred = max(model.iteration_time(g, bl, nv, ga) for g, nv, ga in layout)
        err = abs(pred - real[name]) / real[name]
        errors.append(err)
        lay = " + ".join(f"{g}({nv},{ga})" for g, nv, ga in layout)
        print(f"{name:<4} {len(layout):>3} {bl:>4} {lay:<28} {real[name] * 1e3:>9.3f} {pred * 1e3:>9.3f} "
              f"{err * 100:>6.1f}% {spread[name] * 100:>6.1f}%")
        rows.append({"config": name, "cuda_graphs": mode, "execution": prof.execution,
                     "num_gpus": len(layout), "local_batch": bl, "layout": layout,
                     "real_s": real[name], "real_rounds_s": runs[name], "round_spread": spread[name],
                     "predicted_s": pred, "rel_error": err})
    print(f"real-vs-real spread between rounds (noise floor): mean {statistics.mean(spread.values()) * 100:.1f}%")
    print(f"\nmean relative error ({prof.execution}): {statistics.mean(errors) * 100:.1f}% over "
          f"{len(rows)} configurations (paper Table 6: 5.9% average, 1.3-9% per model)")
    return {"rows": rows, "profile": prof.to_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="profiling repeats per point")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure every real configuration this many times (round-to-round spread "
                         "= the machine's noise floor)")
    ap.add_argument("--statistic", default="median", choices=("median", "min"),
                    help="per-step statistic for profile and real runs (min: undisturbed time)")
    ap.add_argument("--cuda-graphs", default="auto,off",
                    help="on CUDA: the worker's cuda_graphs values to profile and run, each both "
                         "ways (default auto,off; on CPU only off exists)")
    ap.add_argument("--out", default=default_out('perf_model.json'))
    args = ap.parse_args()
    torch.set_num_threads(1)
    on_cuda = args.device.startswith("cuda")

    modes = [m.strip() for m in args.cuda_graphs.split(",")] if on_cuda else ["off"]
    bad = [m for m in modes if m not in ("auto", "off")]
    if bad:
        ap.error(f"--cuda-graphs must list values among auto, off; got {bad}")
    rows, profiles_out, by_mode = [], {}, {}
    for mode in modes:
        mode_rows = measure_mode(args, mode, on_cuda)
        rows += mode_rows["rows"]
        profiles_out[mode] = mode_rows["profile"]
        by_mode[mode] = statistics.mean(r["rel_error"] for r in mode_rows["rows"])
    mean = statistics.mean(r["rel_error"] for r in rows)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"load average after the run: {load}")
    result = {"statistic": args.statistic, "load_average": load, "machine": f"{platform.machine()} {args.device}, 2-core CPU dev machine, no GPU"
              if not on_cuda else f"{torch.cuda.get_device_name()}",
              "device": args.device, "rows": rows, "mean_rel_error": mean,
              "mean_rel_error_by_cuda_graphs": by_mode, "paper_mean_rel_error": 0.059,
              "mean_round_spread": statistics.mean(r["round_spread"] for r in rows),
              "profiles": profiles_out}
    write_json(args.out, result)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        main()
