"""From an allocation (GPUs per node) to placed GPU actors.

Rank layout (the one source of truth for who is in which similarity group): nodes in cluster
order; the ``g`` GPUs allocated on a node form ``g // 2`` pairs and, when ``g`` is odd, one solo
GPU (:func:`jabasray.types.node_units`). Units are numbered in that order; ranks follow them:
a pair's two GPUs get consecutive ranks, group 0 then group 1; a solo GPU gets one rank and
``group = SOLO_GROUP``: it runs both groups' decoupled workers, the first half of its VSWs in
group 0 and the second half in group 1. Group H of the configuration solver (Alg. 1, line 5 of
the JABAS paper) is group 0, so ``plan.workers[i]`` configures unit ``i``.

Placement: one Ray placement group per unit (``STRICT_PACK``, one bundle per GPU), so both
GPUs of a pair land on one Ray node, and a unit can be kept, released or added on its own when
the allocation changes (unit ``k`` of a node is the node's ``k``-th; an allocation of ``g``
GPUs on a node uses its units ``0..``). GPU types are Ray
resources: an emulated GPU of type ``t`` is one unit of the custom resource ``gpu_<t>`` with no CPU
(8 emulated GPUs fit on 2 cores); a real GPU is ``{"GPU": 1}`` plus ``gpu_<t>`` when the cluster
advertises such a resource (how a heterogeneous cluster labels its nodes' GPU types).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from ..config import JobConfig
from ..errors import NodesGone, PlacementTimeout
from ..planners.job_planner import choose_for_job, initial_trajectory
from ..serialization import JsonMixin
from ..types import ClusterSpec, NodeSpec, solo_unit
from ..validation import check_int

log = logging.getLogger(__name__)


SOLO_GROUP = -1   # Slot.group of a GPU that forms both similarity groups (two VSW halves)


def resource_name(gpu_type: str) -> str:
    """The Ray custom resource that stands for one GPU of ``gpu_type``."""
    return f"gpu_{gpu_type}"


@dataclass(frozen=True)
class Slot(JsonMixin):
    """One GPU of an allocation and the actor rank that will own it."""

    rank: int          # rank in the process group
    node: str          # ClusterSpec node name
    gpu_type: str      # GPU type
    speed: float       # emulation speed factor of the node
    group: int         # similarity group: 0 (group H), 1, or SOLO_GROUP (both, by VSW halves)
    pair: int          # unit index = index into plan.workers / group_gpus
    local_pair: int = 0  # index of the unit on its node (identity of the unit's GPUs)
    ray_node_id: str | None = None  # Ray node the slot is pinned to (NodeSpec.ray_node_id)
    launch_s: float | None = None   # its node must be launched first (NodeSpec.launch_s): its
                                    # bundle names gpu_<type>, its placement waits this longer

    @property
    def pair_key(self) -> tuple[str, int]:
        return (self.node, self.local_pair)

    @property
    def solo(self) -> bool:
        """True for a GPU that forms both similarity groups (no partner)."""
        return self.group == SOLO_GROUP


def ray_cluster_spec(speeds: dict[str, float] | None = None,
                     memory_gb: dict[str, float] | None = None) -> ClusterSpec:
    """The running Ray cluster as a ClusterSpec: ``ClusterSpec.from_ray(ray.nodes(), ...)``,
    marked ``follow_ray`` (a job given it plans with the live nodes, joined ones included:
    :mod:`.cluster_view`)."""
    import ray
    if not ray.is_initialized():
        raise ValueError("the cluster is detected from a running Ray: call ray.init() first "
                         "or pass a ClusterSpec")
    return replace(ClusterSpec.from_ray(ray.nodes(), speeds=speeds, memory_gb=memory_gb),
                   follow_ray=True)


def job_cluster(cluster: ClusterSpec, job: JobConfig) -> ClusterSpec:
    """The GPUs ``job`` may use: all of them for IIDP data parallelism (pairs and solo GPUs);
    only identical pairs for Crossbow SMA (its learner tuner runs a pair's two GPUs alike) and
    burst parallelism (DeepPool's plan over pair-built similarity groups), where an odd GPU of a
    node is left out with a warning."""
    if job.sync != "sma" and job.parallelism != "burst":
        return cluster
    try:
        return cluster.validated_pairs(drop_odd_gpu=True)
    except ValueError:
        mode = "sync='sma' (Crossbow)" if job.sync == "sma" else "parallelism='burst'"
        raise ValueError(f"cluster: {mode} needs two GPUs of one type on one node, got "
                         f"{[(n.name, n.num_gpus) for n in cluster.nodes]}; use sync='iidp' "
                         f"(any number of GPUs)") from None


def normalize_allocation(cluster: ClusterSpec, allocation: dict[str, int]) -> dict[str, int]:
    """Validate ``{node name: number of GPUs}`` against ``cluster``; drop zero entries."""
    out: dict[str, int] = {}
    for name, gpus in allocation.items():
        node = cluster.node(name)
        check_int(f"allocation[{name}]", gpus, min_value=0, max_value=node.num_gpus)
        if gpus:
            out[name] = int(gpus)
    if not out:
        raise ValueError("allocation must use at least one GPU, got none")
    return out


def full_allocation(cluster: ClusterSpec) -> dict[str, int]:
    """Every GPU of every node."""
    return {n.name: n.num_gpus for n in cluster.nodes}


def autoscale_allocation(cluster: ClusterSpec, model: Any, trajectory: Sequence[float],
                         dataset_size: int, job: JobConfig) -> dict[str, int]:
    """:func:`jabasray.planners.job_planner.choose_for_job` -> ``{node: GPUs}``."""
    return normalize_allocation(cluster, choose_for_job(cluster, model, trajectory, dataset_size,
                                                        job).allocation.node_gpus)


def next_allocation(cluster: ClusterSpec, model: Any, forecast: Sequence[float] | None,
                    dataset_size: int, job: JobConfig, fixed: bool = False,
                    current: dict[str, int] | None = None, switch_cost_s: float = 0.0,
                    plan_cache: dict | None = None) -> tuple[dict[str, int], dict[str, int] | None, Any]:
    """The allocation a job runs next on ``cluster``: every GPU when ``fixed`` (no
    ``job.autoscale``, or burst parallelism's fixed G), else the auto-scaler (JABAS 6.3) over all
    candidate allocations on the ``forecast`` B_G trajectory (None or empty: the initial phase,
    B_G^init for every interval of the epoch), a move away from ``current`` charged
    ``switch_cost_s`` seconds (:mod:`jabasray.planners.autoscale` notes). Also returns the
    allocation the auto-scaler would have chosen without that charge where it differs (else
    None), and the auto-scaler's :class:`~jabasray.planners.autoscale.AutoscaleDecision`
    (None when ``fixed``). ``plan_cache``: the job planner's
    (:attr:`jabasray.planners.job_planner.JobPlanner.plan_cache`), kept across decisions."""
    if fixed:
        return full_allocation(cluster), None, None
    d = choose_for_job(cluster, model, forecast or initial_trajectory(job, dataset_size), dataset_size,
                       job, current=current, switch_cost_s=switch_cost_s, plan_cache=plan_cache)
    other = d.uncharged_choice
    return (normalize_allocation(cluster, d.allocation.node_gpus),
            normalize_allocation(cluster, other.node_gpus) if other is not None else None, d)


def slots_for(cluster: ClusterSpec, allocation: dict[str, int]) -> list[Slot]:
    """Ranks for an allocation (see module docstring for the layout)."""
    allocation = normalize_allocation(cluster, allocation)
    slots: list[Slot] = []
    unit = 0
    for node in cluster.nodes:
        gpus = allocation.get(node.name, 0)
        for k in range(gpus // 2 + gpus % 2):
            groups = (0, 1) if k < gpus // 2 else (SOLO_GROUP,)
            for g in groups:
                slots.append(Slot(rank=len(slots), node=node.name, gpu_type=node.gpu_type,
                                  speed=node.speed, group=g, pair=unit, local_pair=k,
                                  ray_node_id=node.ray_node_id, launch_s=node.launch_s))
            unit += 1
    return slots


def group_gpus(slots: list[Slot]) -> list[str]:
    """Group H as unit names, in unit order: the ``G``/``H`` input of the solver (a pair's GPU
    type, or :func:`jabasray.types.solo_unit` of a solo GPU)."""
    return [solo_unit(s.gpu_type) if s.solo else s.gpu_type for s in slots if s.group in (0, SOLO_GROUP)]


def multi_node(slots: list[Slot]) -> bool:
    """Whether ``slots`` span several nodes (the model's all-reduce depends on it)."""
    return len({s.node for s in slots}) > 1


def layout_for(slots: list[Slot], workers: list[Any]) -> list[int]:
    """Decoupled workers per rank: unit ``i``'s ranks run ``workers[i]`` (Plan.workers), a solo
    GPU twice (both groups)."""
    units = len({s.pair for s in slots})
    if len(workers) != units:
        raise ValueError(f"plan.workers must have one entry per GPU unit ({units}), got {len(workers)}")
    return [int(workers[s.pair].num_workers) * (2 if s.solo else 1) for s in slots]


def drop_gpus(cluster: ClusterSpec, node_name: str, count: int = 1) -> ClusterSpec | None:
    """The cluster without ``count`` GPUs of ``node_name`` (a node left without a GPU is removed).
    Returns None when nothing is left."""
    nodes: list[NodeSpec] = []
    for n in cluster.nodes:
        if n.name == node_name:
            if n.num_gpus - count >= 1:
                nodes.append(replace(n, num_gpus=n.num_gpus - count))
        else:
            nodes.append(n)
    return ClusterSpec(nodes=nodes) if nodes else None


def drop_dead_nodes(cluster: ClusterSpec, alive_ray_nodes: set[str]) -> ClusterSpec | None:
    """The cluster without the nodes pinned to a Ray node that is no longer alive (nodes without
    ``ray_node_id`` stay). Returns None when nothing is left."""
    nodes = [n for n in cluster.nodes if n.ray_node_id is None or n.ray_node_id in alive_ray_nodes]
    return ClusterSpec(nodes=nodes) if nodes else None


def alive_ray_nodes() -> set[str]:
    """Ids of the Ray nodes alive now."""
    import ray
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def gpu_ray_nodes(cluster: ClusterSpec, emulate: bool, nodes: list[dict] | None = None) -> dict[str, str]:
    """The live Ray nodes that may host ``cluster``'s GPU actors: ``{Ray node id: name}`` (a
    pinned node's spec name; for unpinned specs every live node that offers a resource of a
    GPU bundle, named by its IP). ``nodes``: ``ray.nodes()`` (read when None)."""
    if nodes is None:
        import ray
        nodes = ray.nodes()
    live = [n for n in nodes if n.get("Alive")]
    out = {n.ray_node_id: n.name for n in cluster.nodes if n.ray_node_id is not None}
    if any(n.ray_node_id is None for n in cluster.nodes):
        totals: dict[str, float] = {}
        for n in live:
            for k, v in n.get("Resources", {}).items():
                totals[k] = totals.get(k, 0.0) + v
        keys = {k for n in cluster.nodes if n.ray_node_id is None
                for k in bundle_for(n.gpu_type, emulate, totals)}
        for n in live:
            if keys & {k for k, v in n.get("Resources", {}).items() if v > 0}:
                out.setdefault(n["NodeID"], n.get("NodeManagerAddress", n["NodeID"][:8]))
    return {k: v for k, v in out.items() if k in {n["NodeID"] for n in live}}


def ray_cpus() -> float | None:
    """CPUs of the running Ray cluster (None without Ray)."""
    import ray
    return ray.cluster_resources().get("CPU") if ray.is_initialized() else None


NODE_ID_LABEL = "ray.io/node-id"   # the label Ray gives every node (its node id)


def actor_name(label: str, generation: int, slot: Slot, prefix: str = "jabasray") -> str:
    """The name of a GPU actor in ``ray list actors`` and the dashboard:
    ``jabasray:<label>:g<generation>:<node>:rank<rank>`` (label = the run, with a short unique
    suffix; the generation counts placements, so a name is never reused while an actor of an
    earlier placement is still being torn down). The rank is the one the actor was created for;
    an actor kept across a re-placement keeps its name."""
    return f"{prefix}:{label}:g{generation}:{slot.node}:rank{slot.rank}"


EMULATED_CPU_SHARE = 0.01   # CPUs an emulated GPU asks for when the cluster has no gpu_<type>


def bundle_for(gpu_type: str, emulate: bool, available: dict[str, float] | None = None,
               cpus: float = 0.0) -> dict[str, float]:
    """Ray resources of one GPU of ``gpu_type``, with ``cpus`` CPUs for its data-loader workers
    (reserved in the bundle, so a node's GPUs are not placed beyond the CPUs their loaders need).

    Emulated: one unit of the custom resource ``gpu_<type>``, no CPU; on a cluster that does not
    advertise that resource (e.g. a plain ``ray start --head``) a small CPU share instead, so that
    the job still runs (types are then only distinguished by their speed factor).
    Real: ``{"GPU": 1}`` plus ``gpu_<type>`` when the cluster labels its GPUs that way.
    """
    res = resource_name(gpu_type)
    if emulate:
        if available is None or res in available:
            bundle = {res: 1.0}
        else:
            bundle = {"CPU": EMULATED_CPU_SHARE}
    else:
        bundle = {"GPU": 1.0}
        if available is None or res in available:
            bundle[res] = 1.0
    if cpus > 0:
        bundle["CPU"] = bundle.get("CPU", 0.0) + float(cpus)
    return bundle


def pair_request(pair_slots: list[Slot], emulate: bool, available: dict[str, float] | None = None,
                 cpus: float = 0.0) -> tuple[list[dict[str, float]], list[dict[str, str]] | None]:
    """Bundles (one per GPU, :func:`bundle_for` with ``cpus`` loader CPUs) and the
    ``bundle_label_selector`` of the placement group of one GPU pair: every bundle on the pair's
    Ray node when it is pinned (``Slot.ray_node_id``), else None (any node with the resources)."""
    bundles = [bundle_for(s.gpu_type, emulate, available, cpus) for s in pair_slots]
    node_id = pair_slots[0].ray_node_id
    return bundles, ([{NODE_ID_LABEL: node_id} for _ in bundles] if node_id else None)


def missing_resources(bundles: list[dict[str, float]], free: dict[str, float]) -> dict[str, float]:
    """What the ``bundles`` need beyond the ``free`` resources, per resource (empty: the amounts
    are free, but not together on one node)."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + float(v)
    return {k: round(v - free.get(k, 0.0), 6) for k, v in sorted(need.items())
            if v - free.get(k, 0.0) > 1e-9}


def placement_timeout_message(node: str, ray_node_id: str | None, bundles: list[dict[str, float]],
                              timeout_s: float, free: dict[str, float]) -> str:
    """The one line of :class:`~jabasray.errors.PlacementTimeout`: which unit (a GPU pair or a
    solo GPU), what it asked for,
    what is missing from the cluster's free resources."""
    missing = missing_resources(bundles, free)
    where = f"on Ray node {ray_node_id[:8]}" if ray_node_id else "on any one node"
    lack = (f"missing {missing} (free: {({k: free.get(k, 0.0) for k in missing})})" if missing
            else f"the amounts are free in the cluster but not together {where}")
    unit = "GPU pair" if len(bundles) == 2 else "GPU"
    return (f"placement timed out after {timeout_s:.0f}s: the {unit} of node {node} needs "
            f"{bundles} {where}; {lack}; free resources or raise DriverOptions.placement_timeout_s")


def gpus_offered(available: dict[str, float], bundle: dict[str, float]) -> int:
    """How many copies of ``bundle`` fit into ``available`` (one Ray node's free resources)."""
    return int(min(available.get(k, 0.0) / v + 1e-9 for k, v in bundle.items() if v > 0)) \
        if any(v > 0 for v in bundle.values()) else 0


def free_cluster(cluster: ClusterSpec, free_per_node: dict[str, dict[str, float]], emulate: bool,
                 cpus: float = 0.0, totals: dict[str, float] | None = None) -> ClusterSpec | None:
    """The part of ``cluster`` that is free now: each node with as many GPUs as its Ray node's
    free resources (``free_per_node``: Ray node id -> free resources) hold bundles of
    :func:`bundle_for` (``cpus`` loader CPUs each; ``totals``: the cluster's resources, which
    say whether ``gpu_<type>`` exists). A pinned node counts only its own Ray node; an unpinned
    one takes, in cluster order, the Ray node that offers the most GPUs of its bundle (a unit's
    GPUs must share a node), whose offer then shrinks by what it took. Nodes with no free GPU
    (and nodes still to launch, ``NodeSpec.launched``) are left out; None when no node has one."""
    left = {k: dict(v) for k, v in free_per_node.items()}
    nodes: list[NodeSpec] = []
    for n in cluster.nodes:
        if n.launched:   # a node still to launch has no free GPU
            continue
        bundle = bundle_for(n.gpu_type, emulate, totals, cpus)
        if n.ray_node_id is not None:
            where = n.ray_node_id if n.ray_node_id in left else None
        else:
            where = max(left, key=lambda k: gpus_offered(left[k], bundle), default=None)
        take = min(n.num_gpus, gpus_offered(left[where], bundle)) if where is not None else 0
        if take <= 0:
            continue
        for k, v in bundle.items():
            left[where][k] = left[where].get(k, 0.0) - take * v
        nodes.append(replace(n, num_gpus=take))
    return ClusterSpec(nodes=nodes) if nodes else None


def free_resources_per_node(settle_s: float = 10.0) -> dict[str, dict[str, float]]:
    """The free resources of every live Ray node, once they stopped changing (resources just
    released come back asynchronously): read every 0.5 s until two reads agree, at most
    ``settle_s``. Ray has no public per-node API for this (:mod:`.ray_internals`)."""
    import time

    from .ray_internals import available_resources_per_node

    t_end = time.monotonic() + settle_s
    last = available_resources_per_node()
    while time.monotonic() < t_end:
        time.sleep(0.5)
        now = available_resources_per_node()
        if now == last:
            break
        last = now
    alive = alive_ray_nodes()
    return {k: v for k, v in last.items() if k in alive}


@dataclass
class Placement:
    """Live actors of one placement (Ray handles, not serialised).

    ``actors[i]`` runs ``slots[i]``; ``pairs`` maps a pair key (node, local pair) to its placement
    group and its two actors (group 0, group 1), so a later placement can keep them.
    """

    slots: list[Slot]
    actors: list[Any]
    pairs: dict[tuple[str, int], tuple[Any, list[Any]]] = field(default_factory=dict)


def place_actors(slots: list[Slot], make_actor: Callable[[Slot, dict], Any], emulate: bool,
                 timeout_s: float = 120.0, reuse: Placement | None = None, cpus: float = 0.0
                 ) -> tuple[Placement, list[int]]:
    """Start one actor per slot, one placement group per pair; keep the pairs of ``reuse`` that
    the new slots still use (their actors must then be set up again for their new slot) and
    release the others.

    ``make_actor(slot, options)`` must return ``ActorClass.options(**options).remote(...)``;
    ``options`` carries the resources and the placement-group scheduling strategy; every GPU's
    bundle also reserves ``cpus`` CPUs (its data-loader workers), which its actor holds.
    Returns the placement and the ranks whose actors are new. Raises
    :class:`~jabasray.errors.PlacementTimeout` when the resources do not appear within
    ``timeout_s``, or :class:`~jabasray.errors.NodesGone` at once (before anything changed) when
    a slot is pinned to a Ray node that is not alive.

    Pinned slots (``Slot.ray_node_id``, clusters detected from Ray): the pair's placement group
    asks for that node through the label ``ray.io/node-id`` of every bundle, so the actors land
    on the node the allocation names even when other nodes offer the same resources.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    available = ray.cluster_resources()
    pinned = {s.ray_node_id for s in slots if s.ray_node_id}
    if pinned:
        gone = pinned - alive_ray_nodes()
        if gone:
            names = sorted({s.node for s in slots if s.ray_node_id in gone})
            raise NodesGone(f"node(s) {names} left the Ray cluster (Ray node ids "
                            f"{sorted(g[:8] for g in gone)})", sorted(gone))
    wanted: dict[tuple[str, int], list[Slot]] = {}
    for s in slots:
        wanted.setdefault(s.pair_key, []).append(s)
    old = dict(reuse.pairs) if reuse is not None else {}
    for key in [k for k in old if k not in wanted]:
        _release_pair(*old.pop(key))
    pairs: dict[tuple[str, int], tuple[Any, list[Any]]] = {}
    new_ranks: list[int] = []
    created: list[tuple[Any, list[Any]]] = []
    try:
        for key, pair_slots in wanted.items():
            if key in old and len(old[key][1]) == len(pair_slots):
                pairs[key] = old.pop(key)
                continue
            if key in old:    # a solo GPU became a pair or a pair a solo GPU: new actors
                _release_pair(*old.pop(key))
            pair_slots = sorted(pair_slots, key=lambda s: s.group)
            launch_s = pair_slots[0].launch_s   # a node still to launch: its resource, its wait
            avail = {**available, resource_name(pair_slots[0].gpu_type): 1.0} \
                if launch_s is not None else available
            bundles, selector = pair_request(pair_slots, emulate, avail, cpus)
            pg = placement_group(bundles, strategy="STRICT_PACK", bundle_label_selector=selector)
            created.append((pg, []))
            try:
                ray.get(pg.ready(), timeout=timeout_s + (launch_s or 0.0))
            except ray.exceptions.GetTimeoutError:
                raise PlacementTimeout(placement_timeout_message(
                    key[0], pair_slots[0].ray_node_id, bundles, timeout_s,
                    ray.available_resources())) from None
            actors = []
            for i, s in enumerate(pair_slots):
                bundle = bundles[i]
                opts = dict(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                            resources={k: v for k, v in bundle.items() if k not in ("GPU", "CPU")},
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                placement_group=pg, placement_group_bundle_index=i))
                actors.append(make_actor(s, opts))
                created[-1][1].append(actors[-1])
                new_ranks.append(s.rank)
            pairs[key] = (pg, actors)
    except BaseException:
        for pg, actors in created:
            _release_pair(pg, actors)
        raise
    actors = [pairs[s.pair_key][1][max(s.group, 0)] for s in slots]
    return Placement(slots=list(slots), actors=actors, pairs=pairs), sorted(new_ranks)


def _release_pair(pg: Any, actors: list[Any]) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already dead
            pass
    try:
        remove_placement_group(pg)
    except Exception:  # pragma: no cover
        pass


def release(placement: Placement | None) -> None:
    """Kill the actors of a placement and free its placement groups (never waits on them)."""
    if placement is None:
        return
    for pg, actors in placement.pairs.values():
        _release_pair(pg, actors)
    placement.pairs = {}
    placement.actors = []
