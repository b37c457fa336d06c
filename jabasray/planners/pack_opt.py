"""``pack_opt``: which hyperparameter configurations to train together (Pack paper, 5.2-5.4).

Pure planning code (no torch, no ray). A *packable partitioning* of T configurations is a
grouping in which every group ("pack") fits the device memory (section 5.2). Three ways to
build one, the paper's heuristic and the two baselines it is compared with (section 5.4):

* :func:`knn_packing` (section 5.3, the paper's kNN heuristic):
  1. pick a random not-yet-packed configuration as the centroid;
  2. visit the other unpacked configurations from nearest to farthest (ties: lower index) and
     add each one whose distance to the centroid is below the similarity ``threshold`` and
     whose memory still fits the budget (a configuration that does not fit is skipped, a
     smaller farther one may still fit: this is what "packs ... until the device runs out of
     memory" needs when memories differ);
  3. repeat until every configuration is packed. ``threshold=0`` gives singletons (no
     distance is < 0), i.e. the unpacked schedule, which the paper notes is always feasible.
* :func:`random_packing` ("Random Pack Hyperband"): shuffle, then fill packs in that order.
* :func:`batch_size_packing` ("Batch-size Pack Hyperband"): only configurations with the same
  batch size share a pack; greedy fill within each batch size.

Distance (section 5.3): configurations are mapped to a feature space where a categorical
hyperparameter contributes 0 if equal, 1 if different, and a numeric one the distance of the
two values' INDICES in the declared value list. Deviation: the text says "Euclid distance",
but its worked example (A = [20, SGD, 0.01, ReLU], B = [40, Adagrad, 0.01, ReLU] over Table 3
gives 4 + 1 = 5) is the sum of the per-dimension distances, i.e. Manhattan distance. We follow
the worked example by default (``metric="manhattan"``) and offer ``metric="euclidean"``.

Pack memory is the sum of its members' memories (section 4.5: "when packing two models the
GPU memory usage is the sum of memory usage of two models"); the memory of one configuration
comes from a caller-supplied function (measured or modelled).
"""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from jabasray.serialization import JsonMixin
from jabasray.validation import check_choice, check_float, check_int

log = logging.getLogger(__name__)

Config = Mapping[str, Any]
MemoryFn = Callable[[Config], float]

KINDS = ("numeric", "categorical")
METRICS = ("manhattan", "euclidean")
METHODS = ("knn", "random", "batch_size")

__all__ = ["Dimension", "SearchSpace", "PackingPlan", "knn_packing", "random_packing",
           "batch_size_packing", "pack_opt", "TABLE3_SPACE", "Feature", "NormalisedSpace",
           "similarity_order"]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class Dimension(JsonMixin):
    """One hyperparameter: its declared values and how distances are measured on it."""
    name: str            # key in a configuration dict
    values: list[Any]    # declared values; a numeric distance is the difference of indices here
    kind: str            # "numeric" (index distance) or "categorical" (0 if equal else 1)

    def __post_init__(self) -> None:
        check_choice(f"{self.name}.kind", self.kind, KINDS)
        if not self.values:
            raise ValueError(f"{self.name} must declare at least one value, got []")
        for v in self.values:
            ok = _is_number(v) if self.kind == "numeric" else isinstance(v, (str, bool, int, float))
            if not ok:
                allowed = "finite numbers" if self.kind == "numeric" else "strings, booleans or numbers"
                raise ValueError(f"{self.name} values must be {allowed} for a {self.kind} "
                                 f"hyperparameter, got {v!r}")
        if len(set(map(repr, self.values))) != len(self.values):
            raise ValueError(f"{self.name} values must be distinct, got {self.values!r}")

    def index(self, value: Any, field_name: str | None = None) -> int:
        """Position of ``value`` in the declared list (ValueError naming the field otherwise)."""
        for i, v in enumerate(self.values):
            if v == value and isinstance(v, bool) == isinstance(value, bool):
                return i
        shown = ", ".join(repr(v) for v in self.values)
        raise ValueError(f"{field_name or self.name} must be one of {shown}, got {value!r}")


@dataclass
class SearchSpace(JsonMixin):
    """Discrete hyperparameter space: the product of its dimensions' value lists."""
    dimensions: list[Dimension]

    @classmethod
    def from_values(cls, values: Mapping[str, Sequence[Any]],
                    kinds: Mapping[str, str] | None = None) -> "SearchSpace":
        """Build from ``{name: [values...]}``. The kind is inferred unless given: all numbers
        -> numeric, all strings/booleans -> categorical; anything else is refused (the
        packer cannot measure a distance on it)."""
        kinds = dict(kinds or {})
        dims = []
        for name, vals in values.items():
            vals = list(vals)
            kind = kinds.pop(name, None) or _infer_kind(name, vals)
            dims.append(Dimension(name, vals, kind))
        if kinds:
            raise ValueError(f"kinds names unknown hyperparameters {sorted(kinds)}; "
                             f"allowed: {sorted(values)}")
        return cls(dims)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.dimensions]

    @property
    def size(self) -> int:
        return math.prod(len(d.values) for d in self.dimensions)

    def indices(self, config: Config, field_name: str = "config") -> tuple[int, ...]:
        """Index vector of a configuration; ValueError names ``field_name[key]``."""
        out = []
        for d in self.dimensions:
            if d.name not in config:
                raise ValueError(f"{field_name} must set {d.name!r} (one of {d.values!r})")
            out.append(d.index(config[d.name], f"{field_name}[{d.name!r}]"))
        return tuple(out)

    def config_at(self, flat_index: int) -> dict[str, Any]:
        """The ``flat_index``-th configuration of the product (last dimension fastest)."""
        check_int("flat_index", flat_index, min_value=0, max_value=self.size - 1)
        out: dict[str, Any] = {}
        for d in reversed(self.dimensions):
            flat_index, i = divmod(flat_index, len(d.values))
            out[d.name] = d.values[i]
        return {d.name: out[d.name] for d in self.dimensions}

    def sample(self, n: int, rng: random.Random) -> list[dict[str, Any]]:
        """``n`` distinct configurations drawn uniformly without replacement (capped at size)."""
        check_int("n", n, min_value=0)
        return [self.config_at(i) for i in rng.sample(range(self.size), min(n, self.size))]

    def distance(self, a: Config, b: Config, metric: str = "manhattan") -> float:
        """Section 5.3 distance (see module docstring); ``metric`` combines the dimensions."""
        return _combine(self._parts(self.indices(a, "a"), self.indices(b, "b")), metric)

    def _parts(self, ia: Sequence[int], ib: Sequence[int]) -> list[float]:
        return [float(abs(x - y)) if d.kind == "numeric" else float(x != y)
                for d, x, y in zip(self.dimensions, ia, ib)]


def _combine(parts: Sequence[float], metric: str) -> float:
    if metric == "manhattan":
        return float(sum(parts))
    return math.sqrt(sum(p * p for p in parts))


def _infer_kind(name: str, vals: Sequence[Any]) -> str:
    if vals and all(_is_number(v) for v in vals):
        return "numeric"
    if vals and all(isinstance(v, (str, bool)) for v in vals):
        return "categorical"
    bad = next((v for v in vals if not isinstance(v, (str, bool, int, float))
                or (isinstance(v, float) and not math.isfinite(v))), vals[0] if vals else None)
    raise ValueError(f"{name} values must be all numbers (numeric) or all strings/booleans "
                     f"(categorical), got {bad!r} in {list(vals)!r}")


#: The paper's Table 3 search space (1056 configurations).
TABLE3_SPACE = SearchSpace.from_values({
    "batch_size": [20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70],
    "optimizer": ["adam", "sgd", "adagrad", "momentum"],
    "lr": [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1],
    "activation": ["sigmoid", "leaky_relu", "tanh", "relu"],
})


@dataclass
class PackingPlan(JsonMixin):
    """A packable partitioning: ``packs[j]`` lists indices into the configuration list."""
    method: str                                   # "knn", "random" or "batch_size"
    packs: list[list[int]]                        # each configuration index exactly once
    pack_memory: list[float]                      # sum of member memories per pack
    memory_budget: float                          # per-device budget every pack respects
    threshold: float | None = None                # kNN similarity threshold (None: no limit)
    centroids: list[int] = field(default_factory=list)   # kNN: the centroid of each pack

    @property
    def num_packs(self) -> int:
        return len(self.packs)

    def members(self, configs: Sequence[Config]) -> list[list[Config]]:
        return [[configs[i] for i in p] for p in self.packs]


def _memories(configs: Sequence[Config], memory_fn: MemoryFn, memory_budget: float) -> list[float]:
    check_float("memory_budget", memory_budget, min_value=0.0, min_exclusive=True)
    mems = [check_float(f"memory_fn(configs[{i}])", memory_fn(c), min_value=0.0)
            for i, c in enumerate(configs)]
    for i, m in enumerate(mems):
        if m > memory_budget:
            raise ValueError(f"memory_budget must be >= the memory of every configuration; "
                             f"configs[{i}] = {dict(configs[i])!r} needs {m:g} > {memory_budget:g}")
    return mems


def _pack_memory(packs: Sequence[Sequence[int]], mems: Sequence[float]) -> list[float]:
    """Memory of each pack: the sum of its members' memories (section 4.5)."""
    return [sum(mems[j] for j in p) for p in packs]


def _knn(n: int, dist: Callable[[int, int], float], mems: Sequence[float], memory_budget: float,
         threshold: float | None, seed: int, max_pack_size: int | None) -> tuple[list[list[int]], list[int]]:
    """Section 5.3's kNN grouping of items ``0..n-1`` under ``dist`` (module docstring, steps
    1-3); returns ``(packs, centroids)``. Deterministic for a given ``seed``."""
    rng = random.Random(seed)
    remaining = list(range(n))
    packs: list[list[int]] = []
    centroids: list[int] = []
    while remaining:
        c = remaining[rng.randrange(len(remaining))]                 # 1. random centroid
        remaining.remove(c)
        d = {j: dist(c, j) for j in remaining}
        pack, used = [c], mems[c]
        for j in sorted(remaining, key=lambda j: (d[j], j)):         # 2. nearest first
            if max_pack_size is not None and len(pack) >= max_pack_size:
                break
            if threshold is not None and not d[j] < threshold:
                break                                                # sorted: all further are too far
            if used + mems[j] <= memory_budget:
                pack.append(j)
                used += mems[j]
        for j in pack[1:]:
            remaining.remove(j)
        packs.append(pack)
        centroids.append(c)
    return packs, centroids


def knn_packing(configs: Sequence[Config], space: "SearchSpace | NormalisedSpace", memory_fn: MemoryFn,
                memory_budget: float, threshold: float | None = None, seed: int = 0,
                max_pack_size: int | None = None, metric: str = "manhattan") -> PackingPlan:
    """The paper's kNN heuristic (section 5.3; algorithm in the module docstring).

    ``space``: a :class:`SearchSpace` (the paper's index distance on declared values) or a
    :class:`NormalisedSpace` (every dimension scaled to [0, 1]; continuous domains).
    ``threshold``: a configuration joins a centroid's pack only if its distance is strictly
    below it (``None``: no similarity limit, memory only). ``max_pack_size`` optionally caps
    the members per pack. Deterministic for a given ``seed``.
    """
    check_choice("metric", metric, METRICS)
    if threshold is not None:
        check_float("threshold", threshold, min_value=0.0)
    if max_pack_size is not None:
        check_int("max_pack_size", max_pack_size, min_value=1)
    if isinstance(space, SearchSpace):
        idx = [space.indices(c, f"configs[{i}]") for i, c in enumerate(configs)]

        def dist(i: int, j: int) -> float:
            return _combine(space._parts(idx[i], idx[j]), metric)
    else:
        def dist(i: int, j: int) -> float:
            return space.distance(configs[i], configs[j], metric)
    mems = _memories(configs, memory_fn, memory_budget)
    packs, centroids = _knn(len(configs), dist, mems, memory_budget, threshold, seed, max_pack_size)
    log.debug("knn_packing: %d configurations -> %d packs", len(configs), len(packs))
    return PackingPlan("knn", packs, _pack_memory(packs, mems), float(memory_budget),
                       None if threshold is None else float(threshold), centroids)


# ----------------------------------------------------------------------------- normalised distance
# Tune samples continuous and mixed domains (``tune.loguniform``, ``tune.randint`` ...), so the
# paper's "index in the declared value list" does not exist for every dimension. Deviation
# (documented): each dimension's distance is scaled to [0, 1] -- a numeric range by its width
# (on a log scale for log domains), an ordinal value list by its index distance divided by
# (values - 1) (the paper's index rule, normalised), a categorical one 0 if equal else 1 -- so
# no dimension dominates because of its units. Combined as in section 5.3 (sum by default).

FEATURE_KINDS = ("numeric", "ordinal", "categorical")


@dataclass
class Feature(JsonMixin):
    """One dimension of the normalised distance."""
    name: str                       # key in a configuration dict
    kind: str                       # "numeric" (range), "ordinal" (value list) or "categorical"
    lo: float = 0.0                 # numeric: lower end of the range
    hi: float = 1.0                 # numeric: upper end of the range
    log: bool = False               # numeric: distances on log(value) (log-uniform domains)
    values: list[Any] = field(default_factory=list)   # ordinal: the declared values, in order

    def __post_init__(self) -> None:
        check_choice(f"{self.name}.kind", self.kind, FEATURE_KINDS)
        if self.kind == "numeric":
            if not (_is_number(self.lo) and _is_number(self.hi) and self.lo <= self.hi):
                raise ValueError(f"{self.name} range must be finite numbers with lo <= hi, "
                                 f"got [{self.lo!r}, {self.hi!r}]")
            if self.log and self.lo <= 0:
                raise ValueError(f"{self.name} log range must be positive, got lo={self.lo!r}")
        if self.kind == "ordinal" and not self.values:
            raise ValueError(f"{self.name} must declare at least one value, got []")

    def part(self, a: Any, b: Any) -> float:
        """Distance of two values on this dimension, in [0, 1]."""
        if self.kind == "categorical" or not (_is_number(a) and _is_number(b)):
            return 0.0 if a == b else 1.0
        if self.kind == "ordinal":
            n = len(self.values) - 1
            if n == 0:
                return 0.0
            ia = min(range(len(self.values)), key=lambda i: abs(self.values[i] - a))
            ib = min(range(len(self.values)), key=lambda i: abs(self.values[i] - b))
            return abs(ia - ib) / n
        t = math.log if self.log else float
        width = t(self.hi) - t(self.lo)
        if width <= 0:
            return 0.0
        a, b = (min(max(v, self.lo), self.hi) for v in (a, b))
        return abs(t(a) - t(b)) / width


@dataclass
class NormalisedSpace(JsonMixin):
    """The dimensions that distances are measured on (keys not listed are ignored)."""
    features: list[Feature]

    def distance(self, a: Config, b: Config, metric: str = "manhattan") -> float:
        """Normalised section 5.3 distance of two configurations."""
        return _combine([f.part(a.get(f.name), b.get(f.name)) for f in self.features], metric)


def similarity_order(configs: Sequence[Config], space: NormalisedSpace, group_size: int,
                     seed: int = 0) -> list[list[int]]:
    """Configurations grouped so that similar ones sit together: the kNN grouping of
    :func:`knn_packing` with ``group_size`` members per group (no memory limit). A search
    algorithm that emits the groups one after another lets a packing scheduler put similar
    configurations in one pack."""
    check_int("group_size", group_size, min_value=1)
    packs, _ = _knn(len(configs), lambda i, j: space.distance(configs[i], configs[j]),
                    [0.0] * len(configs), 1.0, None, seed, group_size)
    return packs


def _greedy_fill(order: Sequence[int], mems: Sequence[float], budget: float,
                 max_pack_size: int | None) -> list[list[int]]:
    packs: list[list[int]] = []
    used = 0.0
    for j in order:
        if packs and used + mems[j] <= budget and (max_pack_size is None or len(packs[-1]) < max_pack_size):
            packs[-1].append(j)
            used += mems[j]
        else:
            packs.append([j])
            used = mems[j]
    return packs


def random_packing(configs: Sequence[Config], memory_fn: MemoryFn, memory_budget: float,
                   seed: int = 0, max_pack_size: int | None = None) -> PackingPlan:
    """Random Pack baseline (section 5.4): a random order, packs filled in that order."""
    if max_pack_size is not None:
        check_int("max_pack_size", max_pack_size, min_value=1)
    mems = _memories(configs, memory_fn, memory_budget)
    order = list(range(len(configs)))
    random.Random(seed).shuffle(order)
    packs = _greedy_fill(order, mems, memory_budget, max_pack_size)
    return PackingPlan("random", packs, _pack_memory(packs, mems), float(memory_budget))


def batch_size_packing(configs: Sequence[Config], memory_fn: MemoryFn, memory_budget: float,
                       key: str = "batch_size", max_pack_size: int | None = None) -> PackingPlan:
    """Batch-size Pack baseline (section 5.4): only equal ``config[key]`` share a pack,
    greedily filled up to the memory budget."""
    if max_pack_size is not None:
        check_int("max_pack_size", max_pack_size, min_value=1)
    mems = _memories(configs, memory_fn, memory_budget)
    by_bs: dict[Any, list[int]] = {}
    for i, c in enumerate(configs):
        if key not in c:
            raise ValueError(f"configs[{i}] must set {key!r} for batch-size packing")
        by_bs.setdefault(c[key], []).append(i)
    packs: list[list[int]] = []
    for members in by_bs.values():
        packs.extend(_greedy_fill(members, mems, memory_budget, max_pack_size))
    return PackingPlan("batch_size", packs, _pack_memory(packs, mems), float(memory_budget))


def pack_opt(configs: Sequence[Config], space: SearchSpace, memory_fn: MemoryFn, memory_budget: float,
             method: str = "knn", threshold: float | None = None, seed: int = 0,
             max_pack_size: int | None = None, metric: str = "manhattan",
             batch_size_key: str = "batch_size") -> PackingPlan:
    """``pack_opt(T)`` of Packed_Hyperband (section 5.2): a packable partitioning of ``configs``
    by ``method`` (``"knn"``, ``"random"`` or ``"batch_size"``). Every configuration is
    validated against ``space`` whatever the method."""
    check_choice("method", method, METHODS)
    if method == "knn":                                   # validates the configurations itself
        return knn_packing(configs, space, memory_fn, memory_budget, threshold, seed, max_pack_size, metric)
    for i, c in enumerate(configs):
        space.indices(c, f"configs[{i}]")
    if method == "random":
        return random_packing(configs, memory_fn, memory_budget, seed, max_pack_size)
    return batch_size_packing(configs, memory_fn, memory_budget, batch_size_key, max_pack_size)
