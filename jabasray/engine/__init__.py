"""What runs on one device: IIDP virtual stream workers, gradient buckets, one-way weight
sync, the deterministic sampler, the burst-plan executor (torch only, no Ray).

Public surface (cross-team interfaces 1-3): :class:`IIDPWorker`, :class:`StepStats`, the
bucket-plan helpers and the sampler functions.
"""
from .burst import BurstExecutor, BurstStepStats
from .buckets import BucketSpec, FlatBuffers, default_bucket_plan, validate_bucket_plan
from .iidp import IIDPWorker, StepStats
from .sampler import IIDPSampler, IterationIndices, iteration_indices, epoch_permutation, gather_micro_batches
from .weight_sync import R_BUFFER, ShardOptimizer, choose_weight_sync

__all__ = [
    "IIDPWorker", "StepStats", "BurstExecutor", "BurstStepStats",
    "BucketSpec", "FlatBuffers", "default_bucket_plan", "validate_bucket_plan",
    "IIDPSampler", "IterationIndices", "iteration_indices", "epoch_permutation", "gather_micro_batches",
    "R_BUFFER", "ShardOptimizer", "choose_weight_sync",
]
