"""The user's training step, mixed precision and the per-step loss check.

A *step function* ``step_fn(model, batch) -> loss`` computes the mean loss of one micro-batch
(a 0-d tensor); the engine calls ``loss.backward()``. The default, :func:`supervised_step`, is
``loss_fn(model(inputs), targets)`` for ``batch = (inputs, targets)``; anything else (dict
batches, several outputs, auxiliary losses) is the user's own ``step_fn``.

Precision (``"fp32" | "bf16" | "fp16"``): the step runs under ``torch.autocast`` with that
dtype (fp32: no autocast). fp16 gradients underflow without loss scaling, so fp16 also gets a
``torch.amp.GradScaler`` (:func:`make_grad_scaler`): the engine scales each micro-batch loss
before backward, unscales the all-reduced gradient before clipping and the update, and skips
the update when it holds inf/NaN (the scaler's state is part of the worker's checkpoint).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

from ..validation import check_choice

from ..config import PRECISIONS
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def supervised_step(loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """``step(model, (inputs, targets)) = loss_fn(model(inputs), targets)``."""
    def step(model: Any, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return loss_fn(model(inputs), targets)
    step.__name__ = "supervised_step"
    return step


def autocast(device: torch.device, precision: str, cache_enabled: bool = True) -> ContextManager[Any]:
    """``torch.autocast`` for ``precision`` on ``device`` (a no-op context for fp32).
    ``cache_enabled=False`` for a forward captured in a CUDA graph (PyTorch's rule: the
    autocast cache of cast weights must not live across a capture)."""
    check_choice("precision", precision, PRECISIONS)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=_DTYPES[precision],
                          cache_enabled=cache_enabled)


def make_grad_scaler(device: torch.device, precision: str) -> "torch.amp.GradScaler | None":
    """A GradScaler for fp16 (None otherwise)."""
    check_choice("precision", precision, PRECISIONS)
    if precision != "fp16":
        return None
    scaler = torch.amp.GradScaler(torch.device(device).type)
    # initialise the scale now: VSW threads call scale() concurrently, and its lazy
    # initialisation is not thread-safe
    scaler.scale(torch.ones((), device=device))
    return scaler


def check_loss(loss: Any, hook: str = "step_fn") -> torch.Tensor:
    """``loss`` must be a 0-d floating tensor that requires grad; else a one-line ValueError
    naming ``hook`` and what it returned."""
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"{hook} must return a scalar loss tensor, got {type(loss).__name__}: "
                         f"{_short(loss)}")
    if loss.dim() != 0:
        raise ValueError(f"{hook} must return a scalar loss tensor, got a tensor of shape "
                         f"{tuple(loss.shape)}")
    if not loss.is_floating_point() or not loss.requires_grad:
        raise ValueError(f"{hook} must return a loss that requires grad (computed from the "
                         f"model's parameters), got {_short(loss)}")
    return loss


def split_step_output(out: Any, hook: str = "step_fn") -> tuple[Any, dict[str, Any] | None]:
    """A step returns a loss, or ``(loss, {name: value})`` with training metrics (means over
    the step's batch: numbers or one-element tensors, kept on their device). Returns
    ``(loss, metrics or None)``; a bad metrics dict is a one-line ValueError naming ``hook``."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        return out, None
    loss, metrics = out
    for k, v in metrics.items():
        ok = isinstance(k, str) and not isinstance(v, bool) and (
            isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1))
        if not ok:
            raise ValueError(f"{hook} must return (loss, dict[str, number]) for training metrics, "
                             f"got {{{k!r}: {_short(v)}}}")
    return loss, metrics


def check_metrics(metrics: Any, hook: str = "eval_fn") -> dict[str, float]:
    """``metrics`` must be a ``dict[str, number]``; returns it with float values."""
    if not isinstance(metrics, dict) or not metrics:
        raise ValueError(f"{hook} must return a non-empty dict[str, float], got "
                         f"{type(metrics).__name__}: {_short(metrics)}")
    out = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{hook} must return a dict[str, float], got {{{k!r}: {_short(v)}}}")
        out[k] = float(v)
    return out


def _short(x: Any, n: int = 60) -> str:
    s = repr(x).replace("\n", " ")
    return s if len(s) <= n else s[:n - 3] + "..."
