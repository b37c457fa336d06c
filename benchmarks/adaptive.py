"""Adaptive batching + auto-scaling vs static baselines on the emulated heterogeneous cluster.

Four variants of the same job (DigitsCNN on digits, same seed, same profile/perf model), run one
after the other in ONE invocation on the same emulated cluster (JABAS paper section 7.2's
comparison, scaled down):

* ``static_small``  - B_G fixed at the small batch, all GPUs;
* ``static_max``    - B_G fixed at max B_G, all GPUs;
* ``adaptive_all``  - adaptive B_G (SimiGrad-like rule) on all GPUs, no auto-scaling;
* ``jabas``         - adaptive B_G + per-epoch auto-scaling (the full system).

Reported per variant: final validation accuracy, time to the target accuracy (the accuracy the
static small batch reaches, capped by ``--target``), GPU-seconds to that target (sum over the
allocated emulated GPUs of epoch wall time), both for wall time (includes actor placement and
re-placement) and for training time only (the intervals: actor start-up on a 2-core CPU is an
artefact of the emulation). Ratios are relative to ``static_small``.

    python benchmarks/adaptive.py                  # ~5-10 min on a 2-core CPU
    python benchmarks/adaptive.py --epochs 4 --variants jabas static_small

Writes ``<tmp>/jabasray_bench/adaptive.json`` and the per-epoch B_G trajectories of the adaptive
variants to ``benchmarks/data/trajectories_jabas.json`` (input for the forecaster's benchmark).
Runs on the CPU only (it needs Ray: the GPU actors are Ray actors).
"""
from __future__ import annotations

import argparse
import logging
import platform
import time
from dataclasses import replace
from pathlib import Path

from common import default_out, write_json

HERE = Path(__file__).resolve().parent
VARIANTS = ("static_small", "static_max", "adaptive_all", "jabas")


def variant_job(name: str, base, small: int):
    if name == "static_small":
        return replace(base, adaptive=False, autoscale=False, initial_global_batch=small)
    if name == "static_max":
        return replace(base, adaptive=False, autoscale=False, initial_global_batch=base.max_global_batch)
    if name == "adaptive_all":
        return replace(base, adaptive=True, autoscale=False)
    return replace(base, adaptive=True, autoscale=True)


def time_to(epochs: list[dict], target: float, key: str) -> float | None:
    """Cumulative ``key`` over epochs until the first epoch whose val accuracy >= target."""
    total = 0.0
    for e in epochs:
        total += e[key]
        if e["val_accuracy"] is not None and e["val_accuracy"] >= target:
            return total
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--small", type=int, default=64, help="static small B_G (= initial B_G)")
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--target", type=float, default=0.95, help="upper cap of the target accuracy")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", type=Path, default=Path(default_out('adaptive.json')))
    ap.add_argument("--trajectories", type=Path, default=HERE / "data" / "trajectories_jabas.json")
    ap.add_argument("--device", default="cpu", choices=["cpu"],
                    help="the benchmark drives Ray actors; only CPU emulation is supported")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import ray
    import torch

    from jabasray.actors.driver import DriverOptions
    from jabasray.actors.trainer import JabasTrainer, emulated_resources
    from jabasray.config import JobConfig, RunConfig
    from jabasray.data import load_digits_split
    from jabasray.models import DigitsCNN
    from jabasray.planners.perf_model import PerfModel, emulated_profiles
    from jabasray.profiler import profile_model
    from jabasray.types import ClusterSpec

    torch.set_num_threads(1)
    cluster = ClusterSpec.emulated({"fast": (1, 4, 0.5), "slow": (1, 4, 0.25)})
    train, val = load_digits_split()
    base = JobConfig(epochs=args.epochs, lr=0.1, lr_scaling="sqrt", initial_global_batch=args.small,
                     min_global_batch=args.small, max_global_batch=args.max_batch, min_local_batch=8,
                     adapt_interval=5, alpha=0.1, gamma=0.5, warmup_iterations=10, seed=0)
    t0 = time.perf_counter()
    prof = profile_model(DigitsCNN, train, min_local_batch=8, max_local_batch=64, warmup=2, repeats=5,
                         cache_dir=HERE / "out" / ".profiles", gpu_type="cpu")
    prof = replace(prof, allreduce_inter=prof.allreduce_inter or prof.allreduce_intra)
    profiles = emulated_profiles(prof, {n.gpu_type: n.speed for n in cluster.nodes})
    print(f"profile: {time.perf_counter() - t0:.1f}s (cached in benchmarks/out/.profiles)")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             resources=emulated_resources(cluster), runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    results = {}
    runs_dir = HERE / "out" / "adaptive_runs"
    try:
        for name in args.variants:
            job = variant_job(name, base, args.small)
            t = time.perf_counter()
            run_dir = runs_dir / name
            if run_dir.exists():
                import shutil
                shutil.rmtree(run_dir)
            res = JabasTrainer(DigitsCNN, train, None, None, job, cluster=cluster,
                               run_config=RunConfig(str(runs_dir), name), val_dataset=val,
                               perf_model=PerfModel(profiles), options=DriverOptions()).fit()
            epochs = []
            for e in res.history.epochs:
                train_time = sum(r.time_s for r in res.history.intervals if r.epoch == e.epoch)
                epochs.append({"epoch": e.epoch, "allocation": e.allocation, "num_gpus": len(e.gpu_types),
                               "trajectory": e.trajectory, "forecast": e.predicted_trajectory,
                               "val_accuracy": e.val_accuracy, "wall_s": e.time_s, "train_s": train_time,
                               "gpu_seconds_wall": e.gpu_seconds,
                               "gpu_seconds_train": train_time * len(e.gpu_types),
                               "throughput": e.throughput})
            results[name] = {"job": job.to_dict(), "epochs": epochs, "events": res.history.events,
                             "final_val_accuracy": res.val_accuracy,
                             "total_wall_s": time.perf_counter() - t}
            print(f"{name:13s} final acc {res.val_accuracy:.4f}  "
                  f"allocations {[e['num_gpus'] for e in epochs]}  ({time.perf_counter() - t:.0f}s)",
                  flush=True)
    finally:
        ray.shutdown()

    ref = results.get("static_small")
    target = min(args.target, ref["final_val_accuracy"]) if ref else args.target
    summary = {}
    for name, r in results.items():
        s = {"final_val_accuracy": r["final_val_accuracy"]}
        for kind in ("wall", "train"):
            s[f"time_to_target_{kind}_s"] = time_to(r["epochs"], target, f"{kind}_s")
            s[f"gpu_seconds_to_target_{kind}"] = time_to(r["epochs"], target, f"gpu_seconds_{kind}")
        summary[name] = s
    print(f"\ntarget accuracy {target:.4f} (static_small final, capped at {args.target})")
    print(f"{'variant':13s} {'final acc':>9s} {'t->target':>10s} {'(train)':>8s} {'GPU-s':>8s} "
          f"{'(train)':>8s} {'t ratio':>8s} {'GPU-s ratio':>11s}")
    base_s = summary.get("static_small", {})
    for name, s in summary.items():
        def fmt(v):
            return f"{v:.1f}" if v is not None else "n/a"

        def ratio(k):
            a, b = s.get(k), base_s.get(k)
            return f"{a / b:.2f}" if a is not None and b else "n/a"
        print(f"{name:13s} {s['final_val_accuracy']:9.4f} {fmt(s['time_to_target_wall_s']):>10s} "
              f"{fmt(s['time_to_target_train_s']):>8s} {fmt(s['gpu_seconds_to_target_wall']):>8s} "
              f"{fmt(s['gpu_seconds_to_target_train']):>8s} {ratio('time_to_target_wall_s'):>8s} "
              f"{ratio('gpu_seconds_to_target_wall'):>11s}")
    doc = {"benchmark": "adaptive", "machine": f"{platform.platform()} (2-core CPU dev machine, no GPU)",
           "cluster": cluster.to_dict(), "target_accuracy": target, "summary": summary,
           "variants": results}
    write_json(args.out, doc, indent=1, announce=False)
    runs = [{"variant": n, "gamma": r["job"]["gamma"], "alpha": r["job"]["alpha"],
             "trajectories": [e["trajectory"] for e in r["epochs"]],
             "val_accuracy": [e["val_accuracy"] for e in r["epochs"]]}
            for n, r in results.items() if r["job"]["adaptive"]]
    if runs:
        write_json(args.trajectories, {"source": "benchmarks/adaptive.py", "model": "DigitsCNN",
                                       "dataset": "digits", "adapt_interval": base.adapt_interval,
                                       "runs": runs}, indent=1, announce=False)
    print(f"wrote {args.out}" + (f" and {args.trajectories}" if runs else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
