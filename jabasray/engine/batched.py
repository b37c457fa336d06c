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
:func:`join_batches` INTERLEAVES the round's micro-batches (row ``b*n + v`` = sample ``b`` of
VSW ``v``): one copy of the inputs, which lets every BatchNorm view its activations as
``[B_L, n*C, ...]`` without a copy (:mod:`.vsw_norm`); every other layer is per sample and
indifferent to the order of rows, and so is a per-sample-mean loss. Without per-VSW
BatchNorm the order is free altogether: :func:`join_adjacent` then joins micro-batches that
lie back to back in memory (the loader's views of one batch) as one view, without a copy.

:class:`BatchedExecution` runs such a step on a :class:`~jabasray.engine.state.StepState`: the
main VSW's module over each GA round, BatchNorm per VSW (the state's packed ``norms``),
gradients accumulating in place, inside the eager frame of :mod:`.eager`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping   # (isinstance with typing's alias is ~5x slower)
from typing import Any, Callable, Sequence

import torch

from .eager import EagerExecution, StepRequest
from .loader import _is_per_sample
from .state import VSW, backward
from .vsw_norm import ghost_norms

MicroBatch = Any


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


def join_batches(parts: Sequence[Any]) -> Any:
    """Interleave ``n`` equal-size micro-batches along the sample dimension (structure kept):
    row ``b*n + v`` of the result is row ``b`` of ``parts[v]``. Tensors by ``torch.stack`` on
    dim 1 (one copy; a single part is returned as it is), lists/tuples/dicts element-wise,
    collated lists of plain values likewise. ``ValueError`` for anything else."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError("a 0-d tensor in a micro-batch cannot be joined")
        if len(parts) == 1:
            return first
        rows = {int(p.shape[0]) for p in parts}
        if len(rows) != 1:
            raise ValueError(f"micro-batches of unequal size {sorted(rows)} cannot be interleaved")
        return torch.stack(list(parts), dim=1).reshape(len(parts) * rows.pop(), *first.shape[1:])
    if isinstance(first, Mapping):
        return {k: join_batches([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        if _is_per_sample(first):
            if len({len(p) for p in parts}) != 1:
                raise ValueError("micro-batches of unequal size cannot be interleaved")
            return type(first)(v for row in zip(*parts) for v in row)
        return type(first)(join_batches([p[i] for p in parts]) for i in range(len(first)))
    raise ValueError(f"a micro-batch leaf of type {type(first).__name__} cannot be joined")


def _adjacent(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``parts`` when they are contiguous views of one tensor lying back to back
    (e.g. :func:`~jabasray.engine.loader.split_batch`'s views of one batch), else ``None``."""
    first = parts[0]
    base = first._base
    if base is None or first.dim() == 0 or not first.is_contiguous():
        return None
    rest, dtype = first.shape[1:], first.dtype
    row = math.prod(rest)                # elements per sample
    end = first.storage_offset() + first.shape[0] * row
    for p in parts[1:]:
        if (p._base is not base or p.dtype != dtype or p.shape[1:] != rest
                or not p.is_contiguous() or p.storage_offset() != end):
            return None
        end += p.shape[0] * row
    rows = (end - first.storage_offset()) // row if row else sum(int(p.shape[0]) for p in parts)
    return first.as_strided((rows, *rest), first.stride(), first.storage_offset())


def join_adjacent(parts: Sequence[Any]) -> Any:
    """Concatenate ``n`` micro-batches along the sample dimension WITHOUT a copy (row
    ``v*B_L + b`` = sample ``b`` of VSW ``v``), structure kept, when every tensor leaf's parts
    lie back to back in memory; ``None`` otherwise (then :func:`join_batches`). For steps
    without per-VSW BatchNorm: every layer is per sample, so the order of the rows does not
    matter - but it must be the same for every leaf, hence all leaves or none."""
    if len(parts) == 1:
        return parts[0]
    out = _join_adjacent(parts)
    return None if out is _NOT_ADJACENT else out


def join_any_order(parts: Sequence[Any]) -> Any:
    """Join micro-batches in any row order (the same for every leaf), for a step without
    per-VSW BatchNorm: without a copy where they lie back to back (:func:`join_adjacent`),
    else interleaved (:func:`join_batches`)."""
    out = join_adjacent(parts)
    return join_batches(parts) if out is None else out


_NOT_ADJACENT = object()


def _join_adjacent(parts: Sequence[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(p, torch.Tensor) for p in parts):
            return _NOT_ADJACENT
        out = _adjacent(parts)
        return _NOT_ADJACENT if out is None else out
    if isinstance(first, Mapping):
        out = {}
        for k in first:
            out[k] = _join_adjacent([p[k] for p in parts])
            if out[k] is _NOT_ADJACENT:
                return _NOT_ADJACENT
        return out
    if isinstance(first, (list, tuple)):
        if _is_per_sample(first):
            return type(first)(v for p in parts for v in p)
        items = []
        for i in range(len(first)):
            items.append(_join_adjacent([p[i] for p in parts]))
            if items[-1] is _NOT_ADJACENT:
                return _NOT_ADJACENT
        return type(first)(items)
    return _NOT_ADJACENT


def batched_rounds(state: Any, buckets: Any, rounds: Sequence[Any], weight: float,
                   losses: list[torch.Tensor]) -> None:
    """The main VSW's GA rounds, one forward/backward pass each over ``rounds[j]`` (the ``n``
    VSWs' ``j``-th micro-batches side by side, BatchNorm per VSW by
    :func:`~jabasray.engine.vsw_norm.ghost_norms`), the loss scaled by ``weight`` and appended
    to ``losses``; the gradients accumulate in place and the main VSW's buckets are finished
    after the last round. The batched and segmented executions both run their rounds here (the
    segmented one's bucket hooks end its segments inside ``backward``)."""
    main = state.vsws[0]
    for j, batch in enumerate(rounds):
        with ghost_norms(state.norms):
            scaled = state.forward(main, batch, weight, losses)
        backward(main, scaled, last=j == len(rounds) - 1)
    buckets.finish_vsw(main)


class BatchedExecution(EagerExecution):
    """One forward/backward of the main VSW per GA round over the n VSWs' micro-batches."""

    batched = True

    def active(self) -> list[VSW]:
        return self.state.vsws[:1]

    def join(self, micro_batches: Sequence[MicroBatch]) -> list[MicroBatch]:
        """GA round ``j``'s micro-batches of the ``n`` VSWs joined into one batch, for every
        round (``ValueError`` when they cannot be joined: the step then runs per VSW).
        Without per-VSW BatchNorm the row order is free: micro-batches that lie back to back
        (the loader's views of one batch) join without a copy."""
        state = self.state
        n, ga_rounds = state.num_vsw, state.num_ga + 1
        join = join_batches if state.norms.active else join_any_order
        return [join([micro_batches[v * ga_rounds + j] for v in range(n)]) for j in range(ga_rounds)]

    def loss_weight_folded(self) -> bool:
        # the 1/(global decoupled workers) of the update folded into the loss: the gradients
        # leave backward averaged (no extra pass over them in the update). Single device
        # only: with a process group another rank may run per VSW this step (e.g. forming
        # both similarity groups), and every rank must all-reduce SUMS
        return self.process_group is None

    def passes(self, req: StepRequest, begin_vsw: Callable[[VSW], tuple[list[int], list[torch.Tensor]]],
               weights: list[float], plan: Sequence[MicroBatch]) -> list[list[torch.Tensor]]:
        """Batched execution (module notes): the main VSW runs GA round ``j`` as one pass over
        ``plan[j]`` (the ``n`` VSWs' ``j``-th micro-batches side by side), BatchNorm per VSW
        (:func:`~jabasray.engine.vsw_norm.ghost_norms`), loss times ``n`` (the sum of the VSWs'
        mean losses) / the global number of decoupled workers where that average is folded into
        the loss; gradients accumulate in place."""
        state = self.state
        lanes, main = state.lanes, state.vsws[0]
        weight = state.num_vsw / (state.global_num_workers if self.loss_weight_folded() else 1)
        try:
            with lanes.context(lanes.vsw[0]):
                _, losses = begin_vsw(main)
                batched_rounds(state, self.buckets, plan, weight, losses)
        finally:
            main.in_step = main.counting = False
        return [losses]
