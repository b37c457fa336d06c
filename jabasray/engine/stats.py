"""What one IIDP step reports (:class:`StepStats`) and how a step's loss is read.

The step never reads the device: its loss is summed on the device and handed over as a 0-d
tensor that becomes a float when read (:class:`_DeviceScalar`); :func:`read_losses` reads an
interval's losses with one transfer. :class:`_Timings` are the host timings of the update's
phases (exposed communication, optimizer, weight copy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


class _DeviceScalar:
    """Dataclass field descriptor: holds a float or a 0-d tensor; reading the attribute turns a
    tensor into a float once (a device synchronisation on CUDA) and keeps the float. No
    default (``__get__`` on the class raises AttributeError, the dataclass rule for that)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> float:
        if obj is None:
            raise AttributeError("no default")
        v = obj.__dict__[self._key]
        if isinstance(v, torch.Tensor):
            v = float(v)
            obj.__dict__[self._key] = v
        return v

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self._key] = value


def read_losses(values: Sequence[Any]) -> list[float]:
    """Floats of step losses (:attr:`StepStats.loss_raw`): device tensors are read with ONE
    transfer (one synchronisation per interval instead of one per step)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    it = iter(torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).tolist())
    return [next(it) if isinstance(v, torch.Tensor) else float(v) for v in values]


@dataclass
class StepStats:
    """What one :meth:`IIDPWorker.train_step` reports.

    ``loss`` reads as a float; the IIDP engine stores it as a 0-d device tensor so that a step
    never waits for the device: reading ``loss`` synchronises, :attr:`loss_raw` does not (read
    many steps' losses at once with :func:`read_losses`)."""

    loss: float = _DeviceScalar()    # mean loss over all decoupled workers of all devices
    num_workers: int                 # decoupled workers on this device: n_vsw * (n_GA + 1)
    global_num_workers: int          # decoupled workers on all devices
    num_samples: int                 # samples processed on this device
    compute_time: float              # s: forward + backward of all VSWs (launches overlapped comm)
    comm_time: float                 # s: waiting for all-reduces after compute (exposed comm)
    update_time: float               # s: optimizer + weight copy
    weight_sync: str                 # "sws" | "ows" as used
    local_grad: torch.Tensor | None = None  # keep_local_grad: 1-D, trainable-parameter order;
                                            # keep_local_grad="split": [2, P], the two VSW halves
    optimizer_time: float = 0.0      # s: part of update_time spent in the optimizer (t_optim)
    copy_time: float = 0.0           # s: part of update_time spent copying weights (t_copy)
    metric_sums: dict = field(default_factory=dict)    # step_fn's (loss, {name: mean}) metrics:
                                     # sum over this device's forwards of mean x samples (float64,
                                     # 0-d tensors on the device)
    metric_counts: dict = field(default_factory=dict)  # samples behind each metric sum
    batched: bool = False            # the VSWs ran as one batched pass (else per VSW)
    graphed: bool = False            # the step was one replay of a captured CUDA graph

    @property
    def loss_raw(self) -> Any:
        """``loss`` as stored: a float or a 0-d device tensor (no synchronisation)."""
        return self.__dict__["_loss"]


@dataclass
class _Timings:
    comm: float = 0.0
    optim: float = 0.0
    copy: float = 0.0
