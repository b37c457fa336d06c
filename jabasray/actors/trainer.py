"""``JabasTrainer(...).fit() -> Result``: the public entry point, in Ray Train's shape.

``fit()`` connects to Ray (or starts a local instance with the emulated GPU resources the
cluster needs) and runs the :class:`~jabasray.actors.driver.JabasDriver` loop: by default in a
restartable, detached Ray actor named after the run (:mod:`.driver_actor`; its progress streams
back into the callbacks here; ``fit(wait=False)`` returns the run's name at once), or in this
process with ``DriverOptions(driver="local")``. The run writes into ``run_config.path`` - a local
or NFS folder, or a cloud URI such as ``s3://bucket/runs/name``, through one ``pyarrow.fs``
filesystem (:mod:`jabasray.storage`): ``checkpoints/``, ``metrics.json``/``.csv``,
``trajectory.png`` (B_G trajectory, actual and forecast, and the allocation per epoch) and the
exported ``checkpoint_<epoch>/``. Calling ``fit()`` again on a run folder with a checkpoint
resumes it (e.g. after raising ``epochs``). Before any work it proves that the run folder (and
the profile cache) can be written and read back (unreachable storage, missing credentials: one
line) and writes the run's storage marker (:mod:`.run_record`), which the driver checks at
every start and restart; the run's lock (:func:`jabasray.actors.run_folder.run_lock`) is held
by whichever process runs the driver (this one, or the driver actor), so a second run on the
same folder is refused in one line.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import (JobConfig, RunConfig, Scaling, is_ray_run_config, run_config_from_ray,
                      scaling_from_ray)
from ..errors import HookError
from ..storage import StoragePath, as_storage_path, explain, resolve
from ..types import ClusterSpec
from .callbacks import ConsoleReporter, check_sendable, console_reporter, tracker_callbacks
from .checkpoint import Checkpoint, latest_checkpoint
from .driver import DriverCallback, DriverOptions, JabasDriver
from .hooks import JobHooks, ProbeReport, run_probe
from .job_identity import check_run, job_identity
from .metrics import MetricsHistory, held_line, plot_history, save_metrics
from .ray_internals import ray_address_file
from .placement import resource_name
from .run_folder import probe_run_folder, run_lock
from .run_record import RunRecord

log = logging.getLogger(__name__)


@dataclass
class Result:
    """What ``fit()`` returns, in Ray Train's ``Result`` shape; readable from any machine that
    reaches the run's storage (:meth:`from_path`).

    ``checkpoint`` is a ``ray.train.Checkpoint(path, filesystem)`` on the run's storage holding
    the user's own objects as plain torch files, loadable without jabasray
    (:func:`export_checkpoint`): ``model.pt`` (the model's ``state_dict``), ``optimizer.pt``
    (the optimizer's ``state_dict``), and when present ``lr_scheduler.pt`` / ``grad_scaler.pt``;
    ``metadata.json`` says which epoch it is. ``checkpoint.as_directory()`` downloads it from
    remote storage (a local folder is used in place). ``metrics`` is the last epoch's flat row
    (``EpochRecord.flat``), ``metrics_dataframe`` all of them (``metrics.csv``, read through
    the run's filesystem). ``path`` is the run folder (a local absolute path or a URI such as
    ``s3://bucket/runs/name``), ``filesystem`` its ``pyarrow.fs`` filesystem. The jabasray run
    checkpoint (driver + worker state, what resumes a run) is ``run_checkpoint``.
    """

    metrics: dict                 # the last epoch's row (EpochRecord.flat())
    history: MetricsHistory       # per interval and per epoch
    checkpoint: Any               # ray.train.Checkpoint of the last epoch (None before any)
    path: str                     # the run folder: local path or URI
    metrics_path: StoragePath     # metrics.json
    plot_path: StoragePath | None  # trajectory.png
    run_checkpoint: Checkpoint | None = None   # jabasray's epoch checkpoint (resume)
    storage: StoragePath | None = None         # the run folder (filesystem + path)

    def __repr__(self) -> str:
        """Compact, as Ray Train's: the last epoch's metrics (4 significant digits), the run
        folder and the checkpoint - not the history (``result.history``, ``metrics.json``)."""
        def short(v: Any) -> str:
            return f"{v:.4g}" if isinstance(v, float) else repr(v)
        metrics = ", ".join(f"{k!r}: {short(v)}" for k, v in self.metrics.items() if v is not None)
        cp = None if self.checkpoint is None else f"Checkpoint(path={self.checkpoint.path!r})"
        return (f"Result(metrics={{{metrics}}}, path={self.path!r}, "
                f"epochs={len(self.history.epochs)}, checkpoint={cp})")

    @property
    def filesystem(self) -> Any:
        """The run folder's ``pyarrow.fs.FileSystem`` (Ray Train's ``Result.filesystem``)."""
        return self._run.filesystem

    @property
    def _run(self) -> StoragePath:
        return self.storage if self.storage is not None else resolve(self.path)

    @property
    def val_accuracy(self) -> float | None:
        return self.history.final_val_accuracy

    @property
    def metrics_dataframe(self) -> Any:
        """All epochs' rows as a ``pandas.DataFrame`` (``metrics.csv`` on the run's storage)."""
        import io

        import pandas as pd
        return pd.read_csv(io.BytesIO((self._run / "metrics.csv").read_bytes()))

    @property
    def error(self) -> None:      # Ray Train's Result.error: fit() raises instead
        return None

    @classmethod
    def from_path(cls, path: "str | Path | StoragePath", storage_filesystem: Any = None) -> "Result":
        """The Result of the run folder ``path`` (a local path or URI; with
        ``storage_filesystem``, a path on that filesystem), as ``fit()`` left it."""
        run = path if isinstance(path, StoragePath) else resolve(path, storage_filesystem)
        metrics_path = run / "metrics.json"
        try:
            text = metrics_path.read_text()
        except FileNotFoundError:
            raise ValueError(f"path {run} is not a jabasray run folder (no metrics.json)") from None
        except OSError as e:
            raise ValueError(f"path {run} cannot be read: {explain(e)}") from None
        history = MetricsHistory.from_json(text)
        cp = latest_checkpoint(run)
        plot = run / "trajectory.png"
        return cls(metrics=history.epochs[-1].flat() if history.epochs else {}, history=history,
                   checkpoint=export_checkpoint(cp, run) if cp is not None else None,
                   path=str(run), metrics_path=metrics_path,
                   plot_path=plot if plot.exists() else None, run_checkpoint=cp, storage=run)


def export_checkpoint(run_checkpoint: Checkpoint, run_dir: "str | Path | StoragePath") -> Any:
    """The user-facing ``ray.train.Checkpoint(path, filesystem)`` of a run checkpoint: the
    folder ``<run>/checkpoint_<epochs_done:06d>`` on the run's storage with ``model.pt``,
    ``optimizer.pt`` (and ``lr_scheduler.pt``, ``grad_scaler.pt`` when the job has them) saved
    by ``torch.save`` as plain state dicts - ``torch.load(..., weights_only=True)`` loads them
    without jabasray - and ``metadata.json``, written last (the export's commit mark: a folder
    without it is an interrupted export and is written again). Written once per run checkpoint."""
    import json

    import torch
    from ray.train import Checkpoint as RayCheckpoint

    out = as_storage_path(run_dir) / f"checkpoint_{run_checkpoint.epochs_done:06d}"
    meta = out / "metadata.json"
    if not meta.exists():
        state = run_checkpoint.load_worker_state()
        out.rmtree()
        parts = {"model.pt": state.get("model", state.get("z")),   # IIDP: "model"; SMA: central z
                 "optimizer.pt": state.get("optimizer", state.get("lr_optimizer")),
                 "lr_scheduler.pt": state.get("lr_scheduler"),
                 "grad_scaler.pt": state.get("grad_scaler")}
        written = []
        for name, obj in parts.items():
            if obj is None and name != "model.pt":
                continue
            with (out / name).open_output() as fh:
                torch.save(obj, fh)
            written.append(name)
        meta.write_text(json.dumps({"epochs_done": run_checkpoint.epochs_done,
                                    "run_checkpoint": str(run_checkpoint.path),
                                    "files": sorted(written)}, indent=1))
    return RayCheckpoint(path=out.fs_path, filesystem=out.filesystem)


def default_optimizer_fn(lr: float) -> Callable:
    """SGD with momentum 0.9 at ``lr`` (the LR at initial_global_batch; the batch-size rule
    multiplies it)."""
    def make(params: Any) -> Any:
        import torch
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return make


DEFAULT_LR = 0.05   # the default optimizer's LR when neither optimizer_fn nor JobConfig.lr is given


def default_loss_fn(outputs: Any, targets: Any) -> Any:
    import torch.nn.functional as F
    return F.cross_entropy(outputs, targets)


def emulated_resources(cluster: ClusterSpec) -> dict[str, float]:
    """Custom resources a local Ray instance needs to host ``cluster`` emulated on CPU."""
    out: dict[str, float] = {}
    for n in cluster.nodes:
        out[resource_name(n.gpu_type)] = out.get(resource_name(n.gpu_type), 0) + n.num_gpus
    return out


def ensure_ray(cluster: ClusterSpec | None, emulate: bool = True, num_cpus: int = 2,
               address: str | None = None) -> bool:
    """Connect to Ray when needed. Returns True when this call started a local instance.

    Order: already initialised -> use it; ``address`` given -> connect to it ("local": always
    start a new local instance); ``RAY_ADDRESS`` set or a cluster started with ``ray start`` on
    this machine -> connect to it; else start a local instance with ``num_cpus`` CPUs and the
    emulated ``gpu_<type>`` resources of ``cluster``.
    """
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
    if address and address != "local":
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return False
    if address is None and (os.environ.get("RAY_ADDRESS") or os.path.exists(ray_address_file())):
        # RAY_ADDRESS, else the address a `ray start` on this machine wrote where Ray keeps it
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), runtime_env=env,
                     log_to_driver=True)
            return False
        except ConnectionError:
            log.info("no running Ray cluster found; starting a local one")
    resources = emulated_resources(cluster) if (cluster is not None and emulate) else {}
    # address="local": a new instance even where a `ray start` cluster runs on this machine
    # (without it, ray.init() joins that cluster and refuses num_cpus/resources)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             resources=resources or None, runtime_env=env, log_to_driver=True)
    return True


def check_resources(cluster: ClusterSpec, emulate: bool) -> None:
    """ValueError when the Ray cluster lacks the resources ``cluster`` needs."""
    import ray

    have = ray.cluster_resources()
    need = emulated_resources(cluster) if emulate else {"GPU": sum(n.num_gpus for n in cluster.nodes)}
    short = {k: v for k, v in need.items() if have.get(k, 0) < v}
    if emulate and short and not any(k in have for k in need):
        log.warning("the Ray cluster has none of the emulated GPU resources %s: emulated GPU actors "
                    "take a small CPU share each instead", sorted(need))
        return
    if short:
        raise ValueError(f"cluster needs Ray resources {need} but the running Ray cluster has "
                         f"{ {k: have.get(k, 0) for k in need} }; start Ray with those resources "
                         f"or pass a smaller cluster")


def _apply_scaling(scaling_config: Any, cluster: ClusterSpec | None, options: DriverOptions | None
                   ) -> tuple[ClusterSpec | None, DriverOptions | None, Scaling | None]:
    """``(cluster, options, scaling)`` for a Ray Train ``ScalingConfig`` (:func:`scaling_from_ray`):
    ``use_gpu=False`` becomes ``num_workers`` GPUs emulated on CPU (Ray Train's CPU workers);
    ``use_gpu=True`` real GPUs (``DriverOptions(device="cuda")``), at most ``num_workers`` of the
    detected cluster's (``scaling``, applied when the cluster is detected: those GPUs, on the
    fewest nodes, are the job's for the whole run; like any part of a detected cluster it does
    not follow nodes that join later, :mod:`.cluster_view` rule 1). One-line ValueError where it
    contradicts ``cluster`` or ``options``."""
    if scaling_config is None:
        return cluster, options, None
    scaling = scaling_from_ray(scaling_config)
    if cluster is not None:
        raise ValueError("scaling_config and cluster both say which GPUs to use: pass one (cluster= "
                         "lists the GPUs; scaling_config= bounds the detected cluster's)")
    device = "cuda" if scaling.use_gpu else "cpu"
    if options is not None and options.device != device:
        raise ValueError(f"scaling_config.use_gpu={scaling.use_gpu} trains on {device} but "
                         f"options.device is {options.device!r}: make them agree")
    options = options or DriverOptions(device=device)
    if not scaling.use_gpu:
        return ClusterSpec.emulated({"cpu": (1, scaling.max_gpus, 1.0)}), options, None
    return None, options, scaling


# optimizers that set their own per-parameter step size: an LR scaled with the batch multiplies
# a step they already adapt, which their users seldom expect
ADAPTIVE_STEP_OPTIMIZERS = ("Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam",
                            "RMSprop", "Rprop", "SparseAdam", "Adafactor")


def training_changes(job: JobConfig, optimizer_class: str, lr: float) -> str:
    """One line saying what jabasray changes in the user's training: the global batch (moving
    between its bounds every ``adapt_interval`` iterations, or fixed) and the optimizer's LR
    (kept, or scaled with B_G by ``lr_scaling``, with a warning for adaptive-step optimizers),
    the warm-up and the gradient clipping when set. ``optimizer_class``: ``module.Class``."""
    name = optimizer_class.rsplit(".", 1)[-1]
    if job.adaptive and job.min_global_batch < job.max_global_batch:
        batch = (f"the global batch starts at {job.initial_global_batch} and moves between "
                 f"{job.min_global_batch} and {job.max_global_batch} every {job.adapt_interval} "
                 f"iterations (adaptive=False keeps it)")
    else:
        batch = f"the global batch stays {job.initial_global_batch}"
    if job.lr_scaling == "none":
        rate = f"{name}'s LR {lr:g} is kept whatever the batch (lr_scaling='none')"
    else:
        rule = "sqrt(B_G" if job.lr_scaling == "sqrt" else "(B_G"
        rate = (f"{name}'s LR {lr:g} is scaled as {lr:g} x {rule} / {job.initial_global_batch}) "
                f"(lr_scaling={job.lr_scaling!r})")
        if name in ADAPTIVE_STEP_OPTIMIZERS:
            rate += f" - {name} adapts its own step size; lr_scaling='none' keeps its LR"
    extras = []
    if job.warmup_iterations:
        extras.append(f"a linear LR warm-up over {job.warmup_iterations} iterations")
    if job.grad_clip_norm is not None:
        extras.append(f"the global gradient clipped to L2 norm {job.grad_clip_norm:g}")
    return "jabasray changes in your training: " + "; ".join([batch, rate, *extras])


def detect_cluster() -> ClusterSpec:
    """The running Ray cluster as a ClusterSpec (``ClusterSpec.from_ray``), every GPU."""
    from .placement import ray_cluster_spec
    return ray_cluster_spec()


class JabasTrainer:
    """Train ``model_fn()`` with JABAS (adaptive batching + auto-scaling) on the user's own job.

    Data - either in memory or built on every actor:
        dataset: map-style training dataset in memory (a TensorDataset is fastest); shared
            through the Ray object store.
        dataset_fn: ``() -> Dataset`` called on every GPU actor instead (e.g. reading files from
            local or shared disk); samples are read by a DataLoader per actor
            (``num_data_workers``, ``collate_fn``, ``prefetch_factor``, pinned memory on CUDA) in
            the order of the exactly-once sampler. The driver never reads a sample: it learns
            ``len(dataset)`` from a one-off probe task (:mod:`jabasray.actors.hooks`); every
            actor checks that its dataset has the probe's length and first and last sample
            (different files on different nodes: one line naming the node).
        val_dataset / val_dataset_fn: the same for validation (evaluated after every epoch,
            sharded over the actors).

    The job:
        model_fn: ``() -> torch.nn.Module``; called on every GPU actor (seeded with job.seed).
        optimizer_fn: ``params -> torch.optim.Optimizer``. Its LR is the LR at
            ``initial_global_batch``; ``JobConfig.lr_scaling`` multiplies it as B_G moves (None:
            SGD, momentum 0.9, LR ``JobConfig.lr`` or 0.05). A ``JobConfig.lr`` that disagrees
            with the optimizer's LR is an error naming both.
        loss_fn: ``(outputs, targets) -> mean loss`` (None: cross-entropy) for the default step.
        step_fn: ``(model, batch) -> scalar mean loss`` instead of the default step.
        eval_fn: ``(model, batches) -> dict[str, float]`` of per-sample means (None: loss and
            top-1 accuracy of a classifier).
        lr_scheduler_fn: ``optimizer -> torch LR scheduler``, stepped every iteration or every
            epoch (``lr_scheduler_interval``); the batch-size rule and warm-up multiply the LR
            it sets. Its state is checkpointed.
        job_config: :class:`JobConfig` (also ``precision`` and ``grad_clip_norm``).
        cluster: the GPUs to use (None: detected from the running Ray cluster).
        run_config: :class:`RunConfig` (storage_path - a local path or a URI such as
            ``s3://bucket/runs`` - name, storage_filesystem).
        perf_model / profiles: skip profiling (tests, pre-measured clusters).
        options: :class:`DriverOptions` (device, emulation, force_replacement, ...).
        callbacks: :class:`DriverCallback` hooks (progress bars, fault injection in tests).
        background: optional background scheduler (``rebalance(actor_handles)``).
        scaling_config: Ray Train's ``ScalingConfig`` instead of ``cluster``: ``num_workers``
            is the most GPUs the auto-scaler may use, ``use_gpu=False`` emulates them on CPU,
            ``accelerator_type`` (or ``resources_per_worker``'s) picks the GPU type.
        verbose: what ``fit()`` shows, as Ray's ``verbose``: 0 nothing; 1 (default) its
            console lines (e.g. that a finished run's result is returned); 2 also the actors'
            INFO log lines (else WARNING and above).
    """

    def __init__(self, model_fn: Callable, dataset: Any = None, optimizer_fn: Callable | None = None,
                 loss_fn: Callable | None = None, job_config: JobConfig | None = None,
                 cluster: ClusterSpec | None = None, run_config: RunConfig | None = None,
                 val_dataset: Any = None, *, dataset_fn: Callable | None = None,
                 val_dataset_fn: Callable | None = None, step_fn: Callable | None = None,
                 eval_fn: Callable | None = None, lr_scheduler_fn: Callable | None = None,
                 lr_scheduler_interval: str = "iteration", collate_fn: Callable | None = None,
                 num_data_workers: int = 0, prefetch_factor: int = 2, eval_batch_size: int = 256,
                 verbose: int = 1, perf_model: Any = None, profiles: dict | None = None,
                 options: DriverOptions | None = None, callbacks: Sequence[DriverCallback] = (),
                 background: Any = None, scaling_config: Any = None) -> None:
        cluster, options, self.scaling = _apply_scaling(scaling_config, cluster, options)
        if not callable(model_fn):
            raise ValueError(f"model_fn must be callable () -> nn.Module, got {model_fn!r}")
        self.job = job_config or JobConfig()
        if not isinstance(self.job, JobConfig):
            raise ValueError(f"job_config must be a JobConfig, got {type(self.job).__name__}")
        if (dataset is None) == (dataset_fn is None):
            raise ValueError("exactly one of dataset (in memory) and dataset_fn (built on each "
                             f"actor) must be given, got dataset={type(dataset).__name__}, "
                             f"dataset_fn={dataset_fn!r}")
        if val_dataset is not None and val_dataset_fn is not None:
            raise ValueError("at most one of val_dataset and val_dataset_fn may be given")
        if optimizer_fn is not None and not callable(optimizer_fn):
            raise ValueError(f"optimizer_fn must be callable params -> Optimizer, got {optimizer_fn!r}")
        from .hooks import refuse_module_classes
        refuse_module_classes(loss_fn=loss_fn, step_fn=step_fn, eval_fn=eval_fn, collate_fn=collate_fn,
                              dataset_fn=dataset_fn, val_dataset_fn=val_dataset_fn)
        self.model_fn = model_fn
        self.dataset = dataset
        if hasattr(dataset, "__len__"):   # bounds before any work
            self.job.check_dataset_size(len(dataset))
        self.optimizer_fn = optimizer_fn or default_optimizer_fn(
            self.job.lr if self.job.lr is not None else DEFAULT_LR)
        self.loss_fn = loss_fn or default_loss_fn
        self.hooks = JobHooks(dataset_fn=dataset_fn, val_dataset_fn=val_dataset_fn, step_fn=step_fn,
                              eval_fn=eval_fn, lr_scheduler_fn=lr_scheduler_fn,
                              lr_scheduler_interval=lr_scheduler_interval, collate_fn=collate_fn,
                              num_data_workers=num_data_workers, prefetch_factor=prefetch_factor,
                              eval_batch_size=eval_batch_size,
                              log_level="INFO" if int(verbose) >= 2 else "WARNING")
        self.cluster = cluster
        if cluster is not None:
            from .placement import job_cluster
            job_cluster(cluster, self.job)   # SMA/burst need GPU pairs: one line, before Ray
        if is_ray_run_config(run_config):   # Ray's own RunConfig: converted or refused here
            run_config = run_config_from_ray(run_config)
        if run_config is not None and not isinstance(run_config, RunConfig):
            raise ValueError(f"run_config must be a jabasray.config.RunConfig, got "
                             f"{type(run_config).__module__}.{type(run_config).__qualname__}")
        # a run without a name gets a unique one (as in Ray Train): two jobs never share a folder
        self.run_config = (run_config or RunConfig()).named(type(self).__name__)
        from ..validation import check_int
        self.verbose = check_int("verbose", int(verbose), min_value=0, max_value=2)
        self._hook_fns = {"model_fn": model_fn, "optimizer_fn": optimizer_fn, "loss_fn": loss_fn,
                          "step_fn": step_fn, "eval_fn": eval_fn, "lr_scheduler_fn": lr_scheduler_fn,
                          "collate_fn": collate_fn, "dataset_fn": dataset_fn,
                          "val_dataset_fn": val_dataset_fn}
        self.val_dataset = val_dataset
        self.perf_model, self.profiles = perf_model, profiles
        self.options = options or DriverOptions()
        self.callbacks = list(callbacks)
        self.background = background
        self.driver: JabasDriver | None = None
        self._checked: tuple[ProbeReport, Any] | None = None   # preflight()'s, for the next fit()

    def fit(self, wait: bool = True) -> Result | str:
        """Run (or resume) the job; see the module docstring for what is written.

        With the actor driver (the default) and ``wait=False``, return the run's name as soon as
        its driver actor is started (follow it with ``jabasray attach NAME`` or
        :func:`jabasray.actors.run_client.follow`). ``RunConfig.callbacks`` (TensorBoard, CSV,
        ... loggers) then run in the driver actor, which must be able to receive them
        (one-line ValueError before any work); ``JabasTrainer(callbacks=...)`` run only in a
        process that follows the run."""
        try:
            return self._start(wait)
        except HookError as e:   # the user's code raised: the one line and the user's frames
            raise e.with_traceback(None) from None   # (its notes), not jabasray's frames

    def _start(self, wait: bool) -> Result | str:
        opts = self.options
        if not wait and opts.driver != "actor":
            raise ValueError(f"wait=False needs DriverOptions(driver='actor'), got driver={opts.driver!r}")
        if not wait:
            check_sendable(self._detached_callbacks())
        run_dir = self.run_config.path     # resolved here: a bad URI is one line, before Ray
        cache = (as_storage_path(opts.profile_cache_dir) if opts.profile_cache_dir
                 else run_dir.parent / ".profiles")
        # storage problems (unreachable, credentials, permissions, a full disk) and a second
        # run on this folder are found before any work
        probe_run_folder(run_dir, extra_dirs=(cache,))
        if opts.driver == "actor":    # the driver actor holds the lock in its own process;
            import ray                # a name or folder in use is refused here, before anything
                                      # starts (the name needs Ray, when it is already up)
            if ray.is_initialized():
                from .run_client import check_name_free
                check_name_free(self.run_config.name)
            with run_lock(run_dir, named_driver=True):
                pass
            return self._fit(run_dir, wait)
        with run_lock(run_dir) as lock:
            return self._fit(run_dir, wait, lock)

    def _fit(self, run_dir: StoragePath, wait: bool, lock: Any = None) -> Result | str:
        opts = self.options
        # a job with in-memory datasets is probed in this process: a changed job is refused,
        # and a finished run's result returned, before Ray starts; a dataset_fn job's probe
        # runs in a Ray task, after it
        checked, self._checked = self._checked or self._preflight(run_dir), None
        if checked is None or checked[1].kind != "finished":
            ensure_ray(self.cluster, emulate=opts.emulate)
            cluster = self.cluster if self.cluster is not None else detect_cluster()
            if self.scaling is not None:    # Ray Train's ScalingConfig: these GPUs at most
                cluster = cluster.limited(self.scaling.max_gpus, self.scaling.gpu_type)
            check_resources(cluster, opts.emulate)
            if checked is None:
                checked = self._probe_and_check_run(run_dir)
        probe, start = checked
        if start.kind == "finished":
            self._say(start.message)
            return Result.from_path(run_dir)
        self._say(training_changes(self.job, (probe.optimizer or {}).get("class", "optimizer"),
                                   probe.optimizer_lr))
        hooks = self.hooks
        if self.dataset is None:          # dataset_fn: the size is known from the probe only
            self.job.check_dataset_size(probe.dataset_size)
            # every GPU actor checks that it built the dataset the probe saw (hooks.check_same_dataset)
            hooks = replace(hooks, dataset_fingerprint=probe.fingerprint)
        args = (self.model_fn, self.dataset, self.optimizer_fn, self.loss_fn, self.job, cluster, run_dir)
        kwargs = dict(val_dataset=self.val_dataset, perf_model=self.perf_model, profiles=self.profiles,
                      options=opts, background=self.background, hooks=hooks,
                      dataset_size=probe.dataset_size, profile_data=probe.profile_rows,
                      failure=self.run_config.failure_config,
                      force_resume=self.run_config.resume == "force",
                      checkpoint=self.run_config.checkpoint_config)
        # the console and Ray's logger callbacks (RunConfig.callbacks), fed in this process; a
        # detached run's RunConfig.callbacks run in its driver actor (callbacks module notes)
        callbacks, trackers = tracker_callbacks(self.run_config.callbacks, run_dir,
                                                self.run_config.name, self.job.to_dict())
        callbacks = [*self.callbacks, *callbacks]
        reporter = console_reporter(callbacks)
        if reporter is None and self.verbose >= 1 and wait:
            reporter = ConsoleReporter()
            callbacks.append(reporter)
        if not wait:
            trackers, reporter = None, None
        if trackers is not None:
            callbacks.append(trackers)
        self.driver = JabasDriver(*args, **kwargs, callbacks=callbacks)  # checks the input
        self.driver.lock = lock
        record = RunRecord(self.run_config.name, run_dir)
        done = start.checkpoint.epochs_done if start.checkpoint is not None else 0
        try:
            if trackers is not None:
                trackers.start()
            if reporter is not None:
                reporter.start(max(0, self.job.epochs - done) * probe.dataset_size)
            if opts.driver == "actor":
                from . import run_client
                self.driver = None
                run_client.check_name_free(self.run_config.name)
                record.begin()                # the marker, and Ray's record of it (run_record)
                run_client.start_run(self.run_config.name, args, kwargs, opts,
                                     callbacks=() if wait else self._detached_callbacks())
                if not wait:
                    return self.run_config.name
                result = run_client.follow(self.run_config.name, callbacks)
            else:
                record.begin()
                history = self.driver.run()
                result = finish_run(history, run_dir,
                                    self.driver.last_checkpoint or latest_checkpoint(run_dir))
                record.forget()
        except BaseException:
            if trackers is not None:
                trackers.finish(failed=True)
            raise
        finally:
            if reporter is not None:
                reporter.close()
        if trackers is not None:
            trackers.finish(failed=False)
        if result.history.held is not None:
            self._say(held_line(result.history.held))
        return result

    def _detached_callbacks(self) -> list[Any]:
        """What a detached run's driver actor runs: ``RunConfig.callbacks`` but a console
        reporter (the actor has no console)."""
        return [cb for cb in self.run_config.callbacks if not isinstance(cb, ConsoleReporter)]

    def _say(self, message: str | None) -> None:
        """One console line of ``fit()`` (``verbose`` >= 1), also logged."""
        if message:
            log.info(message)
            if self.verbose >= 1:
                print(message, flush=True)

    def preflight(self) -> Any:
        """What :meth:`fit` checks before Ray starts, for a job whose datasets are in memory
        (its probe runs in this process): every hook on a tiny batch, then the run folder's
        record of the job (a changed job is a one-line ValueError). Returns the
        :class:`~jabasray.actors.job_identity.RunStart` (``kind == "finished"``: the run has
        its result, nothing to start), or None for a ``dataset_fn`` job, whose probe runs in a
        Ray task once Ray is up. :meth:`fit` then does not probe and check again."""
        self._checked = self._preflight(self.run_config.path)     # fit() uses it, once
        return None if self._checked is None else self._checked[1]

    def _preflight(self, run_dir: StoragePath) -> tuple[ProbeReport, Any] | None:
        if self.hooks.dataset_fn is not None or self.hooks.val_dataset_fn is not None:
            return None
        return self._probe_and_check_run(run_dir)

    def _probe_and_check_run(self, run_dir: StoragePath) -> tuple[ProbeReport, Any]:
        """:meth:`probe`, then the run folder's record of the job that wrote it: resume only
        the same job (:func:`~jabasray.actors.job_identity.check_run`)."""
        probe = self.probe()
        identity = job_identity(self.job, probe.model or {}, probe.optimizer or {},
                                self._hook_fns, probe.dataset_size)
        return probe, check_run(run_dir, identity, self.run_config.name, self.run_config.resume,
                                self.job.epochs)

    def probe(self) -> ProbeReport:
        """Check every hook on a tiny batch before any actor starts (:func:`run_probe`) and
        that ``JobConfig.lr``, when given, is the optimizer's LR. One-line ValueError."""
        need_rows = (self.dataset is None and self.perf_model is None and self.profiles is None)
        report = run_probe(self.model_fn, self.optimizer_fn, self.loss_fn, self.hooks,
                           self.dataset, self.val_dataset, self.job.precision, need_rows,
                           self.job.per_sample_loss)
        if self.job.lr is not None and not math.isclose(report.optimizer_lr, self.job.lr,
                                                        rel_tol=1e-12):
            raise ValueError(f"lr: JobConfig.lr = {self.job.lr} disagrees with the LR of the "
                             f"optimizer optimizer_fn builds ({report.optimizer_lr}); the "
                             f"optimizer's LR is the LR at initial_global_batch - drop "
                             f"JobConfig.lr or make them equal")
        return report


def finish_run(history: MetricsHistory, run_dir: "str | Path | StoragePath",
               checkpoint: Checkpoint | None) -> Result:
    """Write ``metrics.json``, ``metrics.csv`` and ``trajectory.png`` of an ended run (through
    its filesystem); its :class:`Result` (``checkpoint``: the Ray Train export of ``checkpoint``)."""
    run = as_storage_path(run_dir)
    metrics_path = save_metrics(history, run / "metrics.json")
    plot_path = None
    if history.epochs:
        try:
            plot_path = plot_history(history, run / "trajectory.png")
        except Exception as e:  # noqa: BLE001 - a plot must not fail the run
            log.warning("could not write the plot: %s", e)
    return Result(metrics=history.epochs[-1].flat() if history.epochs else {}, history=history,
                  checkpoint=export_checkpoint(checkpoint, run) if checkpoint is not None else None,
                  path=str(run), metrics_path=metrics_path, plot_path=plot_path,
                  run_checkpoint=checkpoint, storage=run)
