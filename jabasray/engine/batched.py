"""Batched VSW execution: when it is exact, and how the VSWs' micro-batches become one batch.

After one-way weight sync (JABAS/IIDP section 4) all ``n`` VSWs of a device hold the same
weights, so GA round ``j`` of the ``n`` VSWs (VSW ``v`` takes micro-batch ``v*(n_GA+1) + j``)
is ONE forward/backward over the ``n`` micro-batches side by side. With a step whose loss is
a per-sample mean over equal local batches of ``B_L`` samples,

    L_joint = 1/(n B_L) sum_v sum_{i in v} l_i = (1/n) sum_v L_v,

so ``n * L_joint`` back-propagates exactly ``sum_v grad L_v``, IIDP's local sum of the
decoupled workers' gradients (the update then divides by the global number of decoupled
workers, as per-VSW execution does). BatchNorm stays per VSW (:mod:`.vsw_norm`). GA rounds
accumulate in place (activation memory as for ``n`` concurrent VSWs, not ``n*(n_GA+1)``).

:func:`batch_fallback_reason` says why a step cannot run batched (then it runs per VSW);
:func:`join_batches` concatenates micro-batches, without a copy when they are adjacent views
of one batch (the loader splits one collated batch, so with ``n_GA = 0`` a round is exactly
the batch it was split from).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .loader import _is_per_sample


def batch_fallback_reason(num_vsw: int, ragged: bool, per_sample_loss: bool,
                          coupling: Sequence[str], forced: str | None) -> str | None:
    """Why this step runs per VSW, or ``None`` when batched execution is exact.

    ``forced``: the per-VSW scheme the user forced (``vsw_execution``), ``None`` for "auto".
    """
    if forced is not None:
        return f"vsw_execution={forced!r} forces per-VSW execution"
    if ragged:                           # (each micro-batch weighted by its size)
        return "ragged step (micro-batches of unequal size)"
    if num_vsw == 1:
        return None                      # one VSW: batched and per-VSW are the same pass
    if not per_sample_loss:
        return "per_sample_loss=False (the step's loss is not a per-sample mean)"
    if coupling:
        return "batch-coupled modules " + ", ".join(coupling[:3]) + (" ..." if len(coupling) > 3 else "")
    return None


def _adjacent(parts: Sequence[torch.Tensor]) -> bool:
    """``parts`` are contiguous, same-shaped-row views that follow each other in one storage."""
    p0 = parts[0]
    if not p0.is_contiguous():
        return False
    storage = p0.untyped_storage().data_ptr()
    end = p0.data_ptr() + p0.numel() * p0.element_size()
    for p in parts[1:]:
        if (not p.is_contiguous() or p.dtype != p0.dtype or p.device != p0.device
                or p.shape[1:] != p0.shape[1:] or p.untyped_storage().data_ptr() != storage
                or p.data_ptr() != end):
            return False
        end += p.numel() * p.element_size()
    return True


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


def join_batches(parts: Sequence[Any]) -> Any:
    """Concatenate micro-batches along the sample dimension (structure kept): tensors by
    ``torch.cat`` (a view when :func:`_adjacent`), lists/tuples/dicts element-wise, collated
    lists of plain values by list concatenation. ``ValueError`` for anything else."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError("a 0-d tensor in a micro-batch cannot be concatenated")
        if len(parts) == 1:
            return first
        if _adjacent(parts) and not any(p.requires_grad for p in parts):
            rows = sum(int(p.shape[0]) for p in parts)
            shape = (rows, *first.shape[1:])
            return first.as_strided(shape, _contiguous_strides(shape))
        return torch.cat(list(parts))
    if isinstance(first, Mapping):
        return {k: join_batches([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        if _is_per_sample(first):
            return type(first)(v for p in parts for v in p)
        return type(first)(join_batches([p[i] for p in parts]) for i in range(len(first)))
    raise ValueError(f"a micro-batch leaf of type {type(first).__name__} cannot be concatenated")
