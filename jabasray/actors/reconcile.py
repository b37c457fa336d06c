"""What the driver remembers about the cluster, reconciled with the live Ray cluster.

A ClusterSpec detected from Ray pins every node to a Ray node id (``NodeSpec.ray_node_id``).
Ids live only as long as their raylet: after a node restart, a cluster restart, or when a
checkpoint is resumed elsewhere, every id the driver kept (in its spec, in a checkpoint's
``DriverState``) may name nothing. So at every start, resume and driver restart the driver maps
what it remembers onto what is alive now (:func:`reconcile`), and a placement that finds a pinned
node gone re-plans on the live cluster instead of failing.

Matching (:func:`reconcile`): rule by rule, each remembered node still unmatched (in its order)
takes a live node not taken yet, of its GPU type, that the rule accepts:

1. the same Ray node id (the same raylet, still alive);
2. the same name (a spec that pins no node - not a detected cluster - matches by name only);
3. exactly the remembered GPU count; 4. more GPUs (the smallest such); 5. fewer (the largest):
   types and counts, never ids, say which machine can stand in for which.

A matched node keeps the remembered speed, memory and TFLOPS (the user's figures of that GPU
type) and takes the live node's name, id and ``min(remembered, live)`` GPUs. A remembered node
without a match is left out. Live nodes nobody remembers are not added: the cluster a job was
given bounds what it uses.

The allocation (``{node name: pairs}``) follows the renaming (:func:`remap_allocation`) when every
allocated node was matched with at least its pairs; otherwise the driver chooses it again.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from ..types import ClusterSpec, NodeSpec

log = logging.getLogger(__name__)


def _rules(node: NodeSpec, cand: NodeSpec, unpinned_spec: bool) -> list[bool]:
    """Whether ``cand`` matches ``node`` under each rule in order (module notes): the same raylet,
    the same name, the same count, more GPUs, fewer GPUs (all within the same GPU type)."""
    if cand.gpu_type != node.gpu_type:
        return [False] * 5
    if unpinned_spec:    # a spec that pins nothing (not a detected cluster): by name only
        return [False, cand.name == node.name, False, False, False]
    return [node.ray_node_id is not None and cand.ray_node_id == node.ray_node_id,
            cand.name == node.name, cand.num_gpus == node.num_gpus,
            cand.num_gpus > node.num_gpus, cand.num_gpus < node.num_gpus]


def _assign(remembered: list[NodeSpec], live: list[NodeSpec]) -> dict[int, int]:
    """``{remembered index: live index}``: rule by rule, every remembered node still unmatched
    takes the first free live node the rule accepts (more GPUs: the smallest such; fewer: the
    largest), so exact type-and-count matches are all made before any inexact one (a maximum
    number of them: within one (type, count) class any free node will do)."""
    unpinned = not any(n.ray_node_id for n in remembered) and not any(n.ray_node_id for n in live)
    out: dict[int, int] = {}
    for rule in range(5):
        for i, node in enumerate(remembered):
            if i in out:
                continue
            free = [j for j in range(len(live)) if j not in out.values()
                    and _rules(node, live[j], unpinned)[rule]]
            if rule == 3:
                free.sort(key=lambda j: live[j].num_gpus)
            elif rule == 4:
                free.sort(key=lambda j: -live[j].num_gpus)
            if free:
                out[i] = free[0]
    return out


def reconcile(remembered: ClusterSpec, live: ClusterSpec
              ) -> tuple[ClusterSpec | None, dict[str, str], list[str]]:
    """Map ``remembered`` onto ``live`` (module notes). Returns (the reconciled cluster, or None
    when no node matched; ``{remembered name: live name}`` of the matched nodes; one line per node
    that moved to another Ray node or was left out)."""
    match = _assign(list(remembered.nodes), list(live.nodes))
    nodes: list[NodeSpec] = []
    rename: dict[str, str] = {}
    notes: list[str] = []
    for i, node in enumerate(remembered.nodes):
        if i not in match:
            notes.append(f"node {node.name} ({node.num_gpus}x {node.gpu_type}) is not in the live "
                         f"cluster: left out")
            continue
        target = live.nodes[match[i]]
        nodes.append(replace(node, name=target.name, ray_node_id=target.ray_node_id,
                             num_gpus=min(node.num_gpus, target.num_gpus)))
        rename[node.name] = target.name
        if target.ray_node_id != node.ray_node_id or target.name != node.name:
            notes.append(f"node {node.name} ({node.num_gpus}x {node.gpu_type}) -> live node "
                         f"{target.name} ({target.num_gpus}x {target.gpu_type})")
    return (ClusterSpec(nodes=nodes) if nodes else None), rename, notes


def remap_allocation(allocation: dict[str, int], rename: dict[str, str],
                     cluster: ClusterSpec) -> dict[str, int] | None:
    """``allocation`` under the node names of ``cluster`` (``rename``: old -> new name), or None
    when an allocated node was not matched or has fewer GPUs than allocated now."""
    out: dict[str, int] = {}
    gpus = {n.name: n.num_gpus for n in cluster.nodes}
    for name, k in allocation.items():
        new = rename.get(name)
        if new is None or gpus.get(new, 0) < k:
            return None
        out[new] = k
    return out


def same_shape(a: ClusterSpec, b: ClusterSpec, rename: dict[str, str]) -> bool:
    """Whether ``b`` is ``a`` with its nodes renamed by ``rename`` (same nodes, in order, with the
    same GPU types and counts): a plan made on ``a`` holds on ``b``."""
    return len(a.nodes) == len(b.nodes) and all(
        rename.get(x.name) == y.name and (x.gpu_type, x.num_gpus) == (y.gpu_type, y.num_gpus)
        for x, y in zip(a.nodes, b.nodes))


def pinned(cluster: ClusterSpec) -> bool:
    """Whether any node of ``cluster`` is pinned to a Ray node id (a cluster detected from Ray)."""
    return any(n.ray_node_id is not None for n in cluster.nodes)


def live_ray_cluster() -> ClusterSpec | None:
    """The alive Ray nodes with GPUs (``ClusterSpec.from_ray(ray.nodes())``); None when none."""
    import ray
    try:
        return ClusterSpec.from_ray(ray.nodes())
    except ValueError:   # no alive node with GPUs
        return None


def reconcile_with_ray(remembered: ClusterSpec) -> tuple[ClusterSpec | None, dict[str, str], list[str]]:
    """:func:`reconcile` ``remembered`` with the live Ray cluster; a spec that pins no node is
    returned as it is (its nodes are placed wherever their resources are)."""
    if not pinned(remembered):
        return remembered, {n.name: n.name for n in remembered.nodes}, []
    live = live_ray_cluster()
    if live is None:
        return None, {}, [f"the live Ray cluster has no node with GPUs: none of "
                          f"{[n.name for n in remembered.nodes]} is left"]
    return reconcile(remembered, live)


__all__ = ["reconcile", "remap_allocation", "same_shape", "pinned", "live_ray_cluster",
           "reconcile_with_ray"]
