"""Packed Hyperband with Ray Tune: a small sweep over the Pack paper's Table 3 hyperparameters
(batch size, optimizer, learning rate, activation) for an MLP on scikit-learn's digits.

You describe how ONE configuration trains (a TrainingSpec: model, optimizer, batch size, data,
metric as functions of the config) and a Tune param space of discrete choices; jabasray packs
similar configurations into one Tune trial per device (kNN pack_opt under a memory budget),
runs Hyperband's successive halving and returns an ordinary ray.tune.ResultGrid with one row
per configuration.

    python examples/tune_packed_hyperband.py            # R=27, eta=3: about 15 s on 2 CPUs
    python examples/tune_packed_hyperband.py --R 81     # the paper's setting (longer)
"""
from __future__ import annotations

import argparse
import tempfile

import ray
from ray import tune

from jabasray.tuner import HyperbandConfig, PackedHyperbandTuner
from jabasray.tuner.digits import TABLE3_PARAM_VALUES, digits_mlp_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--R", type=int, default=27, help="max resource units per configuration")
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--steps-per-unit", type=int, default=4, help="mini-batch steps per resource unit")
    ap.add_argument("--memory-budget", type=float, default=2.5e6, help="bytes a device offers a pack")
    ap.add_argument("--storage", default=None, help="Tune storage path (default: a temp folder)")
    args = ap.parse_args()

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    spec = digits_mlp_spec(steps_per_unit=args.steps_per_unit)       # MLP-3 on digits, metric "accuracy"
    param_space = {name: tune.choice(values) for name, values in TABLE3_PARAM_VALUES.items()}
    tuner = PackedHyperbandTuner(
        spec, param_space=param_space,
        hyperband=HyperbandConfig(R=args.R, eta=args.eta, memory_budget=args.memory_budget,
                                  pack_method="knn", resources_per_pack={"cpu": 1}),
        run_config=tune.RunConfig(name="packed_hyperband_example",
                                  storage_path=args.storage or tempfile.mkdtemp(prefix="jabasray_tune_")))
    grid = tuner.fit()                                  # a ray.tune.ResultGrid, one row per config
    best = grid.get_best_result()
    packs = tuner.search_result.packs
    print(f"{len(grid)} configurations trained in {len(packs)} packed trials "
          f"(largest pack: {max(len(p['members']) for p in packs)} configurations)")
    print(f"best configuration: {best.config}")
    print(f"best validation accuracy: {best.metrics['accuracy']:.4f} after {best.metrics['resource']} units")
    print(f"its checkpoint: {best.checkpoint}")
    ray.shutdown()


if __name__ == "__main__":
    main()
