"""How far the iteration-time model's predictions are from what ran, on the README's main command.

``jabasray train`` (the embedded job: digits CNN on the emulated default cluster) run as a user
runs it, ``--runs`` times, each in a fresh folder. From every run's ``metrics.json``: per
interval the relative error of the prediction, (predicted - measured) / measured, of the whole
interval and of each named term (steps, loader, similarity, read, call, configure:
``IntervalRecord.predicted_terms`` against ``measured_terms``); per epoch the error of the
training time against the sum of its intervals' predictions; per run the medians of the
absolute errors (the statistic the README reports) and of the signed ones (a bias shows
there), the load average before and after, and the measured host costs and emulation line
(the run's first event). The summary holds the median over runs of each run's median.

    python benchmarks/prediction_error.py [--runs 3] [--out /tmp/x.json] [-- extra train flags]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import default_out, write_json  # noqa: E402

from jabasray.planners.interval_model import TERMS  # noqa: E402


def rel(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured > 0 else None


def errors(metrics: dict) -> dict:
    """Per-interval, per-term and per-epoch relative errors of one run's ``metrics.json``."""
    intervals = metrics["intervals"]
    out: dict = {"interval": [], "epoch": [], "terms": {t: [] for t in TERMS}}
    for r in intervals:
        e = rel(r["predicted_time_s"], r["time_s"])
        if e is not None:
            out["interval"].append(e)
        for t in TERMS:
            p, m = r["predicted_terms"].get(t, 0.0), r["measured_terms"].get(t, 0.0)
            if m > 0 and p > 0:
                out["terms"][t].append(rel(p, m))
    for ep in metrics["epochs"]:
        e = rel(ep["predicted_train_time_s"] or 0.0, ep["train_time_s"])
        if e is not None:
            out["epoch"].append(e)
    return out


def medians(values: list[float]) -> dict:
    if not values:
        return {"abs": None, "signed": None, "n": 0}
    return {"abs": statistics.median(abs(v) for v in values), "signed": statistics.median(values),
            "n": len(values)}


def run_once(extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run(["jabasray", "train", "--no-progress", "--name", "bench",
                               "--storage-path", tmp, *extra], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"jabasray train failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        metrics = json.loads((Path(tmp) / "bench" / "metrics.json").read_text())
    errs = errors(metrics)
    return {"wall_s": wall, "load_before": load0, "load_after": os.getloadavg()[0],
            "events": metrics["events"][:1], "errors": errs,
            "interval": medians(errs["interval"]), "epoch": medians(errs["epoch"]),
            "terms": {t: medians(v) for t, v in errs["terms"].items()},
            "epoch_lines": [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=default_out("prediction_error.json"))
    ap.add_argument("extra", nargs="*", help="flags passed to jabasray train (after --)")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    runs = []
    for k in range(args.runs):
        r = run_once(args.extra)
        runs.append(r)
        print(f"run {k + 1}: interval median |error| {r['interval']['abs']:.1%} (signed "
              f"{r['interval']['signed']:+.1%}), epoch {r['epoch']['abs']:.1%} (signed "
              f"{r['epoch']['signed']:+.1%}); {r['wall_s']:.1f} s, load {r['load_before']:.2f} -> "
              f"{r['load_after']:.2f}")
        print("   terms: " + ", ".join(f"{t} {m['abs']:.0%}" for t, m in r["terms"].items() if m["n"]))
    summary = {"interval_abs": statistics.median(r["interval"]["abs"] for r in runs),
               "epoch_abs": statistics.median(r["epoch"]["abs"] for r in runs),
               "interval_signed": statistics.median(r["interval"]["signed"] for r in runs),
               "epoch_signed": statistics.median(r["epoch"]["signed"] for r in runs)}
    print(f"median over {len(runs)} runs: interval |error| {summary['interval_abs']:.1%}, "
          f"epoch |error| {summary['epoch_abs']:.1%}")
    write_json(args.out, {"machine": {"cpus": os.cpu_count(), "platform": sys.platform},
                          "command": ["jabasray", "train", *args.extra], "runs": runs,
                          "summary": summary})


if __name__ == "__main__":
    main()
