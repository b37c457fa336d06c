"""``jabasray train``: train with adaptive batching and auto-scaling on a (possibly emulated) cluster.

Without options it trains the embedded default - :class:`jabasray.models.DigitsCNN` on
scikit-learn's digits - on an emulated heterogeneous cluster (two node types of different speed,
four GPUs each; the fair "wait" emulation) - with ``--device cuda`` on the Ray cluster's real GPUs,
one GPU being enough - starting a local Ray instance unless ``RAY_ADDRESS`` is set or a cluster
started with ``ray start`` is running. It shows a progress bar (stderr), prints one line per
epoch and writes ``metrics.json`` and ``trajectory.png`` into ``<storage-path>/<name>`` (a local
or NFS folder, or a URI such as ``s3://bucket/runs``: :mod:`jabasray.storage`).

``--script FILE`` trains your own model: a Python file that defines

* ``model_fn()`` -> ``torch.nn.Module`` (required),
* ``dataset()`` -> map-style training dataset of ``(input, target)`` (required),
* ``val_dataset()`` -> validation dataset (optional; accuracy is reported per epoch),
* ``optimizer_fn(params)`` -> ``torch.optim.Optimizer`` (optional; default SGD momentum 0.9),
* ``loss_fn(outputs, targets)`` -> mean loss (optional; default cross-entropy).

Instead of ``dataset()``/``val_dataset()`` a script may define ``dataset_fn()``/``val_dataset_fn()``:
they build the datasets on every GPU actor (files on local or shared disk; read by a DataLoader).
Optional hooks, as for ``JabasTrainer``: ``step_fn(model, batch)``, ``eval_fn(model, batches)``,
``lr_scheduler_fn(optimizer)``, ``collate_fn(samples)``, and the values ``lr_scheduler_interval``
("iteration" | "epoch") and ``num_data_workers``.

Or, keeping your own loop (Ray Train's style, :mod:`jabasray.train`), a script that defines
``train_loop_per_worker(config)`` (and optionally the dict ``train_loop_config``); it calls
``prepare_data_loader``, ``prepare_model``, ``prepare_optimizer`` and iterates
``for epoch in epochs(n, ...)`` with ``n`` = ``--epochs``.

Every :class:`jabasray.config.JobConfig` field is an option (``--epochs``, ``--initial-global-batch``,
``--adaptive/--no-adaptive`` ...).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import runpy
import sys
import typing
from pathlib import Path
from typing import Any

from ..config import JobConfig, RunConfig, default_run_name
from ..types import ClusterSpec

if typing.TYPE_CHECKING:   # pragma: no cover
    from ..storage import StoragePath

log = logging.getLogger(__name__)

# The embedded default job: JobConfig defaults except where the digits CNN wants other values
# to reach >= 95% validation accuracy in a few minutes on 2 CPU cores.
EMBEDDED_DEFAULTS = {"epochs": 8, "lr": 0.1, "initial_global_batch": 32, "min_global_batch": 32,
                     "max_global_batch": 256, "min_local_batch": 8, "adapt_interval": 5}
# Emulated cluster of the embedded default: {gpu_type: (nodes, GPUs per node, speed)}. Under the
# fair "wait" emulation (the command's default) the speeds of all eight GPUs sum to 1.5, so two
# host cores keep up with any allocation and leave room for the driver: each emulated GPU then
# runs at its own speed whatever else is placed, and the auto-scaler's choices show.
DEFAULT_CLUSTER = {"fast": (1, 4, 0.25), "slow": (1, 4, 0.125)}



def profiles_from(path: str | None) -> dict | None:
    """``--profiles``: ``{gpu_type: Profile}`` from a folder of profile JSON files (every
    ``*.json`` in it) or one file; None stays None. One-line ValueError when there is none."""
    if path is None:
        return None
    from ..profiles import load_profiles
    p = Path(path)
    files = sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"profiles: {path} is neither a profile JSON file nor a folder holding some")
    return load_profiles(files)


def parse_actor_env(items: list[str]) -> dict[str, str]:
    """``--actor-env NAME=VALUE`` flags -> ``{NAME: VALUE}`` (ValueError, one line, on a flag
    without ``=``; names and values are checked by ``DriverOptions``)."""
    env: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise ValueError(f"actor_env: expected NAME=VALUE, got {item!r}")
        env[name] = value
    return env


def parse_port_range(text: str | None) -> tuple[int, int] | None:
    """``--rendezvous-ports FIRST-LAST`` (or one port) -> (first, last); None stays None."""
    if text is None:
        return None
    first, _, last = text.partition("-")
    try:
        return int(first), int(last or first)
    except ValueError:
        raise ValueError(f"rendezvous_ports must be FIRST-LAST (e.g. 29400-29410), got {text!r}") from None

def default_cluster() -> ClusterSpec:
    return ClusterSpec.emulated(DEFAULT_CLUSTER)


def cluster_for(cluster: str | None, device: str) -> ClusterSpec | None:
    """The cluster ``--cluster`` names: ``"ray"`` (or, on ``--device cuda``, nothing) is the
    running Ray cluster's real GPUs (``None``: detected when the driver starts), a path is a
    cluster file, and nothing on ``--device cpu`` is the emulated two-type default. An emulated
    8-GPU default makes no sense for real GPUs: one GPU must be enough to start."""
    if cluster == "ray" or (cluster is None and device == "cuda"):
        return None
    if cluster:
        return ClusterSpec.from_file(cluster)
    return default_cluster()


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
                   "val_dataset(), optimizer_fn(params), loss_fn(outputs, targets); or "
                   "train_loop_per_worker(config), your own loop (jabasray.train)")
    p.add_argument("--cluster", help="cluster file (YAML/JSON: {nodes: [{name, gpu_type, num_gpus, "
                   "speed}, ...]}) or 'ray' (the running Ray cluster's GPUs); default: with --device cpu "
                   "an emulated two-type cluster, with --device cuda the Ray cluster's GPUs")
    p.add_argument("--storage-path", default="jabasray_runs",
                   help="parent folder of runs: a local or NFS path, or a URI (s3://bucket/runs, "
                        "gs://bucket/runs; credentials from the usual environment variables)")
    p.add_argument("--name", help="run folder name (default: train_<date>_<time>_<6 hex>, unique)")
    p.add_argument("--resume", nargs="?", const="auto", choices=["auto", "force"], default=None,
                   help="continue the run --name from its checkpoint; only the job that wrote it "
                   "(its job.json: model, JobConfig, optimizer, hooks) unless 'force'; a finished "
                   "run returns its result")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: emulate GPU types on CPU; cuda: one real GPU per actor")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of a locally started Ray instance")
    p.add_argument("--emulation", default="wait", choices=["compute", "wait"],
                   help="CPU emulation of a GPU's step: 'wait' (default, fair: CPU time / speed, "
                        "every emulated GPU gets the same share while the speeds sum to <= the "
                        "CPUs) or 'compute' (wall compute time / speed: emulated GPUs share the "
                        "host's cores and get slower the more are placed)")
    p.add_argument("--reprofile", action="store_true", help="measure the model's profile again (ignore the cache)")
    p.add_argument("--online-correction", action="store_true",
                   help="correct the iteration-time model from measured interval times (plans then "
                   "depend on timings: a run is no longer reproducible bit for bit)")
    from ..profiler.buckets import BUCKET_PLANNERS
    p.add_argument("--bucket-planner", default="size", choices=BUCKET_PLANNERS,
                   help="gradient buckets: 'size' (capped at 25 MB, DDP-like) or 'libra' (LIBRA's fusion "
                        "planned on the measured contention)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to use (default: RAY_ADDRESS or a running `ray start` cluster, "
                   "else a new local instance); 'local' always starts a local instance")
    p.add_argument("--drop-odd-gpu", action="store_true",
                   help="deprecated, no effect: any number of GPUs trains (a GPU without a partner "
                        "forms both similarity groups from its own VSWs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--driver", default="actor", choices=["actor", "local"],
                   help="actor: the driver runs as a restartable Ray actor named after the run, so the "
                   "run outlives this command (Ctrl-C detaches); local: in this process")
    p.add_argument("--driver-node", default=None, help="Ray node id or IP for the driver actor "
                   "(default: the head node)")
    p.add_argument("--detach", action="store_true", help="start the run and return at once (needs "
                   "a running Ray cluster); then `jabasray status|attach|stop NAME`")
    p.add_argument("--force-replacement", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--actor-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable of the GPU actors, repeatable (e.g. "
                        "NCCL_SOCKET_IFNAME=eth0, GLOO_SOCKET_IFNAME=eth0, NCCL_DEBUG=WARN)")
    p.add_argument("--rendezvous-ports", default=None, metavar="FIRST-LAST",
                   help="ports the driver's rendezvous store may listen on (default: any free port)")
    p.add_argument("--profiles", default=None, metavar="DIR",
                   help="profiles to plan with instead of measuring: a folder of JSON files written "
                        "by `jabasray profile` (one per GPU type, type names as Ray detects them) "
                        "or one such file")
    p.add_argument("--call-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a call to the GPU actors may take before they count as hung "
                        "(an actor failure: killed, the epoch redone)")
    add_job_arguments(p, EMBEDDED_DEFAULTS, "with --script")
    p.set_defaults(func=run)


def add_job_arguments(p: argparse.ArgumentParser, defaults: dict[str, Any], other: str) -> None:
    """One ``--<field>`` option per ``JobConfig`` field (dest ``job_<field>``), its help naming
    the command's default (``defaults``, else the field's) and, where they differ, the field's
    own default used ``other`` (e.g. "with --script"); :func:`job_config_from_args` reads them."""
    hints = typing.get_type_hints(JobConfig)
    job = p.add_argument_group("job (JobConfig fields)")
    for f in dataclasses.fields(JobConfig):
        tp, optional = _field_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        text = f"(default {default}" + (f"; {other} {f.default})" if default != f.default else ")")
        if tp is bool:
            job.add_argument(flag, dest=f"job_{f.name}", action=argparse.BooleanOptionalAction,
                             default=None, help=text)
        else:
            job.add_argument(flag, dest=f"job_{f.name}", type=_parser_for(tp, f.name), default=None,
                             metavar=tp.__name__.upper(), help=text)


def _parser_for(tp: Any, name: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return tp(text)
        except ValueError:
            pass
        if tp is int:   # "1e8": an integer written in float notation
            try:
                f = float(text)
            except ValueError:
                f = math.nan
            if math.isfinite(f) and f.is_integer():
                return int(f)
        raise argparse.ArgumentTypeError(f"{name} must be {tp.__name__}, got {text!r}")
    return parse


def job_config_from_args(args: argparse.Namespace, embedded: bool | dict[str, Any]) -> JobConfig:
    """JobConfig from the ``--<field>`` options (embedded defaults when training the default;
    a dict: those defaults)."""
    values = dict(embedded) if isinstance(embedded, dict) else dict(EMBEDDED_DEFAULTS) if embedded else {}
    for f in dataclasses.fields(JobConfig):
        v = getattr(args, f"job_{f.name}", None)
        if v is not None:
            values[f.name] = v
    return JobConfig(**values)


def load_script(path: str) -> dict[str, Any]:
    """``runpy`` the user's script and return its job callables (module docstring). A syntax
    error or an exception while it runs is one ``ValueError`` naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"script {path} does not exist")
    ns = call_script(path, "running it", runpy.run_path, str(p), run_name="jabasray_user_script")
    if callable(ns.get("train_loop_per_worker")):
        return ns
    if not callable(ns.get("model_fn")):
        raise ValueError(f"script {path} must define model_fn() or train_loop_per_worker(config) "
                         f"(see `jabasray train --help`)")
    if not (callable(ns.get("dataset")) or callable(ns.get("dataset_fn"))):
        raise ValueError(f"script {path} must define dataset() or dataset_fn() (see `jabasray train --help`)")
    return ns


SCRIPT_HOOKS = ("dataset_fn", "val_dataset_fn", "step_fn", "eval_fn", "lr_scheduler_fn",
                "lr_scheduler_interval", "collate_fn", "num_data_workers")


def script_hooks(ns: dict[str, Any]) -> dict[str, Any]:
    """The optional JabasTrainer hooks a script defines (module docstring), as keyword arguments."""
    return {k: ns[k] for k in SCRIPT_HOOKS if ns.get(k) is not None}


def call_script(path: str, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; an exception raised in the user's script ``path`` becomes a
    one-line ``ValueError``: ``script FILE line N (WHAT): Type: message``."""
    try:
        return fn(*args, **kwargs)
    except SyntaxError as e:
        raise ValueError(f"script {e.filename or path} line {e.lineno}: syntax error: "
                         f"{e.msg}") from None
    except Exception as e:  # noqa: BLE001 - reported with its place in the user's file
        import traceback

        target = Path(path).resolve()
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if Path(f.filename).resolve() == target]
        where = f"line {frames[-1].lineno}" if frames else "(outside the script)"
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"script {path} {where} ({what}): {type(e).__name__}"
                         f"{': ' + text if text else ''}") from None


def run(args: argparse.Namespace) -> int:
    from ..actors.callbacks import ConsoleReporter
    from ..actors.driver import DriverOptions
    from ..actors.run_folder import probe_run_folder, run_lock
    from ..actors.trainer import JabasTrainer, ensure_ray

    if args.drop_odd_gpu:
        print("jabasray train: --drop-odd-gpu is deprecated and has no effect: any number of GPUs "
              "trains", file=sys.stderr)
    job = job_config_from_args(args, embedded=args.script is None)
    name = args.name if args.name is not None else default_run_name("train")
    run_config = RunConfig(storage_path=args.storage_path, name=name, resume=args.resume or "auto")
    check_run_folder(run_config.path, args.resume is not None)
    ns = load_script(args.script) if args.script else {}
    loop = ns.get("train_loop_per_worker")
    if loop is not None:
        model_fn = optimizer_fn = loss_fn = train = val = None
        hooks = {}
    elif args.script:
        hooks = script_hooks(ns)
        model_fn = ns["model_fn"]
        train = call_script(args.script, "dataset()", ns["dataset"]) if "dataset_fn" not in hooks else None
        val = call_script(args.script, "val_dataset()", ns["val_dataset"]) \
            if callable(ns.get("val_dataset")) and "val_dataset_fn" not in hooks else None
        optimizer_fn, loss_fn = ns.get("optimizer_fn"), ns.get("loss_fn")
    else:
        from ..data import load_digits_split
        from ..models import DigitsCNN
        model_fn, optimizer_fn, loss_fn, hooks = DigitsCNN, None, None, {}
        train, val = load_digits_split(seed=job.seed)
    emulate = args.device == "cpu"
    cluster = cluster_for(args.cluster, args.device)
    from ..validation import check_int
    check_int("num_cpus", args.num_cpus, min_value=1)
    if args.detach and (args.driver != "actor" or args.ray_address == "local"):
        raise ValueError("detach: needs --driver actor and a running Ray cluster (not --ray-address local)")
    # the console reporter fit() uses: epoch lines, events, the bar (fit() starts it)
    progress = ConsoleReporter(bar=not args.no_progress)
    if not getattr(args, "verbose", False):
        # the driver's events reach the user through ConsoleReporter.on_event; its INFO log lines
        # would print every event twice (-v shows them).
        logging.getLogger("jabasray.actors").setLevel(logging.WARNING)
    options = DriverOptions(device=args.device, emulate=emulate, emulation=args.emulation,
                            force_replacement=args.force_replacement, reprofile=args.reprofile,
                            online_correction=args.online_correction,
                            driver=args.driver, driver_node=args.driver_node,
                            bucket_planner=args.bucket_planner,
                            actor_env=parse_actor_env(args.actor_env) or None,
                            rendezvous_ports=parse_port_range(args.rendezvous_ports),
                            call_timeout_s=args.call_timeout)
    # built before Ray starts: it checks the batch bounds against the dataset
    verbose = 2 if getattr(args, "verbose", False) else 1
    if loop is not None:
        from ..train import JabasTorchTrainer
        trainer: Any = JabasTorchTrainer(loop, train_loop_config=ns.get("train_loop_config"),
                                         job_config=job, cluster=cluster, run_config=run_config,
                                         options=options, profiles=profiles_from(args.profiles),
                                         callbacks=[progress], verbose=verbose)
    else:
        trainer = JabasTrainer(model_fn, train, optimizer_fn, loss_fn, job, cluster=cluster,
                               run_config=run_config, val_dataset=val, options=options,
                               profiles=profiles_from(args.profiles),
                               callbacks=[progress], verbose=verbose, **hooks)
    started = False
    # the run folder is probed before Ray starts; the in-process driver's lock is taken here too
    # (fit() takes the same lock again), the actor driver takes it in its own process
    probe_run_folder(run_config.path, extra_dirs=(run_config.path.parent / ".profiles",))
    lock = run_lock(run_config.path, named_driver=args.driver == "actor").acquire()
    if args.driver == "actor":      # checked here (one line, before anything starts); the
        lock.release()              # driver actor then holds it in its own process
        lock = None
    try:
        # before Ray starts: every hook on a tiny batch and, with --resume, the job against the
        # run's record (a changed job refused in one line, a finished run's result returned)
        start = trainer.preflight()
        if start is not None and start.kind == "finished":
            result = trainer.fit()
            return _done(result)
        started = ensure_ray(cluster, emulate=emulate, num_cpus=args.num_cpus,
                             address=args.ray_address)
        if args.detach:
            if started:
                raise ValueError("detach: needs a running Ray cluster (`ray start --head`, RAY_ADDRESS "
                                 "or --ray-address): a Ray instance started by this command ends with it")
            progress.close()
            trainer.fit(wait=False)
            print(f"jabasray train: run {name} started in the background ({run_config.path}); "
                  f"follow it with `jabasray status {name}`, `jabasray attach {name}`, "
                  f"`jabasray stop {name}`", flush=True)
            return 0
        print(f"jabasray train: run {run_config.path} ({job.epochs} epochs, B_G "
              f"{job.initial_global_batch} in [{job.min_global_batch}, {job.max_global_batch}])",
              flush=True)
        result = trainer.fit()
    finally:
        if lock is not None:
            lock.release()
        progress.close()
        if started:
            import ray
            ray.shutdown()
    return _done(result)


def _done(result: Any) -> int:
    """The command's last line: epochs, validation accuracy, GPU-seconds, where the files are."""
    acc = result.val_accuracy
    print(f"done: {len(result.history.epochs)} epochs, "
          f"{'val acc %.4f, ' % acc if acc is not None else ''}"
          f"{result.history.total_gpu_seconds:.1f} GPU-s; metrics {result.metrics_path}, "
          f"plot {result.plot_path}", flush=True)
    return 0


def check_run_folder(run_dir: "StoragePath", resume: bool) -> None:
    """Before any work: a new run must not overwrite a run with checkpoints; ``--resume`` needs
    the run folder and reads (verified, ``weights_only``) the checkpoint it will resume from, so a
    corrupt or crafted file is reported in one line before Ray starts. The newest intact
    checkpoint is used (the driver reports corrupt newer ones); a folder whose run died before its
    first checkpoint starts again from epoch 0."""
    from ..actors.checkpoint import latest_checkpoint
    from ..storage import explain

    skipped: list[str] = []   # reported by the driver when it resumes
    try:
        cp = latest_checkpoint(run_dir, skipped)
    except OSError as e:      # unreachable storage, credentials: one line before any work
        raise ValueError(f"storage_path {run_dir.parent} is not reachable: {explain(e)}") from None
    if not resume:
        if cp is not None or skipped:
            raise ValueError(f"name: run {run_dir} already exists; pass --resume to continue it "
                             f"or choose another --name")
        return
    if not run_dir.is_dir():
        raise ValueError(f"resume: run {run_dir} does not exist (check --name and --storage-path)")
    if cp is None:
        print(f"jabasray train: run {run_dir} has no intact checkpoint; starting it from epoch 0",
              file=sys.stderr, flush=True)
        return
    cp.load_driver_state()
    cp.load_worker_state()
