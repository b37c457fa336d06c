"""Profiling the default job's CNN: the earlier profiler ("old", which timed every n_vsw) vs now ("new"), side by side.

Both contenders profile :class:`jabasray.models.DigitsCNN` on the digits data exactly as the
driver asks for it (min B_L 8, B_L up to 64, n_max up to 4, gloo all-reduce fit), with an empty
cache each time:

* old: the profiler of commit 5e4ce8c (``git show``; relative imports made absolute), as the
  driver called it then: warmup 2, repeats 5, median, every n = 1..4 timed, all-reduce measured;
* new: :func:`jabasray.profiler.cluster.cluster_profiles`'s settings: warmup 1, repeats 3,
  trimmed statistic, only n = 1 and n_max timed, monotonicity re-measurement, the all-reduce
  fit cached per host ("new" = a fresh cache, all-reduce measured; "new-warm" = the host's
  all-reduce fit already cached, as for every model after the first).

Rounds are paired (old, new, new-warm, old, new, new-warm, ...); per round we report the time
of each and the ratios old/new and old/new-warm, and their medians. Repeat-to-repeat spread:
for every contender, the relative spread (max - min) / median over rounds of each profiled
compute time t(1) at every B_L, and the number of non-monotone B_L points in its profiles.

Usage: python benchmarks/profiling.py [--rounds 3] [--out /tmp/x.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from common import default_out, write_json

ROOT = Path(__file__).resolve().parents[1]
OLD_REV = "5e4ce8c"


def old_profiler() -> types.ModuleType:
    src = subprocess.run(["git", "show", f"{OLD_REV}:jabasray/profiler/measure.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    src = (src.replace("from ..validation", "from jabasray.validation")
              .replace("from .profile import", "from jabasray.profiles import")
              .replace("from ..engine import", "from jabasray.engine import"))
    mod = types.ModuleType("legacy_measure")
    mod.__file__ = "legacy_measure.py"
    exec(compile(src, "legacy_measure.py", "exec"), mod.__dict__)
    return mod


def run_old(mod, data) -> tuple[float, object]:
    from jabasray.models import DigitsCNN
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        prof = mod.profile_model(DigitsCNN, data, device="cpu", gpu_type="cpu", min_local_batch=8,
                                 weight_sync="auto", bucket_cap_mb=25.0, cache_dir=tmp, warmup=2, repeats=5)
    return time.perf_counter() - t, prof


def run_new(data, allreduce_cache: str | None) -> tuple[float, object]:
    from jabasray.models import DigitsCNN
    from jabasray.profiler.measure import profile_model
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if allreduce_cache:      # only the host's all-reduce fit is already there
            for f in Path(allreduce_cache).glob("allreduce-*.json"):
                (Path(tmp) / f.name).write_text(f.read_text())
        prof = profile_model(DigitsCNN, data, device="cpu", gpu_type="cpu", min_local_batch=8,
                             weight_sync="auto", bucket_cap_mb=25.0, cache_dir=tmp, warmup=1, repeats=3,
                             statistic="trimmed")
        if allreduce_cache is not None and not any(Path(allreduce_cache).glob("allreduce-*.json")):
            for f in Path(tmp).glob("allreduce-*.json"):
                (Path(allreduce_cache) / f.name).write_text(f.read_text())
    return time.perf_counter() - t, prof


def spread(profiles: list) -> dict:
    from jabasray.profiler.measure import monotone_violations
    t1 = [[b.compute_time_1 for b in p.batches] for p in profiles]
    per_bl = [(max(col) - min(col)) / statistics.median(col) for col in zip(*t1)]
    return {"t1_ms": [[round(x * 1e3, 3) for x in row] for row in t1],
            "relative_spread_per_BL": [round(x, 3) for x in per_bl],
            "median_relative_spread": round(statistics.median(per_bl), 3),
            "max_relative_spread": round(max(per_bl), 3),
            "non_monotone_points": sum(len(monotone_violations(row, 0.0)) for row in t1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=default_out('profiling.json'))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from jabasray.data import load_digits_split
    data = load_digits_split()[0]
    old = old_profiler()
    warm_cache = tempfile.mkdtemp(prefix="jabas-allreduce-cache-")
    run_new(data, warm_cache)            # fills the host all-reduce cache for new-warm (not timed)
    rounds, profs = [], {"old": [], "new": [], "new-warm": []}
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        t_old, p_old = run_old(old, data)
        t_new, p_new = run_new(data, None)
        t_warm, p_warm = run_new(data, warm_cache)
        profs["old"].append(p_old)
        profs["new"].append(p_new)
        profs["new-warm"].append(p_warm)
        rounds.append({"round": r, "load_avg_1min": load, "old_s": t_old, "new_s": t_new, "new_warm_s": t_warm,
                       "old_over_new": t_old / t_new, "old_over_new_warm": t_old / t_warm})
        print(f"round {r}: old {t_old:.1f}s  new {t_new:.1f}s  new-warm {t_warm:.1f}s  "
              f"old/new {t_old / t_new:.2f}  old/new-warm {t_old / t_warm:.2f}  (load {load:.1f})", flush=True)
    doc = {"machine": f"{os.cpu_count()}-core CPU dev machine, shared", "torch": torch.__version__,
           "rounds": rounds,
           "median_old_s": statistics.median(r["old_s"] for r in rounds),
           "median_new_s": statistics.median(r["new_s"] for r in rounds),
           "median_new_warm_s": statistics.median(r["new_warm_s"] for r in rounds),
           "median_old_over_new": statistics.median(r["old_over_new"] for r in rounds),
           "median_old_over_new_warm": statistics.median(r["old_over_new_warm"] for r in rounds),
           "load_avg_end": os.getloadavg(),
           "spread": {k: spread(v) for k, v in profs.items()}}
    print({k: v for k, v in doc.items() if k.startswith("median")})
    for k, v in doc["spread"].items():
        print(f"{k}: median relative spread of t(1) {v['median_relative_spread']}, max {v['max_relative_spread']}, "
              f"non-monotone points {v['non_monotone_points']}")
    write_json(args.out, doc)


if __name__ == "__main__":
    sys.exit(main())
