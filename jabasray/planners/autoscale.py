"""JABAS coarse-grained automatic scaling (paper section 6.3) and its cost model (Eq. 8).

Source: JABAS (the JABAS/IIDP paper), section 6.3 (coarse-grained
automatic scaling) and the cost model of section 7.1 (Eq. 8).

Implementation notes
--------------------
* Candidate allocations (``enumerate_allocations``): an allocation takes 0..m_i GPUs from
  node i (m_i GPUs), not all zero, so there are prod_i (m_i + 1) - 1 candidates. The paper
  allocates identical pairs only (m_i / 2 + 1 choices per node); we consider every GPU count
  (one GPU, odd counts, one-GPU nodes): g GPUs of a node form g // 2 pairs and, when g is odd,
  one solo unit that runs both similarity groups itself (:mod:`.config_solver` notes). Group H
  of an allocation is its list of units in node order. Candidates are sorted by GPU count, then
  by preferring earlier nodes; restricted to even counts this is the paper's list for
  N1 = 4 x g_A, N2 = 2 x g_B: (g_A, g_A), (g_B, g_B), (g_A x 4), (g_A, g_A, g_B, g_B), ...
* Large clusters (a deviation from section 6.3, whose list grows as prod_i (m_i / 2 + 1): 3^64
  candidates for 256 GPUs in nodes of four): beyond ``MAX_CANDIDATES`` candidates, nodes alike
  in everything the model and Eq. 8 read (GPU type, GPU count, memory, speed, TFLOPS) are one
  class (:func:`class_allocations`). Interchangeable nodes give the same group H whichever of
  them hold which count, so a class first offers every multiset of per-node counts - the same
  choice as the full list, without its permutations. Where that is still too many, a class
  offers each GPU total once, split pairs first (fewest nodes, even counts, so the most pairs
  and fewest solo GPUs: usually, not always, the fastest split), else whole nodes, else whole
  nodes on a doubling ladder (0, 1, 2, 4, ... nodes and all of them). These coarser levels
  search less than the paper and can miss a better allocation between their steps. The driver
  and the simulator call the same function, so they choose among the same candidates.
* Pruning (ours; the same choice, found faster): a candidate whose epoch cannot be shorter
  than N samples over the sum of its GPUs' peak throughputs (:func:`epoch_lower_bound`; each
  GPU's best samples per second under the model at any B_L, n_vsw and n_GA) is not estimated
  once a candidate already estimated is faster (or cheaper, objective "cost") than that bound,
  with the re-placement charge and without it; candidates are estimated in the order of their
  bounds. Its record says "pruned" with the bound instead of an epoch time.
* Epoch time (``epoch_time``): the trajectory holds one global batch per p iterations. Walking
  through the epoch, chunk c uses B_G = trajectory[c] (the last value once the trajectory is
  exhausted), the plan policy's plan for it (``plan_policy.solve_for_batch``, the same plan
  the driver runs) (B_G* samples per iteration, predicted time t), and runs
  min(p, ceil(remaining samples / B_G*)) iterations - one interval; the epoch time is the sum
  of the intervals' predicted terms (:func:`.interval_model.plan_interval_terms`: t per
  iteration plus, once measured on placed actors, the host terms of each interval, a new plan
  charged its configure call), exactly what the driver records as each interval's
  prediction. The epoch's last iteration may be ragged (fewer samples); it is charged what
  the engine runs for it (:func:`.interval_model.ragged_iteration_time`: per VSW at the
  remainder's micro-batch size, plus the measured ragged-step cost). Each distinct B_G is
  solved once per (group H, N_G, multi-node) - a memo shared by all candidates - and each
  (B_L, M) of Alg. 1 once per group, whichever B_G rounds to it.
* The performance model is re-targeted per allocation when it offers
  ``for_allocation(num_gpus, multi_node)`` (``PerfModel`` does: N_G and the intra-/inter-node
  all-reduce fit of Eq. 3 depend on the allocation); other models are used as given.
* Cost (Eq. 8): the price of a GPU type is proportional to its TFLOPS,
  Cost(X) = C_A1 * X.TFLOPS / A1.TFLOPS; we use ``NodeSpec.price_weight`` (TFLOPS, or the
  emulation speed when TFLOPS is unknown) per GPU-second, so the cost of an epoch is
  epoch_time * sum over allocated GPUs of price_weight, in "TFLOPS-seconds" (multiply by
  C_A1 / A1.TFLOPS to get money).
* Objectives: "time" = least epoch time (ties: cheaper, fewer GPUs); "cost" = least cost (ties:
  faster); "time_under_budget" = least time among allocations with cost <= budget; when none
  fits the budget the cheapest is returned with ``within_budget=False`` and a warning.
* Re-placement cost (a deviation from section 6.3, which picks the allocation of least epoch
  time): moving to another allocation checkpoints the job and restarts its actors, which the
  paper measured at 0.45 % of the training time and leaves out. With short epochs (or a slow
  restart) that is not negligible: a candidate that differs from the ``current`` allocation is
  charged ``switch_cost_s`` seconds on top of its epoch time (and its GPUs' price for them), so
  the job moves only when the next epoch repays the move. ``switch_cost_s = 0`` is the paper's
  rule. The horizon is the next epoch, the one the forecast covers.
* Launch charge (ours): a candidate node that Ray's autoscaler must launch first
  (``NodeSpec.launch_s`` set: :mod:`jabasray.actors.cluster_view`) has no GPUs until it is up,
  so an allocation that uses such nodes is charged the longest ``launch_s`` among them (they
  launch together) on top of its epoch time and of the re-placement charge, its GPUs priced
  for it like the re-placement (:meth:`Allocation.launch_s`, :meth:`CandidateEstimate.weighed`).
  Unlike the re-placement charge it applies with or without a current allocation, and also
  to the choice "without the re-placement charge" (the wait is real either way).
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..config import AUTOSCALE_OBJECTIVES
from ..serialization import JsonMixin
from ..types import ClusterSpec, Plan, node_units
from ..validation import check_choice, check_float, check_int
from .interval_model import host_costs_of, plan_interval_terms, ragged_remainder
from .plan_policy import DEFAULT_TOLERANCE, NoPlanError, solve_for_batch

log = logging.getLogger(__name__)

OBJECTIVES = AUTOSCALE_OBJECTIVES


@dataclass(frozen=True)
class Allocation(JsonMixin):
    """GPUs taken from each node (node name -> GPUs), in cluster node order."""

    node_gpus: dict[str, int]

    def __post_init__(self) -> None:
        if not isinstance(self.node_gpus, dict) or not self.node_gpus:
            raise ValueError(f"node_gpus must be a non-empty mapping node -> GPUs, got {self.node_gpus!r}")
        for k, v in self.node_gpus.items():
            check_int(f"node_gpus[{k}]", v, min_value=0)
        if sum(self.node_gpus.values()) == 0:
            raise ValueError("node_gpus must use at least one GPU, got all zeros")

    def same_gpus(self, other: "Allocation") -> bool:
        """Whether ``other`` takes the same GPUs of every node (nodes with 0 GPUs aside)."""
        return ({n: g for n, g in self.node_gpus.items() if g}
                == {n: g for n, g in other.node_gpus.items() if g})

    @property
    def num_gpus(self) -> int:
        return sum(self.node_gpus.values())

    @property
    def nodes_used(self) -> list[str]:
        return [n for n, g in self.node_gpus.items() if g > 0]

    @property
    def multi_node(self) -> bool:
        return len(self.nodes_used) > 1

    def group_gpus(self, cluster: ClusterSpec) -> list[str]:
        """Group H as similarity units, node order: per node its pairs, then a solo GPU when the
        node's count is odd (:func:`jabasray.types.node_units`)."""
        out: list[str] = []
        for name, gpus in self.node_gpus.items():
            node = cluster.node(name)
            if gpus > node.num_gpus:
                raise ValueError(f"node_gpus[{name}] must be <= {node.num_gpus} (GPUs on that node), "
                                 f"got {gpus}")
            out.extend(node_units(node.gpu_type, gpus))
        return out

    def gpus(self, cluster: ClusterSpec) -> list[str]:
        """All allocated GPUs as type names, node order."""
        self.group_gpus(cluster)   # validates the counts
        return [cluster.node(n).gpu_type for n, g in self.node_gpus.items() for _ in range(g)]

    def price_rate(self, cluster: ClusterSpec) -> float:
        """Sum of Eq. 8 price weights of the allocated GPUs (per second)."""
        return sum(g * cluster.node(n).price_weight for n, g in self.node_gpus.items())

    def launch_s(self, cluster: ClusterSpec) -> float:
        """Seconds before this allocation's GPUs exist: the longest ``launch_s`` of the nodes
        it uses that must be launched first (module notes, "Launch charge"); 0 on live nodes."""
        return max((float(cluster.node(n).launch_s) for n, g in self.node_gpus.items()
                    if g > 0 and cluster.node(n).launch_s is not None), default=0.0)


@dataclass(frozen=True)
class EpochTime(JsonMixin):
    """Predicted epoch on one group H: time, iterations and the plan per distinct B_G."""

    epoch_time: float | None               # seconds (None: some B_G has no plan)
    iterations: int                         # iterations of the epoch (those predicted)
    plans: dict[int, Plan] = field(default_factory=dict)   # requested B_G -> plan
    reason: str = "ok"


@dataclass(frozen=True)
class CandidateEstimate(JsonMixin):
    """One candidate allocation as evaluated by :func:`choose_allocation`."""

    allocation: Allocation
    group_gpus: list[str]
    epoch_time: float | None               # None: infeasible
    cost: float | None                      # Eq. 8 price-weighted GPU-seconds (None: infeasible)
    iterations: int
    reason: str = "ok"
    switch_s: float = 0.0                   # re-placement seconds charged (not the current allocation)
    launch_s: float = 0.0                   # seconds charged for launching its nodes (module notes)

    def weighed(self, charge_switch: bool = True) -> tuple[float, float]:
        """``(time, cost)`` the choice weighs: the epoch's, plus the launch of its nodes and
        (``charge_switch``) the re-placement to this allocation, its GPUs priced for both
        (feasible candidates only)."""
        extra = self.launch_s + (self.switch_s if charge_switch else 0.0)
        rate = self.cost / self.epoch_time if self.epoch_time else 0.0
        return self.epoch_time + extra, self.cost + extra * rate


@dataclass(frozen=True)
class AutoscaleDecision(JsonMixin):
    """The chosen allocation for the next epoch and what it is predicted to do."""

    objective: str                          # "time" | "cost" | "time_under_budget"
    allocation: Allocation                  # pairs per node
    group_gpus: list[str]                   # group H (one GPU per pair)
    epoch_time: float                       # predicted seconds for the epoch
    cost: float                             # Eq. 8 cost of the epoch
    iterations: int                         # predicted iterations in the epoch
    plans: dict[int, Plan]                  # requested B_G -> plan on this allocation
    within_budget: bool = True              # False: no allocation met cost_budget
    candidates: list[CandidateEstimate] = field(default_factory=list)
    uncharged_choice: Allocation | None = None   # what the objective picks without the
                                                 # re-placement charge, where that differs


# ---------------------------------------------------------------------------- enumeration
MAX_CANDIDATES = 2048   # candidates beyond which identical nodes are taken as one class (notes)


def enumerate_allocations(cluster: ClusterSpec, max_candidates: int = MAX_CANDIDATES) -> list[Allocation]:
    """The candidate allocations (module notes): all prod_i (m_i + 1) - 1 of them while that is
    at most ``max_candidates``, else the reduced set of :func:`class_allocations`."""
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(f"cluster must be a ClusterSpec, got {type(cluster).__name__}")
    check_int("max_candidates", max_candidates, min_value=1)
    if math.prod(n.num_gpus + 1 for n in cluster.nodes) - 1 > max_candidates:
        return class_allocations(cluster, max_candidates)
    names = [n.name for n in cluster.nodes]
    combos = itertools.product(*(range(n.num_gpus + 1) for n in cluster.nodes))
    return _ordered(names, [c for c in combos if any(c)])


def _ordered(names: list[str], combos: Sequence[Sequence[int]]) -> list[Allocation]:
    """Allocations sorted by GPU count, then preferring earlier nodes (module notes)."""
    ordered = sorted(set(tuple(c) for c in combos), key=lambda c: (sum(c), tuple(-p for p in c)))
    return [Allocation(dict(zip(names, c))) for c in ordered]


def node_classes(cluster: ClusterSpec) -> list[list[int]]:
    """Indices of interchangeable nodes, cluster order: nodes alike in GPU type, GPU count,
    memory, speed, TFLOPS and launch time (everything the model, Eq. 8 and the launch charge
    read of a node)."""
    classes: dict[tuple, list[int]] = {}
    for i, n in enumerate(cluster.nodes):
        classes.setdefault((n.gpu_type, n.num_gpus, n.memory_gb, n.speed, n.tflops, n.launch_s),
                           []).append(i)
    return list(classes.values())


def _class_levels(num_nodes: int, gpus_per_node: int, granularity: str) -> list[tuple[int, ...]]:
    """The per-node GPU counts one class of ``num_nodes`` interchangeable nodes offers (its
    nodes in order) at a granularity (module notes, "Large clusters"): every multiset of counts
    ("exact": which of the alike nodes holds which count changes nothing), every GPU total split
    pairs first ("gpu"), whole nodes ("node"), or whole nodes on a doubling ladder ("ladder")."""
    m = gpus_per_node
    if granularity == "exact":
        return [tuple(sorted(c, reverse=True))
                for c in itertools.combinations_with_replacement(range(m + 1), num_nodes)]
    if granularity == "gpu":
        return [_pairs_first(total, num_nodes, m) for total in range(num_nodes * m + 1)]
    nodes = range(num_nodes + 1)
    if granularity == "ladder":
        ladder, k = {0, num_nodes}, 1
        while k < num_nodes:
            ladder.add(k)
            k *= 2
        nodes = sorted(ladder)
    return [tuple([m] * k + [0] * (num_nodes - k)) for k in nodes]


def _pairs_first(total: int, num_nodes: int, per_node: int) -> tuple[int, ...]:
    """``total`` GPUs over ``num_nodes`` nodes of ``per_node``: of two splits - full nodes in
    order, and nodes at even counts where the rest still fits - the one on one node if either
    is, else with the fewer solo GPUs (odd counts), else on fewer nodes."""
    def split(even_first: bool) -> tuple[int, ...]:
        counts, left = [], total
        for j in range(num_nodes):
            take = min(per_node, left)
            if even_first and take % 2 and take > 1 and \
                    left - (take - 1) <= (num_nodes - j - 1) * per_node:
                take -= 1
            counts.append(take)
            left -= take
        return tuple(counts)

    def key(counts: tuple[int, ...]) -> tuple:
        used = sum(1 for c in counts if c)
        return (used > 1, sum(c % 2 for c in counts), used)

    return min((split(False), split(True)), key=key)


def class_allocations(cluster: ClusterSpec, max_candidates: int = MAX_CANDIDATES) -> list[Allocation]:
    """Candidates of a large cluster (module notes, "Large clusters"): per class of
    interchangeable nodes (:func:`node_classes`) the per-node GPU counts of the finest
    granularity whose candidate count stays within ``max_candidates`` (:func:`_class_levels`:
    exact, GPU totals, whole nodes, whole nodes on a doubling ladder - the last is used
    whatever its count)."""
    classes = node_classes(cluster)
    sizes = [(len(c), cluster.nodes[c[0]].num_gpus) for c in classes]
    for granularity in ("exact", "gpu", "node", "ladder"):
        levels = [_class_levels(k, m, granularity) for k, m in sizes]
        if math.prod(len(lv) for lv in levels) - 1 <= max_candidates:
            break
    combos = []
    for choice in itertools.product(*levels):
        counts = [0] * len(cluster.nodes)
        for members, per_node in zip(classes, choice):
            for node, g in zip(members, per_node):
                counts[node] = g
        if any(counts):
            combos.append(counts)
    return _ordered([n.name for n in cluster.nodes], combos)


# ---------------------------------------------------------------------------- epoch time
def _check_trajectory(trajectory: Any) -> list[int]:
    if isinstance(trajectory, (str, bytes)) or not hasattr(trajectory, "__iter__"):
        raise ValueError(f"trajectory must be a non-empty list of global batch sizes, got {trajectory!r}")
    traj = list(trajectory)
    if not traj:
        raise ValueError("trajectory must be a non-empty list of global batch sizes, got []")
    out = []
    for i, b in enumerate(traj):
        if isinstance(b, float) and b.is_integer():
            b = int(b)
        out.append(check_int(f"trajectory[{i}]", b, min_value=1))
    return out


def _retarget(model: Any, num_gpus: int, multi_node: bool) -> Any:
    fn = getattr(model, "for_allocation", None)
    return fn(num_gpus, multi_node) if callable(fn) else model


def epoch_time(group_gpus: Sequence[str], model: Any, trajectory: Sequence[int], dataset_size: int,
               adapt_interval: int, min_local_batch: int,
               cache: dict[int, Plan | str] | None = None,
               tolerance: float = DEFAULT_TOLERANCE, tables: dict | None = None,
               solutions: dict | None = None) -> EpochTime:
    """Predicted epoch time of group H for a B_G trajectory (module notes). ``model`` must already
    describe the allocation (see ``PerfModel.for_allocation``); ``cache`` memoises B_G -> plan
    (or the reason there is none). Plans come from :func:`.plan_policy.solve_for_batch` with
    ``tolerance``: the plan the driver will run. A B_G below what the group can run (the policy
    would raise it to its floor) makes the group infeasible here: the auto-scaler does not pick
    an allocation that cannot run the forecast batch sizes. ``tables``: the solver's tables for
    ``model`` (:func:`.config_solver.cached_table`); ``solutions``: the solver's answers per
    (B_L, M) on this group and ``model`` (:func:`.plan_policy.solve_remembered`)."""
    traj = _check_trajectory(trajectory)
    check_int("dataset_size", dataset_size, min_value=1)
    check_int("adapt_interval", adapt_interval, min_value=1)
    check_int("min_local_batch", min_local_batch, min_value=1)
    return _epoch_time(group_gpus, model, traj, dataset_size, adapt_interval, min_local_batch, cache,
                       tolerance, tables, solutions)


def _epoch_time(group_gpus: Sequence[str], model: Any, traj: list[int], dataset_size: int,
                adapt_interval: int, min_local_batch: int, cache: dict[int, Plan | str] | None,
                tolerance: float, tables: dict | None, solutions: dict | None) -> EpochTime:
    """:func:`epoch_time` on arguments already checked (``traj``: whole batches, as
    ``_check_trajectory`` returns them): the auto-scaler checks them once per decision."""
    memo: dict[int, Plan | str] = {} if cache is None else cache
    plans: dict[int, Plan] = {}
    remaining, total, iters, chunk = dataset_size, 0.0, 0, 0
    costs, previous = host_costs_of(model), None
    while remaining > 0:
        bg = traj[min(chunk, len(traj) - 1)]
        plan = memo.get(bg)
        if plan is None:
            plan = memo[bg] = _plan_or_reason(bg, group_gpus, model, min_local_batch, tolerance, tables,
                                              solutions)
        if isinstance(plan, str):
            return EpochTime(None, iters, plans, f"B_G={bg}: {plan}")
        plans[bg] = plan
        n = min(adapt_interval, math.ceil(remaining / plan.global_batch_size))
        # the interval's named terms (interval_model): Eq. 6 for its n iterations plus the host
        # terms measured on the placed actors (none before they were measured)
        total += sum(plan_interval_terms(
            plan, n, costs, configure=plan != previous, model=model,
            remainder=ragged_remainder(remaining, n, plan.global_batch_size)).values())
        previous = plan
        iters += n
        remaining -= n * plan.global_batch_size
        chunk += 1
    return EpochTime(total, iters, plans)


def _plan_or_reason(bg: int, group_gpus: Sequence[str], model: Any, min_local_batch: int,
                    tolerance: float, tables: dict | None = None, solutions: dict | None = None
                    ) -> Plan | str:
    try:
        plan = solve_for_batch(bg, list(group_gpus), model, min_local_batch, tolerance=tolerance,
                               tables=tables, solutions=solutions)
    except NoPlanError as e:
        return e.reason
    if plan.requested_global_batch_size != bg:    # raised to the group's floor
        return (f"global batch {bg} is too small for {len(group_gpus)} GPU units per group "
                f"(the smallest it runs is {plan.requested_global_batch_size})")
    return plan


# ---------------------------------------------------------------------------- choice
def choose_allocation(cluster: ClusterSpec, model: Any, trajectory: Sequence[int], dataset_size: int,
                      adapt_interval: int, min_local_batch: int, objective: str = "time",
                      cost_budget: float | None = None,
                      allocations: Sequence[Allocation] | None = None,
                      tolerance: float = DEFAULT_TOLERANCE, current: Allocation | None = None,
                      switch_cost_s: float = 0.0,
                      plan_cache: dict[tuple, dict[int, Plan | str]] | None = None,
                      prune: bool = True) -> AutoscaleDecision:
    """Evaluate every candidate allocation on the trajectory and pick one by ``objective``.

    ``current``: the allocation the job runs now (None: none, e.g. the first placement); every
    other candidate is charged ``switch_cost_s`` seconds of re-placement (module notes).
    ``plan_cache``: plans (or why there is none) per (group H, N_G, multi-node) and B_G, kept by
    the caller across calls while the model stays the same (the answers are the same; a new
    forecast mostly asks for B_G already solved), and beside them the solver's answers per
    (group H, N_G, multi-node) and (B_L, M) (:func:`.plan_policy.solve_remembered`: a B_G not
    solved yet mostly rounds to an M that was); None: a memo for this call only.
    ``prune``: skip the candidates that cannot be chosen (:func:`epoch_lower_bound`; objectives
    "time" and "cost"); their estimate says so instead of an epoch time. False: every candidate
    is estimated (the same choice, slower).
    Raises ValueError when no allocation can run the trajectory (the message gives the reason
    of the largest allocation).
    """
    check_choice("objective", objective, OBJECTIVES)
    if objective == "time_under_budget" and cost_budget is None:
        raise ValueError("cost_budget must be a number > 0 when objective is 'time_under_budget', got None")
    if cost_budget is not None:
        check_float("cost_budget", cost_budget, min_value=0, min_exclusive=True)
    traj = _check_trajectory(trajectory)
    check_int("dataset_size", dataset_size, min_value=1)
    check_int("adapt_interval", adapt_interval, min_value=1)
    check_int("min_local_batch", min_local_batch, min_value=1)
    check_float("switch_cost_s", switch_cost_s, min_value=0)
    cl = cluster
    memo: dict[tuple, dict] = {} if plan_cache is None else plan_cache
    allocs, groups = _candidates(cl, allocations, memo)
    # per (N_G, multi-node): the model retargeted once and its solver tables, for every
    # candidate of that size (and, in a plan cache, every later decision)
    retargeted = memo.setdefault(("retargeted models",), {})
    peaks = memo.setdefault(("peak throughput",), {})
    plans_of: dict[tuple, dict[int, Plan]] = {}

    def switch_of(alloc: Allocation) -> float:
        return 0.0 if current is None or alloc.same_gpus(current) else float(switch_cost_s)

    def bound_of(alloc: Allocation) -> float | None:
        size = (alloc.num_gpus, alloc.multi_node)
        if size not in retargeted:
            retargeted[size] = (_retarget(model, *size), {})
        types = tuple(cl.gpu_types)    # a cluster may gain GPU types between decisions
        if size + types not in peaks:
            peaks[size + types] = peak_throughputs(retargeted[size][0], types, min_local_batch)
        return epoch_lower_bound(alloc, cl, peaks[size + types], dataset_size)

    bounds: list[float | None] = [None] * len(allocs)
    if prune and objective in ("time", "cost"):
        # the enumerated candidates' bounds depend on the cluster, the model, N and min B_L only:
        # kept beside the candidates (dropped with them when the cluster changes)
        kept = memo.get(("candidates",)) if allocations is None else None
        kept_bounds = kept.get(("bounds", dataset_size, min_local_batch)) if kept is not None else None
        bounds = kept_bounds if kept_bounds is not None else [bound_of(a) for a in allocs]
        if kept is not None:
            kept[("bounds", dataset_size, min_local_batch)] = bounds
    order = sorted(range(len(allocs)), key=lambda i: (bounds[i] is not None, bounds[i] or 0.0, i))
    best_free = best_charged = math.inf      # the objective's value of the best so far
    estimates: dict[int, CandidateEstimate] = {}
    for i in order:
        alloc, lb, group = allocs[i], bounds[i], groups[i]
        switch, launch = switch_of(alloc), alloc.launch_s(cl)
        if lb is not None:
            rate = alloc.price_rate(cl) if objective == "cost" else 1.0
            if (lb + launch) * rate > best_free and (lb + launch + switch) * rate > best_charged:
                estimates[i] = CandidateEstimate(alloc, group, None, None, 0, f"pruned: at least "
                                                 f"{lb:.4g} s, slower than the best", switch, launch)
                continue
        key = (tuple(group), alloc.num_gpus, alloc.multi_node)
        m, tables = retargeted.setdefault((alloc.num_gpus, alloc.multi_node),
                                          (_retarget(model, alloc.num_gpus, alloc.multi_node), {}))
        est = _epoch_time(group, m, traj, dataset_size, adapt_interval, min_local_batch,
                          memo.setdefault(key, {}), tolerance, tables, memo.setdefault(("solutions",) + key, {}))
        cost = est.epoch_time * alloc.price_rate(cl) if est.epoch_time is not None else None
        c = estimates[i] = CandidateEstimate(alloc, group, est.epoch_time, cost, est.iterations,
                                             est.reason, switch, launch)
        if est.epoch_time is not None:
            plans_of[key] = est.plans
            value = 0 if objective == "time" else 1
            best_free = min(best_free, c.weighed(False)[value])
            best_charged = min(best_charged, c.weighed(True)[value])
    cands = [estimates[i] for i in range(len(allocs))]
    feasible = [c for c in cands if c.epoch_time is not None]
    if not feasible:
        raise ValueError(f"trajectory: no allocation can run it; e.g. {cands[-1].reason}")

    best, within = _pick(feasible, objective, cost_budget)
    free = _pick(feasible, objective, cost_budget, charge_switch=False)[0]
    uncharged = None if free.allocation.same_gpus(best.allocation) else free.allocation
    if not within:
        log.warning("no allocation meets cost_budget %.4g (cheapest costs %.4g); using the cheapest",
                    cost_budget, best.cost)
    key = (tuple(best.group_gpus), best.allocation.num_gpus, best.allocation.multi_node)
    plans = plans_of[key]
    return AutoscaleDecision(objective=objective, allocation=best.allocation, group_gpus=best.group_gpus,
                             epoch_time=float(best.epoch_time), cost=float(best.cost),
                             iterations=best.iterations, plans=dict(plans), within_budget=within,
                             candidates=cands, uncharged_choice=uncharged)


def _candidates(cluster: ClusterSpec, allocations: Sequence[Allocation] | None,
                memo: dict) -> tuple[list[Allocation], list[list[str]]]:
    """The candidates (given, else :func:`enumerate_allocations`) and their groups H; the
    enumerated ones kept in ``memo`` while the cluster stays the same."""
    if allocations is not None:
        allocs = list(allocations)
        return allocs, [a.group_gpus(cluster) for a in allocs]
    kept = memo.get(("candidates",))
    if kept is None or kept["cluster"] != cluster:
        allocs = enumerate_allocations(cluster)
        kept = memo[("candidates",)] = {"cluster": cluster, "allocs": allocs,
                                        "groups": [a.group_gpus(cluster) for a in allocs]}
    return kept["allocs"], kept["groups"]


def peak_throughputs(model: Any, gpu_types: Sequence[str], min_local_batch: int) -> dict[str, float] | None:
    """An upper bound on the samples per second one GPU of each type can train under ``model``
    (retargeted to an allocation): the largest ``B_L n_vsw (n_GA + 1) / t(B_L, n_vsw, n_GA)``
    over every B_L the solver may choose (multiples of min B_L), n_vsw <= n_max and n_GA >= 0.
    Eq. 6 is affine in n_GA, t = t_0 + s n_GA, so over n_GA this ratio is largest at n_GA = 0
    or in the limit, ``B_L n_vsw max(1 / t_0, 1 / s)``. None when the model is not affine in
    n_GA (checked at three points) or has no such answers: then nothing is pruned."""
    out: dict[str, float] = {}
    for g in gpu_types:
        try:
            max_bl = int(model.max_local_batch(g))
        except (AttributeError, ValueError):
            return None
        best = 0.0
        for bl in range(min_local_batch, max_bl + 1, min_local_batch):
            for n in range(1, int(model.max_num_vsw(g, bl)) + 1):
                t0, t1, t2 = (float(model.iteration_time(g, bl, n, ga)) for ga in (0, 1, 2))
                slope = t1 - t0
                if t0 <= 0 or slope <= 0 or not math.isclose(t2 - t1, slope, rel_tol=1e-9, abs_tol=1e-15):
                    return None
                best = max(best, bl * n / min(t0, slope))
        if best <= 0:
            return None
        out[g] = best
    return out


def epoch_lower_bound(alloc: Allocation, cluster: ClusterSpec, peaks: dict[str, float] | None,
                      dataset_size: int) -> float | None:
    """A lower bound on any epoch time of ``alloc``: every iteration lasts at least as long as
    each GPU needs for its samples, so an epoch's N samples take at least N over the sum of the
    GPUs' peak throughputs (:func:`peak_throughputs`); the intervals' host terms only add. None
    without peaks. The auto-scaler skips ("prunes") a candidate whose bound, re-placement
    included, is already above the best candidate's weighed time (or cost): it cannot be
    chosen, with the charge or without it."""
    if peaks is None:
        return None
    total = sum(g * peaks[cluster.node(n).gpu_type] for n, g in alloc.node_gpus.items())
    return dataset_size / total if total > 0 else None


def _pick(feasible: Sequence[CandidateEstimate], objective: str, cost_budget: float | None,
          charge_switch: bool = True) -> tuple[CandidateEstimate, bool]:
    """The candidate ``objective`` prefers, each weighed at :meth:`CandidateEstimate.weighed`,
    and whether it meets ``cost_budget`` ("time_under_budget"; none does: the cheapest)."""
    def fastest(c: CandidateEstimate) -> tuple:
        t, cost = c.weighed(charge_switch)
        return (t, cost, c.allocation.num_gpus)

    def cheapest(c: CandidateEstimate) -> tuple:
        t, cost = c.weighed(charge_switch)
        return (cost, t, c.allocation.num_gpus)

    if objective == "time":
        return min(feasible, key=fastest), True
    if objective == "cost":
        return min(feasible, key=cheapest), True
    ok = [c for c in feasible if c.weighed(charge_switch)[1] <= cost_budget]
    return (min(ok, key=fastest), True) if ok else (min(feasible, key=cheapest), False)


__all__ = ["Allocation", "AutoscaleDecision", "CandidateEstimate", "EpochTime", "OBJECTIVES",
           "enumerate_allocations", "class_allocations", "node_classes", "MAX_CANDIDATES", "epoch_time",
           "choose_allocation", "peak_throughputs", "epoch_lower_bound"]
