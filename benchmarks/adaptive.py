"""Adaptive batching + auto-scaling vs static baselines, paired rounds on a fair emulation.

Four contenders train the same job (DigitsCNN on digits, same profile and performance model) on
the same emulated heterogeneous cluster (JABAS paper section 7.2's comparison, scaled down):

* ``static_small``  - B_G fixed at the small batch, all GPUs (what Ray Train DDP would run);
* ``static_max``    - B_G fixed at max B_G, all GPUs;
* ``adaptive_all``  - adaptive B_G (SimiGrad-like rule) on all GPUs, no auto-scaling;
* ``jabas``         - adaptive B_G + per-epoch auto-scaling (the joint system);
* ``static_scaled`` - B_G fixed at the small batch, per-epoch auto-scaling: the same SGD as
  ``static_small`` (IIDP keeps the global batch's gradient whatever the allocation), only the
  float summation order differs. Its accuracy difference to ``static_small`` is the noise
  floor of the comparison: how far a run drifts from a mathematically equal one.

Fairness: the emulated GPUs run under ``DriverOptions(emulation="wait")``
(:mod:`jabasray.actors.emulation`): a step takes its CPU time / speed, and the speeds sum to at
most the host's cores (``--speeds``; 4 x 0.25 + 4 x 0.125 = 1.5 on 2 cores), so an emulated GPU
is equally fast whether 2 or 8 of them are placed. Each round is one seed (model init, data
order, search); the four contenders run in that round in an order rotated by one every round.
Per contender and round: time to the target accuracy (training time: the intervals' wall time
summed over the epochs until the first epoch whose validation accuracy reaches ``--target``;
actor start-up and re-placement are excluded - start-up of Ray actors on a 2-core host is an
artefact of the emulation - and reported apart), the same including them (wall clock from the
start of ``fit()`` to the end of that epoch: start-up, placements and re-placements,
evaluation and checkpoints included; taken by a driver callback at each epoch's end) and
GPU-seconds to it (each epoch's training time x its emulated GPUs); the per-round ratios to
``static_small`` and their medians. The job uses ``JobConfig``'s defaults where the fields below
do not set them (e.g. the LR scaling rule, ``jabasray.adaptive.lr_scaling``).

    flock /tmp/jabasray-bench.lock python benchmarks/adaptive.py     # ~15 min on 2 cores
    python benchmarks/adaptive.py --seeds 0 --epochs 3 --variants jabas static_small

Writes ``<tmp>/jabasray_bench/adaptive.json`` (``--out``) and the per-epoch B_G trajectories of
the adaptive contenders (``--trajectories``; the forecaster's benchmark reads
``benchmarks/data/trajectories_jabas.json``). CPU only (the GPU actors are Ray actors emulating GPU types).
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from common import default_out, rotated, write_json

HERE = Path(__file__).resolve().parent
VARIANTS = ("static_small", "static_max", "adaptive_all", "jabas", "static_scaled")


def variant_job(name: str, base, small: int):
    if name == "static_small":
        return replace(base, adaptive=False, autoscale=False, initial_global_batch=small)
    if name == "static_max":
        return replace(base, adaptive=False, autoscale=False, initial_global_batch=base.max_global_batch)
    if name == "adaptive_all":
        return replace(base, adaptive=True, autoscale=False)
    if name == "static_scaled":
        return replace(base, adaptive=False, autoscale=True, initial_global_batch=small)
    return replace(base, adaptive=True, autoscale=True)


def time_to(epochs: list[dict], target: float, key: str, cumulative: bool = True) -> float | None:
    """``key`` summed over the epochs until the first epoch whose val accuracy >= target
    (``cumulative=False``: ``key`` of that epoch, for a clock that already counts from the
    start); None if no epoch reaches it."""
    total = 0.0
    for e in epochs:
        if e.get(key) is None:
            return None
        total = total + e[key] if cumulative else e[key]
        if e["val_accuracy"] is not None and e["val_accuracy"] >= target:
            return total
    return None


class EpochClock:
    """Driver callback: the wall clock (``time.perf_counter``) at each epoch's end and at each
    phase change (start-up steps, placements, re-placements), taken in the driver's process
    (the benchmark runs the driver in-process, ``driver="local"``)."""

    def __init__(self) -> None:
        self.epoch_end: dict[int, float] = {}
        self.phases: list[tuple[float, str]] = []

    def on_interval(self, driver, record) -> None:
        pass

    def on_event(self, driver, message) -> None:
        pass

    def on_epoch(self, driver, record) -> None:
        self.epoch_end[record.epoch] = time.perf_counter()

    def on_phase(self, driver, phase) -> None:
        self.phases.append((time.perf_counter(), phase))


def run_one(name: str, job, cluster, train, val, profiles, runs_dir: Path) -> dict:
    import shutil

    from jabasray.actors.driver import DriverOptions
    from jabasray.actors.driver_options import TRAINING_PHASE
    from jabasray.actors.trainer import JabasTrainer
    from jabasray.config import RunConfig
    from jabasray.models import DigitsCNN
    run_dir = runs_dir / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    load = os.getloadavg()
    clock = EpochClock()
    t = time.perf_counter()
    res = JabasTrainer(DigitsCNN, train, None, None, job, cluster=cluster,
                       run_config=RunConfig(str(runs_dir), name), val_dataset=val,
                       profiles=profiles, callbacks=[clock],
                       options=DriverOptions(emulation="wait", driver="local")).fit()
    total_wall = time.perf_counter() - t
    epochs = []
    for e in res.history.epochs:
        train_time = sum(r.time_s for r in res.history.intervals if r.epoch == e.epoch)
        end = clock.epoch_end.get(e.epoch)
        epochs.append({"epoch": e.epoch, "allocation": e.allocation, "num_gpus": len(e.gpu_types),
                       "trajectory": e.trajectory, "forecast": e.predicted_trajectory,
                       "val_accuracy": e.val_accuracy, "wall_s": e.time_s, "train_s": train_time,
                       "gpu_seconds_train": train_time * len(e.gpu_types),
                       # wall clock from the start of fit() to this epoch's end (start-up,
                       # re-placements, evaluation and checkpoints included)
                       "wall_clock_s": end - t if end is not None else None,
                       "throughput": e.throughput})
    # start-up: fit() until the first interval; then every later placement phase until training
    # resumed (re-placements by the auto-scaler)
    first = next((i for i, (_, phase) in enumerate(clock.phases) if phase == TRAINING_PHASE), None)
    startup = clock.phases[first][0] - t if first is not None else None
    replacement, begun = 0.0, None
    for when, phase in clock.phases[first + 1:] if first is not None else []:
        if phase != TRAINING_PHASE:
            begun = when if begun is None else begun
        elif begun is not None:
            replacement, begun = replacement + when - begun, None
    return {"job": job.to_dict(), "epochs": epochs, "events": res.history.events,
            "final_val_accuracy": res.val_accuracy, "total_wall_s": total_wall,
            "startup_s": startup, "replacement_s": replacement,
            "load_average_before": load, "load_average_after": os.getloadavg()}


def summarise(rounds: list[dict], target: float) -> dict:
    """Per round and contender: time to the target (training time; and wall clock from the
    start of fit(), start-up and re-placements included) and GPU-seconds to it; per-round
    ratios to static_small; medians over rounds (None where a contender missed the target)."""
    per = {}
    for metric, key, cumulative in (("time_to_target_s", "train_s", True),
                                    ("time_to_target_wall_s", "wall_clock_s", False),
                                    ("gpu_seconds_to_target", "gpu_seconds_train", True)):
        table = {}
        for name in VARIANTS:
            values, ratios = [], []
            for rd in rounds:
                r = rd["runs"].get(name)
                base = rd["runs"].get("static_small")
                if r is None:
                    continue
                v = time_to(r["epochs"], target, key, cumulative)
                b = time_to(base["epochs"], target, key, cumulative) if base is not None else None
                values.append(v)
                ratios.append(v / b if v is not None and b else None)
            if not values:
                continue
            reached = [v for v in values if v is not None]
            ok = [x for x in ratios if x is not None]
            table[name] = {"per_round": values, "ratio_per_round": ratios,
                           "reached": f"{len(reached)}/{len(values)}",
                           "median": statistics.median(reached) if len(reached) == len(values) else None,
                           "median_ratio": statistics.median(ok) if len(ok) == len(ratios) else None}
        per[metric] = table
    per["final_accuracy_difference_points"] = accuracy_differences(rounds)
    return per


def accuracy_differences(rounds: list[dict]) -> dict:
    """Per contender: final validation accuracy minus static_small's in the same round, in
    points (100 x the accuracy difference), per round and their median."""
    table = {}
    for name in VARIANTS:
        diffs = [100 * (rd["runs"][name]["final_val_accuracy"] - rd["runs"]["static_small"]["final_val_accuracy"])
                 for rd in rounds if name in rd["runs"] and "static_small" in rd["runs"]]
        if diffs:
            table[name] = {"per_round": diffs, "median": statistics.median(diffs)}
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one round per seed")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--small", type=int, default=64, help="static small B_G (= initial B_G)")
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--target", type=float, default=0.93, help="target validation accuracy")
    ap.add_argument("--gamma", type=float, default=None,
                    help="similarity threshold of the adaptive contenders (default: JobConfig's, "
                         "0.5; JABAS Table 4: 0.1 for ResNet-50, Faster-R-CNN and GNMT, 0.3 for "
                         "ViT, 0.5-0.9 for the LLMs)")
    ap.add_argument("--speeds", type=float, nargs=2, default=[0.25, 0.125], metavar=("FAST", "SLOW"),
                    help="emulated speeds of the 4 fast and 4 slow GPUs (sum <= host cores)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", type=Path, default=Path(default_out('adaptive.json')))
    ap.add_argument("--trajectories", type=Path, default=Path(default_out("trajectories_jabas.json")),
                    help="B_G trajectories of the adaptive runs (benchmarks/data/ holds the "
                         "forecaster benchmark's input; pass it there to refresh it)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import ray
    import torch

    from jabasray.actors.emulation import host_keeps_up
    from jabasray.actors.trainer import emulated_resources
    from jabasray.config import JobConfig
    from jabasray.data import load_digits_split
    from jabasray.models import DigitsCNN
    from jabasray.planners.perf_model import emulated_profiles
    from jabasray.profiler import profile_model
    from jabasray.types import ClusterSpec

    torch.set_num_threads(1)
    fast, slow = args.speeds
    cluster = ClusterSpec.emulated({"fast": (1, 4, fast), "slow": (1, 4, slow)})
    cpus = 2
    if not host_keeps_up([fast] * 4 + [slow] * 4, cpus):
        ap.error(f"--speeds must sum to <= {cpus} host cores over the 8 GPUs, got {4 * (fast + slow)}")
    train, val = load_digits_split()
    t0 = time.perf_counter()
    prof = profile_model(DigitsCNN, train, min_local_batch=8, max_local_batch=64, warmup=2, repeats=5,
                         cache_dir=HERE / "out" / ".profiles", gpu_type="cpu")
    prof = replace(prof, allreduce_inter=prof.allreduce_inter or prof.allreduce_intra)
    profiles = emulated_profiles(prof, {n.gpu_type: n.speed for n in cluster.nodes})
    print(f"profile: {time.perf_counter() - t0:.1f}s (cached in benchmarks/out/.profiles)", flush=True)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             resources=emulated_resources(cluster), runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    rounds = []
    runs_dir = HERE / "out" / "adaptive_runs"
    try:
        for k, seed in enumerate(args.seeds):
            base = JobConfig(epochs=args.epochs, lr=0.1,
                             initial_global_batch=args.small, min_global_batch=args.small,
                             max_global_batch=args.max_batch, min_local_batch=8, adapt_interval=5,
                             alpha=0.1, warmup_iterations=10, seed=seed,
                             **({} if args.gamma is None else {"gamma": args.gamma}))
            order = rotated(list(args.variants), k)
            runs = {}
            for name in order:
                r = run_one(name, variant_job(name, base, args.small), cluster, train, val,
                            profiles, runs_dir)
                runs[name] = r
                print(f"seed {seed} {name:13s} acc {[round(e['val_accuracy'], 3) for e in r['epochs']]} "
                      f"GPUs {[e['num_gpus'] for e in r['epochs']]} "
                      f"train {sum(e['train_s'] for e in r['epochs']):.1f}s "
                      f"({r['total_wall_s']:.0f}s wall: start-up {r['startup_s'] or 0:.0f}s, "
                      f"re-placements {r['replacement_s']:.0f}s; load {r['load_average_before'][0]:.1f})",
                      flush=True)
            rounds.append({"seed": seed, "order": order, "runs": runs})
    finally:
        ray.shutdown()

    summary = summarise(rounds, args.target)
    for name, d in summary["final_accuracy_difference_points"].items():
        print(f"  final accuracy - static_small's, points: {name:13s} "
              f"{' '.join(f'{x:+5.1f}' for x in d['per_round'])} | median {d['median']:+.1f}")
    for metric, table in summary.items():
        if metric == "final_accuracy_difference_points":
            continue
        print(f"\n{metric} (target {args.target}); per-round ratio to static_small")
        for name, s in table.items():
            vals = " ".join(f"{v:7.1f}" if v is not None else "    n/a" for v in s["per_round"])
            rat = " ".join(f"{x:5.2f}" if x is not None else "  n/a" for x in s["ratio_per_round"])
            med = f"{s['median_ratio']:.2f}" if s["median_ratio"] is not None else "n/a"
            print(f"  {name:13s} {vals} | ratios {rat} | median ratio {med} (reached {s['reached']})")
    doc = {"benchmark": "adaptive", "machine": f"{platform.platform()} ({os.cpu_count()}-core CPU, no GPU)",
           "emulation": "wait", "host_cpus": cpus, "cluster": cluster.to_dict(),
           "target_accuracy": args.target, "seeds": args.seeds, "summary": summary,
           "rounds": rounds}
    write_json(args.out, doc, indent=1, announce=False)
    runs = [{"variant": n, "seed": rd["seed"], "gamma": r["job"]["gamma"], "alpha": r["job"]["alpha"],
             "trajectories": [e["trajectory"] for e in r["epochs"]],
             "val_accuracy": [e["val_accuracy"] for e in r["epochs"]]}
            for rd in rounds for n, r in rd["runs"].items() if r["job"]["adaptive"]]
    if runs:
        write_json(args.trajectories, {"source": "benchmarks/adaptive.py", "model": "DigitsCNN",
                                       "dataset": "digits", "adapt_interval": 5,
                                       "runs": runs}, indent=1, announce=False)
    print(f"wrote {args.out}" + (f" and {args.trajectories}" if runs else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
