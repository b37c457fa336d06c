"""The auto-scaler with and without the re-placement charge, on the README's main command.

``jabasray train`` (the embedded job: digits CNN on the emulated default cluster) run as a user
runs it, once with ``--replacement-cost-s 0`` (the JABAS paper's rule: every epoch moves to the
allocation of least predicted epoch time, whatever re-placing the actors costs) and once with
the default (a move is charged what the last placement of the actors took, so the job moves
only when the next epoch repays it). Paired rounds, the order rotated every round; per run:
seconds to finish (the command's wall time), seconds until the first epoch line that reports
a validation accuracy of at least ``--target`` (time to a result, start-up included), the
re-placements and the moves the charge declined (the run's events), GPU-seconds, the final
accuracy and the load average. Per-round ratios paper / charged (> 1: the charge is faster)
and their medians.

    python benchmarks/replacement_cost.py [--rounds 3] [--target 0.97] [--out /tmp/x.json]
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
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import default_out, rotated, write_json  # noqa: E402

CONTENDERS = {"paper": ["--replacement-cost-s", "0"], "charged": []}
EPOCH_LINE = re.compile(r"^epoch (\d+): .*val acc ([0-9.]+)")


def run_once(extra: list[str], target: float, epochs: int | None) -> dict:
    """One ``jabasray train --no-progress`` in a fresh folder; what it took and did."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["jabasray", "train", "--no-progress", "--name", "bench", *extra]
        if epochs is not None:
            cmd += ["--epochs", str(epochs)]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        to_target = None
        epoch_at = []
        for line in proc.stdout:
            m = EPOCH_LINE.match(line)
            if m:
                epoch_at.append(time.perf_counter() - t0)
                if to_target is None and float(m.group(2)) >= target:
                    to_target = epoch_at[-1]
        if proc.wait() != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
        finish = time.perf_counter() - t0
        metrics = json.loads((Path(tmp) / "jabasray_runs" / "bench" / "metrics.json").read_text())
    epochs_ = metrics["epochs"]
    return {"finish_s": finish, "to_target_s": to_target, "epoch_lines_s": epoch_at,
            "replacements": sum(bool(e["replaced"]) for e in epochs_),
            "declined_moves": sum("would not repay" in ev for ev in metrics["events"]),
            "allocations": [e["allocation"] for e in epochs_],
            "gpu_seconds": sum(e["gpu_seconds"] for e in epochs_),
            "final_val_accuracy": epochs_[-1]["val_accuracy"],
            "load_start": load, "load_end": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.97, help="validation accuracy of 'a result'")
    ap.add_argument("--epochs", type=int, default=None, help="default: the command's (8)")
    ap.add_argument("--out", default=default_out("replacement_cost.json"))
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not 0 < args.target <= 1:
        ap.error(f"--target must be in (0, 1], got {args.target}")
    names = list(CONTENDERS)
    rounds = []
    for r in range(args.rounds):
        runs = {}
        for name in rotated(names, r):
            runs[name] = run_once(CONTENDERS[name], args.target, args.epochs)
            res = runs[name]
            print(f"round {r} {name:8s} finish {res['finish_s']:6.1f} s, to {args.target}: "
                  f"{res['to_target_s'] if res['to_target_s'] is None else round(res['to_target_s'], 1)} s, "
                  f"re-placements {res['replacements']}, declined {res['declined_moves']}, "
                  f"GPU-s {res['gpu_seconds']:.1f}, acc {res['final_val_accuracy']:.4f}, "
                  f"load {res['load_start']:.1f}-{res['load_end']:.1f}", flush=True)
        rounds.append({"round": r, "order": rotated(names, r), "runs": runs})
        write_json(args.out, {"machine": {"cpus": os.cpu_count()}, "argv": sys.argv[1:], "rounds": rounds},
                   announce=False)

    def ratios(key: str) -> list[float]:
        return [rd["runs"]["paper"][key] / rd["runs"]["charged"][key] for rd in rounds
                if rd["runs"]["paper"][key] and rd["runs"]["charged"][key]]
    summary = {k: {"ratios": ratios(k), "median": statistics.median(ratios(k)) if ratios(k) else None}
               for k in ("finish_s", "to_target_s", "gpu_seconds")}
    for k, v in summary.items():
        print(f"paper / charged {k}: {', '.join(f'{x:.2f}' for x in v['ratios'])} "
              f"(median {v['median']:.2f})" if v["median"] is not None else f"{k}: no pairs")
    write_json(args.out, {"machine": {"cpus": os.cpu_count()}, "argv": sys.argv[1:], "rounds": rounds,
                          "summary": summary})


if __name__ == "__main__":
    main()
