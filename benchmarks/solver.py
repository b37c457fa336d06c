"""Configuration solver speed: direct Alg. 1 reference vs our exact solver, in one run.

Instance (the brief's target): 8 GPUs per group H (8 different GPU types, so no sharing of
per-type tables), 16 local batch sizes (min B_L 8 .. 128), B_G chosen so that M = 2592 at
min B_L (the paper reports 27.58 s for M = 2592). The model is ``PerfModel`` over synthetic
profiles (``synthetic_profile``) with different speeds.

The reference (``solve_configuration_reference``: plain Python, O(L M^2 N_H)) is timed once at
the full M if a small-M probe extrapolates (x M^2) to under ``--reference-budget`` seconds,
otherwise at the probe's M only and extrapolated (reported as such). Both must find plans of
the same throughput (checked). Writes <tmp>/jabasray_bench/solver.json.

    python benchmarks/solver.py [--workers 2592] [--gpus 8] [--batches 16] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from common import default_out, write_json
from jabasray.planners.config_solver import solve_configuration, solve_configuration_reference
from jabasray.planners.perf_model import PerfModel
from jabasray.profiles import synthetic_profile


def build(gpus: int, batches: int, min_bl: int) -> tuple[PerfModel, list[str]]:
    profiles = {}
    for i in range(gpus):
        p = synthetic_profile(f"g{i}", min_local_batch=min_bl, num_batches=batches,
                              time_per_sample=1e-3 / (1 + 0.35 * i), fixed_time=2e-3 * (1 + 0.1 * i),
                              max_num_vsw=8, vsw_exponent=0.6 + 0.03 * i)
        profiles[p.gpu_type] = p
    return PerfModel(profiles, num_gpus=2 * gpus, multi_node=True), list(profiles)


class ScalarOnly:
    """The same model without the vectorised ``iteration_times`` (the bare solver contract)."""

    def __init__(self, model: PerfModel) -> None:
        self._m = model

    def iteration_time(self, gpu, local_batch, num_vsw, num_ga):
        return self._m.iteration_time(gpu, local_batch, num_vsw, num_ga)

    def max_local_batch(self, gpu):
        return self._m.max_local_batch(gpu)

    def max_num_vsw(self, gpu, local_batch):
        return self._m.max_num_vsw(gpu, local_batch)


def timed(fn, repeats: int) -> tuple[float, object]:
    out, samples = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2592, help="M at min B_L")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per group H")
    ap.add_argument("--batches", type=int, default=16, help="local batch sizes")
    ap.add_argument("--min-local-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reference-budget", type=float, default=60.0,
                    help="run the reference at full M only if extrapolated to take less (s)")
    ap.add_argument("--out", default=default_out('solver.json'))
    args = ap.parse_args()

    min_bl = args.min_local_batch
    model, gpus = build(args.gpus, args.batches, min_bl)
    global_batch = 2 * args.workers * min_bl
    # fresh model per call so the per-(gpu, B_L, n) memo of PerfModel does not help later runs
    fresh = lambda: model.with_profiles(model.profiles)  # noqa: E731
    t_fast, plan = timed(lambda: solve_configuration(global_batch, gpus, fresh(), min_bl), args.repeats)
    print(f"instance: M={args.workers} at B_L={min_bl}, N_H={args.gpus}, L={args.batches}, B_G={global_batch}")
    print(f"ours:      {t_fast * 1e3:9.2f} ms (median of {args.repeats})  -> B_L={plan.local_batch_size}, "
          f"B_G*={plan.global_batch_size}, t={plan.iteration_time * 1e3:.3f} ms")

    t_scalar, plan_s = timed(lambda: solve_configuration(global_batch, gpus, ScalarOnly(fresh()), min_bl), 1)
    assert abs(plan_s.throughput - plan.throughput) <= 1e-9 * plan.throughput
    print(f"ours, scalar iteration_time only (bare contract): {t_scalar * 1e3:9.2f} ms")

    probe_m = min(args.workers, 324)
    probe_bg = 2 * probe_m * min_bl
    t_probe, ref_probe = timed(lambda: solve_configuration_reference(probe_bg, gpus, fresh(), min_bl), 1)
    fast_probe = solve_configuration(probe_bg, gpus, fresh(), min_bl)
    assert abs(ref_probe.throughput - fast_probe.throughput) <= 1e-9 * fast_probe.throughput
    estimate = t_probe * (args.workers / probe_m) ** 2
    measured_full = estimate < args.reference_budget
    if measured_full:
        t_ref, ref = timed(lambda: solve_configuration_reference(global_batch, gpus, fresh(), min_bl), 1)
        assert abs(ref.throughput - plan.throughput) <= 1e-9 * plan.throughput, (ref, plan)
        how = "measured at full M"
    else:
        t_ref, how = estimate, f"extrapolated (x M^2) from M={probe_m} ({t_probe:.2f} s)"
    print(f"reference: {t_ref * 1e3:9.2f} ms ({how}; same throughput: yes)")
    print(f"speed-up:  {t_ref / t_fast:9.1f} x    (paper: 27.58 s for M = 2592; goal < 0.2 s)")
    result = {
        "machine": f"{platform.processor() or platform.machine()} ({platform.node()}), 2-core CPU dev machine, no GPU",
        "M": args.workers, "N_H": args.gpus, "L": args.batches, "global_batch": global_batch,
        "ours_s": t_fast, "ours_scalar_model_s": t_scalar, "reference_s": t_ref, "reference_how": how, "speedup": t_ref / t_fast,
        "reference_probe": {"M": probe_m, "seconds": t_probe},
        "plan": plan.to_dict(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
