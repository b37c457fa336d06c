"""Validation on one device: the default classification metrics and a shard's evaluation.

``eval_fn(model, batches) -> dict[str, float]`` returns MEANS over the samples of ``batches``
(loss, accuracy, ...): validation is sharded over the actors (each evaluates a contiguous
slice of the validation set) and the shards' means are combined weighted by their sample
counts (:func:`jabasray.actors.metrics.reduce_metrics`), which is exactly the mean over the
whole set for any per-sample mean. A metric that is not a per-sample mean (e.g. AUC) must be
computed from per-sample outputs on one shard instead (``DriverOptions``: not provided).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from .loader import batch_size, to_device
from .step import autocast, check_metrics


def default_eval_fn(loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                    topk: tuple[int, ...] = (1,)) -> Callable[[Any, Iterable], dict[str, float]]:
    """``{"loss": mean loss_fn, "accuracy": top-1}`` (+ ``"top<k>"`` for each other k in
    ``topk``) over ``(inputs, targets)`` batches of a classifier."""
    if loss_fn is None:
        import torch.nn.functional as F
        loss_fn = F.cross_entropy

    def eval_fn(model: Any, batches: Iterable) -> dict[str, float]:
        n, loss_sum = 0, 0.0
        correct = {k: 0 for k in topk}
        for batch in batches:
            if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
                raise ValueError(f"the default eval_fn needs (inputs, targets) batches, got "
                                 f"{type(batch).__name__}; pass eval_fn(model, batches) -> dict")
            x, y = batch
            out = model(x)
            k_n = int(y.shape[0])
            loss_sum += float(loss_fn(out, y)) * k_n
            n += k_n
            if out.dim() == 2 and y.dim() == 1:
                top = out.topk(min(max(topk), out.shape[1]), dim=1).indices
                for k in topk:
                    correct[k] += int((top[:, :k] == y[:, None]).any(dim=1).sum())
        if n == 0:
            return {}
        out_m = {"loss": loss_sum / n}
        for k in topk:
            out_m["accuracy" if k == 1 else f"top{k}"] = correct[k] / n
        return out_m
    return eval_fn


def counted(batches: Iterable, device: torch.device, counter: list[int]) -> Iterator:
    """``batches`` moved to ``device``; ``counter[0]`` counts their samples."""
    for b in batches:
        counter[0] += batch_size(b)
        yield to_device(b, device)


@torch.no_grad()
def evaluate_shard(model: torch.nn.Module, batches: Iterable, eval_fn: Callable,
                   device: torch.device, precision: str = "fp32",
                   hook: str = "eval_fn") -> tuple[dict[str, float], int]:
    """(``eval_fn``'s metrics, samples seen) of ``model`` in eval mode (restored afterwards)
    under ``precision``'s autocast. A shard without samples gives ``({}, 0)``."""
    was_training = model.training
    model.eval()
    counter = [0]
    try:
        with autocast(device, precision):
            metrics = eval_fn(model, counted(batches, device, counter))
    finally:
        model.train(was_training)
    if counter[0] == 0:
        return {}, 0
    return check_metrics(metrics, hook), counter[0]
