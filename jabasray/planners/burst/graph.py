"""The planner's input graph and its series-parallel decomposition (DeepPool section 4.2, Fig. 7).

:class:`LayerGraph` is a DAG of :class:`LayerSpec` with one input and one output layer;
``validate_graph`` checks it and orders it topologically; ``decompose`` reduces it to a
series-parallel tree (:class:`Edge`, :class:`Series`, :class:`Parallel`) whose ``Parallel``
nodes are the branch/join blocks the search reasons about.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence, Union

from ...serialization import JsonMixin
from ...validation import check_float

_INF = math.inf

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



def validate_graph(graph: LayerGraph, counts: Sequence[int]) -> tuple[list[str], dict[str, list[str]]]:
    """Check ``graph`` (times for every count in ``counts``, known inputs, no cycle, one input and
    one output layer); return its topological order (output layer last) and each layer's inputs."""
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


# --------------------------------------------------------------------------- series-parallel tree
# A part of the graph between two layers ``start`` and ``end``: both ends are NOT inside the
# part (their costs are charged by the enclosing part); ``nodes()`` lists the layers inside.
@dataclass
class Edge:
    """A direct edge ``start -> end`` (no layer inside; e.g. a residual shortcut)."""

    start: str
    end: str

    def nodes(self) -> list[str]:
        return []


@dataclass
class Series:
    """``parts[0]``, ``mids[0]``, ``parts[1]``, ...: a chain through the layers ``mids``."""

    start: str
    end: str
    parts: list["SPTree"]     # len(parts) == len(mids) + 1
    mids: list[str]           # the layers between consecutive parts

    def nodes(self) -> list[str]:
        out: list[str] = []
        for i, p in enumerate(self.parts):
            out += p.nodes()
            if i < len(self.mids):
                out.append(self.mids[i])
        return out


@dataclass
class Parallel:
    """A branch/join block: ``start`` forks into ``lanes`` that all join at ``end``."""

    start: str                # the branching layer
    end: str                  # the joining layer
    lanes: list["SPTree"]

    def nodes(self) -> list[str]:
        return [n for lane in self.lanes for n in lane.nodes()]


SPTree = Union[Edge, Series, Parallel]


def series_join(a: SPTree, mid: str, b: SPTree) -> Series:
    """Series composition, flattened; reuses ``a`` when it is a series (the reduction
    discards its inputs, so extending in place keeps long chains linear-time)."""
    out = a if isinstance(a, Series) else Series(a.start, a.end, [a], [])
    out.mids.append(mid)
    if isinstance(b, Series):
        out.parts += b.parts
        out.mids += b.mids
    else:
        out.parts.append(b)
    out.end = b.end
    return out


def parallel_join(trees: list[SPTree]) -> Parallel:
    """Parallel composition of parts with the same ends, flattened, lanes in a fixed order."""
    lanes: list[SPTree] = []
    for tr in trees:
        lanes += tr.lanes if isinstance(tr, Parallel) else [tr]
    lanes.sort(key=lambda tr: (len(tr.nodes()) > 0, tr.nodes()[:1]))  # deterministic order
    return Parallel(trees[0].start, trees[0].end, lanes)


def decompose(names: list[str], preds: dict[str, list[str]], source: str, sink: str) -> SPTree | None:
    """Series-parallel decomposition by the classic reductions (Valdes et al.): merge parallel
    edges, contract every inner node with one input and one output; the graph is series-parallel
    iff a single edge ``source -> sink`` remains.  Returns None for a one-layer graph."""
    if source == sink:
        return None
    # edges keyed by (u, v) -> tree ; multi-edges merge immediately (parallel reduction)
    edges: dict[tuple[str, str], SPTree] = {}
    out_adj: dict[str, set[str]] = {n: set() for n in names}
    in_adj: dict[str, set[str]] = {n: set() for n in names}
    for v in names:
        for u in preds[v]:
            edges[(u, v)] = Edge(u, v)
            out_adj[u].add(v)
            in_adj[v].add(u)
    work = [n for n in names if n not in (source, sink)]
    while work:
        m = work.pop()
        if m not in in_adj or len(in_adj[m]) != 1 or len(out_adj[m]) != 1:
            continue
        (u,), (v,) = tuple(in_adj[m]), tuple(out_adj[m])
        tree = series_join(edges.pop((u, m)), m, edges.pop((m, v)))
        del in_adj[m], out_adj[m]
        out_adj[u].discard(m)
        in_adj[v].discard(m)
        if (u, v) in edges:
            edges[(u, v)] = parallel_join([edges[(u, v)], tree])
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


def blocks_of(tree: SPTree | None) -> Iterable[tuple[str, str, Parallel]]:
    """Every branch/join block of ``tree`` as (branch, join, block), outer blocks first."""
    if tree is None or isinstance(tree, Edge):
        return
    if isinstance(tree, Parallel):
        yield tree.start, tree.end, tree
        for lane in tree.lanes:
            yield from blocks_of(lane)
    else:
        for part in tree.parts:
            yield from blocks_of(part)

