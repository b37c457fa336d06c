"""Train the digits CNN with JABAS (adaptive batching + auto-scaling) through JabasTrainer.

Run it locally (starts a local Ray instance with an emulated heterogeneous cluster)::

    python examples/train_digits.py

or against a Ray cluster (``ray start --head`` first; on a CPU-only cluster give the head node the
emulated GPU resources, e.g. ``ray start --head --resources='{"gpu_fast": 4, "gpu_slow": 4}'``)::

    ray job submit --working-dir . -- python examples/train_digits.py

With a running cluster (``RAY_ADDRESS``, or a ``ray start`` cluster on this machine) the script
connects to it (:func:`jabasray.actors.ensure_ray`). If that cluster has real GPUs, pass
``--device cuda`` and the GPU actors use one GPU each; otherwise GPU types are emulated on CPU
through the ``gpu_<type>`` custom resources.
"""
from __future__ import annotations

import argparse
import logging

from jabasray import ClusterSpec, JobConfig, RunConfig
from jabasray.actors import DriverOptions, JabasTrainer, ensure_ray
from jabasray.actors.placement import ray_cluster_spec
from jabasray.data import load_digits_split
from jabasray.models import DigitsCNN

# {gpu_type: (nodes, GPUs per node, emulated speed)}
EMULATED = {"fast": (1, 4, 0.5), "slow": (1, 4, 0.25)}


def running_emulated_cluster() -> ClusterSpec | None:
    """The Ray cluster we connected to, node by node (each GPU's actor is pinned to its node;
    any GPU count), when its nodes advertise ``gpu_<type>`` resources; types run at EMULATED's speeds.
    None when no node does (e.g. a plain ``ray start --head``)."""
    try:
        spec = ray_cluster_spec(speeds={t: speed for t, (_, _, speed) in EMULATED.items()})
    except ValueError:
        return None
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--storage-path", default="jabasray_runs",
                    help="parent folder of the run's results, or a URI (s3://bucket/runs, "
                         "gs://...); under `ray job submit` give an absolute path (a relative one "
                         "lands in the job's temporary working directory); on several nodes, a "
                         "path every node mounts or a cloud URI")
    ap.add_argument("--name", default="train_digits")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    emulate = args.device == "cpu"
    cluster = ClusterSpec.emulated(EMULATED) if emulate else None   # None: detect GPUs from Ray
    # the running cluster, else a local instance with the emulated gpu_<type> resources
    started_here = ensure_ray(cluster, emulate=emulate)
    if emulate and not started_here:
        cluster = running_emulated_cluster() or cluster
    train, val = load_digits_split()
    job = JobConfig(epochs=args.epochs, lr=0.1, initial_global_batch=32, min_global_batch=32,
                    max_global_batch=256, min_local_batch=8, adapt_interval=5)
    trainer = JabasTrainer(DigitsCNN, train, None, None, job, cluster=cluster,
                           run_config=RunConfig(args.storage_path, args.name), val_dataset=val,
                           options=DriverOptions(device=args.device, emulate=emulate))
    result = trainer.fit()
    for e in result.history.epochs:
        print(f"epoch {e.epoch + 1}: B_G {min(e.trajectory)}-{max(e.trajectory)} "
              f"allocation {e.allocation} val acc {e.val_accuracy:.4f} ({e.time_s:.1f}s)")
    print(f"final val accuracy {result.val_accuracy:.4f}; metrics {result.metrics_path}; "
          f"plot {result.plot_path}")
    print(f"results (checkpoints, metrics.json, trajectory.png): {result.path}")


if __name__ == "__main__":
    main()
