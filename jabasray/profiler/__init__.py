"""Profiler: measures a model on one device and produces a :class:`Profile` (plain data, JSON).

``Profile`` (and friends) live in :mod:`jabasray.profiles` (plain data, no torch), so
planners can use them. ``profile_model`` (in :mod:`jabasray.profiler.measure`, needs torch and the
engine) is imported lazily on first access.
"""
from __future__ import annotations

from typing import Any

from ..profiles import (PROFILE_VERSION, AllReduceFit, BatchProfile, Profile, load_profiles,
                      profile_cache_key, save_profiles, synthetic_profile)

__all__ = ["PROFILE_VERSION", "AllReduceFit", "BatchProfile", "Profile", "load_profiles",
           "profile_cache_key", "save_profiles", "synthetic_profile", "profile_model", "model_signature",
           "measure_allreduce", "cluster_profiles", "cluster_perf_model"]

_LAZY = {"profile_model", "model_signature", "measure_allreduce", "estimate_memory"}


def __getattr__(name: str) -> Any:  # PEP 562: keep torch out of `import jabasray.profiler`
    if name in ("cluster_profiles", "cluster_perf_model"):
        from . import cluster
        return getattr(cluster, name)
    if name in _LAZY:
        from . import measure
        return getattr(measure, name)
    raise AttributeError(f"module 'jabasray.profiler' has no attribute {name!r}")
