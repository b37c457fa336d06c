"""What runs on one device: IIDP virtual stream workers, gradient buckets, one-way weight
sync, the deterministic sampler, the burst-plan executor (torch only, no Ray).

Public surface (cross-team interfaces 1-3): :class:`IIDPWorker`, :class:`StepStats`, the
bucket-plan helpers and the sampler functions.

Names are imported lazily (PEP 562), so that the torch-free modules of this package (the
sampler's digests, the training-metrics rule) can be imported by the metrics records and the
simulator without importing torch.
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "IIDPWorker": "iidp", "StepStats": "iidp",
    "BurstExecutor": "burst", "BurstStepStats": "burst",
    "BucketSpec": "buckets", "FlatBuffers": "buckets", "default_bucket_plan": "buckets",
    "validate_bucket_plan": "buckets",
    "IIDPSampler": "sampler", "IterationIndices": "sampler", "iteration_indices": "sampler",
    "epoch_permutation": "sampler", "gather_micro_batches": "sampler",
    "R_BUFFER": "weight_sync", "ShardOptimizer": "weight_sync", "choose_weight_sync": "weight_sync",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # PEP 562
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
