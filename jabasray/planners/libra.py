"""LIBRA planner: tensor fusion co-optimised with communication thread allocation.

Liu et al., "LIBRA: Contention-Aware GPU Thread Allocation for Data Parallel Training in High
Speed Networks", Sec. III-B (backward-time model) and Sec. IV (dynamic programming).

Implementation notes
--------------------
Input is a list of :class:`LayerProfile` in BACKWARD order (index 0 = the layer whose gradient
is ready first, i.e. the model's last layer), each with its standalone backward time ``b_l``
and gradient bytes ``c_l``; and a fitted :class:`~jabasray.planners.libra_model.ContentionModel`.

* :func:`backward_time` evaluates a fusion (consecutive groups) + threads with Eq. 8-15: stage 0
  is group 1's computation; stage i overlaps group i's all-reduce with the remaining computation
  ``s_b^i``; the all-reduce of group i+1 starts as soon as group i's all-reduce is done and
  group i+1's gradients exist (non-overlapped computation ``t_b^i`` in between, Eq. 13).
* :func:`allocate_threads` is the DP of Eq. 17 for a given fusion: the computation is cut into
  ``Z`` chunks of size ``w``; ``T(i, z)`` is the best time at which stage i ends with z chunks
  computed; a stage whose communication outlives the computation is only allowed when z = Z
  (Eq. 19).
* :func:`co_optimize` is Eq. 23 / Algorithm 1: ``T(i, l, z)`` also chooses where groups end, with
  at most ``K`` groups. Both DPs share one implementation (:func:`_fusion_dp`): the stage-time
  table ``h`` depends only on (group, window length z - z', whether z = Z), so it is minimised
  over the thread choices once and the recursion is a min-plus product vectorised with numpy.
  Cost O(K L^2 Z^2 + L^2 Z J) time, O(K L Z) memory.
* Deviation (documented, makes Theorem 1 hold as stated): Algorithm 1 lets the first group's
  all-reduce start only at a chunk edge (T[0][0][z] = z w), so the proof's K-1 adjustments
  leave group 1 off-grid and the bound degrades to K/Z. We additionally let group 1 start
  exactly when its gradients are ready (at ``n(l)``), which is what the evaluator does anyway,
  so the DP's search space contains the adjusted optimal schedule and
  ``T_hat <= (1 + (K-1)/Z) T*`` follows as in Sec. IV-C.
* :func:`plan_buckets` (Algorithm 2, line 4) returns the best, under the model, of the
  co-optimised plan, LIBRA-M (Eq. 17 threads on the default size-capped fusion) and the
  default size-capped fusion with a fixed thread count; the plan records which one won.

Plans are :class:`LibraPlan` dataclasses (JSON round-trip) holding layer names per bucket and
threads per bucket; :func:`to_engine_bucket_plan` turns them into the engine's bucket plan
(parameter names per bucket, backward order; interface 1).

Usage (Algorithm 2)::

    rows = profiler.contention.measure_contention_rows(compute_fn, comm_fn, sizes, threads)
    model = libra_model.fit_contention_model(*rows, num_workers=N, hop_latency=alpha)
    layers = profiler.contention.layer_profiles(net, x, y, loss_fn)      # backward order
    plan = plan_buckets(model, layers, thread_choices=[128, 256, ..., 4096])
    bucket_plan = to_engine_bucket_plan(plan, group_params_by_layer(n for n, _ in net.named_parameters()))
    IIDPWorker(net, ..., bucket_plan=bucket_plan)        # plan.threads / cta_counts(plan): per bucket
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..serialization import JsonMixin
from ..validation import check_float, check_int
from .libra_model import ContentionModel

log = logging.getLogger(__name__)

MB = 1024 * 1024


# --------------------------------------------------------------------------- data
@dataclass(frozen=True)
class LayerProfile(JsonMixin):
    """One layer as LIBRA sees it (listed in backward order)."""

    name: str                # layer (module) name, e.g. "classifier.3"
    backward_time: float     # b_l: standalone backward computation time of the layer (s)
    grad_bytes: float        # c_l: bytes of gradient the layer produces (0 for parameter-free)


@dataclass(frozen=True)
class StageTime(JsonMixin):
    """Stage i of the backward pass: t^i = t_o^i + t_b^i + t_c^i (Sec. III-B)."""

    overlap: float           # t_o: overlapped computation/communication time
    compute: float           # t_b: residual (non-overlapped) computation time
    comm: float              # t_c: residual (non-overlapped) communication time


@dataclass(frozen=True)
class BackwardTime(JsonMixin):
    """Model-predicted backward time of a fusion + thread allocation (Eq. 8-15)."""

    total: float             # sum of all stage times
    stages: list[StageTime]  # K + 1 stages; stage 0 is group 1's computation alone


@dataclass(frozen=True)
class LibraPlan(JsonMixin):
    """A gradient-bucket plan with a communication thread count per bucket."""

    buckets: list[list[str]]       # layer names per bucket, buckets and layers in backward order
    threads: list[int]             # communication threads allocated to each bucket's all-reduce
    backward_time: float           # model-predicted backward time T_hat (Eq. 8-15, no chunk edges)
    method: str                    # "coopt" (Eq. 23), "threads" (Eq. 17), "default", "exhaustive"
    dp_time: float | None = None   # T(K, Z): the DP optimum on the chunk grid (>= backward_time)
    max_groups: int | None = None  # K: limit on the number of buckets (None: not limited)
    num_chunks: int | None = None  # Z: computation chunks of the DP grid
    baseline_time: float | None = None  # default fusion + fixed threads, same model (plan_buckets)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)


# --------------------------------------------------------------------------- validation
def _check_layers(layers: Sequence[LayerProfile]) -> tuple[list[str], np.ndarray, np.ndarray]:
    if len(layers) == 0:
        raise ValueError("layers must be a non-empty list of LayerProfile (backward order), got []")
    names, b, c = [], [], []
    for i, layer in enumerate(layers):
        if not isinstance(layer, LayerProfile):
            raise ValueError(f"layers[{i}] must be a LayerProfile, got {type(layer).__name__}")
        if not isinstance(layer.name, str) or not layer.name:
            raise ValueError(f"layers[{i}].name must be a non-empty string, got {layer.name!r}")
        names.append(layer.name)
        b.append(check_float(f"layers[{i}].backward_time", layer.backward_time, min_value=0.0))
        c.append(check_float(f"layers[{i}].grad_bytes", layer.grad_bytes, min_value=0.0))
    dup = sorted(n for n, k in Counter(names).items() if k > 1)
    if dup:
        raise ValueError(f"layers names must be unique, got duplicates {dup}")
    if sum(b) <= 0:
        raise ValueError("layers backward_time must sum to > 0 (the DP cuts the computation into chunks)")
    return names, np.asarray(b, dtype=float), np.asarray(c, dtype=float)


def _bucket_bounds(buckets: Sequence[Sequence[str]], names: Sequence[str]) -> list[tuple[int, int]]:
    """Index ranges [start, end) of each bucket; buckets must cover ``names`` consecutively in order."""
    if len(buckets) == 0:
        raise ValueError("buckets must be a non-empty list of layer-name lists")
    flat = [n for bucket in buckets for n in bucket]
    if any(len(bucket) == 0 for bucket in buckets):
        raise ValueError("buckets must not contain an empty bucket")
    if flat != list(names):
        raise ValueError("buckets must list every layer exactly once, consecutively, in the layers' "
                         f"(backward) order; got {flat[:8]}... for layers {list(names)[:8]}...")
    bounds, start = [], 0
    for bucket in buckets:
        bounds.append((start, start + len(bucket)))
        start += len(bucket)
    return bounds


def _group_sums(x: np.ndarray, bounds: Sequence[tuple[int, int]]) -> list[float]:
    """Per-group totals of a per-layer quantity (``b`` or ``c``) over index ranges [start, end)."""
    return [float(x[s:e].sum()) for s, e in bounds]


def _check_threads(model: ContentionModel, threads: Sequence[int], count: int, name: str) -> list[int]:
    if len(threads) != count:
        raise ValueError(f"{name} must hold one thread count per bucket ({count}), got {len(threads)}")
    return model.check_threads(threads, name)


# --------------------------------------------------------------------------- Eq. 8-15
def backward_time(model: ContentionModel, comp: Sequence[float], sizes: Sequence[float],
                  threads: Sequence[int]) -> BackwardTime:
    """Backward time of K tensor groups (backward order) under the contention model, Eq. 8-15.

    ``comp[i] = b_i`` (standalone backward time of group i), ``sizes[i] = c_i`` (gradient bytes),
    ``threads[i] = r_i``. Recursion (0-based groups, s = remaining computation)::

        t^0 = b_1;  s = sum_{j>=2} b_j                            (stage 0, s_b^1)
        stage i:  t_o, s_hat, t_c = f_o, f_b, f_c (c_i, s, r_i)   (Eq. 12, 14)
                  t_b = max(0, s_hat - sum_{j>=i+2} b_j)          (Eq. 13)
                  s   = s_hat - t_b                               (Eq. 15)
    """
    b = [check_float(f"comp[{i}]", x, min_value=0.0) for i, x in enumerate(comp)]
    c = [check_float(f"sizes[{i}]", x, min_value=0.0) for i, x in enumerate(sizes)]
    if len(b) == 0 or len(b) != len(c):
        raise ValueError(f"comp and sizes must be non-empty and of equal length, got {len(b)} and {len(c)}")
    r = _check_threads(model, threads, len(b), "threads")
    suffix = np.concatenate([np.cumsum(np.asarray(b)[::-1])[::-1], [0.0, 0.0]])  # suffix[k] = sum b[k:]
    stages = [StageTime(0.0, b[0], 0.0)]
    s = float(suffix[1])
    for i in range(len(b)):
        f_o, f_b, f_c = (float(x) for x in model.overlap(c[i], s, r[i]))
        t_b = max(0.0, f_b - float(suffix[i + 2]))
        s = f_b - t_b
        stages.append(StageTime(f_o, t_b, f_c))
    total = float(sum(st.overlap + st.compute + st.comm for st in stages))
    return BackwardTime(total=total, stages=stages)


def evaluate_plan(model: ContentionModel, layers: Sequence[LayerProfile], buckets: Sequence[Sequence[str]],
                  threads: Sequence[int]) -> BackwardTime:
    """:func:`backward_time` of a layer-level fusion (``buckets`` of layer names, backward order)."""
    names, b, c = _check_layers(layers)
    bounds = _bucket_bounds(buckets, names)
    return backward_time(model, _group_sums(b, bounds), _group_sums(c, bounds), threads)


# --------------------------------------------------------------------------- default fusion
def size_capped_fusion(layers: Sequence[LayerProfile], bucket_cap_mb: float = 25.0) -> list[list[str]]:
    """Default tensor fusion: walk layers in backward order, close a bucket once it holds
    >= ``bucket_cap_mb`` MiB of gradients (the PyTorch-DDP style size cap)."""
    names, _, c = _check_layers(layers)
    cap = check_float("bucket_cap_mb", bucket_cap_mb, min_value=0.0, min_exclusive=True) * MB
    buckets: list[list[str]] = [[]]
    size = 0.0
    for name, nbytes in zip(names, c):
        if size >= cap:
            buckets.append([])
            size = 0.0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def default_plan(model: ContentionModel, layers: Sequence[LayerProfile], threads: int,
                 bucket_cap_mb: float = 25.0) -> LibraPlan:
    """Size-capped fusion with the same (library-default) thread count for every bucket."""
    buckets = size_capped_fusion(layers, bucket_cap_mb)
    alloc = [check_int("default_threads", threads, min_value=1)] * len(buckets)
    t = evaluate_plan(model, layers, buckets, alloc).total
    return LibraPlan(buckets=buckets, threads=alloc, backward_time=t, method="default", baseline_time=t)


# --------------------------------------------------------------------------- the DP (Eq. 17, 23)
@dataclass(frozen=True)
class _DPResult:
    bounds: list[tuple[int, int]]
    thread_idx: list[int]
    dp_time: float


def _fusion_dp(model: ContentionModel, b: np.ndarray, c: np.ndarray, R: np.ndarray, K: int, Z: int,
               fixed: bool, exact_first: bool = True) -> _DPResult:
    """Algorithm 1 (Eq. 23); with ``fixed=True`` every unit is its own group (Eq. 17, K = L).

    ``T[i, l, z]``: best time at which stage i ends, the first l units merged into i groups, z
    chunks of computation done. ``T[0, 0, z] = z w`` (Alg. 1 line 5). Transition (line 9-13)::

        T[i, l, z] = min_{l', z' >= zmin(l), j} T[i-1, l', z'] + h(C(l'..l), (z - z') w, R_j)

    where h = inf if z < Z and the communication outlives the window (Eq. 19).
    """
    L = b.size
    w = float(b.sum()) / Z
    n = np.concatenate([[0.0], np.cumsum(b)])                  # n(l): computation of units 1..l
    cc = np.concatenate([[0.0], np.cumsum(c)])
    # GetMinChunkID: first chunk edge at or after n(l) (tolerance for float round-off)
    zmin = np.clip(np.ceil(n / w - 1e-9).astype(int), 0, Z)
    windows = np.arange(Z + 1) * w
    zz = np.arange(Z + 1)
    gap = zz[None, :] - zz[:, None]                             # gap[z', z] = z - z'
    ok_gap = gap >= 0
    gap = np.where(ok_gap, gap, 0)
    INF = np.inf
    T = np.full((K + 1, L + 1, Z + 1), INF)
    T[0, 0, :] = windows
    LOG = np.full((K + 1, L + 1, Z + 1, 3), -1, dtype=np.int64)   # (l', z' or -1 = exact start, j)

    def stage_table(sizes: np.ndarray, win: np.ndarray) -> tuple[np.ndarray, ...]:
        f_o, f_b, f_c = model.overlap(sizes[:, None, None], win[None, :, None], R[None, None, :])
        h = f_o + f_b + f_c
        h_mid = np.where(f_c > 0, INF, h)                        # Eq. 19, z < Z
        return h_mid.min(axis=2), h_mid.argmin(axis=2), h.min(axis=2), h.argmin(axis=2)

    for l in range(1, L + 1):
        lps = np.array([l - 1]) if fixed else np.arange(0, l)
        sizes = cc[l] - cc[lps]
        h_mid, j_mid, h_end, j_end = stage_table(sizes, windows)   # (P, Z+1) over window length
        # Only z' >= zmin(l) (Alg. 1 line 8: z' w >= n(l)) and z >= z' matter: work on the
        # sub-grid z', z in [zl, Z] of size S. G[p, z' - zl, z - zl] = stage cost from chunk z'
        # to z (Eq. 18-19); the last column (z = Z) may leave a communication residual.
        zl = int(zmin[l])
        S = Z + 1 - zl
        sub_gap = gap[:S, :S]
        G = h_mid[:, sub_gap]
        G[:, :, S - 1] = h_end[:, sub_gap[:, S - 1]]
        G[:, ~ok_gap[:S, :S]] = INF
        # exact start of the first group at n(l) (deviation, see module notes)
        win0 = np.maximum(windows - n[l], 0.0)
        e_mid, ej_mid, e_end, ej_end = stage_table(np.array([cc[l]]), win0)
        exact = np.where(zz == Z, e_end[0], e_mid[0]) + n[l]
        exact_j = np.where(zz == Z, ej_end[0], ej_mid[0])
        exact = np.where(windows >= n[l] - 1e-9 * w, exact, INF)
        zs = zz[zl:]
        for i in range(1, min(K, l) + 1):
            if fixed and i != l:
                continue
            first = 0 if fixed else i - 1                        # T[i-1, l'] is inf for l' < i-1
            prev = T[i - 1, lps[first:], zl:]                    # (P', S) over z'
            if not np.isfinite(prev).any():
                continue
            M = (prev[:, :, None] + G[first:]).reshape(-1, S)   # rows (p, z'), columns z
            arg = M.argmin(axis=0)
            best = M[arg, np.arange(S)]
            p_idx, zp_off = np.divmod(arg, S)
            p_idx = p_idx + first
            zp = zp_off + zl
            T[i, l, zl:] = best
            LOG[i, l, zl:, 0] = lps[p_idx]
            LOG[i, l, zl:, 1] = zp
            LOG[i, l, zl:, 2] = np.where(zs == Z, j_end[p_idx, zs - zp], j_mid[p_idx, zs - zp])
            if i == 1 and exact_first:
                better = exact < T[1, l]
                T[1, l, better] = exact[better]
                LOG[1, l, better] = np.stack([np.zeros(better.sum(), dtype=np.int64),
                                              -np.ones(better.sum(), dtype=np.int64),
                                              exact_j[better]], axis=1)
    final = T[1:, L, Z]
    if not np.isfinite(final).any():  # pragma: no cover - z = Z always admits a schedule
        raise RuntimeError("LIBRA DP found no feasible schedule")
    i = int(np.argmin(final)) + 1
    dp_time = float(final[i - 1])
    bounds, tidx = [], []
    l, z = L, Z
    while i > 0:                                                 # GatherResults (line 16)
        lp, zp, j = (int(v) for v in LOG[i, l, z])
        bounds.append((lp, l))
        tidx.append(j)
        if zp < 0:
            break
        i, l, z = i - 1, lp, zp
    bounds.reverse()
    tidx.reverse()
    assert bounds[0][0] == 0 and bounds[-1][1] == L, "DP backtrack must cover all units"
    return _DPResult(bounds=bounds, thread_idx=tidx, dp_time=dp_time)


def _check_dp_args(model: ContentionModel, thread_choices: Sequence[int], num_chunks: int,
                   max_groups: int | None = None) -> np.ndarray:
    if max_groups is not None:
        check_int("max_groups", max_groups, min_value=1)
    check_int("num_chunks", num_chunks, min_value=1)
    if len(thread_choices) == 0:
        raise ValueError("thread_choices must be a non-empty list of thread counts >= 1 "
                         "(e.g. powers of 2 from 128 to 4096), got []")
    return np.asarray(model.check_threads(list(thread_choices), "thread_choices"), dtype=float)


def allocate_threads(model: ContentionModel, layers: Sequence[LayerProfile], buckets: Sequence[Sequence[str]],
                     thread_choices: Sequence[int], num_chunks: int = 150) -> LibraPlan:
    """Thread allocation for a given fusion: the DP of Eq. 17 (LIBRA-M when ``buckets`` is the default).

    Returns the plan with ``dp_time = T(K, Z)`` and ``backward_time = T_hat`` (Eq. 8-15);
    Theorem 1: ``T_hat <= (1 + (K-1)/Z) T*`` with T* the best allocation from ``thread_choices``.
    """
    names, b, c = _check_layers(layers)
    R = _check_dp_args(model, thread_choices, num_chunks)
    bounds = _bucket_bounds(buckets, names)
    res = _fusion_dp(model, np.array(_group_sums(b, bounds)), np.array(_group_sums(c, bounds)), R,
                     K=len(bounds), Z=num_chunks, fixed=True)
    threads = [int(R[j]) for j in res.thread_idx]
    buckets = [list(bk) for bk in buckets]
    t = evaluate_plan(model, layers, buckets, threads).total
    return LibraPlan(buckets=buckets, threads=threads, backward_time=t, method="threads",
                     dp_time=res.dp_time, max_groups=len(bounds), num_chunks=num_chunks)


def co_optimize(model: ContentionModel, layers: Sequence[LayerProfile], thread_choices: Sequence[int],
                max_groups: int = 10, num_chunks: int = 150) -> LibraPlan:
    """Tensor fusion + thread allocation with at most ``max_groups`` buckets: Eq. 23, Algorithm 1.

    Time O(K L^2 Z^2 + L^2 Z J). ``T_hat <= (1 + (K-1)/Z) T*`` with T* the best plan over all
    fusions into <= K consecutive groups and all allocations from ``thread_choices``.
    """
    names, b, c = _check_layers(layers)
    R = _check_dp_args(model, thread_choices, num_chunks, max_groups)
    K = min(max_groups, len(names))
    res = _fusion_dp(model, b, c, R, K=K, Z=num_chunks, fixed=False)
    buckets = [names[s:e] for s, e in res.bounds]
    threads = [int(R[j]) for j in res.thread_idx]
    t = evaluate_plan(model, layers, buckets, threads).total
    return LibraPlan(buckets=buckets, threads=threads, backward_time=t, method="coopt",
                     dp_time=res.dp_time, max_groups=max_groups, num_chunks=num_chunks)


def plan_buckets(model: ContentionModel, layers: Sequence[LayerProfile], thread_choices: Sequence[int],
                 max_groups: int = 10, num_chunks: int = 150, bucket_cap_mb: float = 25.0,
                 default_threads: int | None = None) -> LibraPlan:
    """LIBRA's plan (Algorithm 2, line 4): the best under the model of the co-optimised plan
    (Eq. 23), LIBRA-M (Eq. 17 on the size-capped fusion) and the size-capped fusion with
    ``default_threads`` for every bucket (default: the largest thread choice, as NCCL saturates
    the network). Never predicted slower than that default; ``method`` names the winner and
    ``baseline_time`` holds the default's predicted backward time. Defaults K = 10, Z = 150 are
    the paper's settings (Sec. V-A).
    """
    R = _check_dp_args(model, thread_choices, num_chunks, max_groups)
    fixed = (int(R.max()) if default_threads is None
             else check_int("default_threads", default_threads, min_value=1))
    model.check_threads([fixed], "default_threads")
    base = default_plan(model, layers, fixed, bucket_cap_mb)
    candidates = [co_optimize(model, layers, thread_choices, max_groups, num_chunks),
                  allocate_threads(model, layers, base.buckets, thread_choices, num_chunks), base]
    best = min(candidates, key=lambda p: p.backward_time)   # stable: prefers coopt on ties
    log.info("LIBRA plan: %s with %d buckets, predicted backward %.4gs (default %.4gs)",
             best.method, best.num_buckets, best.backward_time, base.backward_time)
    return replace(best, baseline_time=base.backward_time)


# --------------------------------------------------------------------------- exhaustive reference
def exhaustive_plan(model: ContentionModel, layers: Sequence[LayerProfile], thread_choices: Sequence[int],
                    max_groups: int | None = None,
                    buckets: Sequence[Sequence[str]] | None = None) -> LibraPlan:
    """Reference optimum T* by enumeration (tests and benchmarks; exponential time).

    With ``buckets``: every allocation in ``thread_choices^K`` for that fusion (problem 7).
    Without: every fusion into <= ``max_groups`` consecutive groups x every allocation.
    """
    names, b, c = _check_layers(layers)
    R = [int(r) for r in _check_dp_args(model, thread_choices, 1, max_groups)]
    L = len(names)
    if buckets is not None:
        fusions: Iterable[list[tuple[int, int]]] = [_bucket_bounds(buckets, names)]
    else:
        K = L if max_groups is None else min(max_groups, L)

        def all_fusions() -> Iterable[list[tuple[int, int]]]:
            for k in range(1, K + 1):
                for cuts in itertools.combinations(range(1, L), k - 1):
                    edges = (0, *cuts, L)
                    yield list(zip(edges[:-1], edges[1:]))
        fusions = all_fusions()
    best: tuple[float, list[tuple[int, int]], tuple[int, ...]] | None = None
    for bounds in fusions:
        gb, gc = _group_sums(b, bounds), _group_sums(c, bounds)
        for alloc in itertools.product(R, repeat=len(bounds)):
            t = backward_time(model, gb, gc, alloc).total
            if best is None or t < best[0]:
                best = (t, bounds, alloc)
    assert best is not None
    t, bounds, alloc = best
    return LibraPlan(buckets=[names[s:e] for s, e in bounds], threads=list(alloc), backward_time=t,
                     method="exhaustive", max_groups=max_groups)


def theorem1_bound(max_groups: int, num_chunks: int) -> float:
    """The approximation factor 1 + (K-1)/Z of Theorem 1 (Eq. 20)."""
    check_int("max_groups", max_groups, min_value=1)
    check_int("num_chunks", num_chunks, min_value=1)
    return 1.0 + (max_groups - 1) / num_chunks


# --------------------------------------------------------------------------- engine bridge
def cta_counts(plan: LibraPlan, threads_per_cta: int = 512) -> list[int]:
    """Thread counts as NCCL CTA (channel) counts: ``ceil(threads / threads_per_cta)`` per bucket.

    NCCL runs ``NCCL_NTHREADS`` threads per CTA (512 by default on recent GPUs); a per-bucket CTA
    count is what a communicator's ``minCTAs``/``maxCTAs`` config can pin.
    """
    check_int("threads_per_cta", threads_per_cta, min_value=1)
    return [-(-int(t) // threads_per_cta) for t in plan.threads]


def group_params_by_layer(param_names: Iterable[str]) -> dict[str, list[str]]:
    """Group ``model.named_parameters()`` names by owning module (``"a.b.weight"`` -> ``"a.b"``).

    Keeps first-appearance (forward) order of layers and of parameters within a layer. A
    top-level parameter (no dot) is its own layer.
    """
    out: dict[str, list[str]] = {}
    for name in param_names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"param_names must be non-empty strings, got {name!r}")
        layer = name.rsplit(".", 1)[0] if "." in name else name
        out.setdefault(layer, []).append(name)
    return out


def to_engine_bucket_plan(plan: LibraPlan | Sequence[Sequence[str]],
                          layer_params: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """The engine's bucket plan (interface 1): parameter names per bucket, in backward order.

    ``layer_params[layer]`` lists the layer's parameter names in ``model.named_parameters()``
    order; within a bucket the layers keep the plan's backward order and each layer's
    parameters are reversed, so the flattened plan is ``reversed(named_parameters)`` when the
    layers are given in backward order. Every parameter of ``layer_params`` must appear exactly once.
    A parameter-free layer may map to ``[]``; a bucket left without any parameter is an error.
    """
    buckets = plan.buckets if isinstance(plan, LibraPlan) else plan
    if len(buckets) == 0:
        raise ValueError("plan must hold at least one bucket")
    seen_layers: set[str] = set()
    seen_params: set[str] = set()
    out: list[list[str]] = []
    for k, bucket in enumerate(buckets):
        params: list[str] = []
        for layer in bucket:
            if layer not in layer_params:
                raise ValueError(f"layer_params has no entry for layer {layer!r} of bucket {k}; "
                                 f"known layers: {sorted(layer_params)[:10]}")
            if layer in seen_layers:
                raise ValueError(f"plan lists layer {layer!r} twice")
            seen_layers.add(layer)
            for p in reversed(list(layer_params[layer])):
                if p in seen_params:
                    raise ValueError(f"layer_params lists parameter {p!r} twice")
                seen_params.add(p)
                params.append(p)
        if not params:
            raise ValueError(f"bucket {k} ({list(bucket)}) holds no parameter; merge parameter-free "
                             "layers into a neighbour")
        out.append(params)
    missing = [layer for layer in layer_params if layer not in seen_layers]
    if missing:
        raise ValueError(f"plan misses layers {missing[:10]} of layer_params; every trainable "
                         "parameter must be in exactly one bucket")
    return out
