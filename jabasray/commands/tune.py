"""``jabasray tune``: a packed sweep over the Pack paper's Table 3 space (MLP on digits) with
Ray Tune's own ``Tuner``: every configuration a Tune trial, trials packed per device.

``--scheduler asha`` (Tune's ASHAScheduler with a similarity search order) or ``hyperband``
(jabasray's :class:`~jabasray.tuner.PackedHyperband` on Tune's HyperBandScheduler).
"""
from __future__ import annotations

import argparse
import json
import tempfile

from jabasray.validation import check_choice, check_int

SCHEDULERS = ("asha", "hyperband")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help="packed Ray Tune sweep (Table 3 space, MLP on digits)")
    p.add_argument("--scheduler", default="asha", help="asha | hyperband (default asha)")
    p.add_argument("--R", type=int, default=27, help="max resource units per configuration (default 27)")
    p.add_argument("--eta", type=int, default=3, help="halving rate, >= 2 (default 3)")
    p.add_argument("--num-samples", type=int, default=32, help="configurations (asha; default 32)")
    p.add_argument("--steps-per-unit", type=int, default=4, help="mini-batch steps per resource unit")
    p.add_argument("--members-per-device", type=int, default=8, help="trials packed into one model per device")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--storage", default=None, help="Tune storage path (default: a temp folder)")
    p.add_argument("--json", action="store_true", help="print the best result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # every option is validated before Ray is imported (a bad value costs nothing)
    check_choice("scheduler", args.scheduler, SCHEDULERS)
    for name in ("R", "num_samples", "steps_per_unit", "members_per_device", "num_cpus"):
        check_int(name, getattr(args, name), min_value=1)
    check_int("eta", args.eta, min_value=2)
    if args.scheduler == "hyperband":
        from jabasray.tuner.brackets import tune_hyperband_schedule
        tune_hyperband_schedule(args.R, args.eta)
    from jabasray.tuner.digits import TABLE3_PARAM_VALUES, digits_mlp_spec

    spec = digits_mlp_spec(steps_per_unit=args.steps_per_unit)
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from jabasray.tuner import PackedHyperband, SimilaritySearch, packed

    space = {k: tune.choice(v) for k, v in TABLE3_PARAM_VALUES.items()}
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        # packed() decides whether packing pays on the cluster just joined; the searcher keeps
        # the sampled order where it does not
        if args.scheduler == "hyperband":
            # num_samples by default: one Hyperband iteration's sample, what PackedHyperband runs
            trainable = packed(spec, max_units=args.R, param_space=space, members_per_device=args.members_per_device,
                               reduction_factor=args.eta)
            tune_config = PackedHyperband(args.R, args.eta, args.members_per_device,
                                          trainable=trainable).tune_config("accuracy", "max")
        else:
            trainable = packed(spec, max_units=args.R, param_space=space, members_per_device=args.members_per_device,
                               num_samples=args.num_samples, reduction_factor=args.eta)
            tune_config = tune.TuneConfig(
                metric="accuracy", mode="max", num_samples=args.num_samples,
                scheduler=ASHAScheduler(max_t=args.R, grace_period=1, reduction_factor=args.eta),
                search_alg=SimilaritySearch(group_size=args.members_per_device, batch_size=args.num_samples,
                                            trainable=trainable),
                max_concurrent_trials=args.num_samples)
        grid = tune.Tuner(
            trainable, param_space=space, tune_config=tune_config,
            run_config=tune.RunConfig(name="jabasray_tune", verbose=1,
                                      storage_path=args.storage or tempfile.mkdtemp(prefix="jabasray_tune_"))).fit()
    finally:
        if started:
            ray.shutdown()
    best = grid.get_best_result()
    config = {k: best.config[k] for k in TABLE3_PARAM_VALUES}
    if args.json:
        print(json.dumps({"config": config, "accuracy": best.metrics["accuracy"],
                          "units": best.metrics["units"], "trials": len(grid), "errors": grid.num_errors}))
    else:
        print(f"{len(grid)} configurations ({grid.num_errors} errors); best: {json.dumps(config)} "
              f"accuracy {best.metrics['accuracy']:.4f} at {best.metrics['units']} units")
    return 0
