"""Train a small ResNet on an image dataset stored as files, the way real jobs are written.

The script first writes a CIFAR-sized image dataset to disk (generated: 10 classes of 32x32 RGB
PNG files whose colour and stripe pattern depend on the class, plus noise), then trains
:class:`jabasray.models.SmallResNet` with JABAS on an emulated heterogeneous cluster:

* ``dataset_fn`` / ``val_dataset_fn`` build a map-style Dataset over the files ON EACH ACTOR
  (the driver never reads an image), read by a DataLoader per actor with worker processes;
* the user's optimizer (SGD, LR 0.1 at the initial global batch) with a cosine LR schedule
  stepped every iteration - JABAS multiplies it by the batch-size rule as B_G adapts;
* bf16 autocast, gradient clipping, top-1/top-5 validation sharded over the actors.

Run it locally (starts a local Ray instance)::

    python examples/train_resnet_files.py

or on a Ray cluster (the data folder must be on a disk every node sees, ``--data-dir``)::

    ray start --head --resources='{"gpu_fast": 2, "gpu_slow": 2}'
    ray job submit --working-dir . -- python examples/train_resnet_files.py --data-dir /tmp/jr_images

The run folder holds ``metrics.json``, ``metrics.csv``, ``trajectory.png`` and
``checkpoint_<epoch>/model.pt`` - a plain ``state_dict``: ``torch.load(path, weights_only=True)``.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from jabasray import ClusterSpec, JobConfig, RunConfig
from jabasray.actors import DriverOptions, JabasTrainer, ensure_ray
from jabasray.engine.evaluation import default_eval_fn
from jabasray.data import ImageFiles, write_image_files
from jabasray.models import SmallResNet

EMULATED = {"fast": (1, 2, 1.0), "slow": (1, 2, 0.5)}   # {gpu_type: (nodes, GPUs per node, speed)}
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="/tmp/jabasray_images")
    ap.add_argument("--train-images", type=int, default=1536)
    ap.add_argument("--val-images", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="DataLoader workers per actor")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--storage-path", default="jabasray_runs")
    ap.add_argument("--name", default="train_resnet_files")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()

    train_dir = write_image_files(Path(args.data_dir) / "train", args.train_images, seed=0)
    val_dir = write_image_files(Path(args.data_dir) / "val", args.val_images, seed=1)
    emulate = args.device == "cpu"
    cluster = ClusterSpec.emulated(EMULATED) if emulate else None
    ensure_ray(cluster, emulate=emulate)

    job = JobConfig(epochs=args.epochs, initial_global_batch=64, min_global_batch=32,
                    max_global_batch=256, min_local_batch=8, adapt_interval=4,
                    lr_scaling="sqrt", warmup_iterations=10, precision="bf16", grad_clip_norm=5.0)
    iterations = args.epochs * math.ceil(args.train_images / job.initial_global_batch)
    trainer = JabasTrainer(
        SmallResNet,
        optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4),
        dataset_fn=lambda: ImageFiles(train_dir), val_dataset_fn=lambda: ImageFiles(val_dir),
        # cosine over the run's iterations at the initial B_G (a larger B_G ends it early: the
        # scheduler then stays at eta_min; pick T_max for your schedule)
        lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iterations),
        lr_scheduler_interval="iteration",
        eval_fn=default_eval_fn(torch.nn.functional.cross_entropy, topk=(1, 5)),
        num_data_workers=args.workers, job_config=job, cluster=cluster,
        run_config=RunConfig(args.storage_path, args.name), verbose=2 if args.verbose else 1,
        options=DriverOptions(device=args.device, emulate=emulate))
    result = trainer.fit()
    print(result.metrics_dataframe[["epoch", "train_loss", "val_loss", "val_accuracy", "val_top5",
                                    "lr", "global_batch_max", "time_s"]].to_string(index=False))
    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "model.pt", weights_only=True)
    print(f"final top-1 {result.metrics['val_accuracy']:.4f}, top-5 {result.metrics['val_top5']:.4f}; "
          f"checkpoint {result.checkpoint.path} ({len(state)} tensors); run {result.path}")


if __name__ == "__main__":
    main()
