"""JABAS configuration solver (paper section 5.2, Algorithm 1), exact and fast.

Source: JABAS (the JABAS/IIDP paper), Algorithm 1 ("line N" below is its line N)
and section 5.2 with Eq. 7 and the Figure 8 example.

Problem (Eq. 7). For one group H of GPUs (one GPU of every identical pair) and a requested
global batch B_G, choose a local batch B_L (a multiple of min B_L, at most min_g max B_L^g)
and per GPU g a pair (n_vsw, n_GA) with 1 <= n_vsw <= n_max(g, B_L), n_GA >= 0, such that the
decoupled workers n_vsw * (n_GA + 1) of the group sum to M = round(B_G / B_L / 2) and the
throughput F(C) = B_L * M * 2 / max_g t_g is maximal (t_g: predicted iteration time, Eq. 6).

Implementation notes (how this maps onto Algorithm 1)
-----------------------------------------------------
* Lines 6-9: B_L runs over min B_L, 2 min B_L, ... up to min_g max B_L^g; M uses round half
  up (``floor(x + 0.5)``; Python's ``round`` would round half to even). When M < N_H the loop
  stops (line 9): M only shrinks as B_L grows.
* Lines 10-20 (search space + ``PRUNESLOWCONFIGURATIONS``): for each GPU *type* of H we build
  ``best[k]`` = the fastest (n_vsw, n_GA) with exactly k decoupled workers, k = 1..M - N_H + 1
  (a GPU can never take more, since every other GPU takes >= 1). Identical GPUs share it.
  When the model offers ``iteration_times(gpu, B_L, n_vsw, n_GA_array)`` (``PerfModel`` does;
  Eq. 6 is affine in n_GA) the n_GA loop of line 13 is one numpy call.
* Lines 21-23 (dynamic programming): we need min over k_1 + ... + k_N = M of max_j best_j[k_j].
  Instead of the O(M^2 N_H) min-max recurrence we search the bottleneck time T directly:
  T is feasible iff M is in the sumset S_1(T) + ... + S_N(T), S_j(T) = {k : best_j[k] <= T}.
  Feasibility is monotone in T, the optimum is one of the best_j values, and each set and
  sumset is an int bitset (a sumset: per maximal run of set bits of one operand, a few
  shift-ORs of the other; exact integer logic; sets full of holes by a 0/1 convolution, FFT
  for long ones, exact after thresholding integer counts at 0.5); GPUs of one type are one
  count-fold sumset, by doubling. We start at a cheap necessary lower bound (the smallest admissible k's sum to
  at most M and the largest to at least M, checked for every candidate T at once) and gallop
  upwards, so usually only one or two feasibility checks run per B_L. The assignment is
  recovered by backtracking through the reachable totals of the first j GPUs: GPU j, last
  first, takes its fastest admissible k (ties: the smaller k) whose remainder is reachable.
  This is exact: the same optimum as the recurrence (checked against exhaustive enumeration
  in tests/test_config_solver.py).
* Search bounds (ours): one GPU takes at most ``MAX_WORKERS_PER_GPU`` decoupled workers (a
  B_L with M > N_H * MAX_WORKERS_PER_GPU is skipped: some GPU would need more), and at most
  ``MAX_LOCAL_BATCH_CANDIDATES`` local batch sizes are searched (ValueError naming
  min_local_batch otherwise). So the work per call is at most O(L * N_H * K log(N_H K)) with
  K = MAX_WORKERS_PER_GPU, whatever B_G is asked (e.g. 10^11 answers "too large" at once).
* Lines 24-25: a B_L replaces the incumbent only with strictly higher throughput (ties keep the
  smaller B_L). A B_L whose optimistic throughput B_L * M * 2 / T_lower_bound cannot beat the
  incumbent is skipped without solving (exact pruning).

Solo units (ours: any number of GPUs). Group H lists *units*: a GPU type stands for a pair of
identical GPUs of one node (one in each similarity group); a solo name (``"<type>/solo"``,
:func:`jabasray.types.solo_unit`) stands for a GPU without a partner, which runs both groups'
decoupled workers itself as two equal halves of its VSWs. A solo unit with (n_vsw, n_GA) per
group therefore runs 2 n_vsw VSWs: :class:`UnitModel` answers the solver's questions for it
from the GPU's model at 2 n_vsw (and n_max / 2), so Alg. 1 runs unchanged over units.

``solve_configuration`` returns a :class:`Plan` or ``None``; ``solve_configuration_detailed``
returns a :class:`SolverResult` whose ``reason`` says why there is no plan and whose
``outcomes`` list what happened at every B_L. ``solve_configuration_reference`` is the direct
plain-Python O(L M^2 N_H) transcription of Algorithm 1 used as the baseline in
``benchmarks/solver.py`` and as a second oracle in tests.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from ..serialization import JsonMixin
from ..types import Plan, WorkerConfig, unit_gpu
from ..validation import check_float, check_int

log = logging.getLogger(__name__)

# Search bounds (ours, not the paper's): they make the solver's work bounded by construction.
MAX_WORKERS_PER_GPU = 4096        # decoupled workers n_vsw * (n_GA + 1) one GPU may take
MAX_LOCAL_BATCH_CANDIDATES = 4096  # B_L values searched (max B_L / min B_L)


class IterationTimeModel(Protocol):
    """What the solver needs from a performance model (``PerfModel`` satisfies it)."""

    def iteration_time(self, gpu: str, local_batch: int, num_vsw: int, num_ga: int) -> float: ...
    def max_local_batch(self, gpu: str) -> int: ...
    def max_num_vsw(self, gpu: str, local_batch: int) -> int: ...


@dataclass(frozen=True)
class LocalBatchOutcome(JsonMixin):
    """What the solver found for one candidate B_L."""

    local_batch: int                     # B_L
    num_workers_per_group: int           # M
    iteration_time: float | None = None  # optimal max_g t_g at this B_L (None: not solved)
    throughput: float | None = None      # B_L * M * 2 / iteration_time
    note: str = ""                       # "", "pruned: ...", "no configuration: ..."


@dataclass(frozen=True)
class SolverResult(JsonMixin):
    """Result of :func:`solve_configuration_detailed`: the plan (or None) and why."""

    plan: Plan | None
    reason: str                          # "ok" or why no plan exists
    requested_global_batch_size: int
    outcomes: list[LocalBatchOutcome] = field(default_factory=list)


class UnitModel:
    """The iteration-time model over similarity units (module notes): a pair's unit name is its
    GPU type and is answered by ``model`` as is; a solo unit with ``num_vsw`` VSWs per group is
    its GPU running ``2 num_vsw`` VSWs, so it admits ``max_num_vsw // 2`` per group."""

    def __init__(self, model: Any) -> None:
        self.model = model
        if callable(getattr(model, "iteration_times", None)):
            self.iteration_times = self._iteration_times
        if callable(getattr(model, "weight_sync_method", None)):
            self.weight_sync_method = self._weight_sync_method

    def iteration_time(self, gpu: str, local_batch: int, num_vsw: int, num_ga: int) -> float:
        g, solo = unit_gpu(gpu)
        return self.model.iteration_time(g, local_batch, num_vsw * (2 if solo else 1), num_ga)

    def _iteration_times(self, gpu: str, local_batch: int, num_vsw: int, num_ga: Any) -> Any:
        g, solo = unit_gpu(gpu)
        return self.model.iteration_times(g, local_batch, num_vsw * (2 if solo else 1), num_ga)

    def _weight_sync_method(self, gpu: str, local_batch: int, num_vsw: int) -> str:
        g, solo = unit_gpu(gpu)
        return self.model.weight_sync_method(g, local_batch, num_vsw * (2 if solo else 1))

    def max_local_batch(self, gpu: str) -> int:
        return int(self.model.max_local_batch(unit_gpu(gpu)[0]))

    def max_num_vsw(self, gpu: str, local_batch: int) -> int:
        g, solo = unit_gpu(gpu)
        n = int(self.model.max_num_vsw(g, local_batch))
        return n // 2 if solo else n


class LocalBatchBound:
    """``model`` with its largest local batch capped at ``cap`` (a user bound on B_L, e.g.
    ``JobConfig.max_local_batch``): Alg. 1 line 4 then searches B_L <= cap only."""

    def __init__(self, model: Any, cap: int) -> None:
        self.model, self.cap = model, int(check_int("max_local_batch", cap, min_value=1))

    def max_local_batch(self, gpu: str) -> int:
        return min(int(self.model.max_local_batch(gpu)), self.cap)

    def for_allocation(self, num_gpus: int, multi_node: bool) -> "LocalBatchBound":
        fa = getattr(self.model, "for_allocation", None)
        return LocalBatchBound(fa(num_gpus, multi_node) if callable(fa) else self.model, self.cap)

    def __getattr__(self, name: str) -> Any:   # everything else: the model's own
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)


def unit_model(model: Any) -> Any:
    """``model`` answering for similarity units (:class:`UnitModel`; idempotent)."""
    return model if isinstance(model, UnitModel) else UnitModel(model)


# ---------------------------------------------------------------------------- validation
def _validate(global_batch_size: Any, group_gpus: Any, model: Any, min_local_batch: Any) -> list[str]:
    check_int("global_batch_size", global_batch_size, min_value=1)
    check_int("min_local_batch", min_local_batch, min_value=1)
    if isinstance(group_gpus, str) or not isinstance(group_gpus, (list, tuple)) or not group_gpus:
        raise ValueError(f"group_gpus must be a non-empty list of GPU type names, got {group_gpus!r}")
    for i, g in enumerate(group_gpus):
        if not isinstance(g, str) or not g:
            raise ValueError(f"group_gpus[{i}] must be a non-empty GPU type name, got {g!r}")
    for name in ("iteration_time", "max_local_batch", "max_num_vsw"):
        if not callable(getattr(model, name, None)):
            raise ValueError(f"model must provide {name}(...) (iteration_time, max_local_batch, "
                             f"max_num_vsw), got {type(model).__name__}")
    return list(group_gpus)


def num_workers_per_group(global_batch_size: int, local_batch: int) -> int:
    """M = round(B_G / B_L / 2) of Alg. 1 line 8, rounding halves up."""
    return int(math.floor(global_batch_size / local_batch / 2 + 0.5))


# ---------------------------------------------------------------------------- search space
@dataclass
class _TypeTable:
    """best[k] (k = 0..K; best[0] = inf) and the (n_vsw, n_GA) achieving it."""

    best: np.ndarray
    nvsw: np.ndarray
    nga: np.ndarray


def fastest_per_worker_count(model: Any, gpu: str, local_batch: int, max_workers: int,
                             max_vsw: int) -> _TypeTable:
    """Alg. 1 lines 10-20 for one GPU type: for each k in 1..max_workers the fastest
    (n_vsw, n_GA) with n_vsw * (n_GA + 1) = k and n_vsw <= max_vsw (ties: fewer VSWs)."""
    best = np.full(max_workers + 1, np.inf)
    nvsw = np.zeros(max_workers + 1, dtype=np.int64)
    nga = np.zeros(max_workers + 1, dtype=np.int64)
    vectorised = getattr(model, "iteration_times", None)
    for n in range(1, min(max_vsw, max_workers) + 1):
        ga = np.arange(max_workers // n, dtype=np.int64)          # k = n (ga + 1) <= max_workers
        if vectorised is not None:
            ts = np.asarray(vectorised(gpu, local_batch, n, ga), dtype=float)
        else:
            ts = np.array([model.iteration_time(gpu, local_batch, n, int(g)) for g in ga], dtype=float)
        ks = n * (ga + 1)
        better = ts < best[ks]
        best[ks[better]] = ts[better]
        nvsw[ks[better]] = n
        nga[ks[better]] = ga[better]
    return _TypeTable(best, nvsw, nga)


# ---------------------------------------------------------------------------- min-max assignment
# Sets of worker counts are int bitsets (bit k set: k is in the set). The sets are small (at
# most M + 1 bits) and nearly intervals, so a sumset is a few shifts and ORs per maximal run of
# set bits, exact integer logic with no rounding. Where both operands have many runs (sets
# full of holes) a 0/1 convolution is cheaper: np.convolve, or an FFT for long arrays, exact
# after thresholding the integer counts at 0.5; so a sumset stays O(M log M) whatever the sets.
_ONES = re.compile("1+")
_MAX_RUNS = 64     # runs of set bits beyond which a sumset is a convolution
_FFT_MIN = 96      # below this length np.convolve is faster than FFT


def _bitset(mask: np.ndarray) -> int:
    """The set {k : mask[k]} as an int bitset."""
    return int.from_bytes(np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes(), "little")


def _runs(bits: int) -> list[tuple[int, int]]:
    """Maximal runs of set bits of ``bits``: (first bit, length), lowest first."""
    return [(m.start(), m.end() - m.start()) for m in _ONES.finditer(format(bits, "b")[::-1])]


def _num_runs(bits: int) -> int:
    """How many maximal runs of set bits ``bits`` has (bits whose lower neighbour is clear)."""
    return (bits & ~(bits << 1)).bit_count()


def _sumset(a: int, b: int, limit: int, b_runs: list[tuple[int, int]] | None = None) -> int:
    """{x + y : x in a, y in b} up to ``limit``, of two bitsets: the operand with fewer runs of
    set bits is taken run by run ([s, s + L) shifts the other by s and smears it over L
    positions, in O(log L) shift-ORs). ``b_runs``: ``_runs(b)`` when the caller has it."""
    mask = (1 << (limit + 1)) - 1
    a &= mask
    b &= mask
    if not a or not b:
        return 0
    if b_runs is None:
        b_runs = _runs(b)
    a_runs = _num_runs(a)
    if min(a_runs, len(b_runs)) > _MAX_RUNS:
        return _bitset(_convolve(_bool_array(a, limit), _bool_array(b, limit), limit))
    if a_runs < len(b_runs):
        runs, other = _runs(a), b
    else:
        runs, other = b_runs, a
    out = 0
    for start, length in runs:
        if start > limit:
            break
        smeared, width = other, 1
        while width < length:                 # smeared = OR of other << d, d < width
            step = min(width, length - width)
            smeared |= smeared << step
            width += step
        out |= smeared << start
    return out & mask


def _bool_array(bits: int, limit: int) -> np.ndarray:
    """The bitset ``bits`` as a bool array of length limit + 1 (bits beyond it dropped)."""
    raw = np.frombuffer(bits.to_bytes(limit // 8 + 1, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[: limit + 1].astype(bool)


def _convolve(a: np.ndarray, b: np.ndarray, limit: int) -> np.ndarray:
    """{x + y : a[x], b[y]} as a bool array of length limit + 1 (0/1 convolution)."""
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    n = len(fa) + len(fb) - 1
    if min(len(fa), len(fb)) < _FFT_MIN:
        c = np.convolve(fa, fb)
    else:
        size = 1 << (n - 1).bit_length()
        c = np.fft.irfft(np.fft.rfft(fa, size) * np.fft.rfft(fb, size), size)[:n]
    out = np.zeros(limit + 1, dtype=bool)
    m = min(limit + 1, n)
    out[:m] = c[:m] > 0.5
    return out


def _power_sumset(allowed: int, count: int, limit: int) -> int:
    """The ``count``-fold sumset allowed + ... + allowed (up to ``limit``) by doubling:
    O(log count) sumsets instead of ``count``."""
    result, base = None, allowed
    while count:
        if count & 1:
            result = base if result is None else _sumset(result, base, limit)
        count >>= 1
        if count:
            base = _sumset(base, base, limit)
    return result


def _feasible(groups: Sequence[tuple[np.ndarray, int]], total: int, threshold: float) -> bool:
    """Whether the units, ``count`` alike per (table, count) of ``groups``, can take exactly
    ``total`` workers with every time <= ``threshold`` (each group's sumset by
    :func:`_power_sumset`)."""
    reach = 1                                   # {0}
    for best, count in groups:
        allowed = _bitset(best <= threshold)
        if not allowed:
            return False
        reach = _sumset(reach, _power_sumset(allowed, count, total), total)
        if not reach:
            return False
    return bool(reach >> total & 1)


def _first_necessary(groups: Sequence[tuple[np.ndarray, int]], total: int, cands: np.ndarray) -> int | None:
    """Index of the first candidate threshold T meeting the necessary condition (every unit has
    an admissible k, the smallest admissible k's sum to <= ``total`` and the largest to >=
    ``total``), all candidates at once; None when none does. The condition is monotone in T:
    the smallest admissible k of a table is the first k whose prefix minimum is <= T, the
    largest the last k whose suffix minimum is <= T."""
    lo = np.zeros(len(cands), dtype=np.int64)
    hi = np.zeros(len(cands), dtype=np.int64)
    ok = np.ones(len(cands), dtype=bool)
    for t, count in groups:
        prefix = np.fmin.accumulate(t)                       # non-increasing
        suffix = np.fmin.accumulate(t[::-1])[::-1]           # non-decreasing
        first = np.searchsorted(-prefix, -cands, side="left")
        last = np.searchsorted(suffix, cands, side="right") - 1
        ok &= first < len(t)
        lo += count * np.minimum(first, len(t) - 1)
        hi += count * last
    meets = ok & (lo <= total) & (hi >= total)
    return int(np.argmax(meets)) if meets[-1] else None


def min_max_assignment(tables: Sequence[np.ndarray], total: int) -> tuple[float, list[int]] | None:
    """Exact ``min over k_1+...+k_N = total, k_j >= 1 of max_j tables[j][k_j]``.

    ``tables[j][k]`` is GPU j's time with k workers (index 0 and infeasible entries = inf).
    Returns (bottleneck time T, [k_1, ..., k_N]) or None when no assignment exists. The
    assignment is the backtracking's (module notes): GPU j, from the last to the first, takes
    the fastest k with tables[j][k] <= T (the smallest such k on ties) whose remainder the GPUs
    before it can take within T.
    """
    n = len(tables)
    if n == 0 or total < n:
        return None
    # units given the same table (GPUs of one type) are handled once, with their count
    distinct: dict[int, list] = {}
    tabs = []
    for t in tables:
        entry = distinct.get(id(t))
        if entry is None:
            arr = np.array(t[: total - n + 2], dtype=float)
            arr[0] = np.inf                  # every GPU takes at least one worker
            entry = distinct[id(t)] = [arr, 0]
        entry[1] += 1
        tabs.append(entry[0])
    groups = [(arr, count) for arr, count in distinct.values()]
    cands = np.unique(np.concatenate([t[np.isfinite(t)] for t, _ in groups]))
    if cands.size == 0:
        return None
    start = _first_necessary(groups, total, cands)
    if start is None:
        return None
    # Gallop from the lower bound to the first exactly feasible threshold, then bisect.
    step, prev, probe = 1, start - 1, start
    found: int | None = None
    while probe < len(cands):
        if _feasible(groups, total, cands[probe]):
            found = probe
            break
        prev, probe, step = probe, min(len(cands) - 1, probe + step), step * 2
        if prev == len(cands) - 1:
            break
    if found is None:
        return None
    lo_i, hi_i = prev + 1, found
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if _feasible(groups, total, cands[mid]):
            hi_i = mid
        else:
            lo_i = mid + 1
    T = float(cands[hi_i])
    # per distinct table: its admissible set (bits and runs) and its admissible k, fastest first
    # (ties: the smaller k)
    admissible: dict[int, tuple[int, list[tuple[int, int]], list[int]]] = {}
    for t in tabs:
        if id(t) not in admissible:
            ks = np.flatnonzero(t <= T)
            bits = _bitset(t <= T)
            admissible[id(t)] = (bits, _runs(bits), ks[np.lexsort((ks, t[ks]))].tolist())
    reach = [1]                                 # reach[j]: the first j units' totals within T
    for t in tabs:
        bits, runs, _ = admissible[id(t)]
        reach.append(_sumset(reach[-1], bits, total, runs))
    if not reach[-1] >> total & 1:             # cannot happen: T was feasible
        raise RuntimeError("min_max_assignment: the feasible threshold is not reachable unit by unit")
    # Backtrack: GPU j takes the fastest admissible k that leaves a reachable remainder.
    ks_out = [0] * n
    s = total
    for j in range(n - 1, -1, -1):
        before = reach[j]
        for k in admissible[id(tabs[j])][2]:
            if k <= s and before >> (s - k) & 1:
                break
        else:  # cannot happen: reach[j + 1] holds s
            raise RuntimeError("min_max_assignment: backtracking failed")
        ks_out[j] = k
        s -= k
    return T, ks_out


# ---------------------------------------------------------------------------- Algorithm 1
def _weight_syncs(model: Any, workers: Sequence[WorkerConfig], local_batch: int) -> tuple[str, list[str]]:
    """The weight sync the model predicts for each worker's configuration (``weight_sync_method``
    of the model, e.g. PerfModel's faster of SWS/OWS) and the common one ("mixed" when GPUs
    differ). A model without the method: "auto" everywhere (the engine's own rule decides)."""
    fn = getattr(model, "weight_sync_method", None)
    if not callable(fn):
        return "auto", ["auto"] * len(workers)
    known: dict[tuple[str, int], str] = {}   # units of one type and VSW count: asked once
    per = []
    for w in workers:
        key = (w.gpu, w.num_vsw)
        if key not in known:
            known[key] = str(fn(w.gpu, local_batch, w.num_vsw))
        per.append(known[key])
    return (per[0] if len(set(per)) == 1 else "mixed"), per


def local_batch_candidates(min_local_batch: int, max_local_batch: int) -> range:
    """Alg. 1 line 6: B_L = min B_L, 2 min B_L, ... <= max B_L; at most MAX_LOCAL_BATCH_CANDIDATES
    of them (a ValueError naming min_local_batch otherwise: the search must stay bounded)."""
    count = max(0, max_local_batch // min_local_batch)
    if count > MAX_LOCAL_BATCH_CANDIDATES:
        raise ValueError(f"min_local_batch must be >= {-(-max_local_batch // MAX_LOCAL_BATCH_CANDIDATES)} "
                         f"so that at most {MAX_LOCAL_BATCH_CANDIDATES} local batch sizes up to the "
                         f"largest one ({max_local_batch}) are searched, got {min_local_batch}")
    return range(min_local_batch, max_local_batch + 1, min_local_batch)


def max_global_batch(group_size: int, max_local_batch: int) -> int:
    """The largest B_G any B_L can serve within the search bound: B_G* = 2 B_L M with
    M <= N_H * MAX_WORKERS_PER_GPU at the largest B_L."""
    return 2 * max_local_batch * group_size * MAX_WORKERS_PER_GPU


def cached_table(tables: dict | None, model: Any, gpu: str, local_batch: int, max_workers: int,
                 max_vsw: int) -> _TypeTable:
    """:func:`fastest_per_worker_count`, kept in ``tables`` (None: not kept) per (unit, B_L,
    n_max): a table for K workers is the first K + 1 entries of any longer one (each entry is
    the fastest configuration with exactly k workers, whatever the length), so the longest
    computed serves every shorter request. The caller keeps ``tables`` for ONE model whose times
    do not change (the auto-scaler's plan cache, dropped with the model)."""
    if tables is None:
        return fastest_per_worker_count(model, gpu, local_batch, max_workers, max_vsw)
    key = (gpu, local_batch, max_vsw)
    hit = tables.get(key)
    if hit is None or len(hit.best) <= max_workers:
        hit = tables[key] = fastest_per_worker_count(model, gpu, local_batch, max_workers, max_vsw)
    if len(hit.best) == max_workers + 1:
        return hit
    return _TypeTable(hit.best[:max_workers + 1], hit.nvsw[:max_workers + 1], hit.nga[:max_workers + 1])


def solve_local_batch(global_batch_size: int, gpus: Sequence[str], model: Any, local_batch: int,
                      incumbent: float | None = None, tables: dict | None = None
                      ) -> tuple[Plan | None, LocalBatchOutcome]:
    """Alg. 1 lines 8-23 for ONE local batch size: the optimal (n_vsw, n_GA) per GPU of the group
    at this B_L, or None with the reason in the outcome. ``incumbent``: a throughput to beat
    (exact pruning, line 24); None solves unconditionally. ``tables``: see :func:`cached_table`."""
    gpus = list(gpus)
    model = unit_model(model)
    n_h = len(gpus)
    types = list(dict.fromkeys(gpus))
    m = num_workers_per_group(global_batch_size, local_batch)                 # line 8
    if m < n_h:                                                                # line 9
        return None, LocalBatchOutcome(local_batch, m, note="stop: M < N_H (line 9)")
    if m > n_h * MAX_WORKERS_PER_GPU:   # search bound: some GPU would take > MAX_WORKERS_PER_GPU
        return None, LocalBatchOutcome(local_batch, m, note=f"skipped: M={m} needs more than "
                                       f"{MAX_WORKERS_PER_GPU} decoupled workers per GPU (search bound)")
    max_workers = min(m - n_h + 1, MAX_WORKERS_PER_GPU)
    per_type: dict[str, _TypeTable] = {}
    missing = []
    for g in types:
        nmax = int(model.max_num_vsw(g, local_batch))
        if nmax < 1:
            missing.append(g)
            continue
        per_type[g] = cached_table(tables, model, g, local_batch, max_workers, nmax)
    if missing:
        return None, LocalBatchOutcome(local_batch, m, note=f"no configuration: {missing} "
                                       f"cannot run one VSW at this B_L")
    arrays = [per_type[g].best for g in gpus]
    # Exact pruning: even the necessary lower bound of T cannot beat the incumbent.
    lb = max(float(np.min(t.best[1:])) for t in per_type.values())
    if incumbent is not None and local_batch * m * 2 / lb <= incumbent:
        return None, LocalBatchOutcome(local_batch, m, note="pruned: cannot beat the incumbent")
    res = min_max_assignment(arrays, m)
    if res is None:
        return None, LocalBatchOutcome(local_batch, m, note="no configuration: M workers "
                                       "cannot be split over the group")
    t_iter, ks = res
    thp = local_batch * m * 2 / t_iter
    workers = worker_configs(gpus, ks, per_type)
    common, per_worker = _weight_syncs(model, workers, local_batch)
    plan = Plan(global_batch_size=local_batch * m * 2, local_batch_size=local_batch,
                workers=workers, iteration_time=t_iter,
                requested_global_batch_size=global_batch_size,
                weight_sync=common, worker_weight_sync=per_worker)
    return plan, LocalBatchOutcome(local_batch, m, t_iter, thp)


def worker_configs(gpus: Sequence[str], ks: Sequence[int], per_type: dict[str, _TypeTable]) -> list[WorkerConfig]:
    """Alg. 1's configuration per unit of the group: unit ``gpus[j]`` with ``ks[j]`` decoupled
    workers runs its type table's fastest (n_vsw, n_GA) for that count. Units of one type and
    count get the same (immutable) configuration, read from the table once: on a large
    cluster hundreds of units share a handful of them."""
    made: dict[tuple[str, int], WorkerConfig] = {}
    out = []
    for g, k in zip(gpus, ks):
        w = made.get((g, k))
        if w is None:
            t = per_type[g]
            w = made[(g, k)] = WorkerConfig(g, int(t.nvsw[k]), int(t.nga[k]))
        out.append(w)
    return out


def solve_configuration_detailed(global_batch_size: int, group_gpus: Sequence[str], model: Any,
                                 min_local_batch: int, max_deviation: float | None = None) -> SolverResult:
    """Algorithm 1 (exact, see module notes). Returns the plan and a reason when there is none.

    ``max_deviation`` (our addition; None = the paper): skip local batch sizes whose rounded
    B_G* = 2 B_L M differs from the requested B_G by more than this fraction. Alg. 1 maximises
    throughput B_G*/t, so for small M the rounding can favour a B_G* well above the request
    (e.g. B_G 64, B_L 48 -> M = round(0.67) = 1 -> B_G* = 96); 0 demands B_G* = B_G exactly.
    """
    gpus = _validate(global_batch_size, group_gpus, model, min_local_batch)
    model = unit_model(model)
    if max_deviation is not None:
        check_float("max_deviation", max_deviation, min_value=0)
    n_h = len(gpus)
    types = list(dict.fromkeys(gpus))
    max_bl = min(int(model.max_local_batch(g)) for g in types)           # line 4
    outcomes: list[LocalBatchOutcome] = []
    if max_bl < min_local_batch:
        reason = (f"min_local_batch {min_local_batch} exceeds the largest local batch that fits "
                  f"on every GPU of the group ({max_bl})")
        return SolverResult(None, reason, global_batch_size, outcomes)
    best_plan: Plan | None = None
    best_thp = 0.0
    stop_note = ""
    for local_batch in local_batch_candidates(min_local_batch, max_bl):      # line 6
        m = num_workers_per_group(global_batch_size, local_batch)
        if max_deviation is not None and m >= n_h and \
                abs(2 * local_batch * m - global_batch_size) > max_deviation * global_batch_size:
            outcomes.append(LocalBatchOutcome(local_batch, m, note=f"skipped: B_G*={2 * local_batch * m} "
                                              f"deviates more than {max_deviation:g} from B_G"))
            continue
        plan, outcome = solve_local_batch(global_batch_size, gpus, model, local_batch,
                                          incumbent=best_thp if best_plan is not None else None)
        outcomes.append(outcome)
        if outcome.note.startswith("stop"):
            stop_note = f"B_L={local_batch}: M={m} decoupled workers per group < N_H={n_h} GPUs"
            break
        if plan is not None and outcome.throughput > best_thp:               # line 24
            best_thp, best_plan = outcome.throughput, plan
    if best_plan is not None:
        return SolverResult(best_plan, "ok", global_batch_size, outcomes)
    if stop_note and len(outcomes) == 1:
        reason = (f"global batch {global_batch_size} is too small for {n_h} GPUs per group: "
                  f"{stop_note}; need B_G >= {min_local_batch * (2 * n_h - 1)}")
    elif outcomes and all(o.note.startswith("skipped: M=") for o in outcomes):
        reason = (f"global batch {global_batch_size} is too large for {n_h} GPUs per group: it must "
                  f"be <= {max_global_batch(n_h, max_bl)} (at most {MAX_WORKERS_PER_GPU} decoupled "
                  f"workers per GPU at B_L <= {max_bl})")
    else:
        notes = "; ".join(f"B_L={o.local_batch}: {o.note}" for o in outcomes if o.note)
        reason = f"no configuration for global batch {global_batch_size}: {notes}"
    log.debug("solve_configuration: %s", reason)
    return SolverResult(None, reason, global_batch_size, outcomes)


def solve_configuration(global_batch_size: int, group_gpus: Sequence[str], model: Any,
                        min_local_batch: int, max_deviation: float | None = None) -> Plan | None:
    """The best :class:`Plan` for one group H (Eq. 7), or None (see
    :func:`solve_configuration_detailed` for the reason).

    ``group_gpus``: unit names of group H, one per identical pair or solo GPU (module notes); ``model``: any object
    with ``iteration_time(gpu, local_batch, num_vsw, num_ga)``, ``max_local_batch(gpu)`` and
    ``max_num_vsw(gpu, local_batch)``. ``plan.workers[i]`` configures ``group_gpus[i]``.
    ``max_deviation``: see :func:`solve_configuration_detailed` (default: the paper's Alg. 1).
    """
    return solve_configuration_detailed(global_batch_size, group_gpus, model, min_local_batch,
                                        max_deviation).plan


def explain_configuration(global_batch_size: int, group_gpus: Sequence[str], model: Any,
                          min_local_batch: int) -> str:
    """The reason string of :func:`solve_configuration_detailed` ("ok" when a plan exists)."""
    return solve_configuration_detailed(global_batch_size, group_gpus, model, min_local_batch).reason


# ---------------------------------------------------------------------------- reference
def solve_configuration_reference(global_batch_size: int, group_gpus: Sequence[str], model: Any,
                                  min_local_batch: int) -> Plan | None:
    """Direct plain-Python transcription of Algorithm 1: the search space of lines 10-18 for every
    GPU of H (scalar ``iteration_time`` calls, n_GA in [0, floor(M / n_vsw)]), pruning to the
    fastest configuration per worker count (line 20) and the min-max dynamic programme over the
    GPUs, O(M^2) per GPU, O(L M^2 N_H) in all. Slow; a baseline and an oracle."""
    gpus = _validate(global_batch_size, group_gpus, model, min_local_batch)
    model = unit_model(model)
    n_h = len(gpus)
    max_bl = min(int(model.max_local_batch(g)) for g in gpus)
    best: Plan | None = None
    best_thp = 0.0
    for local_batch in range(min_local_batch, max_bl + 1, min_local_batch):
        m = num_workers_per_group(global_batch_size, local_batch)
        if m < n_h:
            break
        pruned: list[dict[int, tuple[float, int, int]]] = []
        for g in gpus:
            table: dict[int, tuple[float, int, int]] = {}
            for nv in range(1, min(m, int(model.max_num_vsw(g, local_batch))) + 1):
                for ga in range(0, m // nv + 1):
                    k = nv * (ga + 1)
                    if k > m:
                        continue
                    t = model.iteration_time(g, local_batch, nv, ga)
                    if k not in table or t < table[k][0]:
                        table[k] = (t, nv, ga)
            pruned.append(table)
        # Min-max recurrence over GPUs: f[s] = best bottleneck of the GPUs so far taking s
        # workers in total; choice[j][s] = workers of GPU j in that optimum (for backtracking).
        inf = float("inf")
        f = [0.0] + [inf] * m
        choices: list[list[int]] = []
        for table in pruned:
            nxt = [inf] * (m + 1)
            ch = [0] * (m + 1)
            items = sorted(table.items())
            for s in range(m + 1):
                fs = f[s]
                if fs == inf:
                    continue
                for k, (t, _, _) in items:
                    s2 = s + k
                    if s2 > m:
                        break
                    v = fs if fs > t else t
                    if v < nxt[s2]:
                        nxt[s2] = v
                        ch[s2] = k
            f = nxt
            choices.append(ch)
        if f[m] == inf:
            continue
        ks = [0] * n_h
        rest = m
        for j in range(n_h - 1, -1, -1):
            ks[j] = choices[j][rest]
            rest -= ks[j]
        t_iter = f[m]
        thp = local_batch * m * 2 / t_iter
        if thp > best_thp:
            best_thp = thp
            workers = [WorkerConfig(g, pruned[i][k][1], pruned[i][k][2]) for i, (g, k) in enumerate(zip(gpus, ks))]
            common, per_worker = _weight_syncs(model, workers, local_batch)
            best = Plan(global_batch_size=local_batch * m * 2, local_batch_size=local_batch,
                        workers=workers, iteration_time=t_iter,
                        requested_global_batch_size=global_batch_size,
                        weight_sync=common, worker_weight_sync=per_worker)
    return best


def min_max_assignment_reference(tables: Sequence[np.ndarray], total: int) -> tuple[float, list[int]] | None:
    """Plain-Python transcription of :func:`min_max_assignment`: the bottleneck T by the min-max
    recurrence f_j(s) = min over k >= 1 of max(f_{j-1}(s - k), tables[j][k]) (as in
    :func:`solve_configuration_reference`), the assignment by the same backtracking over the
    reachable totals of the first j GPUs kept as Python sets. O(N M^2); an oracle for tests."""
    n = len(tables)
    if n == 0 or total < n:
        return None
    inf = float("inf")
    f = [0.0] + [inf] * total
    for t in tables:
        nxt = [inf] * (total + 1)
        for s in range(total + 1):
            if f[s] == inf:
                continue
            for k in range(1, min(total - s, len(t) - 1) + 1):
                v = max(f[s], float(t[k]))
                if v < nxt[s + k]:
                    nxt[s + k] = v
        f = nxt
    T = f[total]
    if T == inf:
        return None
    reach = [{0}]
    for t in tables:
        admissible = [k for k in range(1, len(t)) if t[k] <= T]
        reach.append({s + k for s in reach[-1] for k in admissible if s + k <= total})
    ks, s = [0] * n, total
    for j in range(n - 1, -1, -1):
        t = tables[j]
        options = [k for k in range(1, min(s, len(t) - 1) + 1) if t[k] <= T and s - k in reach[j]]
        ks[j] = min(options, key=lambda k: (t[k], k))
        s -= ks[j]
    return T, ks


__all__ = ["solve_configuration", "solve_configuration_detailed", "explain_configuration",
           "solve_configuration_reference", "solve_local_batch", "local_batch_candidates",
           "max_global_batch", "MAX_WORKERS_PER_GPU", "MAX_LOCAL_BATCH_CANDIDATES", "SolverResult", "LocalBatchOutcome",
           "min_max_assignment", "min_max_assignment_reference", "fastest_per_worker_count",
           "num_workers_per_group", "worker_configs", "IterationTimeModel", "UnitModel", "unit_model", "LocalBatchBound"]
