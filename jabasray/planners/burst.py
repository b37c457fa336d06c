"""DeepPool burst-parallel planner: a GPU count for every layer under a GPU-sec amplification limit.

Implements §4 of DeepPool (``papers/deeppool-burst-parallel.txt``): Algorithm 1 ("Search
Linear") for a chain of layers, and the branch/join graph reduction of §4.2 for graphs whose
chains fork and join (Inception, residual blocks).  Pure Python + numpy, no torch, no ray.

Implementation notes
--------------------
Cost model (§4.1, "we simply divide the payload size by the bandwidth and add the propagation
delay"), with per-GPU bandwidth ``B`` (bytes/s) and propagation delay ``d`` (s):

* ``comp(i, g)``: forward+backward time of layer i at per-GPU batch ``global/g`` (given).
* ``sync(i, g) = 2 (g-1)/g * P_i / B + d`` for ``g > 1`` (ring all-reduce payload of the
  layer's ``P_i`` parameter bytes), 0 for ``g = 1`` or ``P_i = 0``.
* ``comm((i,g) -> (j,h)) = 2 (f(g,h) * A_i / B + d)`` for ``g != h``, 0 for ``g == h``: the
  activation ``A_i`` (global batch) goes forward and its gradient backward.  ``f`` is the
  largest fraction of ``A_i`` one GPU sends or receives when samples are re-sharded
  contiguously from GPUs ``0..g-1`` to ``0..h-1`` (``rescale_fraction``, closed form; equals
  ``1/min(g,h)`` for powers of two >= 2).  When a branch runs on its *own* GPU set (see below)
  nothing stays local and ``f = max(1/g, 1/h)`` (``disjoint_fraction``).

Amplification (§4.2): ``Amp(i, g) = T[i][g] * g / comp(i, 1)`` where
``T[i][g] = comm_in + comp(i,g) + sync(i,g)`` is the time spent on layer i *for the chosen
predecessor*.  Because T depends on the incoming edge, the limit is a constraint on each edge
``(i-1,h) -> (i,g)``::

    (comm((i-1,h)->(i,g)) + comp(i,g) + sync(i,g)) * g  <=  AmpLimit * comp(i,1)

and the DP of Algorithm 1 becomes an exact shortest path over feasible edges:
``S[i][g] = min_h S[i-1][h] + comm + comp(i,g) + sync(i,g)`` over feasible h, ``S[0][g]=0``.

*Deviation from the paper's pseudo-code.*  Algorithm 1 filters predecessor *states* by their
already fixed ``Amp(i-1,h)`` and accepts the first candidate unconditionally
(``bestAmp = inf`` makes ``max(bestAmp, AmpLimit) = inf``), so a returned plan can exceed the
limit, and a state whose cheapest predecessor breaks the limit is dropped although another
predecessor would have kept it feasible.  Checking the same ``Amp`` on the edge instead gives
the optimum under exactly the paper's definition (tests compare with exhaustive search) and
every returned plan respects the limit.  ``search_linear_paper`` keeps a literal transcription
for comparison.  The all-one-GPU plan always satisfies the limit (``AmpLimit >= 1``), so a plan
always exists.  A layer with several incoming edges (a join) is checked once per incoming edge.

Graph reduction (§4.2, Fig. 7).  The layer DAG is decomposed into a series-parallel tree: a
*block* is a branching layer ``s``, a joining layer ``t`` and the chains ("lanes") between them
(a lane may contain nested blocks, or be a bare edge such as a residual shortcut).  For every
block the planner computes the transition cost ``tau[(s,g) -> (t,h)]`` with linear searches
on each lane for every ``(g, h)``, as the paper describes, and the enclosing chain uses ``tau``
in place of ``comm``.  ``R_i[g, h]`` is lane i's best time on the shared GPUs (from the end of
``s`` to its data arriving at ``t``), ``Q_i[g, h]`` its best time on a new set of GPUs (transfers
in and out with the disjoint fraction).  The paper lets the join keep the critical branch and
greedily move other branches to new GPUs when that "won't increase the total training time or
overshoot the amplification limit"; we take the exact minimum over every choice P of lanes
moved (at least one lane stays):

    tau = min_P max( sum_{i not in P} R_i , max_{i in P} Q_i )

The paper does not say how many GPUs a parallel lane may use; we split the pool evenly: with
``m = |P| + 1`` concurrent lanes every layer inside the block uses at most ``cap_m`` = the
largest candidate count ``<= cap // m`` (``cap`` = G, or the enclosing lane's cap), so the lanes
always fit on the G GPUs.  Every transfer into the join is checked against the join's limit on
its own edge.

Vectorisation.  Lane costs are min-plus matrices over (count of s, count of t), built with numpy
(``O(n^3)`` per inner layer for n candidate counts); the top-level chain carries a single row,
the paper's S vector (``O(n^2)`` per layer).  All edge matrices (with the limit applied) are
built in one numpy expression per problem, and a plain-chain lane is computed for all its
variants (shared/own GPUs, caps) in one stacked pass.  Argmins are recomputed only for the
cells the backtrace visits.

Table 3 limits the search to powers of two (``powers_of_two=True``, the default); with
``False`` every count 1..G is a candidate.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence, Union

import numpy as np

from ..serialization import JsonMixin
from ..validation import check_float, check_int

log = logging.getLogger(__name__)

_INF = math.inf
_AMP_RTOL = 1e-12   # relative slack on the amplification check (float round-off only)
# A block with k lanes has 2^k - 1 serial/parallel choices, all enumerated for k <= 8 (Inception
# has at most 4).  Wider blocks only consider moving ONE lane to its own GPUs (search stays
# polynomial; the optimum over all choices is then not guaranteed for such blocks).
_MAX_ENUMERATED_LANES = 8

__all__ = ["LayerSpec", "LayerGraph", "NetworkModel", "LayerPlan", "BlockPlan", "BurstPlan",
           "Evaluation", "BurstProblem", "candidate_gpu_counts", "rescale_fraction",
           "disjoint_fraction", "plan_burst", "evaluate_assignment", "search_linear_paper"]


# --------------------------------------------------------------------------- input data
@dataclass
class LayerSpec(JsonMixin):
    """One layer (a node of the DAG)."""

    name: str                                        # unique layer name
    comp_time: dict[int, float]                      # GPU count g -> fwd+bwd seconds at batch global/g
    activation_bytes: float = 0.0                    # output activation of the GLOBAL batch, bytes
    param_bytes: float = 0.0                         # parameter (= gradient) bytes to synchronise
    inputs: list[str] = field(default_factory=list)  # names of the layers feeding this one


@dataclass
class LayerGraph(JsonMixin):
    """A layer DAG with a single input layer and a single output layer."""

    layers: list[LayerSpec]

    def layer(self, name: str) -> LayerSpec:
        for spec in self.layers:
            if spec.name == name:
                return spec
        raise KeyError(name)


@dataclass(frozen=True)
class NetworkModel(JsonMixin):
    """Full-bisection network (§4.1): per-GPU bandwidth and minimum propagation delay."""

    bandwidth: float        # bytes per second per GPU
    latency: float = 0.0    # propagation delay per transfer, seconds

    def __post_init__(self) -> None:
        check_float("network.bandwidth", self.bandwidth, min_value=0, min_exclusive=True)
        check_float("network.latency", self.latency, min_value=0)


# --------------------------------------------------------------------------- results
@dataclass
class LayerPlan(JsonMixin):
    """Per-layer outcome: the GPU count and the terms of ``T[i][g]``."""

    name: str
    gpus: int
    comp_time: float
    sync_time: float
    comm_in_time: float      # all transfers into this layer (fwd activation + bwd gradient)
    amplification: float     # max over incoming edges of (comm + comp + sync) * g / comp(i,1)


@dataclass
class BlockPlan(JsonMixin):
    """One branch/join block: which lanes run in parallel on their own GPUs."""

    branch: str                  # branching layer s
    join: str                    # joining layer t
    lanes: list[list[str]]       # layer names inside each lane ([] = direct edge s -> t)
    parallel: list[bool]         # lane runs on a separate GPU set, concurrently
    lane_gpu_cap: int            # max GPU count of any layer inside the block


@dataclass
class BurstPlan(JsonMixin):
    """Planner output (§4): per-layer GPU counts minimising the iteration time."""

    iteration_time: float
    gpu_sec: float                       # sum over layers of g * (comm_in + comp + sync)
    total_gpus: int
    amplification_limit: float
    candidate_gpu_counts: list[int]
    layers: list[LayerPlan]
    blocks: list[BlockPlan] = field(default_factory=list)

    @property
    def gpu_counts(self) -> dict[str, int]:
        return {lp.name: lp.gpus for lp in self.layers}

    @property
    def max_amplification(self) -> float:
        return max(lp.amplification for lp in self.layers)


@dataclass
class Evaluation(JsonMixin):
    """Cost of one explicit assignment (``evaluate_assignment``)."""

    iteration_time: float             # inf when infeasible
    feasible: bool
    reason: str                       # why infeasible ("" when feasible)
    layers: list[LayerPlan]


# --------------------------------------------------------------------------- cost model
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


def _amp(t: float, g: int, comp1: float) -> float:
    """``Amp = T * g / comp(i, 1)`` (0/0 counts as 0)."""
    return t * g / comp1 if comp1 > 0 else (0.0 if t == 0 else _INF)


# --------------------------------------------------------------------------- SP tree
@dataclass
class _Edge:
    s: str
    t: str

    def nodes(self) -> list[str]:
        return []


@dataclass
class _Series:
    s: str
    t: str
    parts: list["_Tree"]      # len(parts) == len(mids) + 1
    mids: list[str]

    def nodes(self) -> list[str]:
        out: list[str] = []
        for i, p in enumerate(self.parts):
            out += p.nodes()
            if i < len(self.mids):
                out.append(self.mids[i])
        return out


@dataclass
class _Parallel:
    s: str
    t: str
    lanes: list["_Tree"]

    def nodes(self) -> list[str]:
        return [n for lane in self.lanes for n in lane.nodes()]


_Tree = Union[_Edge, _Series, _Parallel]


def _series(a: _Tree, mid: str, b: _Tree) -> _Series:
    """Series composition, flattened; reuses ``a`` when it is a series (the reduction
    discards its inputs, so extending in place keeps long chains linear-time)."""
    out = a if isinstance(a, _Series) else _Series(a.s, a.t, [a], [])
    out.mids.append(mid)
    if isinstance(b, _Series):
        out.parts += b.parts
        out.mids += b.mids
    else:
        out.parts.append(b)
    out.t = b.t
    return out


def _parallel(trees: list[_Tree]) -> _Parallel:
    lanes: list[_Tree] = []
    for tr in trees:
        lanes += tr.lanes if isinstance(tr, _Parallel) else [tr]
    lanes.sort(key=lambda tr: (len(tr.nodes()) > 0, tr.nodes()[:1]))  # deterministic order
    return _Parallel(trees[0].s, trees[0].t, lanes)


def _decompose(names: list[str], preds: dict[str, list[str]], source: str, sink: str) -> _Tree | None:
    """Series-parallel decomposition by the classic reductions (Valdes et al.): merge parallel
    edges, contract every inner node with one input and one output; the graph is series-parallel
    iff a single edge ``source -> sink`` remains.  Returns None for a one-layer graph."""
    if source == sink:
        return None
    # edges keyed by (u, v) -> tree ; multi-edges merge immediately (parallel reduction)
    edges: dict[tuple[str, str], _Tree] = {}
    out_adj: dict[str, set[str]] = {n: set() for n in names}
    in_adj: dict[str, set[str]] = {n: set() for n in names}
    for v in names:
        for u in preds[v]:
            edges[(u, v)] = _Edge(u, v)
            out_adj[u].add(v)
            in_adj[v].add(u)
    work = [n for n in names if n not in (source, sink)]
    while work:
        m = work.pop()
        if m not in in_adj or len(in_adj[m]) != 1 or len(out_adj[m]) != 1:
            continue
        (u,), (v,) = tuple(in_adj[m]), tuple(out_adj[m])
        tree = _series(edges.pop((u, m)), m, edges.pop((m, v)))
        del in_adj[m], out_adj[m]
        out_adj[u].discard(m)
        in_adj[v].discard(m)
        if (u, v) in edges:
            edges[(u, v)] = _parallel([edges[(u, v)], tree])
        else:
            edges[(u, v)] = tree
            out_adj[u].add(v)
            in_adj[v].add(u)
        for n in (u, v):
            if n not in (source, sink):
                work.append(n)
    if len(edges) != 1 or (source, sink) not in edges:
        left = sorted(n for n in in_adj if n not in (source, sink))
        raise ValueError("graph must be series-parallel (every fork joins again, as in Fig. 7); "
                         f"cannot reduce around layers {left[:5]}")
    return edges[(source, sink)]


# --------------------------------------------------------------------------- problem
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
        self.order, self.preds = _validate_graph(graph, self.counts)
        self.specs = {spec.name: spec for spec in graph.layers}
        self.source = self.order[0]
        self.sink = self.order[-1]
        self.tree = _decompose(self.order, self.preds, self.source, self.sink)

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
        # Amp check as "(T * g) <= limit * comp(i,1)" (no division: comp(i,1) may be 0).
        budget = self.limit * comp[:, 0] * (1.0 + _AMP_RTOL)
        self.budget = dict(zip(self.order, budget.tolist()))
        self._comm_cache: dict[tuple[str, bool], np.ndarray] = {}
        # All edge matrices at once: _edges[disjoint, e] = comm, or inf where Amp(v, h) > limit.
        index = {name: i for i, name in enumerate(self.order)}
        pairs = [(u, v) for v in self.order for u in self.preds[v]]
        self._edge_id = {pair: e for e, pair in enumerate(pairs)}
        us = np.array([index[u] for u, _ in pairs], dtype=int)
        vs = np.array([index[v] for _, v in pairs], dtype=int)
        act = np.array([float(sp.activation_bytes) for sp in specs])
        stacked = []
        for disjoint in (False, True):
            comm_e = self._comm(act[us, None, None], disjoint)
            ok = (comm_e + work[vs, None, :]) * self.cs[None, None, :] <= budget[vs, None, None]
            stacked.append(np.where(ok, comm_e, _INF))
        self._edges = np.stack(stacked) if pairs else np.zeros((2, 0, self.n, self.n))
        # _cap_mask[k]: 0 for the first k candidate counts, inf above (k = cap_index(cap))
        self._cap_mask = np.where(np.arange(self.n)[None, :] < np.arange(self.n + 1)[:, None], 0.0, _INF)

    # -- scalar helpers (evaluate_assignment) and matrices (search) share these formulas
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
        return [(s, t, [lane.nodes() for lane in tree.lanes]) for s, t, tree in _blocks_of(self.tree)]

    def cap_index(self, cap: int) -> int:
        """Number of candidate counts ``<= cap``."""
        return bisect.bisect_right(self.counts, cap)

    def split_cap(self, cap: int, lanes: int) -> int | None:
        """Largest candidate count ``<= cap // lanes`` (None when no candidate fits)."""
        k = self.cap_index(cap // lanes)
        return self.counts[k - 1] if k > 0 else None


def _validate_graph(graph: LayerGraph, counts: Sequence[int]) -> tuple[list[str], dict[str, list[str]]]:
    if not isinstance(graph, LayerGraph):
        raise ValueError(f"graph must be a LayerGraph, got {type(graph).__name__}")
    if not graph.layers:
        raise ValueError("graph.layers must be a non-empty list of LayerSpec, got []")
    names: list[str] = []
    seen: set[str] = set()
    for idx, spec in enumerate(graph.layers):
        if not isinstance(spec, LayerSpec) or not isinstance(spec.name, str) or not spec.name:
            raise ValueError(f"graph.layers[{idx}] must be a LayerSpec with a non-empty name, got {spec!r}")
        if spec.name in seen:
            raise ValueError(f"graph.layers[{idx}].name must be unique, got duplicate {spec.name!r}")
        names.append(spec.name)
        seen.add(spec.name)
        ct = spec.comp_time
        if not isinstance(ct, dict):
            raise ValueError(f"layers[{spec.name}].comp_time must be a dict GPU count -> seconds, got {ct!r}")
        try:
            fast_ok = all(0.0 <= ct[g] < _INF for g in counts)   # also rejects NaN
        except (KeyError, TypeError):
            fast_ok = False
        if not fast_ok:
            for g in counts:
                if g not in ct:
                    raise ValueError(f"layers[{spec.name}].comp_time is missing GPU count {g} "
                                     f"(needs every candidate count {list(counts)})")
                check_float(f"layers[{spec.name}].comp_time[{g}]", ct[g], min_value=0.0)
        check_float(f"layers[{spec.name}].activation_bytes", spec.activation_bytes, min_value=0.0)
        check_float(f"layers[{spec.name}].param_bytes", spec.param_bytes, min_value=0.0)
    preds: dict[str, list[str]] = {}
    for spec in graph.layers:
        if not isinstance(spec.inputs, (list, tuple)):
            raise ValueError(f"layers[{spec.name}].inputs must be a list of layer names, got {spec.inputs!r}")
        for u in spec.inputs:
            if u not in seen:
                raise ValueError(f"layers[{spec.name}].inputs names unknown layer {u!r}")
            if u == spec.name:
                raise ValueError(f"graph contains a cycle: layer {u!r} feeds itself")
        if len(set(spec.inputs)) != len(spec.inputs):
            raise ValueError(f"layers[{spec.name}].inputs lists a layer twice: {spec.inputs}")
        preds[spec.name] = list(spec.inputs)
    # Kahn's algorithm: topological order or a cycle
    indeg = {n: len(preds[n]) for n in names}
    succ: dict[str, list[str]] = {n: [] for n in names}
    for v in names:
        for u in preds[v]:
            succ[u].append(v)
    ready = [n for n in names if indeg[n] == 0]
    order: list[str] = []
    while ready:
        u = ready.pop(0)
        order.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    if len(order) != len(names):
        stuck = sorted(n for n in names if indeg[n] > 0)
        raise ValueError(f"graph contains a cycle through layers {stuck[:5]}")
    sources = [n for n in names if not preds[n]]
    sinks = [n for n in names if not succ[n]]
    if len(sources) != 1:
        raise ValueError(f"graph must have exactly one input layer (no inputs), got {sources[:5]}")
    if len(sinks) != 1:
        raise ValueError(f"graph must have exactly one output layer (feeding nothing), got {sinks[:5]}")
    order.remove(sinks[0])
    order.append(sinks[0])
    return order, preds


# --------------------------------------------------------------------------- search
@dataclass
class _Rec:
    """Backtrace record of one propagation step.  Argmins are not stored: the backtrace
    recomputes ``argmin_g v_in[row, g] + mat[g, col]`` for the one cell it visits."""

    v_in: np.ndarray | None = None         # rows of the step's input (None: identity start)
    mat: np.ndarray | None = None          # edge cost or block transition tau
    parts: list["_Rec"] = field(default_factory=list)    # series: one per part
    values: list[np.ndarray] = field(default_factory=list)  # parallel: tau of each option
    options: list[tuple] = field(default_factory=list)    # parallel: per option, per lane (key, is_par)

    def start(self, row: int, col: int) -> int:
        if self.v_in is None:
            return row
        return int(np.argmin(self.v_in[row] + self.mat[:, col]))


@dataclass
class _ChainRec:
    """Backtrace record of a chain lane computed for several variants at once."""

    steps: list[tuple[np.ndarray, np.ndarray]]   # per inner layer: (input rows, next edge), stacked
    variant: int                                  # index on the stacked axis


def _minplus(v: np.ndarray | None, mat: np.ndarray) -> np.ndarray:
    """``out[r, h] = min_g v[r, g] + mat[g, h]``; ``v is None`` is the min-plus identity."""
    if v is None:
        return mat
    return (v[:, :, None] + mat[None, :, :]).min(axis=1)


class _Search:
    """Vectorised DP over the SP tree (Algorithm 1 + graph reduction)."""

    def __init__(self, prob: BurstProblem) -> None:
        self.p = prob
        self.memo: dict[tuple, tuple[np.ndarray, _Rec]] = {}

    def lane(self, tree: _Tree, ef: bool, xf: bool, cap: int) -> tuple[np.ndarray, _Rec]:
        """Cost matrix ``M[g_s, g_t]`` of a lane (memoised per variant)."""
        key = (id(tree), ef, xf, cap)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.propagate(tree, None, ef, xf, cap)
            self.memo[key] = hit
        return hit

    def lanes_for(self, tree: _Tree, keys: list[tuple[bool, bool, int]]) -> None:
        """Memoise every variant ``keys`` of a lane.  A plain chain (no nested block) is done
        for all variants at once, stacked on a leading axis, so numpy calls do not grow with
        the number of variants."""
        todo = [key for key in dict.fromkeys(keys) if (id(tree), *key) not in self.memo]
        if not todo:
            return
        if isinstance(tree, _Edge):
            parts, mids = [tree], []
        elif isinstance(tree, _Series) and all(isinstance(p, _Edge) for p in tree.parts):
            parts, mids = tree.parts, tree.mids
        else:
            for key in todo:
                self.lane(tree, *key)
            return
        last = len(parts) - 1

        def edges(i: int) -> np.ndarray:
            flags = [(ef and i == 0) or (xf and i == last) for ef, xf, _ in todo]
            return self.p.edge_matrices(parts[i].s, parts[i].t, flags)

        caps = [cap for _, _, cap in todo]
        mat = edges(0)
        steps: list[tuple[np.ndarray, np.ndarray]] = []
        for i, mid in enumerate(mids):
            v_in = mat + self.p.node_costs(mid, caps)[:, None, :]
            e = edges(i + 1)
            steps.append((v_in, e))
            mat = (v_in[:, :, :, None] + e[:, None, :, :]).min(axis=2)
        for vi, key in enumerate(todo):
            self.memo[(id(tree), *key)] = (mat[vi], _ChainRec(steps, vi))

    def propagate(self, tree: _Tree, v: np.ndarray | None, ef: bool, xf: bool,
                  cap: int) -> tuple[np.ndarray, _Rec]:
        """``out[r, h] = min_g v[r, g] + cost_tree[g, h]``; ef/xf: edges touching s/t are disjoint."""
        if isinstance(tree, _Edge):
            mat = self.p.edge_matrix(tree.s, tree.t, ef or xf)
            return _minplus(v, mat), _Rec(v, mat)
        if isinstance(tree, _Series):
            recs = []
            last = len(tree.parts) - 1
            for i, part in enumerate(tree.parts):
                v, rec = self.propagate(part, v, ef and i == 0, xf and i == last, cap)
                recs.append(rec)
                if i < last:
                    v = v + self.p.node_costs(tree.mids[i], [cap])
            return v, _Rec(parts=recs)
        return self.parallel(tree, v, ef, xf, cap)

    def parallel(self, tree: _Parallel, v: np.ndarray | None, ef: bool, xf: bool,
                 cap: int) -> tuple[np.ndarray, _Rec]:
        """Branch/join reduction: ``tau[g, h]`` over serial / parallel lane choices."""
        k = len(tree.lanes)
        options: list[tuple] = []
        values: list[np.ndarray] = []
        serial_key = (ef, xf, cap)
        max_side = (k - 1 if k <= _MAX_ENUMERATED_LANES else 1) if self.p.parallel_branches else 0
        sub_caps: list[int] = []          # sub_caps[size - 1]: lane cap with size lanes moved
        for size in range(1, max_side + 1):
            sub_cap = self.p.split_cap(cap, size + 1)
            if sub_cap is None:           # cap // lanes only shrinks as lanes are added
                break
            sub_caps.append(sub_cap)
        keys = [serial_key] + [key for sc in sub_caps for key in ((ef, xf, sc), (True, True, sc))]
        for lane in tree.lanes:
            self.lanes_for(lane, keys)
        options.append(tuple((serial_key, False) for _ in range(k)))
        values.append(sum(self.lane(lane, *serial_key)[0] for lane in tree.lanes))
        for size, sub_cap in enumerate(sub_caps, start=1):
            main_key, par_key = (ef, xf, sub_cap), (True, True, sub_cap)
            for par in itertools.combinations(range(k), size):
                main = sum(self.lane(tree.lanes[i], *main_key)[0] for i in range(k) if i not in par)
                side = np.maximum.reduce([self.lane(tree.lanes[i], *par_key)[0] for i in par])
                options.append(tuple((par_key, True) if i in par else (main_key, False)
                                     for i in range(k)))
                values.append(np.maximum(main, side))
        tau = np.minimum.reduce(values) if len(values) > 1 else values[0]
        return _minplus(v, tau), _Rec(v, tau, values=values, options=options)

    # -- backtrace
    def backtrace(self, tree: _Tree, rec: _Rec, row: int, col: int,
                  assign: dict[str, int], blocks: dict[tuple[str, str], tuple]) -> int:
        """Fill ``assign`` (layer -> count index) for the inner layers; return the start column."""
        if isinstance(rec, _ChainRec):
            cur = col
            for i in range(len(rec.steps) - 1, -1, -1):
                v_in, e = rec.steps[i]
                cur = int(np.argmin(v_in[rec.variant, row] + e[rec.variant, :, cur]))
                assign[tree.mids[i]] = cur
            return row
        if isinstance(tree, _Edge):
            return rec.start(row, col)
        if isinstance(tree, _Series):
            cur = col
            for i in range(len(tree.parts) - 1, -1, -1):
                cur = self.backtrace(tree.parts[i], rec.parts[i], row, cur, assign, blocks)
                if i > 0:
                    assign[tree.mids[i - 1]] = cur
            return cur
        start = rec.start(row, col)
        option = rec.options[int(np.argmin([val[start, col] for val in rec.values]))]
        for lane, (key, _) in zip(tree.lanes, option):
            _, lane_rec = self.memo[(id(lane), *key)]
            got = self.backtrace(lane, lane_rec, start, col, assign, blocks)
            if got != start:  # pragma: no cover - internal invariant
                raise RuntimeError("burst planner backtrace lost the branch layer's GPU count")
        blocks[(tree.s, tree.t)] = (tuple(is_par for _, is_par in option), option[0][0][2])
        return start


def plan_burst(graph: LayerGraph, network: NetworkModel, total_gpus: int,
               amplification_limit: float, powers_of_two: bool = True,
               parallel_branches: bool = True) -> BurstPlan:
    """Find per-layer GPU counts minimising the iteration time under the amplification limit.

    Args:
        graph: layer DAG (single input and output layer, series-parallel) with
            ``comp_time[g]`` for every candidate count ``g``.
        network: per-GPU bandwidth and propagation delay (§4.1).
        total_gpus: G, GPUs available to the job (>= 1).
        amplification_limit: max ``Amp(i, g) = T[i][g] * g / comp(i, 1)`` of any layer (>= 1).
        powers_of_two: consider only GPU counts that are powers of two (Table 3's setting).
        parallel_branches: allow non-critical branches to run concurrently on their own GPUs.

    Returns:
        the optimal :class:`BurstPlan` under the cost model of the module docstring.
    """
    prob = BurstProblem(graph, network, total_gpus, amplification_limit, powers_of_two,
                        parallel_branches)
    search = _Search(prob)
    src, snk = prob.source, prob.sink
    # Source layer: no incoming transfer, Amp(src, g) = (comp + sync) * g / comp(src, 1).
    src_ok = prob.work[src] * prob.cs <= prob.budget[src]
    v0 = np.where(src_ok, prob.work[src], _INF)[None, :]
    assign: dict[str, int] = {}
    blocks: dict[tuple[str, str], tuple] = {}
    if prob.tree is None:                      # a single layer
        final = v0[0]
        end = int(np.argmin(final))
        assign[src] = end
    else:                                      # S vector through the whole reduced chain
        vt, rec = search.propagate(prob.tree, v0, False, False, prob.total_gpus)
        final = vt[0] + prob.work[snk]
        end = int(np.argmin(final))
        assign[snk] = end
        assign[src] = search.backtrace(prob.tree, rec, 0, end, assign, blocks)
    best = float(final[end])
    counts = {name: prob.counts[idx] for name, idx in assign.items()}
    decisions = {key: val[0] for key, val in blocks.items()}
    ev = evaluate_assignment(prob, counts, decisions)
    if not ev.feasible or not math.isclose(ev.iteration_time, best, rel_tol=1e-9, abs_tol=1e-15):
        raise RuntimeError(f"burst planner inconsistency: DP {best} vs evaluation "
                           f"{ev.iteration_time} ({ev.reason})")  # pragma: no cover
    block_plans = [BlockPlan(s, t, [lane.nodes() for lane in tree.lanes], list(blocks[(s, t)][0]),
                             int(blocks[(s, t)][1]))
                   for s, t, tree in _blocks_of(prob.tree) if (s, t) in blocks]
    gpu_sec = sum(lp.gpus * (lp.comm_in_time + lp.comp_time + lp.sync_time) for lp in ev.layers)
    log.debug("burst plan: %d layers, G=%d, limit=%.3g -> %.6g s", len(ev.layers),
              prob.total_gpus, prob.limit, best)
    return BurstPlan(iteration_time=best, gpu_sec=float(gpu_sec), total_gpus=prob.total_gpus,
                     amplification_limit=prob.limit, candidate_gpu_counts=list(prob.counts),
                     layers=ev.layers, blocks=block_plans)


def _blocks_of(tree: _Tree | None) -> Iterable[tuple[str, str, _Parallel]]:
    if tree is None or isinstance(tree, _Edge):
        return
    if isinstance(tree, _Parallel):
        yield tree.s, tree.t, tree
        for lane in tree.lanes:
            yield from _blocks_of(lane)
    else:
        for part in tree.parts:
            yield from _blocks_of(part)


# --------------------------------------------------------------------------- evaluation
def evaluate_assignment(problem: BurstProblem, counts: dict[str, int],
                        parallel: dict[tuple[str, str], Sequence[bool]] | None = None,
                        enforce_limit: bool = True) -> Evaluation:
    """Iteration time of an explicit plan, by walking the SP tree with scalar arithmetic.

    ``counts`` gives every layer's GPU count; ``parallel[(branch, join)]`` says per lane (in
    ``BlockPlan.lanes`` order) whether it runs on its own GPUs (default: all serial).  This is
    the reference the search is checked against (exhaustive search = enumerate + evaluate).
    ``enforce_limit=False`` still reports each layer's amplification but does not call a plan
    over the limit infeasible (to price e.g. plain data parallelism on all G GPUs).
    """
    p = problem
    parallel = parallel or {}
    idx = {g: i for i, g in enumerate(p.counts)}
    for name in p.order:
        if name not in counts or counts[name] not in idx:
            raise ValueError(f"counts[{name}] must be one of {p.counts}, got {counts.get(name)!r}")
    comm_in = {n: 0.0 for n in p.order}
    amp = {n: 0.0 for n in p.order}
    problems: list[str] = []

    def work(v: str) -> float:
        return float(p.work[v][idx[counts[v]]])

    def check_amp(v: str, comm: float) -> None:
        g = counts[v]
        t = comm + work(v)
        amp[v] = max(amp[v], _amp(t, g, float(p.comp[v][0])))
        if enforce_limit and t * g > p.budget[v]:
            problems.append(f"Amp({v}, {g}) exceeds {p.limit}")

    def lane_time(tree: _Tree, ef: bool, xf: bool, cap: int) -> float:
        if isinstance(tree, _Edge):
            c = float(p.comm_matrix(tree.s, ef or xf)[idx[counts[tree.s]], idx[counts[tree.t]]])
            comm_in[tree.t] += c
            check_amp(tree.t, c)
            return c
        if isinstance(tree, _Series):
            total = 0.0
            last = len(tree.parts) - 1
            for i, part in enumerate(tree.parts):
                total += lane_time(part, ef and i == 0, xf and i == last, cap)
                if i < last:
                    m = tree.mids[i]
                    if counts[m] > cap:
                        problems.append(f"{m} uses {counts[m]} GPUs > lane cap {cap}")
                    total += work(m)
            return total
        flags = list(parallel.get((tree.s, tree.t), [False] * len(tree.lanes)))
        if len(flags) != len(tree.lanes) or all(flags):
            raise ValueError(f"parallel[({tree.s!r}, {tree.t!r})] must have {len(tree.lanes)} flags, "
                             f"not all True, got {flags}")
        if not any(flags):
            return sum(lane_time(lane, ef, xf, cap) for lane in tree.lanes)
        sub = p.split_cap(cap, sum(flags) + 1)
        if sub is None or not p.parallel_branches:
            problems.append(f"block {tree.s}->{tree.t} cannot run {sum(flags) + 1} lanes in parallel")
            return _INF
        main = sum(lane_time(lane, ef, xf, sub) for lane, f in zip(tree.lanes, flags) if not f)
        side = max(lane_time(lane, True, True, sub) for lane, f in zip(tree.lanes, flags) if f)
        return max(main, side)

    total = work(p.source)
    check_amp(p.source, 0.0)
    if p.tree is not None:
        total += lane_time(p.tree, False, False, p.total_gpus) + work(p.sink)
    feasible = not problems
    layers = [LayerPlan(n, counts[n], float(p.comp[n][idx[counts[n]]]), float(p.sync[n][idx[counts[n]]]),
                        comm_in[n], amp[n]) for n in p.order]
    return Evaluation(total if feasible else _INF, feasible, "; ".join(problems[:3]), layers)


# --------------------------------------------------------------------------- paper transcription
def search_linear_paper(comp: np.ndarray, comm: np.ndarray, sync: np.ndarray,
                        counts: Sequence[int], amp_limit: float) -> tuple[float, list[int]]:
    """Literal transcription of Algorithm 1 (for comparison only; see module docstring).

    ``comp[i, g]``, ``sync[i, g]``: (L, n) over count indices; ``counts[g]`` the GPU count of
    index g (``counts[0] == 1``); ``comm[i, h, g]``: (L, n, n) transfer into layer i from count
    index h of layer i-1 (``comm[0]`` unused).  Returns (S at the best final count,
    count index per layer); the final layer picks argmin S among states within the limit
    (or overall argmin if none is).
    """
    L, n = comp.shape
    S = np.zeros((L, n))
    T = np.zeros((L, n))
    back = np.zeros((L, n), dtype=int)
    for i in range(L):
        for g in range(n):
            if i == 0:                               # S[0][g] = 0: no predecessor transfer
                S[i, g] = comp[i, g] + sync[i, g]
                T[i, g] = S[i, g]
                continue
            best_amp = best_s = best_t = _INF
            for h in range(n):
                a = _amp(T[i - 1, h], counts[h], comp[i - 1, 0])
                cand = S[i - 1, h] + comm[i, h, g]
                if a <= max(best_amp, amp_limit) and cand <= best_s:
                    best_s, best_t = cand, comm[i, h, g]
                    best_amp = min(best_amp, a)
                    back[i, g] = h
            S[i, g] = best_s + comp[i, g] + sync[i, g]
            T[i, g] = best_t + comp[i, g] + sync[i, g]
    amps = np.array([_amp(T[L - 1, g], counts[g], comp[L - 1, 0]) for g in range(n)])
    pool = np.where(amps <= amp_limit)[0]
    end = int(pool[np.argmin(S[L - 1, pool])]) if len(pool) else int(np.argmin(S[L - 1]))
    path = [end]
    for i in range(L - 1, 0, -1):
        path.append(int(back[i, path[-1]]))
    return float(S[L - 1, end]), path[::-1]
