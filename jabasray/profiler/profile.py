"""Compatibility re-export: the profile data classes now live in :mod:`jabasray.profiles`
(plain data beside ``types.py``, so planners never import ``profiler``)."""
from __future__ import annotations

from ..profiles import (PROFILE_VERSION, AllReduceFit, BatchProfile, Profile, load_profiles,
                        profile_cache_key, save_profiles, synthetic_profile)

__all__ = ["PROFILE_VERSION", "AllReduceFit", "BatchProfile", "Profile", "load_profiles",
           "profile_cache_key", "save_profiles", "synthetic_profile"]
