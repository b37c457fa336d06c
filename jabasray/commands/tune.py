"""``jabasray tune``: packed Hyperband over the Pack paper's Table 3 space (MLP on digits).

Runs the example sweep of ``examples/tune_packed_hyperband.py`` from the command line and
prints the best configuration; ``--method none`` runs the same search unpacked.
"""
from __future__ import annotations

import argparse
import json
import tempfile


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help="packed Hyperband sweep (Table 3 space, MLP on digits) with Ray Tune")
    p.add_argument("--R", type=int, default=27, help="max resource units per configuration (default 27)")
    p.add_argument("--eta", type=int, default=3, help="Hyperband halving rate, >= 2 (default 3)")
    p.add_argument("--steps-per-unit", type=int, default=4, help="mini-batch steps per resource unit")
    p.add_argument("--memory-budget", type=float, default=2.5e6, help="bytes per device for pack_opt")
    p.add_argument("--method", default="knn", help="knn | random | batch_size | none (default knn)")
    p.add_argument("--threshold", type=float, default=None, help="kNN similarity threshold")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--storage", default=None, help="Tune storage path (default: a temp folder)")
    p.add_argument("--json", action="store_true", help="print the search result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jabasray.tuner import HyperbandConfig, PackedHyperbandTuner
    from jabasray.tuner.digits import TABLE3_PARAM_VALUES, digits_mlp_spec

    # TrainingSpec and HyperbandConfig validate every option, before Ray is imported
    spec = digits_mlp_spec(steps_per_unit=args.steps_per_unit)
    hyperband = HyperbandConfig(R=args.R, eta=args.eta, memory_budget=args.memory_budget,
                                pack_method=args.method, threshold=args.threshold)
    import ray
    from ray import tune

    tuner = PackedHyperbandTuner(
        spec, param_space={k: tune.choice(v) for k, v in TABLE3_PARAM_VALUES.items()},
        hyperband=hyperband,
        run_config=tune.RunConfig(name="jabasray_tune",
                                  storage_path=args.storage or tempfile.mkdtemp(prefix="jabasray_tune_")))
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        res = tuner.fit(result_grid=False)
    finally:
        if started:
            ray.shutdown()
    best = res.records[res.best_config_id]
    if args.json:
        print(res.to_json(indent=2))
    else:
        print(f"{len(res.records)} configurations, {len(res.packs)} packed trials, {res.search_time_s:.1f} s")
        print(f"best: {json.dumps(best.config)} accuracy {best.last['accuracy']:.4f} "
              f"at {best.last['resource']} units")
    return 0
