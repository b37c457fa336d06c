"""Profiles for every GPU type of a cluster, from one measurement on this machine.

Emulated cluster (CPU): the model is profiled once on the CPU (cached on disk) and every GPU type
is that profile scaled by its node's ``speed`` (``Profile.scaled``); the emulated "nodes" share
this machine, so the inter-node all-reduce is the intra-node one. Real GPUs: the driver holds
none, so each type is measured in a Ray task holding one GPU of it
(:func:`jabasray.actors.profiling.profile_in_tasks`, passed as ``job_perf_model(measure=...)``);
:func:`cluster_profiles` on a CUDA device (the local device's profile standing for every type)
is what a process that owns a GPU may still call.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

from ..config import JobConfig
from ..planners.perf_model import PerfModel, emulated_profiles
from ..profiles import Profile, profile_cache_key
from ..types import ClusterSpec


DRIVER_WARMUP = 1    # untimed steps before each timed point
DRIVER_REPEATS = 3   # timed steps per point ("trimmed" statistic; non-monotone points re-measured)


def driver_cache_key(model_signature: str, *, device: str, emulate: bool, min_local_batch: int,
                     weight_sync: str, bucket_cap_mb: float, step_fn: Callable | None = None,
                     collate_fn: Callable | None = None, engine_options: dict | None = None) -> str:
    """The cache file stem :func:`cluster_profiles` uses (e.g. to pre-fill a cache); a job's
    own ``step_fn``/``collate_fn`` are part of it (:func:`.measure.callable_fingerprint`)."""
    from .measure import _default_gpu_type, measurement_settings
    import torch
    gpu_type = "cpu" if emulate else _default_gpu_type(torch.device(device))
    return profile_cache_key(model_signature, gpu_type, measurement_settings(
        torch.device(device).type, min_local_batch, None, 4, None, bucket_cap_mb, weight_sync,
        DRIVER_WARMUP, DRIVER_REPEATS, "trimmed", contention=measures_contention(device),
        step_fn=step_fn, collate_fn=collate_fn, engine_options=engine_options))


def cluster_devices(cluster: ClusterSpec) -> int:
    """How many GPUs (devices) ``cluster`` holds in all."""
    return sum(n.num_gpus for n in cluster.nodes)


def measures_contention(device: str) -> bool:
    """The driver measures the gloo contention (Profile.contention) for CPU actors only: they run
    gloo on the cores the measurement used; NCCL's contention on a GPU is not measured."""
    return str(device).startswith("cpu")


def cluster_profiles(model_fn: Callable, dataset: Any, cluster: ClusterSpec, *, loss_fn: Callable,
                     optimizer_fn: Callable | None, device: str, emulate: bool, min_local_batch: int,
                     weight_sync: str, bucket_cap_mb: float, cache_dir: str | Path,
                     refresh: bool = False, max_local_batch: int | None = None,
                     step_fn: Callable | None = None, collate_fn: Callable | None = None,
                     engine_options: dict | None = None) -> dict[str, Profile]:
    """``{gpu_type: Profile}`` for every GPU type of ``cluster`` (module notes); ``refresh``
    re-measures even when a cached profile exists; ``max_local_batch`` (the job's bound on B_L)
    caps the local batches measured; ``step_fn``/``collate_fn``: the job's own step and batches
    (any batch type) are what is measured; ``engine_options`` (:func:`.measure.job_engine_options`):
    the execution the job's workers run (batched, per VSW, graphed) is what is measured."""
    from .measure import profile_model

    base = profile_model(model_fn, dataset, loss_fn=loss_fn, optimizer_fn=optimizer_fn,
                         device=device, gpu_type="cpu" if emulate else None,
                         min_local_batch=min_local_batch, max_local_batch=max_local_batch,
                         weight_sync=weight_sync, bucket_cap_mb=bucket_cap_mb, cache_dir=cache_dir,
                         warmup=DRIVER_WARMUP, repeats=DRIVER_REPEATS, statistic="trimmed",
                         contention=measures_contention(device), refresh=refresh,
                         step_fn=step_fn, collate_fn=collate_fn, engine_options=engine_options)
    if emulate:
        if base.allreduce_inter is None:
            base = replace(base, allreduce_inter=base.allreduce_intra)
        return emulated_profiles(base, {n.gpu_type: n.speed for n in cluster.nodes})
    return {t: base.scaled(1.0, t) for t in cluster.gpu_types}


def emulation_host_devices(torch_threads: int = 1, cpus: float | None = None) -> int:
    """Emulated GPUs this host runs at once: its cores (or ``cpus``, e.g. Ray's CPU resource,
    when smaller) divided by the torch threads of one actor, at least 1."""
    import os
    cores = os.cpu_count() or 1
    if cpus is not None:
        cores = min(cores, int(cpus))
    return max(1, cores // max(1, torch_threads))


def cluster_perf_model(cluster: ClusterSpec, weight_sync: str, profiles: dict[str, Profile] | None,
                       measure: Callable[[], dict[str, Profile]], host_devices: int | None = None) -> PerfModel:
    """The iteration-time model of a job: from the given ``profiles``, else from ``measure()``
    (e.g. :func:`cluster_profiles` bound to the job); every GPU type of the cluster needs one.
    ``host_devices``: see ``PerfModel`` (emulation on one host)."""
    profiles = profiles or measure()
    missing = [t for t in cluster.gpu_types if t not in profiles]
    if missing:
        raise ValueError(f"profiles must cover every GPU type of the cluster; missing {missing}")
    return PerfModel(profiles, weight_sync=weight_sync, host_devices=host_devices)


def job_perf_model(model_fn: Callable, rows: Any, cluster: ClusterSpec, job: JobConfig, *,
                   loss_fn: Callable, optimizer_fn: Callable | None, device: str, emulate: bool,
                   torch_threads: int, bucket_cap_mb: float, cache_dir: str | Path,
                   host_cpus: float | None = None, perf_model: Any = None,
                   profiles: dict[str, Profile] | None = None, refresh: bool = False,
                   shared_host: bool = True, step_fn: Callable | None = None,
                   collate_fn: Callable | None = None,
                   measure: Callable[[], dict[str, Profile]] | None = None) -> Any:
    """The iteration-time model a job plans with: ``perf_model`` as given, else a PerfModel from
    the given ``profiles``, else from profiling ``model_fn`` on ``rows`` ((inputs, targets)
    pairs, or any samples batched by ``collate_fn`` and trained by the job's ``step_fn``) with
    :func:`cluster_profiles` (cached in ``cache_dir``; ``refresh`` re-measures), or with
    ``measure()`` when given (e.g. every GPU type in a Ray task holding one GPU of it,
    :func:`jabasray.actors.profiling.profile_in_tasks`).
    Emulation: the host runs :func:`emulation_host_devices` ``(torch_threads, host_cpus)``
    emulated GPUs at once (``shared_host`` False: the "wait" emulation, whose emulated GPUs do
    not share the host's cores, :mod:`jabasray.actors.emulation`). ValueError (one line) when nothing can be profiled, or when the job's
    min B_L fits on no GPU type (no plan could ever exist)."""
    from ..planners.plan_policy import check_min_local_batch
    from .measure import job_engine_options

    if perf_model is None and profiles is None and rows is None:
        raise ValueError("profiles or perf_model must be given when the batches are not "
                         "(inputs, targets) tensor pairs and no step_fn trains them (the profiler "
                         "runs the job's step on them)")
    host = emulation_host_devices(torch_threads, host_cpus) if emulate and shared_host else None
    model = perf_model or cluster_perf_model(cluster, job.weight_sync, profiles, measure or partial(
        cluster_profiles, model_fn, rows, cluster, loss_fn=loss_fn, optimizer_fn=optimizer_fn,
        device=device, emulate=emulate, min_local_batch=job.min_local_batch,
        max_local_batch=job.max_local_batch, weight_sync=job.weight_sync,
        bucket_cap_mb=bucket_cap_mb, cache_dir=cache_dir, refresh=refresh, step_fn=step_fn,
        collate_fn=collate_fn, engine_options=job_engine_options(job, cluster_devices(cluster), device)),
        host_devices=host)
    check_min_local_batch(model, cluster.gpu_types, job.min_local_batch)
    return model


__all__ = ["driver_cache_key", "measures_contention", "cluster_devices", "cluster_profiles", "cluster_perf_model",
           "emulation_host_devices", "job_perf_model"]
