"""Adaptive batching (JABAS section 6): gradient similarity of the two GPU groups, SimiGrad's
batch-size rule, learning-rate scaling, and the global-batch-size forecaster (6.2).

Pure numpy/python; torch is only touched when torch tensors are passed to the similarity
functions, scikit-learn/statsmodels only when a forecaster is fitted.
"""
from .batch_rule import AdaptiveBatchController, AdaptiveBatchState, next_global_batch
from .forecast import FORECAST_METHODS, GBSForecaster
from .lr_scaling import lr_factor, scaled_lr
from .similarity import cosine_similarity, group_similarity

__all__ = [
    "AdaptiveBatchController", "AdaptiveBatchState", "FORECAST_METHODS", "GBSForecaster",
    "cosine_similarity", "group_similarity", "lr_factor", "next_global_batch", "scaled_lr",
]
