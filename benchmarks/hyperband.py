"""Packed Hyperband vs Ray Tune's own HyperBandScheduler (Pack paper, section 5.4, Table 4).

Search space: the paper's Table 3 (batch size 20..70, optimizer Adam/SGD/Adagrad/Momentum,
learning rate 1e-6..1e-1, activation Sigmoid/LeakyReLU/Tanh/ReLU) over an MLP-3 on
scikit-learn's digits; R = 81, eta = 3 (the paper's setting); 1 resource unit =
``--steps-per-unit`` mini-batch steps. Both searches get the SAME 143 configurations (the ones
packed Hyperband samples for its five brackets), read the same shared input stream and start
from the same initial weights, so they differ only in how they are scheduled:

* ``packed``: :class:`jabasray.tuner.PackedHyperbandTuner` (kNN pack_opt under
  ``--memory-budget`` bytes per device; one Tune trial per pack, one CPU each); its wall-clock
  is reported without and with building the per-configuration ResultGrid (built directly
  from the recorded results, no second Tune run);
* ``ray_hyperband``: ``tune.Tuner`` with ``HyperBandScheduler(max_t=81, reduction_factor=3)``
  and one ordinary trial per configuration (one CPU each), checkpoints at the rung boundaries.

Both read the digits data from Ray's object store (``tune.with_parameters``), loaded once by
the driver; neither rebuilds it per trial process.

Extra packed variants (``--methods knn,random,batch_size``) reproduce the paper's baselines.
A tiny warm-up search runs first; then ``--repeats`` rounds alternate the order of the variants
and the best (minimum) wall time of each counts (the machine may be shared).
Runs its own local Ray with ``num_cpus=2``; prints ratios, writes benchmarks/out/hyperband.json.

    python benchmarks/hyperband.py [--steps-per-unit 2] [--memory-budget 2.5e6] [--methods knn]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--R", type=int, default=81)
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--steps-per-unit", type=int, default=2)
    ap.add_argument("--memory-budget", type=float, default=2.5e6, help="bytes per device for pack_opt")
    ap.add_argument("--methods", default="knn", help="comma list of knn,random,batch_size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="alternating repeats; the best wall time counts")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "hyperband.json"))
    args = ap.parse_args(argv)

    import ray
    from ray import tune
    from ray.tune.schedulers import HyperBandScheduler
    from ray.tune.search import BasicVariantGenerator

    from jabasray.tuner import HyperbandConfig, PackedHyperbandTuner, make_trainable
    from jabasray.tuner.digits import TABLE3_PARAM_VALUES, digits_mlp_spec

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    storage = tempfile.mkdtemp(prefix="jabasray_hb_bench_")
    spec = digits_mlp_spec(steps_per_unit=args.steps_per_unit, seed=args.seed)
    param_space = {k: tune.choice(v) for k, v in TABLE3_PARAM_VALUES.items()}
    out: dict = {"machine": f"{platform.machine()} {os.cpu_count()}-core CPU, no GPU, Ray num_cpus={args.num_cpus}",
                 "args": vars(args), "packed": {}}
    configs = None
    data = spec.data_fn()              # the baseline's copy; the packed tuner caches its own

    def run_packed(method: str, rep: int) -> dict:
        tuner = PackedHyperbandTuner(
            spec, param_space=param_space,
            hyperband=HyperbandConfig(R=args.R, eta=args.eta, memory_budget=args.memory_budget,
                                      pack_method=method, seed=args.seed),
            run_config=tune.RunConfig(name=f"packed_{method}_{rep}", storage_path=storage))
        t0 = time.perf_counter()
        res = tuner.search()
        t_search = time.perf_counter() - t0
        grid = tuner._result_grid(res)                  # what tuner.fit() returns
        t_total = time.perf_counter() - t0
        best = grid.get_best_result()
        sizes = [len(p["members"]) for p in res.packs]
        pack_df = tuner.packs_grid.get_dataframe()
        units = sum(max(h["resource"] for h in r.history) for r in res.records if r.history)
        return {"search_s": t_search, "with_result_grid_s": t_total, "num_trials": len(sizes),
                "units_trained": units, "sum_pack_train_time_s": float(pack_df["pack_train_time_s"].sum()),
                "sum_pack_setup_s": float(pack_df["pack_setup_s"].sum()),
                "sum_trial_time_s": float(pack_df["time_total_s"].sum()),
                "mean_pack_size": sum(sizes) / len(sizes), "max_pack_size": max(sizes),
                "best_accuracy": best.metrics["accuracy"],
                "best_config": {k: best.config[k] for k in TABLE3_PARAM_VALUES}, "rows": len(grid),
                "configs": [r.config for r in res.records]}

    def run_baseline(pts: list, rep: int) -> dict:
        # evaluate/report/checkpoint only at Hyperband's rung boundaries (powers of eta), as
        # the packed trials do; HyperBandScheduler then runs on time_attr="units"
        rungs = [args.eta ** i for i in range(0, 20) if args.eta ** i <= args.R]
        trainable = make_trainable(spec, stream_batch=max(TABLE3_PARAM_VALUES["batch_size"]),
                                   max_units=args.R, checkpoint_units=rungs, report_units=rungs)
        t0 = time.perf_counter()
        grid = tune.Tuner(
            tune.with_resources(tune.with_parameters(trainable, data=data), {"cpu": 1}),
            param_space=param_space,
            tune_config=tune.TuneConfig(
                metric="accuracy", mode="max", num_samples=len(pts), reuse_actors=True,
                search_alg=BasicVariantGenerator(points_to_evaluate=pts),
                scheduler=HyperBandScheduler(time_attr="units", max_t=args.R, reduction_factor=args.eta)),
            run_config=tune.RunConfig(name=f"ray_hyperband_{rep}", storage_path=storage, verbose=0)).fit()
        wall = time.perf_counter() - t0
        best = grid.get_best_result()
        return {"wall_s": wall, "num_trials": len(grid), "errors": grid.num_errors,
                "units_trained": sum(int(r.metrics.get("units", 0)) for r in grid),
                "sum_trial_time_s": sum(float(r.metrics.get("time_total_s", 0.0)) for r in grid),
                "best_accuracy": best.metrics["accuracy"],
                "best_config": {k: best.config[k] for k in TABLE3_PARAM_VALUES}}

    def keep_min(slot: dict, key: str, run: dict, time_key: str) -> None:
        runs = slot.setdefault(key + "_runs", [])
        runs.append(run[time_key])
        if key not in slot or run[time_key] < slot[key][time_key]:
            slot[key] = run

    def baseline(rep: int) -> None:
        r = run_baseline(configs, rep)
        keep_min(base, "ray_hyperband", r, "wall_s")
        print(f"[rep {rep}] ray HyperBandScheduler: {r['wall_s']:.1f} s, {r['num_trials']} trials, "
              f"best acc {r['best_accuracy']:.4f} {r['best_config']}", flush=True)

    packed: dict = {}
    base: dict = {}
    try:
        # warm-up: a tiny packed search so that every variant finds warm Ray workers
        PackedHyperbandTuner(spec, param_space=param_space,
                             hyperband=HyperbandConfig(R=3, eta=args.eta, memory_budget=args.memory_budget),
                             run_config=tune.RunConfig(name="warmup", storage_path=storage)).search()
        methods = [m for m in args.methods.split(",") if m]
        for rep in range(args.repeats):
            order = ["baseline"] + methods if rep % 2 else methods + ["baseline"]
            for v in order:
                if v == "baseline":
                    if not args.skip_baseline and configs is not None:
                        baseline(rep)
                else:
                    r = run_packed(v, rep)
                    configs = configs or r["configs"]
                    keep_min(packed, v, r, "search_s")
                    print(f"[rep {rep}] packed[{v}]: search {r['search_s']:.1f} s (+ResultGrid "
                          f"{r['with_result_grid_s']:.1f} s), {r['num_trials']} pack trials (mean "
                          f"{r['mean_pack_size']:.1f} configs), best acc {r['best_accuracy']:.4f} "
                          f"{r['best_config']}", flush=True)
            if rep == 0 and not args.skip_baseline and "ray_hyperband" not in base:
                baseline(rep)                                # first repeat ran packed first
        for m in methods:
            r = dict(packed[m])
            r.pop("configs", None)
            r["search_s_runs"] = packed[m + "_runs"]
            out["packed"][m] = r
        if base:
            out["ray_hyperband"] = {**base["ray_hyperband"], "wall_s_runs": base["ray_hyperband_runs"]}
            t_base = out["ray_hyperband"]["wall_s"]
            for method, r in out["packed"].items():
                r["speedup_search"] = t_base / r["search_s"]
                r["speedup_with_result_grid"] = t_base / r["with_result_grid_s"]
                r["accuracy_gap_points"] = 100 * (out["ray_hyperband"]["best_accuracy"] - r["best_accuracy"])
                print(f"speedup packed[{method}] vs Ray HyperBand (best of {args.repeats}): "
                      f"{r['speedup_search']:.2f}x (with ResultGrid {r['speedup_with_result_grid']:.2f}x); "
                      f"best-accuracy gap {r['accuracy_gap_points']:+.2f} points")
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
