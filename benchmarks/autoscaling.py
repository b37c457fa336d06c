"""The README's main job on an autoscaling cluster against a fixed cluster holding every node.

Both contenders are Ray's fake multi-node provider under the real autoscaler on this machine
(the cluster of ``tests/test_cluster_provision.py``: a head with 2 CPUs and no GPU), with the
main job's two GPU types as worker node types - ``fast``: one node of 4 emulated GPUs at speed
0.25, ``slow``: one of 4 at 0.125 (``jabasray train``'s default cluster):

* ``autoscaling``: no worker node at the start (``min_workers: 0``, an idle timeout of
  ``--idle-timeout-s``); the job is given the node types (a cluster file with ``node_types:``),
  asks Ray's autoscaler for the nodes of the allocation it chooses, and clears the request at
  its end, after which the autoscaler lets the nodes go;
* ``fixed``: both nodes launched before the job starts and kept (``min_workers: 1``); the job is
  given the same file and finds both nodes live.

Each run is ``jabasray train --no-progress --ray-address <the cluster>`` (the main job as a user
runs it), a fresh cluster per run. Paired rounds, the order rotated every round (A B, B A, ...);
per run: seconds to finish (the command's wall time), seconds until the first epoch line that
reports a validation accuracy of at least ``--target``, and the GPU-hours held - the GPUs of the
live worker nodes, read every 0.5 s from the command's start to its end, and for the
autoscaling cluster on until its nodes are gone (they are paid until then) - beside the
GPU-hours the job itself reports: over its whole run (``metrics.json``'s ``held``: from the
driver's start to its end, and the part outside the epochs) and inside its epochs
(``held_gpu_seconds``), and the GPUs its actors used (``gpu_seconds``). What the watch saw
over the job's own run (``gpu_hours_held_during_run``, the same span as the job's figure) and
after it until the nodes went (``gpu_hours_held_after_run``: the autoscaler's idle timeout,
which the job cannot count) split the gap between the two. Per-round ratios fixed /
autoscaling and their medians.

    python benchmarks/autoscaling.py [--rounds 2] [--epochs N] [--target 0.97] [--out /tmp/x.json]

The JSON goes outside the repository by default (``benchmarks/common.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))   # the fake autoscaling cluster of the tests

from autoscaling_cluster import FakeAutoscalingCluster  # noqa: E402
from common import default_out, rotated, write_json  # noqa: E402

EPOCH_LINE = re.compile(r"^epoch (\d+): .*val acc ([0-9.]+)")
SPEEDS = {"fast": 0.25, "slow": 0.125}   # jabasray train's default cluster
GPUS_PER_NODE = 4
CONTENDERS = ("autoscaling", "fixed")


def worker_types(fixed: bool) -> dict:
    return {t: {"resources": {"CPU": 1, f"gpu_{t}": GPUS_PER_NODE}, "node_config": {},
                "min_workers": 1 if fixed else 0, "max_workers": 1} for t in SPEEDS}


def cluster_file(folder: str, launch_s: float) -> str:
    path = os.path.join(folder, "cluster.json")
    with open(path, "w") as f:
        json.dump({"node_types": [{"name": t, "gpu_type": t, "num_gpus": GPUS_PER_NODE, "max_workers": 1,
                                   "speed": s, "launch_s": launch_s} for t, s in SPEEDS.items()]}, f)
    return path


class HeldWatch:
    """The GPUs of the cluster's live nodes, read every ``period_s`` in a thread: ``samples``
    of ``(perf_counter time, GPUs)``; :meth:`gpu_seconds` integrates them (constant between
    reads)."""

    def __init__(self, ray, period_s: float = 0.5) -> None:
        self.ray, self.period_s = ray, period_s
        self.samples: list[tuple[float, int]] = []
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def read(self) -> None:
        gpus = sum(v for n in self.ray.nodes() if n["Alive"]
                   for k, v in n["Resources"].items() if k.startswith("gpu_"))
        self.samples.append((time.perf_counter(), int(gpus)))

    def loop(self) -> None:
        while not self.stop_flag.wait(self.period_s):
            try:
                self.read()
            except Exception:  # noqa: BLE001 - the cluster went (a failed run): stop reading
                return

    def start(self) -> "HeldWatch":
        self.read()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join()
        self.read()

    def gpus(self) -> int:
        return self.samples[-1][1]

    def gpu_seconds(self, t_from: float, t_to: float) -> float:
        total, pts = 0.0, list(self.samples)
        for (t, g), (t_next, _) in zip(pts, pts[1:] + [(t_to, 0)]):
            lo, hi = max(t, t_from), min(t_next, t_to)
            if hi > lo:
                total += g * (hi - lo)
        return total


def run_once(name: str, args: argparse.Namespace) -> dict:
    """One ``jabasray train`` on a fresh cluster of contender ``name``; what it took and held."""
    import ray

    fixed = name == "fixed"
    cluster = FakeAutoscalingCluster(worker_types(fixed), idle_timeout_s=args.idle_timeout_s)
    # this checkout's jabasray in every process of the cluster (the driver actor, the GPU
    # actors) as in the command, not an installed one
    root = os.path.abspath(os.path.join(HERE, ".."))
    cluster.env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [cluster.env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cluster.start()
            os.environ.update({"RAY_AUTH_MODE": "disabled"})   # the cluster's own mode
            ray.init(address=cluster.address, log_to_driver=False)
            t_ready = time.perf_counter()
            while fixed and sum(1 for n in ray.nodes() if n["Alive"]) < 1 + len(SPEEDS):
                if time.perf_counter() - t_ready > args.launch_wait_s:
                    raise RuntimeError(f"fixed cluster: its {len(SPEEDS)} nodes did not come up "
                                       f"within {args.launch_wait_s:.0f} s")
                time.sleep(0.5)
            ready_s = time.perf_counter() - t_ready
            cmd = [sys.executable, "-m", "jabasray.cli", "train", "--no-progress", "--name", "bench", "--ray-address",
                   cluster.address, "--cluster", cluster_file(tmp, args.launch_s)]
            if args.epochs is not None:
                cmd += ["--epochs", str(args.epochs)]
            load = os.getloadavg()[0]
            watch = HeldWatch(ray).start()
            t0 = time.perf_counter()
            unix_to_perf = t0 - time.time()   # the job's unix times on the watch's clock
            proc = subprocess.Popen(cmd, cwd=tmp, env=cluster.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            to_target, epoch_at = None, []
            for line in proc.stdout:
                m = EPOCH_LINE.match(line)
                if m:
                    epoch_at.append(time.perf_counter() - t0)
                    if to_target is None and float(m.group(2)) >= args.target:
                        to_target = epoch_at[-1]
            err = proc.stderr.read()
            if proc.wait() != 0:
                raise RuntimeError(f"{name}: {' '.join(cmd)} exited with {proc.returncode}: {err[-2000:]}")
            finish = time.perf_counter() - t0
            release_s = None
            if not fixed:   # paid until the autoscaler lets the nodes go
                while watch.gpus() and time.perf_counter() - t0 - finish < args.release_wait_s:
                    time.sleep(0.5)
                release_s = time.perf_counter() - t0 - finish if not watch.gpus() else None
            watch.stop()
            held_job_s = watch.gpu_seconds(t0, t0 + finish)
            t_end = time.perf_counter() if not fixed else t0 + finish   # what "held" counts to
            held = watch.gpu_seconds(t0, t_end)
            metrics = json.loads((Path(tmp) / "jabasray_runs" / "bench" / "metrics.json").read_text())
            run = metrics.get("held") or {}
            if run:   # the job's own run, on the watch's clock
                run_from, run_to = run["start_s"] + unix_to_perf, run["end_s"] + unix_to_perf
                seen_run, seen_after = watch.gpu_seconds(run_from, run_to), watch.gpu_seconds(run_to, t_end)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            cluster.stop()
    epochs = metrics["epochs"]
    return {"finish_s": finish, "to_target_s": to_target, "epoch_lines_s": epoch_at,
            "gpu_hours_held": held / 3600, "gpu_hours_held_during_job": held_job_s / 3600,
            "gpu_hours_reported_held": sum(e.get("held_gpu_seconds") or 0.0 for e in epochs) / 3600,
            "gpu_hours_reported_run": run["total"] / 3600 if run else None,
            "gpu_hours_reported_outside_epochs": (run["total"] - run["inside_epochs"]) / 3600 if run else None,
            "reported_launched_gpus_at_end": run.get("launched_gpus_at_end"),
            "gpu_hours_held_during_run": seen_run / 3600 if run else None,
            "gpu_hours_held_after_run": seen_after / 3600 if run else None,
            "gpu_hours_used": sum(e["gpu_seconds"] for e in epochs) / 3600,
            "release_s": release_s, "fixed_ready_s": ready_s if fixed else None,
            "allocations": [e["allocation"] for e in epochs],
            "final_val_accuracy": epochs[-1]["val_accuracy"],
            "load_start": load, "load_end": os.getloadavg()[0]}


def hours(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=None, help="default: the command's (8)")
    ap.add_argument("--target", type=float, default=0.97, help="validation accuracy of 'a result'")
    ap.add_argument("--launch-s", type=float, default=10.0, help="the node types' launch_s (the job's charge)")
    ap.add_argument("--idle-timeout-s", type=float, default=10.0, help="the autoscaler's idle timeout")
    ap.add_argument("--launch-wait-s", type=float, default=180.0, help="the fixed cluster's nodes must be up by then")
    ap.add_argument("--release-wait-s", type=float, default=120.0, help="the autoscaling cluster's nodes must be gone by then")
    ap.add_argument("--out", default=default_out("autoscaling.json"))
    args = ap.parse_args(argv)
    for flag, value, low in (("--rounds", args.rounds, 1), ("--epochs", args.epochs or 1, 1)):
        if value < low:
            ap.error(f"{flag} must be >= {low}, got {value}")
    if not 0 < args.target <= 1:
        ap.error(f"--target must be in (0, 1], got {args.target}")
    rounds = []
    for r in range(args.rounds):
        runs = {}
        for name in rotated(list(CONTENDERS), r):
            runs[name] = run_once(name, args)
            m = runs[name]
            print(f"round {r + 1} {name}: finish {m['finish_s']:.1f}s, to target "
                  f"{m['to_target_s'] if m['to_target_s'] is None else round(m['to_target_s'], 1)}s, "
                  f"held {m['gpu_hours_held']:.4f} GPU-h (job reports {hours(m['gpu_hours_reported_run'])} "
                  f"over its run, {hours(m['gpu_hours_reported_outside_epochs'])} of it outside the epochs, "
                  f"{m['gpu_hours_reported_held']:.4f} inside; seen {hours(m['gpu_hours_held_during_run'])} "
                  f"during its run, {hours(m['gpu_hours_held_after_run'])} after it; "
                  f"used {m['gpu_hours_used']:.4f}), allocations {m['allocations']}", flush=True)
        a, f = runs["autoscaling"], runs["fixed"]
        rounds.append({"order": rotated(list(CONTENDERS), r), "runs": runs,
                       "fixed_over_autoscaling": {
                           "finish": ratio(f["finish_s"], a["finish_s"]),
                           "to_target": ratio(f["to_target_s"], a["to_target_s"]),
                           "gpu_hours_held": ratio(f["gpu_hours_held"], a["gpu_hours_held"])}})
    medians = {}
    for key in ("finish", "to_target", "gpu_hours_held"):
        vals = [x["fixed_over_autoscaling"][key] for x in rounds if x["fixed_over_autoscaling"][key] is not None]
        medians[key] = statistics.median(vals) if vals else None
    print("median fixed / autoscaling: " + ", ".join(
        f"{k} {v:.2f}" if v is not None else f"{k} n/a" for k, v in medians.items()))
    write_json(args.out, {"args": vars(args), "rounds": rounds, "median_fixed_over_autoscaling": medians})


if __name__ == "__main__":
    main()
