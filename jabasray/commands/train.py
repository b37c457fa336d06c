"""``jabasray train``: train with adaptive batching and auto-scaling on a (possibly emulated) cluster.

Without options it trains the embedded default - :class:`jabasray.models.DigitsCNN` on
scikit-learn's digits - on an emulated heterogeneous cluster (two node types of different speed,
two GPU pairs each), starting a local Ray instance unless ``RAY_ADDRESS`` is set or a cluster
started with ``ray start`` is running. It shows a progress bar (stderr), prints one line per
epoch and writes ``metrics.json`` and ``trajectory.png`` into ``<storage-path>/<name>``.

``--script FILE`` trains your own model: a Python file that defines

* ``model_fn()`` -> ``torch.nn.Module`` (required),
* ``dataset()`` -> map-style training dataset of ``(input, target)`` (required),
* ``val_dataset()`` -> validation dataset (optional; accuracy is reported per epoch),
* ``optimizer_fn(params)`` -> ``torch.optim.Optimizer`` (optional; default SGD momentum 0.9),
* ``loss_fn(outputs, targets)`` -> mean loss (optional; default cross-entropy).

Every :class:`jabasray.config.JobConfig` field is an option (``--epochs``, ``--initial-global-batch``,
``--adaptive/--no-adaptive`` ...).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import runpy
import sys
import typing
from pathlib import Path
from typing import Any

from ..config import JobConfig, RunConfig
from ..types import ClusterSpec

log = logging.getLogger(__name__)

# The embedded default job: JobConfig defaults except where the digits CNN wants other values
# to reach >= 95% validation accuracy in a few minutes on 2 CPU cores.
EMBEDDED_DEFAULTS = {"epochs": 8, "lr": 0.1, "initial_global_batch": 32, "min_global_batch": 32,
                     "max_global_batch": 256, "min_local_batch": 8, "adapt_interval": 5}
# Emulated cluster of the embedded default: {gpu_type: (nodes, GPUs per node, speed)}.
DEFAULT_CLUSTER = {"fast": (1, 4, 0.5), "slow": (1, 4, 0.25)}


def default_cluster() -> ClusterSpec:
    return ClusterSpec.emulated(DEFAULT_CLUSTER)


def _field_type(tp: Any) -> tuple[Any, bool]:
    """(python type, optional) of a JobConfig field annotation."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return args[0], True
    return tp, False


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train with adaptive batching + auto-scaling (JABAS)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", help="Python file defining model_fn(), dataset() and optionally "
                   "val_dataset(), optimizer_fn(params), loss_fn(outputs, targets)")
    p.add_argument("--cluster", help="cluster file (YAML/JSON: {nodes: [{name, gpu_type, num_gpus, "
                   "speed}, ...]}); default: an emulated two-type cluster, or the running Ray cluster "
                   "with --cluster ray")
    p.add_argument("--storage-path", default="jabasray_runs", help="parent folder of runs")
    p.add_argument("--name", help="run folder name (default: train-<timestamp>)")
    p.add_argument("--resume", action="store_true", help="continue the run --name from its checkpoint")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: emulate GPU types on CPU; cuda: one real GPU per actor")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of a locally started Ray instance")
    p.add_argument("--reprofile", action="store_true", help="measure the model's profile again (ignore the cache)")
    from ..profiler.buckets import BUCKET_PLANNERS
    p.add_argument("--bucket-planner", default="size", choices=BUCKET_PLANNERS,
                   help="gradient buckets: 'size' (capped at 25 MB, DDP-like) or 'libra' (LIBRA's fusion "
                        "planned on the measured contention)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to use (default: RAY_ADDRESS or a running `ray start` cluster, "
                   "else a new local instance); 'local' always starts a local instance")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--force-replacement", action="store_true", help=argparse.SUPPRESS)
    hints = typing.get_type_hints(JobConfig)
    job = p.add_argument_group("job (JobConfig fields)")
    for f in dataclasses.fields(JobConfig):
        tp, optional = _field_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = EMBEDDED_DEFAULTS.get(f.name, f.default)
        text = f"(default {default}" + (f"; with --script {f.default})" if default != f.default else ")")
        if tp is bool:
            job.add_argument(flag, dest=f"job_{f.name}", action=argparse.BooleanOptionalAction,
                             default=None, help=text)
        else:
            job.add_argument(flag, dest=f"job_{f.name}", type=_parser_for(tp, f.name), default=None,
                             metavar=tp.__name__.upper(), help=text)
    p.set_defaults(func=run)


def _parser_for(tp: Any, name: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {tp.__name__}, got {text!r}") from None
    return parse


def job_config_from_args(args: argparse.Namespace, embedded: bool) -> JobConfig:
    """JobConfig from the ``--<field>`` options (embedded defaults when training the default)."""
    values = dict(EMBEDDED_DEFAULTS) if embedded else {}
    for f in dataclasses.fields(JobConfig):
        v = getattr(args, f"job_{f.name}", None)
        if v is not None:
            values[f.name] = v
    return JobConfig(**values)


def load_script(path: str) -> dict[str, Any]:
    """``runpy`` the user's script and return its job callables (module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"script {path} does not exist")
    ns = runpy.run_path(str(p), run_name="jabasray_user_script")
    for required in ("model_fn", "dataset"):
        if not callable(ns.get(required)):
            raise ValueError(f"script {path} must define {required}() (see `jabasray train --help`)")
    return ns


def run(args: argparse.Namespace) -> int:
    from ..actors.driver import DriverOptions
    from ..actors.trainer import JabasTrainer, ensure_ray

    job = job_config_from_args(args, embedded=args.script is None)
    name = args.name or datetime.datetime.now().strftime("train-%Y%m%d-%H%M%S")
    run_config = RunConfig(storage_path=args.storage_path, name=name)
    from ..actors.checkpoint import latest_checkpoint
    if args.resume:
        if latest_checkpoint(run_config.path) is None:
            raise ValueError(f"resume: run {run_config.path} has no checkpoint to resume")
    elif latest_checkpoint(run_config.path) is not None:
        raise ValueError(f"name: run {run_config.path} already exists; pass --resume to continue "
                         f"it or choose another --name")
    if args.script:
        ns = load_script(args.script)
        model_fn, train = ns["model_fn"], ns["dataset"]()
        val = ns["val_dataset"]() if callable(ns.get("val_dataset")) else None
        optimizer_fn, loss_fn = ns.get("optimizer_fn"), ns.get("loss_fn")
    else:
        from ..data import load_digits_split
        from ..models import DigitsCNN
        model_fn, optimizer_fn, loss_fn = DigitsCNN, None, None
        train, val = load_digits_split(seed=job.seed)
    emulate = args.device == "cpu"
    if args.cluster == "ray":
        cluster = None
    elif args.cluster:
        cluster = ClusterSpec.from_file(args.cluster).validated_pairs(drop_odd_gpu=True)
    else:
        cluster = default_cluster()
    from ..validation import check_int
    check_int("num_cpus", args.num_cpus, min_value=1)
    started = ensure_ray(cluster, emulate=emulate, num_cpus=args.num_cpus, address=args.ray_address)
    progress = _Progress(total=job.epochs * len(train), enabled=not args.no_progress)
    if not getattr(args, "verbose", False):
        # the driver's events reach the user through _Progress.on_event; its INFO log lines
        # would print every event twice (-v shows them).
        logging.getLogger("jabasray.actors").setLevel(logging.WARNING)
    options = DriverOptions(device=args.device, emulate=emulate,
                            force_replacement=args.force_replacement, reprofile=args.reprofile,
                            bucket_planner=args.bucket_planner)
    trainer = JabasTrainer(model_fn, train, optimizer_fn, loss_fn, job, cluster=cluster,
                           run_config=run_config, val_dataset=val, options=options,
                           callbacks=[progress])
    try:
        print(f"jabasray train: run {run_config.path} ({job.epochs} epochs, B_G "
              f"{job.initial_global_batch} in [{job.min_global_batch}, {job.max_global_batch}])",
              flush=True)
        result = trainer.fit()
    finally:
        progress.close()
        if started:
            import ray
            ray.shutdown()
    acc = result.val_accuracy
    print(f"done: {len(result.history.epochs)} epochs, "
          f"{'val acc %.4f, ' % acc if acc is not None else ''}"
          f"{result.history.total_gpu_seconds:.1f} GPU-s; metrics {result.metrics_path}, "
          f"plot {result.plot_path}", flush=True)
    return 0


class _Progress:
    """tqdm bar on stderr (samples) + one printed line per epoch."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="sample", file=sys.stderr, dynamic_ncols=True,
                            leave=False)

    # DriverCallback protocol (duck-typed to keep the import light)
    def on_interval(self, driver: Any, record: Any) -> None:
        if self.bar is not None:
            self.bar.update(min(self.total - self.bar.n, record.samples))
            self.bar.set_postfix(B_G=record.global_batch, B_L=record.local_batch,
                                 phi=f"{record.phi:.2f}" if record.phi is not None else "-",
                                 loss=f"{record.loss:.3f}")

    def on_epoch(self, driver: Any, record: Any) -> None:
        alloc = ",".join(f"{k}:{v}" for k, v in record.allocation.items())
        traj = record.trajectory
        acc = f"{record.val_accuracy:.4f}" if record.val_accuracy is not None else "-"
        line = (f"epoch {record.epoch + 1}: B_G {min(traj)}-{max(traj)}, allocation {alloc} "
                f"({len(record.gpu_types)} GPUs), {record.throughput:.0f} samples/s, "
                f"val acc {acc}, {record.time_s:.1f}s")
        if record.prediction_error is not None:
            line += (f", train {record.train_time_s:.1f}s vs predicted {record.predicted_train_time_s:.1f}s "
                     f"(error {100 * record.prediction_error:+.0f}%)")
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def on_event(self, driver: Any, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
