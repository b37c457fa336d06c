"""The cost problem (DeepPool section 4.1-4.2): transfer fractions, the network model, and
:class:`BurstProblem`, the validated planner input with every per-GPU-count cost precomputed.

The formulas are written out in the package docstring (:mod:`jabasray.planners.burst`).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from ...serialization import JsonMixin
from ...validation import check_float, check_int
from .graph import LayerGraph, blocks_of, decompose, validate_graph

_INF = math.inf
_AMP_RTOL = 1e-12   # relative slack on the amplification check (float round-off only)


@dataclass(frozen=True)
class NetworkModel(JsonMixin):
    """Full-bisection network (§4.1): per-GPU bandwidth and minimum propagation delay."""

    bandwidth: float        # bytes per second per GPU
    latency: float = 0.0    # propagation delay per transfer, seconds

    def __post_init__(self) -> None:
        check_float("network.bandwidth", self.bandwidth, min_value=0, min_exclusive=True)
        check_float("network.latency", self.latency, min_value=0)



def candidate_gpu_counts(total_gpus: int, powers_of_two: bool = True) -> list[int]:
    """GPU counts the search considers: powers of two ``<= G`` (Table 3) or ``1..G``."""
    check_int("total_gpus", total_gpus, min_value=1)
    if powers_of_two:
        return [1 << k for k in range(total_gpus.bit_length()) if (1 << k) <= total_gpus]
    return list(range(1, total_gpus + 1))


def rescale_fraction(g: np.ndarray | int, h: np.ndarray | int) -> np.ndarray:
    """Largest fraction of a tensor one GPU sends or receives when samples sharded contiguously
    over GPUs ``0..g-1`` are re-sharded over ``0..h-1``.

    With ``a = min(g,h) < b = max(g,h)``: GPU ``k`` of the small side keeps the overlap
    ``max(0, (k+1)/b - k/a)``, which shrinks with k, so the busiest sender is ``k = a-1`` and
    sends ``1/a - max(0, a/b + 1/a - 1)``; every GPU ``k >= a`` of the large side receives a
    full shard ``1/b``.  ``f = max(those two)``; 0 when ``g == h``.
    """
    g = np.asarray(g, dtype=float)
    h = np.asarray(h, dtype=float)
    a = np.minimum(g, h)
    b = np.maximum(g, h)
    f = np.maximum(1.0 / a - np.maximum(0.0, a / b + 1.0 / a - 1.0), 1.0 / b)
    return np.where(g == h, 0.0, f)


def disjoint_fraction(g: np.ndarray | int, h: np.ndarray | int) -> np.ndarray:
    """Fraction sent/received per GPU between two disjoint GPU sets: ``max(1/g, 1/h)``."""
    g = np.asarray(g, dtype=float)
    h = np.asarray(h, dtype=float)
    return np.maximum(1.0 / g, 1.0 / h)


def amplification(t: float, g: int, comp1: float) -> float:
    """``Amp = T * g / comp(i, 1)`` (0/0 counts as 0)."""
    return t * g / comp1 if comp1 > 0 else (0.0 if t == 0 else _INF)


def _reference_work(order: list[str], preds: dict[str, list[str]], comp1: np.ndarray) -> dict[str, float]:
    """Reference work of every layer: ``comp(i, 1)``, or for a zero-compute layer the largest
    reference work among its inputs (0 for a zero-compute input layer).  ``order`` is topological."""
    ref: dict[str, float] = {}
    for name, own in zip(order, comp1.tolist()):
        ref[name] = own if own > 0 else max((ref[u] for u in preds[name]), default=0.0)
    return ref


class BurstProblem:
    """Validated planner input with the per-count cost arrays precomputed.

    Arrays are indexed by position in ``counts`` (the candidate GPU counts)."""

    def __init__(self, graph: LayerGraph, network: NetworkModel, total_gpus: int,
                 amplification_limit: float, powers_of_two: bool = True,
                 parallel_branches: bool = True) -> None:
        self.total_gpus = check_int("total_gpus", total_gpus, min_value=1)
        self.limit = check_float("amplification_limit", amplification_limit, min_value=1.0)
        if not isinstance(network, NetworkModel):
            raise ValueError(f"network must be a NetworkModel, got {type(network).__name__}")
        self.network = network
        self.parallel_branches = bool(parallel_branches)
        self.counts = candidate_gpu_counts(total_gpus, powers_of_two)
        self.cs = np.asarray(self.counts, dtype=float)
        self.n = len(self.counts)
        self.order, self.preds = validate_graph(graph, self.counts)
        self.specs = {spec.name: spec for spec in graph.layers}
        self.source = self.order[0]
        self.sink = self.order[-1]
        self.tree = decompose(self.order, self.preds, self.source, self.sink)

        bw, lat = network.bandwidth, network.latency
        gg, hh = np.meshgrid(self.cs, self.cs, indexing="ij")
        shared = rescale_fraction(gg, hh)
        self._frac = {False: shared, True: disjoint_fraction(gg, hh)}
        self._moves = {False: shared > 0, True: np.ones_like(shared, dtype=bool)}
        specs = [self.specs[name] for name in self.order]
        comp = np.array([[float(sp.comp_time[g]) for g in self.counts] for sp in specs])
        pbytes = np.array([float(sp.param_bytes) for sp in specs])[:, None]
        # sync(i, g) = 2 (g-1)/g P_i / B + d  (0 for g = 1 or P_i = 0)
        sync = np.where((self.cs[None, :] > 1) & (pbytes > 0),
                        2.0 * (self.cs[None, :] - 1) / self.cs[None, :] * pbytes / bw + lat, 0.0)
        work = comp + sync
        self.comp = dict(zip(self.order, comp))
        self.sync = dict(zip(self.order, sync))
        self.work = dict(zip(self.order, work))
        # Amp check as "(T * g) <= limit * reference work" (no division).  The reference work
        # of a layer is comp(i, 1); a zero-compute layer (a concat, the profiler's output join)
        # has none, and a transfer into it is judged against the reference work of the layer
        # whose output it carries (see "Zero-compute layers" in the package docstring).
        self.reference_work = _reference_work(self.order, self.preds, comp[:, 0])
        self._comm_cache: dict[tuple[str, bool], np.ndarray] = {}
        # All edge matrices at once: _edges[disjoint, e] = comm, or inf where Amp(v, h) > limit.
        index = {name: i for i, name in enumerate(self.order)}
        pairs = [(u, v) for v in self.order for u in self.preds[v]]
        self._edge_id = {pair: e for e, pair in enumerate(pairs)}
        us = np.array([index[u] for u, _ in pairs], dtype=int)
        vs = np.array([index[v] for _, v in pairs], dtype=int)
        act = np.array([float(sp.activation_bytes) for sp in specs])
        edge_budget = np.array([self.edge_budget(u, v) for u, v in pairs])
        stacked = []
        for disjoint in (False, True):
            comm_e = self._comm(act[us, None, None], disjoint)
            ok = (comm_e + work[vs, None, :]) * self.cs[None, None, :] <= edge_budget[:, None, None]
            stacked.append(np.where(ok, comm_e, _INF))
        self._edges = np.stack(stacked) if pairs else np.zeros((2, 0, self.n, self.n))
        # _cap_mask[k]: 0 for the first k candidate counts, inf above (k = cap_index(cap))
        self._cap_mask = np.where(np.arange(self.n)[None, :] < np.arange(self.n + 1)[:, None], 0.0, _INF)

    # -- scalar helpers (evaluate_assignment) and matrices (search) share these formulas
    def edge_reference(self, u: str | None, v: str) -> float:
        """The work ``Amp`` of layer v is measured against on its incoming edge from u (None:
        v is the input layer): ``comp(v, 1)``, or for a zero-compute v the reference work of u."""
        own = float(self.comp[v][0])
        if own > 0 or u is None:
            return own
        return self.reference_work[u]

    def edge_budget(self, u: str | None, v: str) -> float:
        """``limit * edge_reference(u, v)`` (with float round-off slack): the edge is feasible
        iff ``(comm + comp(v, h) + sync(v, h)) * h <= edge_budget``."""
        return self.limit * self.edge_reference(u, v) * (1.0 + _AMP_RTOL)

    def _comm(self, act: np.ndarray | float, disjoint: bool) -> np.ndarray:
        """``2 (f A / B + d)`` over (g, h) where data moves, 0 elsewhere; ``act`` (activation
        bytes A) broadcasts against the trailing (n, n) axes."""
        per_move = 2.0 * (self._frac[disjoint] * act / self.network.bandwidth + self.network.latency)
        return np.where(self._moves[disjoint], per_move, 0.0)

    def comm_matrix(self, u: str, disjoint: bool) -> np.ndarray:
        """``comm((u,g) -> (.,h))`` for all (g, h): ``2 (f A_u / B + d)`` where data moves."""
        key = (u, disjoint)
        mat = self._comm_cache.get(key)
        if mat is None:
            mat = self._comm_cache[key] = self._comm(float(self.specs[u].activation_bytes), disjoint)
        return mat

    def edge_matrix(self, u: str, v: str, disjoint: bool) -> np.ndarray:
        """Transfer cost of edge u -> v with inf where ``Amp(v, h)`` would break the limit:
        ``(comm + comp(v,h) + sync(v,h)) * h > limit * comp(v,1)``."""
        return self._edges[int(disjoint), self._edge_id[(u, v)]]

    def edge_matrices(self, u: str, v: str, disjoint: list[bool]) -> np.ndarray:
        """``edge_matrix`` for several flags, stacked: (len(disjoint), n, n)."""
        return self._edges[np.asarray(disjoint, dtype=int), self._edge_id[(u, v)]]

    def node_costs(self, name: str, caps: list[int]) -> np.ndarray:
        """``comp + sync`` of a layer for several lane caps (inf above the cap): (len(caps), n)."""
        ks = [self.cap_index(cap) for cap in caps]
        return self.work[name][None, :] + self._cap_mask[ks]

    def blocks(self) -> list[tuple[str, str, list[list[str]]]]:
        """Every branch/join block as (branch layer, join layer, layers of each lane)."""
        return [(s, t, [lane.nodes() for lane in tree.lanes]) for s, t, tree in blocks_of(self.tree)]

    def cap_index(self, cap: int) -> int:
        """Number of candidate counts ``<= cap``."""
        return bisect.bisect_right(self.counts, cap)

    def split_cap(self, cap: int, lanes: int) -> int | None:
        """Largest candidate count ``<= cap // lanes`` (None when no candidate fits)."""
        k = self.cap_index(cap // lanes)
        return self.counts[k - 1] if k > 0 else None


