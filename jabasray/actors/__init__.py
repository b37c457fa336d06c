"""The Ray layer: GPU actors (one per GPU), the JABAS driver, placement, checkpoints, metrics.

Public API::

    from jabasray.actors import JabasTrainer, Result, JabasDriver, DriverOptions, DriverCallback
    result = JabasTrainer(model_fn, dataset, optimizer_fn, loss_fn, job_config,
                          cluster=None, run_config=RunConfig(storage_path, name),
                          val_dataset=None).fit()

Emulated GPU types are Ray custom resources ``gpu_<type>`` (:func:`placement.resource_name`).
Names are imported lazily so that ``import jabasray.actors`` stays cheap.
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "JabasTrainer": "trainer", "Result": "trainer", "ensure_ray": "trainer",
    "JabasDriver": "driver", "DriverOptions": "driver", "DriverCallback": "driver",
    "ActorFailure": "fanout",
    "GPUActor": "gpu_actor", "IntervalRequest": "gpu_actor", "IntervalReply": "gpu_actor",
    "MetricsHistory": "metrics", "IntervalRecord": "metrics", "EpochRecord": "metrics",
    "plot_history": "metrics",
    "Checkpoint": "checkpoint", "DriverState": "checkpoint", "latest_checkpoint": "checkpoint",
    "Slot": "placement", "slots_for": "placement", "resource_name": "placement",
    "Rendezvous": "rendezvous", "RendezvousServer": "rendezvous",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # PEP 562
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
