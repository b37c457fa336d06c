"""What the cluster can provide: the auto-scaler's candidate nodes, and what the job asks Ray for.

The driver asks this module, as it asks the planners, at the start and at every epoch end
(:class:`ClusterView`); the rules:

1. **Live nodes.** A job whose cluster follows Ray (``ClusterSpec.follow_ray``: the cluster
   :func:`.placement.ray_cluster_spec` detects, ``--cluster ray``; or a spec that lists
   ``node_types``) plans with the GPU nodes alive *now* (``ray.nodes()`` through
   :meth:`jabasray.types.ClusterSpec.from_ray`), read again at every epoch end: a node that
   joined (added by hand, or launched by Ray's autoscaler) is a candidate of the next
   allocation, a node that left is not. A live node keeps the name and the place in the
   cluster's node order it had when first seen (the given spec's name, ``<Ray node
   id[:8]>-<type>``, or the name of the launchable node it was launched for, read from its
   placement groups), so an allocation that stays on it keeps its ranks and actors. Speed,
   memory and TFLOPS of a GPU type come from the given spec's nodes or node types of that type;
   nodes of a GPU type the job's model has no profile of are left out (:func:`only_types`).
   Any other spec - a hand-written one, or a part of a detected one - is used as given (the
   cluster a job was given bounds what it uses: :mod:`.reconcile`; nothing joins).
2. **Launchable nodes.** ``ClusterSpec.node_types`` (:class:`jabasray.types.NodeType`: name,
   GPU type, GPUs per node, ``max_workers``, TFLOPS as the price of Eq. 8, memory, ``launch_s``)
   say what Ray's autoscaler can launch. Ray 2.60 offers no public API that tells a running
   driver its autoscaler's node types: ``ray.autoscaler.v2.sdk.get_cluster_status()`` lists
   live, pending and failed nodes only, and the GCS key the autoscaler v2 ``ClusterConfig``
   would live under is private (``ray._private.state``) and empty with the open-source
   monitor (v1 and v2 alike) - so the user gives them, in the cluster file's ``node_types:``
   section. A type contributes ``max_workers`` minus its live nodes (same GPU type and count)
   launchable nodes, named ``<type>+<i>``, with ``ray_node_id`` None and ``launch_s`` set
   (:attr:`jabasray.types.NodeSpec.launched`): placement asks for their ``gpu_<type>``
   resource on any node and waits ``launch_s`` longer for it; they are never "free" GPUs when a
   placement times out (:func:`.placement.free_cluster`).
3. **Launch charge.** A candidate allocation that uses launchable nodes is charged the longest
   of their ``launch_s`` (default :data:`jabasray.types.DEFAULT_LAUNCH_S`, 120 s) on top of its
   epoch time and the re-placement charge, in one place:
   :meth:`jabasray.planners.autoscale.Allocation.launch_s` (module notes of
   :mod:`jabasray.planners.autoscale`, "Launch charge").
4. **Requests.** Before every placement (at the start and after every decision) the job asks Ray's autoscaler for the
   chosen allocation's placement bundles (:func:`request_bundles`: one
   :func:`.placement.bundle_for` per GPU, the bundles its actors' placement groups ask for)
   through ``ray.autoscaler.sdk.request_resources(bundles=...)``; each request replaces the
   previous one, so a job that shrinks lowers it and the autoscaler may let the unused nodes go
   after its idle timeout. When the run ends or fails the request is cleared
   (``request_resources(bundles=[])``). The request is one per Ray cluster (the last caller's
   wins): two jobs that provision on one cluster overwrite each other's floor.
5. **Draining nodes.** A node that drains (a drain request to Ray's GCS: a spot node's
   preemption notice, a scale-down; :func:`.ray_internals.draining_nodes`) is read after every
   interval (:meth:`ClusterView.draining`, one GCS call). While it drains it is no candidate
   (rule 1 leaves it out), and the driver leaves it mid-epoch before it goes: a mid-epoch
   checkpoint, the allocation chosen again without it, the actors re-placed, the epoch
   continued from its cursor (:meth:`jabasray.actors.driver.JabasDriver.run`).
6. **GPU-hours held.** What a job pays for is the nodes held, not the GPUs its actors use: a
   node's every GPU from when it starts until it ends, idle ones and the autoscaler's idle
   timeout included. For a job that follows Ray these are the lifetimes the GCS records of
   every GPU node (:func:`.ray_internals.node_lifetimes`: the raylet's start, the GCS's end;
   on a cluster shared with other jobs, theirs too), so a node that joins or goes between two
   reads of the driver is counted to the millisecond, not from the next read. A node launched
   for the job's request is paid from the request instead (a cloud bills a node from its
   launch, not from its raylet's start): :func:`match_launches` pairs each launch asked for
   with the first node of its GPU type and count that started after the request, and a launch
   not joined yet is held from its request on. For any other spec: the nodes it lists, held
   throughout. The driver asks at every epoch end for the epoch's window
   (:meth:`ClusterView.held_seconds`, :func:`held_gpu_seconds`), and when the run ends for the
   whole run (:meth:`ClusterView.held_in_run`, :func:`held_parts`): from the run's start
   (:meth:`jabasray.actors.driver.JabasDriver.run`, before profiling) to its end (the actors
   gone, the request cleared), in parts that sum to it exactly - before the first epoch, the
   epochs' own figures, between epochs (decisions, checkpoints, an epoch redone after a
   failure), after the last epoch. Not counted: what the nodes launched for the job are held
   after the run's end, until Ray's autoscaler removes them (its idle timeout, a setting of the
   cluster's autoscaler config the driver cannot read, and the job has ended by then); the
   figure says how many of their GPUs were still alive at the end, so that tail is their GPUs
   times the time they take to go.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from ..types import ClusterSpec, NodeSpec, NodeType
from .placement import bundle_for, resource_name, slots_for

log = logging.getLogger(__name__)


def follows_ray(cluster: ClusterSpec) -> bool:
    """Whether a job given ``cluster`` plans with the live Ray nodes (module rule 1): detected
    from Ray (``follow_ray``), or node types listed."""
    return bool(cluster.node_types) or cluster.follow_ray


def type_figures(cluster: ClusterSpec) -> dict[str, dict[str, Any]]:
    """Per GPU type, the user's figures of it (speed, memory, TFLOPS): from its node types,
    then its nodes (a node's figures win)."""
    out: dict[str, dict[str, Any]] = {}
    for t in cluster.node_types:
        out[t.gpu_type] = dict(speed=t.speed, memory_gb=t.memory_gb, tflops=t.tflops)
    for n in cluster.nodes:
        out[n.gpu_type] = dict(speed=n.speed, memory_gb=n.memory_gb, tflops=n.tflops)
    return out


def live_nodes(ray_nodes: list[dict], figures: dict[str, dict[str, Any]],
               names: dict[str, str] | None = None) -> list[NodeSpec]:
    """The alive GPU nodes of ``ray_nodes`` (``ray.nodes()`` records) as pinned NodeSpecs with
    the user's ``figures`` per GPU type; ``names``: Ray node id -> the name a node keeps (the
    name it had when first seen, or of the launchable node it was launched for; a new node
    whose default name is taken is named by its whole id), kept ones in the order of ``names``.
    Empty when no alive node has GPUs."""
    try:
        spec = ClusterSpec.from_ray(ray_nodes)
    except ValueError:   # no alive GPU node
        return []
    names = names or {}
    kept = set(names.values())
    out = []
    for n in spec.nodes:
        fig = figures.get(n.gpu_type, {})
        name = names.get(n.ray_node_id or "")
        if name is None:   # a node not seen before: its own name, unless a kept one has it
            name = n.name if n.name not in kept else f"{n.ray_node_id}-{n.gpu_type}"
        out.append(replace(n, name=name,
                           speed=float(fig.get("speed", n.speed)),
                           memory_gb=float(fig.get("memory_gb", n.memory_gb)),
                           tflops=fig.get("tflops")))
    # kept nodes in the order they were first seen, new ones after (ray.nodes() has no fixed
    # order; the ranks of an allocation follow the cluster's node order)
    seen = {name: i for i, name in enumerate(names.values())}
    return sorted(out, key=lambda n: (0, seen[n.name]) if n.name in seen else (1, 0))


def launchable_nodes(node_types: list[NodeType], live: list[NodeSpec],
                     taken: set[str] = frozenset()) -> list[NodeSpec]:
    """Per node type, ``max_workers`` minus its live nodes (each live node counted against the
    first type of its GPU type and count) launchable nodes (:meth:`NodeType.node`), numbered
    past the names in ``taken``."""
    claimed: set[int] = set()
    out: list[NodeSpec] = []
    names = set(taken) | {n.name for n in live}
    for t in node_types:
        running = [i for i, n in enumerate(live) if i not in claimed
                   and n.gpu_type == t.gpu_type and n.num_gpus == t.num_gpus][:t.max_workers]
        claimed.update(running)
        index = 0
        for _ in range(t.max_workers - len(running)):
            while f"{t.name}+{index}" in names:
                index += 1
            node = t.node(index)
            names.add(node.name)
            out.append(node)
    return out


def candidate_cluster(given: ClusterSpec, ray_nodes: list[dict] | None,
                      names: dict[str, str] | None = None) -> ClusterSpec | None:
    """The nodes the auto-scaler may choose from (module rules 1-2; pure: ``ray_nodes`` is
    ``ray.nodes()``): the live GPU nodes (or, for a spec that does not follow Ray, its own
    nodes) then the launchable nodes of ``given.node_types``. ``names``: Ray node id -> name
    kept from earlier use. None when there is no node at all."""
    if not follows_ray(given):
        return given
    live = live_nodes(ray_nodes or [], type_figures(given), names)
    nodes = live + launchable_nodes(given.node_types, live, set((names or {}).values()))
    return ClusterSpec(nodes=nodes, node_types=list(given.node_types)) if nodes else None


def only_types(cluster: ClusterSpec, gpu_types: Any) -> tuple[ClusterSpec | None, list[str]]:
    """``cluster`` without the nodes whose GPU type is not in ``gpu_types`` (types the job's
    iteration-time model has no profile of; None: every type is kept), and the names left out."""
    if gpu_types is None:
        return cluster, []
    keep = [n for n in cluster.nodes if n.gpu_type in gpu_types]
    dropped = [n.name for n in cluster.nodes if n.gpu_type not in gpu_types]
    return (replace(cluster, nodes=keep) if keep else None), dropped


def request_bundles(cluster: ClusterSpec, allocation: dict[str, int], emulate: bool,
                    available: dict[str, float] | None = None, cpus: float = 0.0
                    ) -> list[dict[str, float]]:
    """The placement bundles of ``allocation`` on ``cluster``, one per GPU, as its actors ask
    for them (:func:`.placement.bundle_for` with the cluster's ``available`` resources and
    ``cpus`` loader CPUs; a node still to launch always by its ``gpu_<type>`` resource)."""
    out = []
    for s in slots_for(cluster, allocation):
        avail = available
        if s.launch_s is not None and avail is not None:
            avail = {**avail, resource_name(s.gpu_type): 1.0}
        out.append(bundle_for(s.gpu_type, emulate, avail, cpus))
    return out


def request_resources(bundles: list[dict[str, float]]) -> None:
    """Ask Ray's autoscaler to keep ``bundles`` in the cluster (replaces the previous request;
    [] clears it). Never raises: a cluster without an autoscaler ignores the request."""
    try:
        from ray.autoscaler.sdk import request_resources as ray_request
        ray_request(bundles=[dict(b) for b in bundles])
    except Exception as e:  # noqa: BLE001 - a request that fails must not stop training
        log.warning("could not ask Ray's autoscaler for %d bundle(s): %s", len(bundles), e)


def placed_nodes(placement: Any) -> dict[str, str]:
    """``{Ray node id: node name}`` of the launchable nodes a placement's actors run on (read
    from its placement groups, ``ray.util.placement_group_table``): the live node keeps the name
    the allocation knows it by (module rule 1)."""
    if placement is None:
        return {}
    from ray.util.placement_group import placement_group_table

    out: dict[str, str] = {}
    for (name, _), (pg, _) in placement.pairs.items():
        slot = next((s for s in placement.slots if s.node == name), None)
        if slot is None or slot.launch_s is None:
            continue
        try:
            where = placement_group_table(pg).get("bundles_to_node_id", {})
        except Exception:  # noqa: BLE001 - a removed group: nothing to keep
            continue
        for node_id in where.values():
            out[str(node_id)] = name
    return out


@dataclass(frozen=True)
class NodeLife:
    """One GPU node's lifetime (unix seconds) and GPUs, per GPU type it carries."""

    node_id: str
    gpu_type: str
    num_gpus: int
    start_s: float
    end_s: float | None   # None: alive


@dataclass(frozen=True)
class Launch:
    """A node the job's request asked Ray's autoscaler to launch, and when (unix seconds)."""

    gpu_type: str
    num_gpus: int
    asked_s: float


def node_lives(records: list[dict]) -> list[NodeLife]:
    """The GPU nodes of :func:`.ray_internals.node_lifetimes` records, one per node and GPU
    type (GPU types and counts as :meth:`jabasray.types.ClusterSpec.from_ray` reads them)."""
    out = []
    for r in records:
        as_ray = {"NodeID": r["node_id"], "Alive": True, "Resources": r.get("resources", {}),
                  "Labels": r.get("labels", {})}
        try:
            spec = ClusterSpec.from_ray([as_ray])
        except ValueError:   # no GPU on this node (a head, a CPU node)
            continue
        out += [NodeLife(r["node_id"], n.gpu_type, n.num_gpus, float(r["start_s"]),
                         None if r.get("end_s") is None else float(r["end_s"])) for n in spec.nodes]
    return out


def match_launches(lives: list[NodeLife], launches: list[Launch], paid_from: dict[str, float]
                   ) -> tuple[dict[str, float], list[Launch]]:
    """Pair launches with the nodes they brought (module rule 6): in the order asked, each
    launch takes the earliest-started node of its GPU type and count that started at or after
    the request and is not paired yet. Returns ``paid_from`` with the new pairs (node id -> the
    request's time, from which the node is paid) and the launches no node answers yet."""
    paid = dict(paid_from)
    pending = []
    for launch in sorted(launches, key=lambda x: x.asked_s):
        joined = [n for n in lives if n.node_id not in paid and n.gpu_type == launch.gpu_type
                  and n.num_gpus == launch.num_gpus and n.start_s >= launch.asked_s]
        if joined:
            paid[min(joined, key=lambda n: n.start_s).node_id] = launch.asked_s
        else:
            pending.append(launch)
    return paid, pending


def held_gpu_seconds(lives: list[NodeLife], t0: float, t1: float,
                     paid_from: dict[str, float] | None = None, pending: list[Launch] = ()) -> float:
    """GPU-seconds held in the window [t0, t1] (module rule 6; pure):

        sum over nodes n of  g_n * |[a_n, e_n) ∩ [t0, t1]|  +  sum over launches l of  g_l * |[a_l, t1] ∩ [t0, t1]|

    with g the GPUs, a_n the node's start (``paid_from[n]``, its request's time, for a node
    launched for the job), e_n its end (t1 while alive) and a_l the time a launch not joined
    yet was asked for."""
    paid_from = paid_from or {}

    def overlap(a: float, b: float) -> float:
        return max(0.0, min(b, t1) - max(a, t0))

    total = sum(n.num_gpus * overlap(paid_from.get(n.node_id, n.start_s),
                                     t1 if n.end_s is None else n.end_s) for n in lives)
    return total + sum(x.num_gpus * overlap(x.asked_s, t1) for x in pending)


HELD_PARTS = ("before_first_epoch", "inside_epochs", "between_epochs", "after_last_epoch")


def held_parts(held: Callable[[float, float], float], start_s: float, end_s: float,
               epochs: Sequence[tuple[float, float, float | None]]) -> dict[str, float]:
    """The GPU-seconds held over a run from unix time ``start_s`` to ``end_s`` (module rule 6),
    split at the epochs' windows; ``held(t0, t1)``: the GPU-seconds held in a window
    (:func:`held_gpu_seconds` over one read of the lifetimes), ``epochs``: each epoch's window
    ``(t0, t1)`` in run order with the figure recorded at its end (None: ``held(t0, t1)``)::

        before_first_epoch = held(start_s, t0 of the first epoch)
        inside_epochs      = sum over epochs of their figures
        between_epochs     = sum over consecutive epochs i, i+1 of held(t1 of i, t0 of i+1)
        after_last_epoch   = held(t1 of the last epoch, end_s)
        total              = before_first_epoch + inside_epochs + between_epochs + after_last_epoch

    (:data:`HELD_PARTS`, then ``total``: their sum in this order). Without an epoch the run is
    all ``before_first_epoch``."""
    if not epochs:
        parts = {**dict.fromkeys(HELD_PARTS, 0.0), "before_first_epoch": held(start_s, end_s)}
    else:
        parts = {"before_first_epoch": held(start_s, epochs[0][0]),
                 "inside_epochs": sum(held(t0, t1) if got is None else got for t0, t1, got in epochs),
                 "between_epochs": sum((held(a[1], b[0]) for a, b in zip(epochs, epochs[1:])), 0.0),
                 "after_last_epoch": held(epochs[-1][1], end_s)}
    parts["total"] = sum((parts[k] for k in HELD_PARTS), 0.0)
    return parts


class ClusterView:
    """The driver's view of what the cluster can provide (module notes).

    Args:
        given: the cluster the job was given (its node types, its figures per GPU type).
        emulate: GPUs emulated by ``gpu_<type>`` resources (``DriverOptions.emulate``).
        cpus: loader CPUs each GPU's bundle reserves (``DriverOptions``/hooks).
    """

    def __init__(self, given: ClusterSpec, emulate: bool, cpus: float = 0.0) -> None:
        self.given, self.emulate, self.cpus = given, emulate, float(cpus)
        # Ray node id -> the name it keeps: the given spec's pinned nodes first, in its order,
        # then nodes as first seen (a launched node: the candidate's name it was launched for)
        self.names: dict[str, str] = {n.ray_node_id: n.name for n in given.nodes if n.ray_node_id}
        self.requested: list[dict[str, float]] | None = None   # the last request (None: none)
        self._unknown: list[str] = []   # nodes last left out for a GPU type without a profile
        self.leaving: dict[str, float | None] = {}   # draining Ray node id -> its deadline (unix s)
        self.launches: list[Launch] = []   # nodes the last request asked to launch, not joined yet
        self.paid_from: dict[str, float] = {}   # Ray node id -> its request's time (rule 6)

    @property
    def follows_ray(self) -> bool:
        return follows_ray(self.given)

    def candidates(self, placement: Any = None) -> ClusterSpec | None:
        """The candidate cluster now (:func:`candidate_cluster` over ``ray.nodes()``); the
        launchable nodes ``placement`` runs on keep their names once live. None without Ray
        (or without any node)."""
        if not self.follows_ray:
            return self.given
        import ray

        if not ray.is_initialized():   # a driver tested without Ray: nothing to read
            return None
        self.names.update(placed_nodes(placement))
        nodes = [n for n in ray.nodes() if n.get("NodeID") not in self.leaving]   # rule 5
        cluster = candidate_cluster(self.given, nodes, self.names)
        for n in cluster.nodes if cluster is not None else []:   # a live node keeps its name
            if n.ray_node_id is not None:
                self.names.setdefault(n.ray_node_id, n.name)
        return cluster

    def refresh(self, current: ClusterSpec, placement: Any = None, gpu_types: Any = None
                ) -> tuple[ClusterSpec | None, list[str]]:
        """The candidates at an epoch end (:meth:`candidates`) without the nodes of GPU types
        not in ``gpu_types`` (those the job's model has profiles of; None: all), and the lines
        that say what changed since ``current`` (the nodes offered; nodes left out, said once
        per change). None (and no line) when the cluster does not follow Ray or has no node."""
        cluster = self.candidates(placement) if self.follows_ray else None
        if cluster is None:
            return None, []
        cluster, unknown = only_types(cluster, gpu_types)
        notes = []
        if unknown and unknown != self._unknown:
            notes.append(f"node(s) {unknown} are not candidates: their GPU type has no profile "
                         f"(restart the run, or pass profiles, to use them)")
        self._unknown = unknown
        if cluster is None:
            return None, notes
        before = {n.name: n.num_gpus for n in current.nodes}
        after = {n.name: n.num_gpus for n in cluster.nodes}
        if before != after:
            notes.append(f"the cluster offers {after} (was {before}; '<type>+<i>': nodes Ray's "
                         f"autoscaler can launch)")
        return cluster, notes

    def request(self, cluster: ClusterSpec, allocation: dict[str, int]) -> list[dict[str, float]]:
        """Ask Ray's autoscaler for ``allocation``'s bundles (module rule 4); returns them."""
        import ray

        if not ray.is_initialized():   # a driver tested without Ray: no autoscaler to ask
            return []
        try:
            bundles = request_bundles(cluster, allocation, self.emulate, ray.cluster_resources(),
                                      self.cpus)
        except ValueError as e:   # an allocation of nodes the cluster no longer has
            log.warning("no request to Ray's autoscaler for allocation %s: %s", allocation, e)
            return []
        if bundles != self.requested:
            now = time.time()
            request_resources(bundles)
            self.requested = bundles
            # a launch asked for again keeps the time it was first asked for (still pending)
            before = {}
            for x in self.launches:
                before.setdefault((x.gpu_type, x.num_gpus), []).append(x.asked_s)
            self.launches = []
            for n in cluster.nodes:
                if n.launched and allocation.get(n.name):
                    earlier = before.get((n.gpu_type, n.num_gpus))
                    self.launches.append(Launch(n.gpu_type, n.num_gpus, earlier.pop(0) if earlier else now))
        return bundles

    def draining(self, placement: Any) -> dict[str, float | None]:
        """The nodes ``placement`` runs on that drain now (module rule 5): ``{node name: unix
        time it goes by (None: no deadline)}``; {} without Ray, or when the GCS cannot say."""
        import ray

        from .ray_internals import RayInternalsError, draining_nodes

        if placement is None or not ray.is_initialized():
            return {}
        try:
            self.leaving = draining_nodes()
        except RayInternalsError:
            raise
        except Exception as e:  # noqa: BLE001 - an unanswered poll must not stop training
            log.warning("could not read the draining nodes from Ray's GCS: %s", e)
            return {}
        if not self.leaving:
            return {}
        where = {**self.names, **placed_nodes(placement)}
        where.update({s.ray_node_id: s.node for s in placement.slots if s.ray_node_id})
        used = {s.node for s in placement.slots}
        return {where[i]: t for i, t in self.leaving.items() if where.get(i) in used}

    def _lives(self) -> list[NodeLife] | None:
        """One read of the GPU nodes' lifetimes from Ray's GCS, the launches asked for paired
        with the nodes they brought (module rule 6); None when the GCS cannot say (logged)."""
        from .ray_internals import RayInternalsError, node_lifetimes

        try:
            lives = node_lives(node_lifetimes())
        except RayInternalsError:
            raise
        except Exception as e:  # noqa: BLE001 - an unanswered read must not stop training
            log.warning("could not read the nodes' lifetimes from Ray's GCS: %s", e)
            return None
        self.paid_from, self.launches = match_launches(lives, self.launches, self.paid_from)
        return lives

    def _held(self, current: ClusterSpec) -> tuple[Callable[[float, float], float] | None,
                                                   list[NodeLife]]:
        """GPU-seconds held in a window as a function of its start and end (module rule 6),
        over one read of the lifetimes for a job that follows Ray (and the lives read), else
        every GPU of ``current``'s nodes throughout (no lives); None when the GCS cannot say."""
        if self.follows_ray:
            import ray

            if ray.is_initialized():
                lives = self._lives()
                if lives is None:
                    return None, []
                paid, pending = dict(self.paid_from), list(self.launches)
                return (lambda t0, t1: held_gpu_seconds(lives, t0, t1, paid, pending)), lives
        gpus = sum(n.num_gpus for n in current.nodes)
        return (lambda t0, t1: gpus * max(0.0, t1 - t0)), []

    def held_seconds(self, current: ClusterSpec, t0: float, t1: float) -> float | None:
        """GPU-seconds held from unix time ``t0`` to ``t1`` (module rule 6): from the nodes'
        lifetimes for a job that follows Ray, else every GPU of ``current``'s nodes throughout.
        None when the GCS cannot say (logged)."""
        held, _ = self._held(current)
        return None if held is None else held(t0, t1)

    def held_in_run(self, current: ClusterSpec, start_s: float, end_s: float,
                    epochs: Sequence[tuple[float, float, float | None]]
                    ) -> tuple[dict[str, float], int] | None:
        """The GPU-seconds held over a run from unix time ``start_s`` to ``end_s``, in parts
        (:func:`held_parts` over one read of the lifetimes, as :meth:`held_seconds`), and the
        GPUs of the nodes launched for the job still alive at the read (held on after the run
        until Ray's autoscaler removes them: not counted, module rule 6). None when the GCS
        cannot say (logged)."""
        held, lives = self._held(current)
        if held is None:
            return None
        alive = sum(n.num_gpus for n in lives if n.node_id in self.paid_from and n.end_s is None)
        return held_parts(held, start_s, end_s, epochs), alive

    def release(self) -> None:
        """Clear this job's request (the run ended or failed)."""
        if self.requested is not None:
            request_resources([])
            self.requested = None
        self.launches = []   # nothing more is launched for this job


__all__ = ["ClusterView", "HELD_PARTS", "Launch", "NodeLife", "candidate_cluster", "held_gpu_seconds",
           "held_parts", "match_launches", "node_lives", "follows_ray", "launchable_nodes", "live_nodes", "only_types",
           "placed_nodes", "request_bundles", "request_resources", "type_figures"]
