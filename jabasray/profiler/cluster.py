"""Profiles for every GPU type of a cluster, from one measurement on this machine.

Emulated cluster (CPU): the model is profiled once on the CPU (cached on disk) and every GPU type
is that profile scaled by its node's ``speed`` (``Profile.scaled``); the emulated "nodes" share
this machine, so the inter-node all-reduce is the intra-node one. Real GPUs: the local device's
profile stands for every type (a real heterogeneous cluster should pass per-type profiles
measured on each type, e.g. with ``jabasray profile``).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..planners.perf_model import PerfModel, emulated_profiles
from ..profiles import Profile
from ..types import ClusterSpec


def cluster_profiles(model_fn: Callable, dataset: Any, cluster: ClusterSpec, *, loss_fn: Callable,
                     optimizer_fn: Callable | None, device: str, emulate: bool, min_local_batch: int,
                     weight_sync: str, bucket_cap_mb: float, cache_dir: str | Path,
                     warmup: int = 2, repeats: int = 5) -> dict[str, Profile]:
    """``{gpu_type: Profile}`` for every GPU type of ``cluster`` (module notes)."""
    from .measure import profile_model

    base = profile_model(model_fn, dataset, loss_fn=loss_fn, optimizer_fn=optimizer_fn,
                         device=device, gpu_type="cpu" if emulate else None,
                         min_local_batch=min_local_batch, weight_sync=weight_sync,
                         bucket_cap_mb=bucket_cap_mb, cache_dir=Path(cache_dir),
                         warmup=warmup, repeats=repeats)
    if emulate:
        if base.allreduce_inter is None:
            base = replace(base, allreduce_inter=base.allreduce_intra)
        return emulated_profiles(base, {n.gpu_type: n.speed for n in cluster.nodes})
    return {t: base.scaled(1.0, t) for t in cluster.gpu_types}


def cluster_perf_model(cluster: ClusterSpec, weight_sync: str, profiles: dict[str, Profile] | None,
                       measure: Callable[[], dict[str, Profile]]) -> PerfModel:
    """The iteration-time model of a job: from the given ``profiles``, else from ``measure()``
    (e.g. :func:`cluster_profiles` bound to the job); every GPU type of the cluster needs one."""
    profiles = profiles or measure()
    missing = [t for t in cluster.gpu_types if t not in profiles]
    if missing:
        raise ValueError(f"profiles must cover every GPU type of the cluster; missing {missing}")
    return PerfModel(profiles, weight_sync=weight_sync)


__all__ = ["cluster_profiles", "cluster_perf_model"]
