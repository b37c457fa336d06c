"""Profiles measured on the GPUs themselves: one Ray task per GPU type, holding one GPU of it.

The driver holds no GPU (the driver actor asks for no CPU and no GPU), so it cannot measure one.
:func:`profile_in_tasks` runs :func:`jabasray.profiler.measure.profile_model` in a Ray task per
GPU type of the cluster, before any GPU actor is placed (the task must get a GPU nobody holds),
all types at once. The task asks for the resources of one GPU of that type - the same bundle a
GPU actor of that type gets (:func:`.placement.bundle_for`: ``gpu_<type>``, or ``GPU`` plus
``gpu_<type>``), and on a cluster that names its types only through Ray's detection a sliver of
the node's ``accelerator_type:<TYPE>`` resource - so a type is measured on its own kind of GPU,
with that GPU's memory bounding the local batches it probes. Emulated types (CPU) are measured
on the CPU of the node holding the emulated resource and scaled by their speed, as the
single-measurement path does.

Cache: per type, in the run's profile folder (any ``pyarrow.fs`` storage), written and read by
the driver only (tasks never touch the run's storage); the key holds the model's signature, the
type, its emulation speed and the measurement settings (:func:`cache_key`).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

from ..profiles import Profile, profile_cache_key
from ..storage import as_storage_path
from ..types import ClusterSpec
from .placement import bundle_for

log = logging.getLogger(__name__)

ACCELERATOR_SHARE = 0.001   # of a node's accelerator_type:<TYPE> resource (Ray gives it 1 per node)


def task_resources(gpu_type: str, emulate: bool, available: dict[str, float]) -> dict[str, float]:
    """Ray resources of the profiling task of ``gpu_type``: one GPU's bundle; a real GPU on a
    cluster without ``gpu_<type>`` resources also asks for a sliver of Ray's
    ``accelerator_type:<TYPE>`` (matched case-insensitively: detected types are lower-cased)."""
    res = bundle_for(gpu_type, emulate, available)
    if not emulate and f"gpu_{gpu_type}" not in res:
        accel = [k for k in available if k.lower() == f"accelerator_type:{gpu_type}".lower()]
        if accel:
            res[accel[0]] = ACCELERATOR_SHARE
    return res


def ray_options(resources: dict[str, float]) -> dict[str, Any]:
    """``.options(...)`` of a task holding ``resources``."""
    return dict(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")})


def cache_key(model_fn: Callable, gpu_type: str, *, device: str, min_local_batch: int,
              weight_sync: str, bucket_cap_mb: float, max_local_batch: int | None = None,
              step_fn: Callable | None = None, collate_fn: Callable | None = None,
              engine_options: dict | None = None) -> str:
    """The cache file stem of ``gpu_type``'s profile measured in a task (model built on the
    driver's CPU for its signature; the job's ``step_fn``/``collate_fn`` by their fingerprints,
    :func:`jabasray.profiler.measure.callable_fingerprint`)."""
    import torch

    from ..profiler.cluster import DRIVER_REPEATS, DRIVER_WARMUP, measures_contention
    from ..profiler.measure import measurement_settings, model_signature
    settings = measurement_settings(torch.device(device).type, min_local_batch, max_local_batch, 4,
                                    None, bucket_cap_mb, weight_sync, DRIVER_WARMUP, DRIVER_REPEATS,
                                    "trimmed", contention=measures_contention(device),
                                    step_fn=step_fn, collate_fn=collate_fn, engine_options=engine_options)
    model = model_fn() if callable(model_fn) and not isinstance(model_fn, torch.nn.Module) else model_fn
    return profile_cache_key(model_signature(model), gpu_type, dict(settings, where="task"))


def measure_type(model_fn: Callable, rows: Any, gpu_type: str, speed: float, *, device: str,
                 emulate: bool, loss_fn: Callable, optimizer_fn: Callable | None,
                 min_local_batch: int, weight_sync: str, bucket_cap_mb: float,
                 torch_threads: int, max_local_batch: int | None = None,
                 step_fn: Callable | None = None, collate_fn: Callable | None = None,
                 engine_options: dict | None = None,
                 host_cache_dir: str | None = None) -> tuple[dict, dict, str]:
    """The body of a profiling task: ``gpu_type``'s profile (as a dict), the resources Ray
    assigned to the task, and its node id. ``host_cache_dir``: see :func:`profile_in_tasks`."""
    import ray
    import torch

    from ..profiler.cluster import DRIVER_REPEATS, DRIVER_WARMUP, measures_contention
    from ..profiler.measure import profile_model

    torch.set_num_threads(torch_threads)
    dev = "cuda:0" if str(device).startswith("cuda") else device   # Ray set CUDA_VISIBLE_DEVICES
    prof = profile_model(model_fn, rows, loss_fn=loss_fn, optimizer_fn=optimizer_fn, device=dev,
                         gpu_type=gpu_type, min_local_batch=min_local_batch,
                         max_local_batch=max_local_batch, weight_sync=weight_sync,
                         bucket_cap_mb=bucket_cap_mb, cache_dir=None, warmup=DRIVER_WARMUP,
                         repeats=DRIVER_REPEATS, statistic="trimmed",
                         contention=measures_contention(device), step_fn=step_fn,
                         collate_fn=collate_fn, engine_options=engine_options,
                         host_cache_dir=host_cache_dir)
    if emulate:   # as cluster_profiles: the CPU measured, scaled by the type's speed
        if prof.allreduce_inter is None:
            prof = replace(prof, allreduce_inter=prof.allreduce_intra)
        prof = prof.scaled(speed, gpu_type)
    ctx = ray.get_runtime_context()
    return prof.to_dict(), dict(ctx.get_assigned_resources()), ctx.get_node_id()


def profile_in_tasks(model_fn: Callable, rows: Any, cluster: ClusterSpec, *, loss_fn: Callable,
                     optimizer_fn: Callable | None, device: str, emulate: bool,
                     min_local_batch: int, weight_sync: str, bucket_cap_mb: float,
                     cache_dir: Any, refresh: bool = False, torch_threads: int = 1,
                     timeout_s: float = 600.0, notes: list[str] | None = None,
                     max_local_batch: int | None = None, step_fn: Callable | None = None,
                     collate_fn: Callable | None = None, engine_options: dict | None = None,
                     host_cache_dir: str | None = None) -> dict[str, Profile]:
    """``{gpu_type: Profile}`` for every type of ``cluster`` (module notes); ``notes`` gets one
    line per type: cached, or where and holding what it was measured. A type whose task does
    not finish within ``timeout_s`` (no free GPU of it) is a one-line
    :class:`~jabasray.errors.PlacementTimeout`. ``host_cache_dir``: a local folder of each node
    where its tasks cache the host measurements (the gloo all-reduce fit and contention, keyed
    by host name: :func:`jabasray.profiler.measure.host_cached`), so profiling another model on
    the cluster does not measure them again; None (default): every task measures them."""
    import ray

    from ..errors import PlacementTimeout

    notes = notes if notes is not None else []
    speeds: dict[str, float] = {}
    for n in cluster.nodes:
        speeds.setdefault(n.gpu_type, n.speed)
    folder = as_storage_path(cache_dir) if cache_dir is not None else None
    available = ray.cluster_resources()
    task = ray.remote(measure_type)
    profiles: dict[str, Profile] = {}
    refs: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for t, speed in speeds.items():
        if folder is not None:
            paths[t] = folder / (cache_key(model_fn, t, device=device, min_local_batch=min_local_batch,
                                           weight_sync=weight_sync, bucket_cap_mb=bucket_cap_mb,
                                           max_local_batch=max_local_batch, step_fn=step_fn,
                                           collate_fn=collate_fn, engine_options=engine_options)
                                 + f"-x{speed:g}.json")
            if not refresh and paths[t].exists():
                try:
                    profiles[t] = Profile.from_json(paths[t].read_text())
                    notes.append(f"profile of {t}: cached ({paths[t].name})")
                    continue
                except (ValueError, TypeError, KeyError) as e:
                    log.warning("ignoring unusable cached profile %s: %s", paths[t], e)
        res = task_resources(t, emulate, available)
        refs[t] = task.options(**ray_options(res), name=f"jabasray-profile-{t}").remote(
            model_fn, rows, t, speed, device=device, emulate=emulate, loss_fn=loss_fn,
            optimizer_fn=optimizer_fn, min_local_batch=min_local_batch, weight_sync=weight_sync,
            bucket_cap_mb=bucket_cap_mb, torch_threads=torch_threads,
            max_local_batch=max_local_batch, step_fn=step_fn, collate_fn=collate_fn,
            engine_options=engine_options, host_cache_dir=host_cache_dir)
    if refs:
        ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = [t for t, r in refs.items() if r in pending]
            for r in pending:
                ray.cancel(r, force=True)
            raise PlacementTimeout(
                f"profiling timed out after {timeout_s:.0f}s: no task holding one GPU of type(s) "
                f"{late} finished ({[task_resources(t, emulate, available) for t in late]}; free: "
                f"{ray.available_resources()}); free a GPU of each type or pass profiles")
        for t, r in refs.items():
            prof_dict, held, node = ray.get(r)
            profiles[t] = Profile.from_dict(prof_dict)
            notes.append(f"profile of {t}: measured in a Ray task holding "
                         f"{ {k: v for k, v in sorted(held.items())} } on node {node[:8]}")
            if t in paths:
                paths[t].write_text(profiles[t].to_json())
    return profiles


__all__ = ["profile_in_tasks", "measure_type", "task_resources", "ray_options", "cache_key"]
