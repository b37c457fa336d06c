"""Gradient similarity Phi of the two GPU groups (SimiGrad, used by JABAS section 6.1).

JABAS splits the current allocation into two identical groups (one GPU of every pair). Every p
iterations each group aggregates the gradients of its decoupled workers and the two aggregates
are compared by their cosine similarity

    Phi = <g_A, g_B> / (||g_A|| * ||g_B||)                                     (SimiGrad, Alg. 1)

Phi close to 1 means a half of the global batch already points where the other half does (the
batch is larger than it needs to be); a small Phi means the gradient is noisy and B_G should grow.

The functions accept numpy arrays, anything with the array protocol (lists, tuples), or torch
tensors (CPU or CUDA). torch is never imported here unless a torch tensor is passed in: a tensor
is reduced with its own methods on its own device and only the scalar result leaves the device.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


def _is_torch_tensor(x: Any) -> bool:
    # Duck typing keeps torch out of the import graph of pure callers (planners, benchmarks).
    return type(x).__module__.startswith("torch") and hasattr(x, "detach") and hasattr(x, "numel")


def _flat_torch(x: Any) -> Any:
    return x.detach().reshape(-1).double()


def cosine_similarity(g1: Any, g2: Any) -> float:
    """Cosine similarity of two gradients, flattened: ``<g1, g2> / (||g1|| ||g2||)``.

    Args:
        g1, g2: gradients of the two groups: numpy arrays, sequences, or torch tensors of the
            same number of elements (any shape; they are flattened). Computed in float64.

    Returns:
        Phi in [-1, 1] as a Python float. If either gradient is all zeros the similarity is
        undefined; like ``torch.nn.functional.cosine_similarity`` (which clamps the norms by a
        small eps) this returns 0.0.

    Raises:
        ValueError: if the sizes differ, a gradient is empty, or holds NaN/inf.
    """
    if _is_torch_tensor(g1) or _is_torch_tensor(g2):
        import torch  # lazy: only when the caller already works with torch

        ref = g1 if _is_torch_tensor(g1) else g2
        a = _flat_torch(torch.as_tensor(g1, device=ref.device))
        b = _flat_torch(torch.as_tensor(g2, device=ref.device))
        _check_sizes(a.numel(), b.numel())
        # One stacked reduction -> a single device-to-host copy.
        dot, n1, n2 = (float(v) for v in torch.stack([a.dot(b), a.dot(a), b.dot(b)]).cpu())
    else:
        a = np.asarray(g1, dtype=np.float64).reshape(-1)
        b = np.asarray(g2, dtype=np.float64).reshape(-1)
        _check_sizes(a.size, b.size)
        dot, n1, n2 = float(a @ b), float(a @ a), float(b @ b)
    if not (math.isfinite(dot) and math.isfinite(n1) and math.isfinite(n2)):
        raise ValueError("gradients must be finite, got NaN or inf in the group gradients")
    if n1 == 0.0 or n2 == 0.0:
        return 0.0
    phi = dot / (math.sqrt(n1) * math.sqrt(n2))
    return max(-1.0, min(1.0, phi))  # rounding can step just outside [-1, 1]


def _check_sizes(n1: int, n2: int) -> None:
    if n1 == 0 or n2 == 0:
        raise ValueError(f"gradients must be non-empty, got sizes {n1} and {n2}")
    if n1 != n2:
        raise ValueError(f"gradients must have the same number of elements, got {n1} and {n2}")


def _sum(grads: Sequence[Any], name: str) -> Any:
    if len(grads) == 0:
        raise ValueError(f"{name} must list at least one gradient, got an empty list")
    if any(_is_torch_tensor(g) for g in grads):
        import torch

        ref = next(g for g in grads if _is_torch_tensor(g))
        total = torch.zeros(ref.numel(), dtype=torch.float64, device=ref.device)
        for g in grads:
            t = _flat_torch(torch.as_tensor(g, device=ref.device))
            _check_sizes(total.numel(), t.numel())
            total += t
        return total
    flat = [np.asarray(g, dtype=np.float64).reshape(-1) for g in grads]
    for f in flat:
        _check_sizes(flat[0].size, f.size)
    return np.sum(flat, axis=0)


def group_similarity(group_a: Sequence[Any], group_b: Sequence[Any]) -> float:
    """Phi of two GPU groups from the per-device local gradients of each group.

    Each device reports ``StepStats.local_grad`` = the SUM over its decoupled workers of their
    micro-batch mean-loss gradients (interfaces.md, 2). A group's aggregated gradient is the
    mean over its ``n_w / 2`` workers, i.e. the sum of its devices' local gradients divided by
    the group's worker count; cosine similarity is scale invariant, so the plain sums suffice:

        Phi = cos(sum_{d in A} local_grad_d, sum_{d in B} local_grad_d)
    """
    return cosine_similarity(_sum(group_a, "group_a"), _sum(group_b, "group_b"))
