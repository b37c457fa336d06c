"""How long Tune-trial-like actors take to become ready when N of them start at once.

Every Tune trial is an actor whose class derives from Ray Tune's ``Trainable``, so each trial
process starts a Ray worker and imports Ray Tune before any of the trainable's own code runs.
A packed sweep admits many trials per device at once (``trials_per_device`` per device), so
this start-up is paid N times, on the same CPUs, and the processes share those CPUs fairly:
the first one is ready hardly earlier than the last. This script measures that alone: N actors
(each reserving ``num_cpus / N`` CPUs, as packed trials do) that import Ray Tune in their
constructor, created together; for each N, the time until the first, the median and the last
is ready. Rounds rotate the order of the N values; the table reports per-N medians over rounds.

    python benchmarks/trial_startup.py [--counts 2,8,16,24] [--rounds 2] [--out /tmp/x.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import default_out, positive_ints, rotated, write_json  # noqa: E402


def start_together(n: int, num_cpus: int) -> dict:
    """Start ``n`` actors at once on a fresh local Ray; seconds until each is ready."""
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=num_cpus / n)
        class TrialLike:
            def __init__(self) -> None:
                import ray.tune  # noqa: F401  (what unpickling a Trainable subclass imports)
                self.ready_at = time.time()

            def ready(self) -> float:
                return self.ready_at

        t0 = time.time()
        actors = [TrialLike.remote() for _ in range(n)]
        pending = [a.ready.remote() for a in actors]
        ready: list[float] = []
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
            ready.append(time.time() - t0)
        return {"n": n, "first_s": ready[0], "median_s": statistics.median(ready), "last_s": ready[-1]}
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="2,8,16,24", help="numbers of actors started together")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--out", default=default_out("trial_startup.json"))
    args = ap.parse_args(argv)
    counts = positive_ints(ap, "--counts", args.counts)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    load_start = os.getloadavg()
    runs = []
    for rnd in range(args.rounds):
        for n in rotated(counts, rnd):
            r = start_together(n, args.num_cpus) | {"round": rnd}
            runs.append(r)
            print(f"[round {rnd}] {n:3d} actors: first ready {r['first_s']:5.1f} s | median "
                  f"{r['median_s']:5.1f} s | last {r['last_s']:5.1f} s", flush=True)
    summary = {}
    for n in counts:
        mine = [r for r in runs if r["n"] == n]
        summary[n] = {k: statistics.median(r[k] for r in mine) for k in ("first_s", "median_s", "last_s")}
    print("\nmedian over rounds:\n| actors | first ready (s) | median (s) | last (s) |\n|---|---|---|---|")
    for n, s in summary.items():
        print(f"| {n} | {s['first_s']:.1f} | {s['median_s']:.1f} | {s['last_s']:.1f} |")
    write_json(args.out, {"machine": f"{platform.machine()} {os.cpu_count()}-core, Ray num_cpus={args.num_cpus}",
                          "args": vars(args), "load_avg_start": load_start, "runs": runs,
                          "summary": {str(n): s for n, s in summary.items()},
                          "load_avg_end": os.getloadavg()})


if __name__ == "__main__":
    main()
