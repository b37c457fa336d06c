"""Packed training inside Ray Tune: a sweep over the Pack paper's Table 3 hyperparameters
(batch size, optimizer, learning rate, activation) for an MLP on scikit-learn's digits.

You keep Ray Tune: ``tune.Tuner``, its schedulers, ``TuneConfig`` and ``RunConfig``. You
describe how ONE configuration trains (a ``TrainingSpec``: model, optimizer, batch size, data,
metric as functions of the config) and wrap it with ``jabasray.tuner.packed``: every
configuration is still its own Tune trial reporting every unit, but the trials that share a
device train inside ONE packed model (Pack's load/free as trials arrive and leave).

    python examples/tune_packed_hyperband.py                      # packed Hyperband, R=9
    python examples/tune_packed_hyperband.py --scheduler asha     # Tune's ASHA, packed
"""
from __future__ import annotations

import argparse
import tempfile

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from jabasray.tuner import PackedHyperband, SimilaritySearch, coordinator_stats, packed, trains_alone
from jabasray.tuner.digits import digits_mlp_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheduler", choices=("hyperband", "asha"), default="hyperband")
    ap.add_argument("--R", type=int, default=9, help="max resource units per configuration")
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--steps-per-unit", type=int, default=4, help="mini-batch steps per resource unit")
    ap.add_argument("--members-per-device", type=int, default=8, help="trials packed per device")
    ap.add_argument("--storage", default=None, help="Tune storage path (default: a temp folder)")
    args = ap.parse_args()

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    spec = digits_mlp_spec(steps_per_unit=args.steps_per_unit)     # MLP-3 on digits, metric "accuracy"
    param_space = {"batch_size": tune.choice([20, 30, 40, 50, 60, 70]),
                   "optimizer": tune.choice(["adam", "sgd", "adagrad", "momentum"]),
                   "lr": tune.loguniform(1e-4, 1e-1),                # continuous domains are fine
                   "activation": tune.choice(["sigmoid", "leaky_relu", "tanh", "relu"])}
    # packed() decides whether packing pays (measured on this machine); the searchers group
    # similar configurations only where it does
    if args.scheduler == "hyperband":
        trainable = packed(spec, max_units=args.R, param_space=param_space,
                           members_per_device=args.members_per_device, reduction_factor=args.eta)
        tune_config = PackedHyperband(R=args.R, eta=args.eta, members_per_device=args.members_per_device,
                                      trainable=trainable).tune_config(metric="accuracy", mode="max")
    else:
        trainable = packed(spec, max_units=args.R, param_space=param_space,
                           members_per_device=args.members_per_device, num_samples=32,
                           reduction_factor=args.eta)
        tune_config = tune.TuneConfig(
            metric="accuracy", mode="max", num_samples=32,
            scheduler=ASHAScheduler(max_t=args.R, grace_period=1, reduction_factor=args.eta),
            search_alg=SimilaritySearch(group_size=args.members_per_device, batch_size=32, trainable=trainable),
            max_concurrent_trials=32)
    tuner = tune.Tuner(
        trainable, param_space=param_space, tune_config=tune_config,
        # packed trials checkpoint when Tune asks: HyperBand's pauses and, here, each trial's end
        run_config=tune.RunConfig(name="packed_tune_example",
                                  checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=True),
                                  storage_path=args.storage or tempfile.mkdtemp(prefix="jabasray_tune_")))
    grid = tuner.fit()                                  # an ordinary ResultGrid: one row per trial
    best = grid.get_best_result()
    if trains_alone(trainable):
        print(f"{len(grid)} configurations, each trained alone (packing does not pay here; see the log)")
    else:
        print(f"{len(grid)} configurations, largest pack: {int(grid.get_dataframe()['pack_size'].max())} trials")
    print(f"best configuration: {best.config}")
    print(f"best validation accuracy: {best.metrics['accuracy']:.4f} after {best.metrics['units']} units")
    print(f"its checkpoint (the model's own state_dict in member.pt): {best.checkpoint}")
    stats = list(coordinator_stats(release=True).values())   # what the packing coordinators did
    runs, members = sum(s["units_run"] for s in stats), sum(s["member_units"] for s in stats)
    print(f"packing coordinators: {members} member-units in {runs} packed units "
          f"({members / max(runs, 1):.1f} trials per pack), {sum(s['units_discarded'] for s in stats)} "
          f"speculative units discarded, {sum(s['busy_s'] for s in stats):.1f} s training")
    ray.shutdown()


if __name__ == "__main__":
    main()
