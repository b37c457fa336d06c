"""``JabasTrainer(...).fit() -> Result``: the public entry point, in Ray Train's shape.

``fit()`` connects to Ray (or starts a local instance with the emulated GPU resources the
cluster needs) and runs the :class:`~jabasray.actors.driver.JabasDriver` loop: by default in a
restartable, detached Ray actor named after the run (:mod:`.driver_actor`; its progress streams
back into the callbacks here; ``fit(wait=False)`` returns the run's name at once), or in this
process with ``DriverOptions(driver="local")``. The run writes into ``run_config.path``:
``checkpoints/``, ``metrics.json`` and ``trajectory.png`` (B_G trajectory, actual and forecast, and the allocation per epoch). Calling ``fit()`` again on
a run folder with a checkpoint resumes it (e.g. after raising ``epochs``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import JobConfig, RunConfig
from ..types import ClusterSpec
from .checkpoint import Checkpoint, latest_checkpoint
from .driver import DriverCallback, DriverOptions, JabasDriver
from .metrics import MetricsHistory, plot_history, save_metrics
from .placement import resource_name

log = logging.getLogger(__name__)


@dataclass
class Result:
    """What ``fit()`` returns (Ray Train's ``Result`` shape plus the full history)."""

    metrics: dict                 # the last epoch's record (EpochRecord.to_dict())
    history: MetricsHistory       # per interval and per epoch
    checkpoint: Checkpoint | None # the last checkpoint (epoch boundary)
    path: Path                    # the run folder
    metrics_path: Path            # metrics.json
    plot_path: Path | None        # trajectory.png

    @property
    def val_accuracy(self) -> float | None:
        return self.history.final_val_accuracy


def default_optimizer_fn(lr: float) -> Callable:
    """SGD with momentum 0.9 at ``lr`` (the driver rescales the LR with B_G)."""
    def make(params: Any) -> Any:
        import torch
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return make


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
        ray.init(address=address, runtime_env=env, log_to_driver=False)
        return False
    if address is None and (os.environ.get("RAY_ADDRESS") or
                            os.path.exists("/tmp/ray/ray_current_cluster")):
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), runtime_env=env,
                     log_to_driver=False)
            return False
        except ConnectionError:
            log.info("no running Ray cluster found; starting a local one")
    resources = emulated_resources(cluster) if (cluster is not None and emulate) else {}
    ray.init(num_cpus=num_cpus, include_dashboard=False, resources=resources or None,
             runtime_env=env, log_to_driver=False)
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


def detect_cluster() -> ClusterSpec:
    """The running Ray cluster as a ClusterSpec (``ClusterSpec.from_ray``); odd GPUs are left out."""
    from .placement import ray_cluster_spec
    return ray_cluster_spec().validated_pairs(drop_odd_gpu=True)


class JabasTrainer:
    """Train ``model_fn()`` on ``dataset`` with JABAS (adaptive batching + auto-scaling).

    Args:
        model_fn: ``() -> torch.nn.Module``; called on every GPU actor (seeded with job.seed).
        dataset: map-style training dataset (a TensorDataset is fastest); shared through the
            Ray object store.
        optimizer_fn: ``params -> torch.optim.Optimizer`` (None: SGD, momentum 0.9, job.lr).
        loss_fn: ``(outputs, targets) -> mean loss`` (None: cross-entropy).
        job_config: :class:`JobConfig`.
        cluster: the GPUs to use (None: detected from the running Ray cluster).
        run_config: :class:`RunConfig` (storage_path, name).
        val_dataset: optional; validation accuracy is measured after every epoch.
        perf_model / profiles: skip profiling (tests, pre-measured clusters).
        options: :class:`DriverOptions` (device, emulation, force_replacement, ...).
        callbacks: :class:`DriverCallback` hooks (progress bars, fault injection in tests).
        background: optional background scheduler (``rebalance(actor_handles)``).
    """

    def __init__(self, model_fn: Callable, dataset: Any, optimizer_fn: Callable | None = None,
                 loss_fn: Callable | None = None, job_config: JobConfig | None = None,
                 cluster: ClusterSpec | None = None, run_config: RunConfig | None = None,
                 val_dataset: Any = None, *, perf_model: Any = None, profiles: dict | None = None,
                 options: DriverOptions | None = None, callbacks: Sequence[DriverCallback] = (),
                 background: Any = None) -> None:
        if not callable(model_fn):
            raise ValueError(f"model_fn must be callable () -> nn.Module, got {model_fn!r}")
        self.job = job_config or JobConfig()
        if not isinstance(self.job, JobConfig):
            raise ValueError(f"job_config must be a JobConfig, got {type(self.job).__name__}")
        self.model_fn = model_fn
        self.dataset = dataset
        self.optimizer_fn = optimizer_fn or default_optimizer_fn(self.job.lr)
        self.loss_fn = loss_fn or default_loss_fn
        self.cluster = cluster
        self.run_config = run_config or RunConfig()
        self.val_dataset = val_dataset
        self.perf_model, self.profiles = perf_model, profiles
        self.options = options or DriverOptions()
        self.callbacks = list(callbacks)
        self.background = background
        self.driver: JabasDriver | None = None

    def fit(self, wait: bool = True) -> Result | str:
        """Run (or resume) the job; see the module docstring for what is written.

        With the actor driver (the default) and ``wait=False``, return the run's name as soon as
        its driver actor is started (follow it with ``jabasray attach NAME`` or
        :func:`jabasray.actors.run_client.follow`)."""
        opts = self.options
        if not wait and opts.driver != "actor":
            raise ValueError(f"wait=False needs DriverOptions(driver='actor'), got driver={opts.driver!r}")
        if self.cluster is not None:
            self.cluster.validated_pairs(drop_odd_gpu=True)
        ensure_ray(self.cluster, emulate=opts.emulate)
        cluster = self.cluster if self.cluster is not None else detect_cluster()
        check_resources(cluster, opts.emulate)
        run_dir = self.run_config.path
        run_dir.mkdir(parents=True, exist_ok=True)
        args = (self.model_fn, self.dataset, self.optimizer_fn, self.loss_fn, self.job, cluster, run_dir)
        kwargs = dict(val_dataset=self.val_dataset, perf_model=self.perf_model, profiles=self.profiles,
                      options=opts, background=self.background)
        self.driver = JabasDriver(*args, **kwargs, callbacks=self.callbacks)  # checks the input
        if opts.driver == "actor":
            from . import run_client
            self.driver = None
            run_client.start_run(self.run_config.name, args, kwargs, opts)
            if not wait:
                return self.run_config.name
            return run_client.follow(self.run_config.name, self.callbacks)
        history = self.driver.run()
        return finish_run(history, run_dir, self.driver.last_checkpoint or latest_checkpoint(run_dir))


def finish_run(history: MetricsHistory, run_dir: Path, checkpoint: Checkpoint | None) -> Result:
    """Write ``metrics.json`` and ``trajectory.png`` of an ended run; its :class:`Result`."""
    metrics_path = save_metrics(history, run_dir / "metrics.json")
    plot_path = None
    if history.epochs:
        plot_path = plot_history(history, run_dir / "trajectory.png")
    last = history.epochs[-1].to_dict() if history.epochs else {}
    return Result(metrics=last, history=history, checkpoint=checkpoint,
                  path=run_dir, metrics_path=metrics_path, plot_path=plot_path)
