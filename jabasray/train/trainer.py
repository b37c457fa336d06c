"""``JabasTorchTrainer(train_loop_per_worker, ...).fit() -> Result``: Ray Train's shape over
jabasray's driver.

The job is the hooks API's job (:class:`jabasray.actors.trainer.JabasTrainer`) whose model,
optimizer, dataset and step come from the user's loop (:class:`.actor.LoopCallables`) and whose
GPU actors host that loop (:class:`.actor.LoopGPUActor`): the probe, the plans, the similarity
every p iterations, the forecast, auto-scaling, checkpoints, storage, the failure policy and
callbacks are the ones every jabasray job has.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Sequence

from ..config import JobConfig
from .actor import LoopCallables, LoopGPUActor
from .bridge import LOOP_NAME, takes_config

log = logging.getLogger(__name__)


class JabasTorchTrainer:
    """Run ``train_loop_per_worker(config)`` (or ``()``) on every GPU actor of a JABAS job.

    Args:
        train_loop_per_worker: the user's loop; it calls :func:`~jabasray.train.prepare_data_loader`,
            :func:`~jabasray.train.prepare_model`, :func:`~jabasray.train.prepare_optimizer` and
            iterates ``for epoch in epochs(n, model=..., optimizer=..., ...)``; ``n`` must equal
            ``job_config.epochs``. Picklable (cloudpickle).
        train_loop_config: its argument (Ray Train's ``train_loop_config``).
        job_config: :class:`JobConfig` (global batch bounds, p, alpha, LR scaling rule ...);
            ``sync="iidp"`` and ``parallelism="data"`` only; CUDA graphs are off (a captured step
            would not run the loop's code again).
        cluster, run_config, options, callbacks, perf_model, profiles, verbose, scaling_config:
            as :class:`~jabasray.actors.trainer.JabasTrainer` (Ray Train's ``ScalingConfig``:
            ``num_workers`` the most GPUs, ``use_gpu=False`` GPUs emulated on CPU).
        num_data_workers, prefetch_factor: DataLoader workers per actor reading the loop's dataset.
    """

    def __init__(self, train_loop_per_worker: Callable, *, train_loop_config: Any = None,
                 job_config: JobConfig | None = None, cluster: Any = None, run_config: Any = None,
                 options: Any = None, callbacks: Sequence[Any] = (), perf_model: Any = None,
                 profiles: dict | None = None, verbose: int = 1, num_data_workers: int = 0,
                 prefetch_factor: int = 2, scaling_config: Any = None) -> None:
        if not callable(train_loop_per_worker):
            raise ValueError(f"{LOOP_NAME} must be callable (config) -> None or () -> None, got "
                             f"{train_loop_per_worker!r}")
        if train_loop_config is not None and not takes_config(train_loop_per_worker):
            raise ValueError(f"train_loop_config is given but {LOOP_NAME} takes no argument; "
                             f"define it as def {LOOP_NAME}(config)")
        job = job_config if job_config is not None else JobConfig()
        if not isinstance(job, JobConfig):
            raise ValueError(f"job_config must be a JobConfig, got {type(job).__name__}")
        if job.sync != "iidp":
            raise ValueError(f"sync: a {LOOP_NAME} job runs with sync='iidp', got {job.sync!r}")
        if job.parallelism != "data":
            raise ValueError(f"parallelism: a {LOOP_NAME} job runs with parallelism='data', "
                             f"got {job.parallelism!r}")
        if job.cuda_graphs != "off":
            job = replace(job, cuda_graphs="off")
        from ..actors.trainer import JabasTrainer

        self.fn, self.config, self.job = train_loop_per_worker, train_loop_config, job
        c = self.calls = LoopCallables(train_loop_per_worker, train_loop_config, job.epochs)
        # the hooks API's trainer, fed by the loop (module notes); it checks its arguments here
        self.trainer = JabasTrainer(c.model_fn, optimizer_fn=c.optimizer_fn, job_config=job,
                                    cluster=cluster, run_config=run_config, dataset_fn=c.dataset_fn,
                                    step_fn=c.step_fn, collate_fn=c.collate_fn, verbose=verbose,
                                    perf_model=perf_model,
                                    profiles=profiles, options=options, callbacks=list(callbacks),
                                    num_data_workers=num_data_workers, prefetch_factor=prefetch_factor,
                                    scaling_config=scaling_config)
        self.trainer.hooks = replace(self.trainer.hooks, actor_class=LoopGPUActor)

    @property
    def run_config(self) -> Any:
        return self.trainer.run_config

    def preflight(self) -> Any:
        """As :meth:`JabasTrainer.preflight`: None (the loop's probe runs in a Ray task)."""
        return self.trainer.preflight()

    def fit(self, wait: bool = True) -> Any:
        """Train; returns the :class:`~jabasray.actors.trainer.Result` (as ``JabasTrainer.fit``)."""
        return self.trainer.fit(wait=wait)
