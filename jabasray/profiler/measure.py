"""Measure a model on one device with the IIDP engine and build its :class:`Profile`.

What is measured (JABAS section 5.1):

* local batch sizes B_L = min B_L, 2 min B_L, ... up to max B_L^g, the largest that fits:
  on CUDA found by probing (a training step per size until ``torch.cuda.OutOfMemoryError``),
  on CPU bounded by ``memory_budget_gb`` with the memory estimate of :func:`estimate_memory`;
  ``max_local_batch`` additionally caps the search (profiling time);
* for every B_L, n_max (the most VSWs that fit: on CUDA probed up to the memory limit, by
  doubling then bisection (:func:`probe_max_fitting`, one untimed step per probe, an
  ``OutOfMemoryError`` empties the cache and means "does not fit"), bounded by ``max_num_vsw``
  (default ``CUDA_NUM_VSW_BOUND``); on CPU there is no memory limit to probe, so n_max is the
  cap ``max_num_vsw`` (default ``CPU_NUM_VSW_CAP``), or the largest n within
  ``memory_budget_gb`` by the estimate) and the
  engine's ``compute_time`` (forward + backward of all VSWs) at n_vsw = 1 and n_vsw = n_max:
  the two points of Eq. 1 (median of ``repeats`` steps after ``warmup`` steps). The engine
  runs the n VSWs as it does in training - batched (one pass over n adjacent micro-batches,
  per-VSW BatchNorm) unless ``vsw_execution`` forces per-VSW execution - so Eq. 1's
  throughput-vs-n_vsw line is that of the batched step (section 5.1 profiles the VSWs the
  paper runs concurrently; what we run instead is what we measure). The profiler's worker is
  built with the job's engine options (:func:`job_engine_options`): a job whose loss is not a
  per-sample mean is timed per VSW, a job on one CUDA device with ``cuda_graphs="auto"`` is
  timed as graph replays (forward, backward and update in one replay, counted as compute), and
  ``Profile.execution`` records what ran;
* zeta, the forward share of forward + backward, timed directly on a copy of the model;
* t_optim: the engine's ``update_time`` at n_vsw = 1 (no weight copies); t_copy: one copy of all
  weights into another replica (a flat buffer of W bytes, as the engine's flat buffers do);
* the step overhead: wall time of a step minus compute, exposed comm and update at n_vsw = 1
  (host bookkeeping outside Eq. 6; see :mod:`jabasray.planners.perf_model`);
* the gradient bucket sizes (the engine's bucket plan, backward order) and W;
* the all-reduce regression of Eq. 3 from timed all-reduces of ``len(allreduce_sizes)`` tensor
  sizes in a ``world_size``-process gloo group on 127.0.0.1 (:func:`measure_allreduce`). Only an
  intra-node fit can be measured from one machine; an inter-node fit measured elsewhere can be
  passed in (``inter_node_fit``). Deviation from JABAS section 5.1 (which profiles this fit
  offline): a training run replaces it by a fit measured on its placed GPU actors with the
  job's backend (:mod:`jabasray.actors.allreduce_fit`), because the fit depends on the link the
  collective actually uses (NVLink/PCIe within a node, the network across nodes) and on the
  backend (NCCL, gloo), none of which this loopback gloo group sees.

Profiles are cached as JSON in ``cache_dir`` under ``<model signature>-<gpu type>-<settings hash>-v<version>``
(:func:`measurement_settings`: device, torch version, profiler revision and every measurement
setting), so a change of any of them re-measures.

Robust and fast: only n_vsw = 1 and n_max are timed (intermediate n are probed with
one untimed step where memory must be probed, skipped on CPU without a memory budget); each
point is the "trimmed" statistic (median of the faster half) of ``repeats`` steps; compute times
that fall as B_L grows are re-measured and, if still non-monotone, clipped.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HookCall
from ..storage import StoragePath, as_storage_path
from ..validation import check_choice, check_float, check_int
from ..profiles import AllReduceFit, BatchProfile, Profile, profile_cache_key
from ..types import accelerator_type_of

log = logging.getLogger(__name__)

DEFAULT_ALLREDUCE_SIZES = tuple(4096 * 2 ** k for k in range(10))   # 4 KiB .. 2 MiB
ACTIVATION_FACTOR = 2.0   # saved activations + their gradients during backward


# ---------------------------------------------------------------------------- helpers
def model_signature(model: nn.Module) -> str:
    """sha256 (16 hex) of the class, the module tree and every parameter's name/shape/dtype."""
    h = hashlib.sha256()
    h.update(f"{type(model).__module__}.{type(model).__qualname__}\n{model!r}\n".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}\n".encode())
    return h.hexdigest()[:16]


def callable_fingerprint(fn: Callable | None) -> str | None:
    """What a profile measured with the user's ``step_fn``/``collate_fn`` depends on: sha256
    (16 hex) of the callable's ``module.qualname``, its code (bytecode, names and constants,
    nested functions included), its defaults and what its closure and a partial's arguments
    hold (callables among them by their own fingerprint, other values by ``repr``); a callable
    instance by its class's ``__call__``. An edited function body under the same name gives
    another fingerprint, so a stale cached profile is not reused. None for None."""
    if fn is None:
        return None
    if isinstance(fn, HookCall):   # the user's callable, not the wrapper that names its errors
        fn = fn.fn
    h = hashlib.sha256()
    _fingerprint_into(h, fn, depth=0)
    return h.hexdigest()[:16]


def _fingerprint_into(h: Any, obj: Any, depth: int) -> None:
    import functools
    import types

    if depth > 4:                                  # deep closures: stop (the name still counts)
        h.update(b"...")
        return
    if isinstance(obj, functools.partial):
        h.update(b"partial(")
        for x in (obj.func, *obj.args, *sorted(obj.keywords.items())):
            _fingerprint_into(h, x, depth + 1)
        h.update(b")")
        return
    if isinstance(obj, types.CodeType):
        h.update(obj.co_code)
        h.update(repr(obj.co_names).encode())
        for c in obj.co_consts:
            _fingerprint_into(h, c, depth + 1) if isinstance(c, types.CodeType) else h.update(repr(c).encode())
        return
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], str):   # a keyword argument
        h.update(obj[0].encode())
        _fingerprint_into(h, obj[1], depth + 1)
        return
    fn = getattr(obj, "__func__", obj)             # bound methods: their function
    code = getattr(fn, "__code__", None)
    if code is None and callable(obj) and not isinstance(obj, type):
        call = getattr(type(obj), "__call__", None)
        code = getattr(call, "__code__", None)
        fn = call if code is not None else fn
        h.update(f"{type(obj).__module__}.{type(obj).__qualname__}()".encode())
    if code is None:                               # a builtin, class or plain value
        name = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        h.update((name if name != "." else repr(obj)).encode())
        return
    h.update(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}".encode())
    _fingerprint_into(h, code, depth + 1)
    h.update(repr(getattr(fn, "__defaults__", None)).encode())
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:                         # an empty cell
            continue
        _fingerprint_into(h, value, depth + 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _batch_fn(data: Any, collate_fn: Callable | None = None) -> Callable[[int], Any]:
    """``n -> batch`` of n samples cycling through ``data`` (a callable ``n -> batch`` is used
    as it is). An indexable dataset is batched as training batches it
    (:func:`jabasray.engine.loader.gather_rows`): a ``TensorDataset`` by direct indexing (a
    tuple of tensors), any other dataset by ``collate_fn`` of the samples - the job's own,
    else torch's ``default_collate`` (so (x, y) pairs, dicts of tensors, ... give the batch a
    training step sees)."""
    if callable(data) and not hasattr(data, "__getitem__"):
        return data
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        from ..engine.loader import gather_rows

        size = len(data)
        if size < 1:
            raise ValueError("data must hold at least one sample, got an empty dataset")

        def take(n: int) -> Any:
            return gather_rows(data, [i % size for i in range(n)], collate_fn)
        return take
    raise ValueError(f"data must be a map-style dataset (with __len__ and __getitem__) or a "
                     f"callable n -> batch, got {type(data).__name__}")


def estimate_memory(model: nn.Module, sample: Callable[[int], tuple[Any, Any]],
                    optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                    loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[int, int], int]:
    """A CPU memory model ``mem(B_L, n_vsw)`` in bytes:

    ``n_vsw * (2 W + B_L * (ACTIVATION_FACTOR * A + I)) + S``: every VSW holds weights and
    gradients (2 W), its activations (A bytes per sample, summed over module outputs, doubled
    for backward) and its input (I bytes per sample); the optimizer state S lives on the main
    VSW only. A, I and S are measured on a 2-sample step of a copy of the model.
    """
    m = copy.deepcopy(model).cpu()
    w = _param_bytes(m)
    acts = [0]

    def hook(_mod: nn.Module, _inp: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            acts[0] += out.numel() * out.element_size()

    leaves = [mod for mod in m.modules() if not list(mod.children())]
    handles = [mod.register_forward_hook(hook) for mod in leaves]
    x, y = sample(2)
    opt = optimizer_fn([p for p in m.parameters() if p.requires_grad])
    loss = loss_fn(m(x), y)
    loss.backward()
    opt.step()
    for h in handles:
        h.remove()
    per_sample_act = acts[0] / 2
    per_sample_in = (x.numel() * x.element_size()) / 2 if isinstance(x, torch.Tensor) else 0
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))

    def mem(local_batch: int, num_vsw: int) -> int:
        per_vsw = 2 * w + local_batch * (ACTIVATION_FACTOR * per_sample_act + per_sample_in)
        return int(num_vsw * per_vsw + state)
    return mem


# ---------------------------------------------------------------------------- all-reduce
def time_allreduces(sizes: Sequence[int], device: str, group: object = None,
                    warmup: int = 1, repeats: int = 3) -> list[float]:
    """This rank's part of the micro-benchmark, on ``group`` (a ``torch.distributed`` group;
    None: the default one): for each size (bytes) a float32 tensor on ``device`` is all-reduced
    ``warmup`` times untimed, then ``repeats`` times, each after a barrier (the ranks start
    together) and timed until the device is done (CUDA is synchronised before and after).
    Returns the median seconds per size. Collective: every rank calls it with the same sizes.
    The driver's measurement on placed actors (:mod:`jabasray.actors.allreduce_fit`) and the
    loopback measurement here (:func:`measure_allreduce`) both run it."""
    import torch.distributed as dist

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    out = []
    for nbytes in sizes:
        buf = torch.ones(max(1, int(nbytes) // 4), dtype=torch.float32, device=dev)
        samples = []
        for r in range(warmup + repeats):
            dist.barrier(group=group)
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            sync()
            if r >= warmup:
                samples.append(time.perf_counter() - t0)
        out.append(statistics.median(samples))
    return out


def _allreduce_worker(rank: int, world: int, init_file: str, out_file: str, sizes: list[int],
                      repeats: int, warmup: int) -> None:
    """One rank of :func:`measure_allreduce` (runs in a child process)."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # the collective ends when the slowest rank has it: take the max over ranks
        med = torch.tensor(time_allreduces(sizes, "cpu", None, warmup, repeats), dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        times = [float(x) for x in med.tolist()]
        if rank == 0:
            Path(out_file).write_text(json.dumps({"sizes": sizes, "times": times}))
    finally:
        dist.destroy_process_group()


def run_gloo_children(module: str, world_size: int, cfg: dict, timeout_s: float) -> dict:
    """Run ``python -m <module> --gloo-child <rank> <cfg json>`` for every rank of a local gloo
    group (127.0.0.1, one torch thread each) and return the JSON that rank 0 writes to
    ``cfg["out"]``. ``cfg`` gets ``world``, ``init`` (the file:// rendezvous) and ``out``.
    Plain subprocesses (not multiprocessing spawn): independent of the caller's __main__."""
    with tempfile.TemporaryDirectory(prefix="jabas-gloo-") as tmp:
        out_file = os.path.join(tmp, "out.json")
        cfg = dict(cfg, world=world_size, init=os.path.join(tmp, "init"), out=out_file)
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs = [subprocess.Popen([sys.executable, "-m", module, "--gloo-child", str(rank), json.dumps(cfg)],
                                  env=env, stderr=subprocess.PIPE, text=True)
                 for rank in range(world_size)]
        errors = []
        try:
            for p in procs:
                _, err = p.communicate(timeout=timeout_s)
                if p.returncode != 0:
                    errors.append((err or "").strip().splitlines()[-1:] or ["exit %d" % p.returncode])
        except subprocess.TimeoutExpired:
            errors.append([f"timed out after {timeout_s}s"])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if errors:
            raise RuntimeError(f"gloo measurement ({module}) failed: {errors[0][0]}")
        return json.loads(Path(out_file).read_text())


def measure_allreduce(sizes: Sequence[int] = DEFAULT_ALLREDUCE_SIZES, world_size: int = 2,
                      repeats: int = 5, warmup: int = 2, bandwidth: float = 1.25e9,
                      timeout_s: float = 120.0) -> tuple[AllReduceFit, list[float]]:
    """Time gloo all-reduces of float32 tensors of ``sizes`` bytes among ``world_size`` local
    processes (127.0.0.1) and fit Eq. 3. Returns (fit, median seconds per size)."""
    check_int("world_size", world_size, min_value=2)
    check_int("repeats", repeats, min_value=1)
    sizes = [check_int("allreduce_sizes[i]", int(s), min_value=4) for s in sizes]
    if len(set(sizes)) < 2:
        raise ValueError(f"allreduce_sizes must hold at least two different sizes, got {sizes}")
    data = run_gloo_children("jabasray.profiler.measure", world_size,
                             {"sizes": sizes, "repeats": repeats, "warmup": warmup}, timeout_s)
    fit = AllReduceFit.fit(data["sizes"], data["times"], num_gpus=world_size, bandwidth=bandwidth)
    return fit, data["times"]


def _load_profile(path: StoragePath) -> Profile:
    """A cached profile (ValueError when it is not one)."""
    import json
    try:
        return Profile.from_json(path.read_text())
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise ValueError(f"{path} is not a valid Profile JSON file: {e}") from None


def host_cached(cache_dir: "str | Path | StoragePath | None", kind: str, key: dict, measure: Callable[[], Any],
                load: Callable[[str], Any], refresh: bool = False) -> Any:
    """A host measurement (not model-specific) cached in ``cache_dir`` as
    ``<kind>-<hash>.json``; the key always includes the host name, the torch version and the
    profiler revision. ``measure()`` returns an object with ``to_json``; ``load(text)`` reads it."""
    import socket
    if cache_dir is None:
        return measure()
    full = dict(key, host=socket.gethostname(), torch=torch.__version__, revision=PROFILER_REVISION)
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:12]
    path = as_storage_path(cache_dir) / f"{kind}-{digest}.json"
    if path.exists() and not refresh:
        try:
            return load(path.read_text())
        except (ValueError, TypeError, KeyError) as e:
            log.warning("ignoring unusable cached %s measurement %s: %s", kind, path, e)
    value = measure()
    path.write_text(value.to_json())
    return value


def cached_allreduce_fit(cache_dir: str | Path | None, sizes: Sequence[int] = DEFAULT_ALLREDUCE_SIZES,
                         world_size: int = 2, refresh: bool = False) -> AllReduceFit:
    """:func:`measure_allreduce`, cached in ``cache_dir`` per host: the fit depends on the host,
    the torch (gloo) version, the world size and the sizes, not on the model, so one measurement
    serves every model profiled on this host (:func:`host_cached`, kind ``allreduce``)."""
    return host_cached(cache_dir, "allreduce", {"world": world_size, "sizes": [int(x) for x in sizes]},
                       lambda: measure_allreduce(sizes, world_size)[0], AllReduceFit.from_json, refresh)


# ---------------------------------------------------------------------------- compute
def lower_median(samples: Sequence[float]) -> float:
    """Median of the faster half of the samples (a trimmed median): load on a shared machine
    only ever slows a step down, so the slow tail is noise, while the plain minimum is one
    lucky sample."""
    xs = sorted(samples)
    return statistics.median(xs[:max(1, (len(xs) + 1) // 2)])


STATISTICS = {"median": statistics.median, "min": min, "trimmed": lower_median}
MONOTONE_TOLERANCE = 0.10   # t(B_L) may fall below t(previous B_L) by this fraction before re-measuring
MONOTONE_RETRIES = 2        # re-measurements of a non-monotone point (then it is clipped, with a warning)
PROFILER_REVISION = 3       # 3: the engine runs n VSWs batched (one pass); bump when the measurement procedure changes (part of the cache key)
CUDA_NUM_VSW_BOUND = 32     # default upper bound of the CUDA n_max probe (probing stops at OOM)
CPU_NUM_VSW_CAP = 4         # default n_max on CPU: no device memory limit to probe there


def probe_max_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest ``n`` in ``1..upper`` with ``fits(n)``, for a monotone ``fits`` (memory grows
    with n: ``fits(n)`` implies ``fits(m)`` for ``m < n``) and ``fits(1)`` known to hold.

    Doubling ``n = 2, 4, 8, ...`` (clipped to ``upper``) until the first failure, then
    bisection between the last fit and that failure: at most ``2 * ceil(log2(upper))`` calls,
    none above the first failing n.
    """
    check_int("upper", upper, min_value=1)
    good, bad = 1, None
    n = 2
    while good < upper:
        n = min(n, upper)
        if fits(n):
            good = n
            n *= 2
        else:
            bad = n
            break
    if bad is None:
        return good
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def oom_probe(step: Callable[[], Any], recover: Callable[[], None]) -> bool:
    """Run ``step()``; True if it ran, False if it ran out of device memory
    (``torch.cuda.OutOfMemoryError``, or a RuntimeError saying "out of memory"): then, with the
    exception and its frames released, ``recover()`` (shrink back) and
    ``torch.cuda.empty_cache()`` so the next probe starts from a clean cache. Other errors
    propagate."""
    try:
        step()
        return True
    except RuntimeError as e:
        if not _is_oom(e):
            raise
    recover()
    if torch.cuda.is_available():
        import gc
        gc.collect()                   # tensors held by cycles through the failed step's frames
        torch.cuda.empty_cache()
    return False


# IIDPWorker options of a job that change which execution a step runs (batched, per VSW,
# graphed) and what the profiler uses without them (the eager step, as before graphs existed);
# the profiler measures with the job's values (job_engine_options)
ENGINE_OPTION_DEFAULTS = {"per_sample_loss": True, "cuda_graphs": "off"}


def check_engine_options(options: dict | None) -> dict:
    """``options`` as a dict of :data:`ENGINE_OPTION_DEFAULTS` keys (``None``: empty), else a
    one-line ValueError naming the allowed keys."""
    if options is None:
        return {}
    if not isinstance(options, dict) or not set(options) <= set(ENGINE_OPTION_DEFAULTS):
        raise ValueError(f"engine_options must be a dict with keys among {sorted(ENGINE_OPTION_DEFAULTS)}, "
                         f"got {options!r}")
    return dict(options)


def job_engine_options(job: Any, num_devices: int, device: str) -> dict:
    """The IIDPWorker options a job's workers are built with that decide what a step executes:
    ``per_sample_loss`` (batched or per VSW) and ``cuda_graphs`` - which captures only on one
    CUDA device without a process group, so it is profiled only for a job on ``device`` CUDA
    with ``num_devices == 1`` (with more devices every step communicates and runs eagerly,
    which is what is measured then; on CPU nothing is captured)."""
    single_cuda = num_devices == 1 and str(device).startswith("cuda")
    return {"per_sample_loss": bool(job.per_sample_loss),
            "cuda_graphs": job.cuda_graphs if single_cuda else "off"}


def step_execution(stats: Any) -> str:
    """What the engine ran for a step: ``"graphed"``, ``"batched"`` or ``"per_vsw"``."""
    return "graphed" if getattr(stats, "graphed", False) else "batched" if stats.batched else "per_vsw"


def measurement_settings(device: str, min_local_batch: int, max_local_batch: int | None,
                         max_num_vsw: int, memory_budget_gb: float | None, bucket_cap_mb: float,
                         weight_sync: str, warmup: int, repeats: int, statistic: str,
                         contention: bool = False, vsw_execution: str = "auto",
                         step_fn: Callable | None = None, collate_fn: Callable | None = None,
                         engine_options: dict | None = None) -> dict:
    """What a profile depends on besides the model and the device type: the cache key's settings
    (``contention``, a forced per-VSW ``vsw_execution`` and the job's own ``step_fn`` /
    ``collate_fn`` - by :func:`callable_fingerprint`, so a changed step or batch function
    measures again - enter the key only when set, so keys of profiles without them are
    unchanged; so do the job's ``engine_options`` that differ from the engine's defaults,
    :func:`job_engine_options`)."""
    extra = {"contention": True} if contention else {}
    if vsw_execution != "auto":
        extra["vsw_execution"] = vsw_execution
    for k, v in sorted(check_engine_options(engine_options).items()):
        if v != ENGINE_OPTION_DEFAULTS[k]:
            extra[k] = v
    if step_fn is not None:
        extra["step_fn"] = callable_fingerprint(step_fn)
    if collate_fn is not None:
        extra["collate_fn"] = callable_fingerprint(collate_fn)
    return {**extra, "device": str(device), "torch": torch.__version__, "revision": PROFILER_REVISION,
            "min_local_batch": int(min_local_batch),
            "max_local_batch": None if max_local_batch is None else int(max_local_batch),
            "max_num_vsw": int(max_num_vsw),
            "memory_budget_gb": None if memory_budget_gb is None else float(memory_budget_gb),
            "bucket_cap_mb": float(bucket_cap_mb), "weight_sync": weight_sync,
            "warmup": int(warmup), "repeats": int(repeats), "statistic": statistic}


def monotone_violations(times: Sequence[float], tolerance: float = MONOTONE_TOLERANCE) -> list[int]:
    """Indices i > 0 whose time is below the largest earlier time by more than ``tolerance``:
    the compute time of a larger local batch (same n_vsw) cannot be smaller."""
    out, top = [], -math.inf
    for i, t in enumerate(times):
        if i and t < top * (1 - tolerance):
            out.append(i)
        top = max(top, t)
    return out


def _step_stats(worker: Any, micro: list, warmup: int, repeats: int,
                stat: Callable = statistics.median) -> tuple[float, float, float, str]:
    """``stat`` (median by default) of (compute_time, update_time, overhead) over ``repeats``
    engine steps after ``warmup``; overhead = wall - compute - comm - update (host bookkeeping);
    and what the engine executed in the timed steps (:func:`step_execution`). A graphed step
    (CUDA graph replay: forward, backward and update in one launch) counts whole as compute,
    its wall time between two device synchronisations."""
    comp, upd, over, ran = [], [], [], set()
    for r in range(warmup + repeats):
        _sync(worker.device)
        t0 = time.perf_counter()
        st = worker.train_step(micro)
        if getattr(st, "graphed", False):
            _sync(worker.device)
        wall = time.perf_counter() - t0
        if r >= warmup:
            ran.add(step_execution(st))
            if getattr(st, "graphed", False):
                comp.append(wall)
                upd.append(0.0)
                over.append(0.0)
                continue
            comp.append(st.compute_time)
            upd.append(st.update_time)
            over.append(max(0.0, wall - st.compute_time - st.comm_time - st.update_time))
    return stat(comp), stat(upd), stat(over), "+".join(sorted(ran))


def _forward_share(model: nn.Module, batch: Any, loss_fn: Callable, device: torch.device,
                   repeats: int, stat: Callable = statistics.median,
                   step_fn: Callable | None = None) -> float:
    """zeta = t_forward / t_(forward+backward), ``stat`` over ``repeats`` on a model copy; the
    forward is the job's step (``step_fn(model, batch)``, else ``loss_fn(model(x), y)``)."""
    from ..engine.loader import to_device
    from ..engine.step import split_step_output, supervised_step

    m = copy.deepcopy(model).to(device)
    b = to_device(batch, device)
    step = step_fn or supervised_step(loss_fn)
    fwd, full = [], []
    for _ in range(repeats + 1):
        m.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        loss = split_step_output(step(m, b))[0]   # a step may also return training metrics
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        full.append(t2 - t0)
    f, t = stat(fwd[1:]), stat(full[1:])
    return min(1.0, max(0.0, f / t)) if t > 0 else 0.5


def _copy_time(model: nn.Module, device: torch.device, repeats: int,
               stat: Callable = statistics.median) -> float:
    """Seconds to copy all trainable weights (one flat buffer of W bytes) into another replica."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    samples = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return stat(samples[1:])


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def gpu_type_name(device_name: str) -> str:
    """The GPU type ``ClusterSpec.from_ray`` gives a GPU called ``device_name``: Ray's
    accelerator type for it (its ``accelerator_type:<TYPE>`` resource and
    ``ray.io/accelerator-type`` label; ``NVIDIA A100-SXM4-80GB`` -> ``A100``), lower-cased, so
    that a profile written by ``jabasray profile`` on that GPU matches the detected type (the
    rule: :func:`jabasray.types.accelerator_type_of`; no Ray here). A name the rule gives
    nothing for: its letters and digits, ``_`` for the rest."""
    accel = accelerator_type_of(device_name)
    if accel:
        return str(accel).lower()
    return "".join(c if c.isalnum() else "_" for c in device_name.lower()).strip("_")


def _default_gpu_type(device: torch.device) -> str:
    if device.type == "cuda":
        return gpu_type_name(torch.cuda.get_device_name(device))
    return "cpu"


def _make_monotone(points: list, try_step: Callable, repeats: int) -> list:
    """Monotonicity across B_L: t(1) and t(n_max) (same n_max) must not fall as B_L grows.
    A point below an earlier one by more than MONOTONE_TOLERANCE is re-measured with twice the
    repeats (up to MONOTONE_RETRIES times; noise usually inflated the EARLIER point, so both
    neighbours are re-measured); what is still non-monotone is clipped up to the running maximum
    and logged."""
    points = list(points)
    for attempt in range(MONOTONE_RETRIES + 1):
        bad = set(monotone_violations([p[2][0] for p in points]))
        same_n = [i for i in range(1, len(points)) if points[i][1] == points[i - 1][1]]
        tmax = monotone_violations([p[3][0] for p in points])
        bad |= {i for i in tmax if i in same_n}
        if not bad:
            return points
        if attempt == MONOTONE_RETRIES:
            break
        redo = sorted(bad | {i - 1 for i in bad})
        log.info("profile: non-monotone compute time at B_L %s; re-measuring %s",
                 [points[i][0] for i in sorted(bad)], [points[i][0] for i in redo])
        for i in redo:
            bl, n_max, _, _ = points[i]
            one = try_step(bl, 1, 2 * repeats)
            at_max = try_step(bl, n_max, 2 * repeats) if n_max > 1 else one
            points[i] = (bl, n_max, one, at_max)
    log.warning("profile: compute time still non-monotone at B_L %s after %d re-measurements; "
                "clipping to the running maximum", [points[i][0] for i in sorted(bad)], MONOTONE_RETRIES)
    out, top1, topm, prev_n = [], 0.0, 0.0, None
    for bl, n_max, one, at_max in points:
        top1 = max(top1, one[0])
        topm = max(topm, at_max[0]) if n_max == prev_n else at_max[0]
        out.append((bl, n_max, (top1,) + tuple(one[1:]), (topm,) + tuple(at_max[1:])))
        prev_n = n_max
    return out


def profile_model(model: nn.Module | Callable[[], nn.Module], data: Any, *,
                  loss_fn: Callable[[Any, Any], torch.Tensor] = F.cross_entropy,
                  optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                  device: str = "cpu", gpu_type: str | None = None, min_local_batch: int = 8,
                  max_local_batch: int | None = None, memory_budget_gb: float | None = None,
                  max_num_vsw: int | None = None, warmup: int = 1, repeats: int = 3, statistic: str = "trimmed",
                  weight_sync: str = "auto", bucket_cap_mb: float = 25.0,
                  allreduce: bool = True, allreduce_sizes: Sequence[int] = DEFAULT_ALLREDUCE_SIZES,
                  allreduce_fit: AllReduceFit | None = None, inter_node_fit: AllReduceFit | None = None,
                  contention: bool = False, vsw_execution: str = "auto",
                  cache_dir: str | Path | None = None, refresh: bool = False,
                  step_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                  collate_fn: Callable[[list], Any] | None = None,
                  engine_options: dict | None = None,
                  host_cache_dir: str | Path | None = None) -> Profile:
    """Profile ``model`` (a module, or a factory) on ``device`` with the IIDP engine.

    ``data``: dataset of (input, target) or callable ``n -> (inputs, targets)``; with the job's
    ``step_fn`` (``(model, batch) -> loss``) and ``collate_fn`` any samples and batch type (e.g.
    dict batches): what is profiled is the job's own step on its own batches.
    ``max_local_batch`` caps max B_L^g (default 8 x min B_L on CPU, 32 x on CUDA);
    ``memory_budget_gb`` bounds memory on CPU (see :func:`estimate_memory`; default: no bound
    other than the cap). ``max_num_vsw``: upper bound of n_max (default: probe up to
    ``CUDA_NUM_VSW_BOUND`` on CUDA, where the memory limit ends the probe; ``CPU_NUM_VSW_CAP``
    on CPU, which has no memory limit to probe). ``statistic`` over the ``repeats`` timed steps: "trimmed" (default, the
    median of the faster half: robust to load spikes on a shared machine), "median" or "min".
    Compute times must grow with B_L; points that do not are re-measured (see
    :func:`_make_monotone`). The cache key holds the model signature, the device type and every
    measurement setting incl. the torch version (:func:`measurement_settings`); ``refresh``
    re-measures regardless.
    ``vsw_execution``: the engine's (``"auto"``: the n VSWs run batched, as in training;
    ``"threads"``/``"one_thread"``: per VSW, for a job whose step cannot be batched, e.g.
    ``JobConfig.per_sample_loss=False``). What runs is what is profiled: each timed step feeds
    ``n`` adjacent micro-batches split from one batch of ``n * B_L`` samples, as the loader does.
    ``allreduce=False`` skips the gloo measurement and uses ``allreduce_fit`` (or a nominal
    fit: alpha 1, beta 0, flagged in the log). ``contention=True`` adds the host's gloo
    compute/communication contention (:func:`jabasray.profiler.contention.cached_contention`,
    cached per host) as ``Profile.contention``: the measurement LIBRA's Eq. 5-6 and the SWS/OWS
    interference are fitted to (CPU/gloo only; it says nothing about NCCL).
    ``engine_options``: the job's IIDPWorker options that decide what a step executes
    (:func:`job_engine_options`: ``per_sample_loss``, ``cuda_graphs``); the profiler's worker is
    built with them, so each (B_L, n_vsw) point times the execution training will run -
    batched, per VSW, or (CUDA, ``cuda_graphs="auto"``, one device) the replayed CUDA graph,
    whose warm-up and capture happen before the timed steps. ``Profile.execution`` records
    what the engine ran in the timed steps at n_max.
    ``host_cache_dir``: where the host measurements (all-reduce fit, contention) are cached when
    not beside the profile in ``cache_dir`` (a profiling task caches no profile, but its host's
    measurements serve every model profiled there).
    """
    from ..engine import IIDPWorker
    from ..engine.loader import split_batch, to_device

    check_int("min_local_batch", min_local_batch, min_value=1)
    engine_options = {**ENGINE_OPTION_DEFAULTS, **check_engine_options(engine_options)}
    if max_num_vsw is not None:
        check_int("max_num_vsw", max_num_vsw, min_value=1)
    check_int("warmup", warmup, min_value=0)
    check_int("repeats", repeats, min_value=1)
    stat = STATISTICS[check_choice("statistic", statistic, tuple(STATISTICS))]
    if max_local_batch is not None:
        check_int("max_local_batch", max_local_batch, min_value=min_local_batch)
    if memory_budget_gb is not None:
        check_float("memory_budget_gb", memory_budget_gb, min_value=0, min_exclusive=True)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda[:index]', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device must be 'cpu' on this machine (CUDA is not available), got {device!r}")
    if max_num_vsw is None:
        max_num_vsw = CUDA_NUM_VSW_BOUND if dev.type == "cuda" else CPU_NUM_VSW_CAP
    base = model() if callable(model) and not isinstance(model, nn.Module) else model
    if not isinstance(base, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or a factory of one, got {type(base).__name__}")
    optimizer_fn = optimizer_fn or (lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9))
    sample = _batch_fn(data, collate_fn)
    gpu_type = gpu_type or _default_gpu_type(dev)
    sig = model_signature(base)

    settings = measurement_settings(dev.type, min_local_batch, max_local_batch, max_num_vsw,
                                    memory_budget_gb, bucket_cap_mb, weight_sync, warmup, repeats, statistic,
                                    contention, vsw_execution, step_fn=step_fn, collate_fn=collate_fn,
                                    engine_options=engine_options)
    key = profile_cache_key(sig, gpu_type, settings)
    cache_path = as_storage_path(cache_dir) / f"{key}.json" if cache_dir else None
    if cache_path is not None and cache_path.exists() and not refresh:
        try:
            cached = _load_profile(cache_path)
            log.info("profile cache hit: %s", cache_path)
            return cached
        except ValueError as e:
            log.warning("ignoring unusable cached profile %s: %s", cache_path, e)

    if max_local_batch is None:   # keep profiling time bounded (CUDA probing stops at OOM)
        max_local_batch = (8 if dev.type == "cpu" else 32) * min_local_batch
    budget = memory_budget_gb * 2 ** 30 if memory_budget_gb is not None else None
    mem = estimate_memory(base, sample, optimizer_fn, loss_fn) \
        if (budget and dev.type == "cpu" and step_fn is None) else None

    def fits_estimate(bl: int, n: int) -> bool:
        return mem is None or mem(bl, n) <= budget

    worker = IIDPWorker(copy.deepcopy(base), optimizer_fn, loss_fn, device=str(dev),
                        weight_sync=weight_sync, bucket_cap_mb=bucket_cap_mb, vsw_execution=vsw_execution,
                        step_fn=step_fn, **engine_options)
    # the profiler visits every (B_L, n) key on purpose, each with a few replays: the cache's
    # "keys change too often" check (meant for training) must not switch graphs off here
    worker._graphs.max_signatures = 1 << 30

    def configure(bl: int, n: int) -> int:
        """Configure (n, 0, B_L); returns the warm-up steps this point needs. An eager step on
        CUDA synchronises the device around its timed phases (``sync_timing``, which rules out
        graphs); a step the engine replays as a CUDA graph runs its graph warm-up and capture
        first."""
        worker.configure(n, 0, bl)
        if dev.type != "cuda":
            return warmup
        worker.sync_timing = False
        graphed = worker.graph_fallback_reason() is None
        worker.sync_timing = not graphed
        return max(warmup, worker._graphs.warmup + 1) if graphed else warmup

    def try_step(bl: int, n: int, reps: int = repeats) -> tuple[float, float, float] | None:
        """``stat`` of (compute, update, overhead) at (B_L, n) over ``reps`` steps, or None when
        it does not fit (``reps=0``: one untimed probe step)."""
        if not fits_estimate(bl, n):
            return None
        # n distinct micro-batches, adjacent views of one batch (what the loader hands over)
        batch = sample(bl * n)
        micro = split_batch(to_device(tuple(batch) if isinstance(batch, list) else batch, dev), [bl] * n)
        out: list = []

        def step() -> None:
            warm = configure(bl, n)
            if reps == 0:
                worker.train_step(micro)
                out.append((0.0, 0.0, 0.0, ""))
            else:
                out.append(_step_stats(worker, micro, warm, reps, stat))

        if dev.type != "cuda":
            step()
        elif not oom_probe(step, lambda: worker.configure(1, 0, bl)):
            return None
        return out[0]

    def find_n_max(bl: int) -> int:
        """The most VSWs that fit. Without a memory bound to probe (CPU without a budget) that is
        ``max_num_vsw`` at once; otherwise untimed probe steps (CUDA: up to the memory limit)."""
        if dev.type == "cpu" and mem is None:
            return max_num_vsw
        return probe_max_fitting(lambda n: try_step(bl, n, reps=0) is not None, max_num_vsw)

    # Eq. 1 needs only n = 1 and n = n_max per B_L: intermediate n are probed (fit or not),
    # never timed.
    points: list[tuple[int, int, tuple, tuple]] = []      # (B_L, n_max, stats at 1, stats at n_max)
    bl = min_local_batch
    while bl <= max_local_batch:
        one = try_step(bl, 1)
        if one is None:
            break
        n_max = find_n_max(bl)
        at_max = try_step(bl, n_max) if n_max > 1 else one
        points.append((bl, n_max, one, at_max))
        bl += min_local_batch
    points = _make_monotone(points, try_step, repeats)
    if dev.type == "cuda":      # the probes leave n_max replicas on the device: free them before
        worker.configure(1, 0, min_local_batch)     # zeta's model copy (it ran out of memory)
        torch.cuda.empty_cache()
    executions = {p[3][3] for p in points if p[3][3]}
    batches: list[BatchProfile] = []
    update_times: list[float] = []
    overheads: list[float] = []
    for bl, n_max, one, at_max in points:
        zeta = _forward_share(worker.model, sample(bl), loss_fn, dev, repeats, stat, step_fn)
        batches.append(BatchProfile(local_batch=bl, max_num_vsw=n_max, compute_time_1=one[0],
                                    compute_time_max=at_max[0], zeta=zeta))
        update_times.append(one[1])
        overheads.append(one[2])
        log.info("profiled B_L=%d: t(1)=%.4gs n_max=%d t(n_max)=%.4gs zeta=%.2f",
                 bl, one[0], n_max, at_max[0], zeta)
    if not batches:
        raise ValueError(f"min_local_batch {min_local_batch} does not fit on {device} "
                         f"(memory_budget_gb={memory_budget_gb})")
    bucket_sizes = list(worker.bucket_nbytes)
    copy_t = _copy_time(worker.model, dev, repeats, stat)
    worker.close()

    host_dir = cache_dir if host_cache_dir is None else host_cache_dir
    if allreduce_fit is None:
        if allreduce:
            allreduce_fit = cached_allreduce_fit(host_dir, allreduce_sizes, refresh=refresh)
        else:
            log.warning("all-reduce not measured: using a nominal Eq. 3 fit (alpha=1, beta=0)")
            allreduce_fit = AllReduceFit(alpha=1.0, beta=0.0)
    measured_contention = None
    if contention:
        from .contention import cached_contention
        measured_contention = cached_contention(host_dir, refresh=refresh)
    prof = Profile(model_signature=sig, gpu_type=gpu_type, min_local_batch=min_local_batch,
                   batches=batches, optimizer_time=statistics.median(update_times), copy_time=copy_t,
                   bucket_sizes=bucket_sizes, param_bytes=_param_bytes(base),
                   allreduce_intra=allreduce_fit, allreduce_inter=inter_node_fit, device=dev.type,
                   bucket_cap_mb=bucket_cap_mb, memory_budget_gb=memory_budget_gb,
                   step_overhead=statistics.median(overheads), contention=measured_contention,
                   execution="+".join(sorted(executions)) or None)
    if cache_path is not None:
        cache_path.write_text(prof.to_json(indent=2))
        log.info("profile saved to %s", cache_path)
    return prof


__all__ = ["profile_model", "model_signature", "job_engine_options", "step_execution", "measure_allreduce", "estimate_memory",
           "probe_max_fitting", "oom_probe", "DEFAULT_ALLREDUCE_SIZES"]


if __name__ == "__main__":  # child process of measure_allreduce (run_gloo_children)
    if len(sys.argv) == 4 and sys.argv[1] == "--gloo-child":
        _cfg = json.loads(sys.argv[3])
        _allreduce_worker(int(sys.argv[2]), _cfg["world"], _cfg["init"], _cfg["out"], _cfg["sizes"],
                          _cfg["repeats"], _cfg["warmup"])
