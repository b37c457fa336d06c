"""Training metrics of the user's step: the one reduction rule, shared by every mode.

A step (``step_fn``, or ``loss_fn`` in the default supervised step) may return
``(loss, {name: value})`` where each value is the MEAN of the metric over the step's ``n``
samples (:func:`jabasray.engine.step.split_step_output`). Means are combined by sample counts:

    sum_k  = sum over forwards f of  m_{k,f} * n_f         (float64)
    count_k = sum over forwards f of n_f
    mean_k = sum_k / count_k

which is exactly the mean over all samples for any per-sample mean (accuracy, loss, top-k),
whatever the split of the samples into forwards, learners, ranks, iterations or intervals.
Every mode uses these functions: the IIDP/VSW engine and the Crossbow SMA learners per forward
(sums stay 0-d float64 tensors on the device, read once per interval), the burst-parallel
executor per output-layer shard, the GPU actor per interval, the driver per interval over ranks
and per epoch over intervals (plain floats there).
"""
from __future__ import annotations

from typing import Any, Mapping


def add_step_metrics(sums: dict, counts: dict[str, int], metrics: Mapping[str, Any], n: int,
                     device: Any = None) -> None:
    """Add one forward's ``metrics`` (means over its ``n`` samples: numbers or one-element
    tensors) to ``sums`` (``mean x n`` as 0-d float64 tensors on the metric's device, or on
    ``device`` for plain numbers) and ``counts`` (``n``), in place. No host synchronisation."""
    import torch

    for k, v in metrics.items():
        t = v.detach().reshape(()).to(torch.float64) if isinstance(v, torch.Tensor) else \
            torch.tensor(float(v), dtype=torch.float64, device=device)
        sums[k] = sums[k] + t * n if k in sums else t * n
        counts[k] = counts.get(k, 0) + n


def merge_metric_sums(sums: dict, counts: dict[str, int], more_sums: Mapping[str, Any],
                      more_counts: Mapping[str, int]) -> None:
    """Add the sums and counts of other forwards (learners, steps, ranks, intervals) into
    ``sums``/``counts`` in place (tensors or floats alike)."""
    for k, v in more_sums.items():
        sums[k] = sums[k] + v if k in sums else v
        counts[k] = counts.get(k, 0) + more_counts[k]


def metric_means(sums: Mapping[str, Any], counts: Mapping[str, int]) -> dict[str, float]:
    """``{name: sum / count}`` for every metric with samples (module notes)."""
    return {k: float(v) / counts[k] for k, v in sums.items() if counts.get(k)}


__all__ = ["add_step_metrics", "merge_metric_sums", "metric_means"]
