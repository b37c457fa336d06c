"""Reconciliation of a remembered cluster with the live one (jabasray.actors.reconcile) and the
placement-timeout line: pure functions, no Ray."""
from __future__ import annotations

import itertools

import pytest

from jabasray.actors.placement import missing_resources, placement_timeout_message
from jabasray.actors.reconcile import reconcile, remap_allocation, same_shape
from jabasray.types import ClusterSpec, NodeSpec


def node(nid: str, gpu: str, n: int, speed: float = 1.0, pinned: bool = True) -> NodeSpec:
    return NodeSpec(f"{nid[:8]}-{gpu}", gpu, n, speed=speed, ray_node_id=nid if pinned else None)


def test_cluster_restart_maps_every_node_by_type_and_count():
    """All ids new: each old node goes to the live node of its type with its GPU count (not the
    first of its type), keeps its speed, and the allocation follows the renaming."""
    old = ClusterSpec(nodes=[node("aaaa0000", "fast", 4, 2.0), node("bbbb0000", "fast", 2, 2.0),
                             node("cccc0000", "slow", 2, 0.5)])
    live = ClusterSpec(nodes=[node("dddd0000", "fast", 2), node("eeee0000", "slow", 2),
                              node("ffff0000", "fast", 4)])
    got, rename, notes = reconcile(old, live)
    assert rename == {"aaaa0000-fast": "ffff0000-fast", "bbbb0000-fast": "dddd0000-fast",
                      "cccc0000-slow": "eeee0000-slow"}
    assert [(n.name, n.ray_node_id, n.num_gpus, n.speed) for n in got.nodes] == [
        ("ffff0000-fast", "ffff0000", 4, 2.0), ("dddd0000-fast", "dddd0000", 2, 2.0),
        ("eeee0000-slow", "eeee0000", 2, 0.5)]
    assert len(notes) == 3 and all("-> live node" in n for n in notes)
    assert same_shape(old, got, rename)
    alloc = {"aaaa0000-fast": 2, "cccc0000-slow": 1}
    assert remap_allocation(alloc, rename, got) == {"ffff0000-fast": 2, "eeee0000-slow": 1}


def test_a_live_node_keeps_its_id_and_the_remembered_count():
    """The same raylet alive: kept (rule 1) even when another live node of its type has exactly
    its count; a node reduced by failures keeps its reduced count; a dead one without a
    stand-in is left out and the allocation naming it cannot be kept."""
    old = ClusterSpec(nodes=[node("aaaa0000", "fast", 2), node("bbbb0000", "slow", 2)])
    live = ClusterSpec(nodes=[node("cccc0000", "fast", 2), node("aaaa0000", "fast", 4)])
    got, rename, notes = reconcile(old, live)
    assert [(n.name, n.num_gpus) for n in got.nodes] == [("aaaa0000-fast", 2)]
    assert rename == {"aaaa0000-fast": "aaaa0000-fast"}
    assert notes == ["node bbbb0000-slow (2x slow) is not in the live cluster: left out"]
    assert not same_shape(old, got, rename)
    assert remap_allocation({"aaaa0000-fast": 1, "bbbb0000-slow": 1}, rename, got) is None
    assert remap_allocation({"aaaa0000-fast": 1}, rename, got) == {"aaaa0000-fast": 1}


def test_unpinned_specs_match_by_name_only_and_an_identical_cluster_changes_nothing():
    spec = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2), NodeSpec("n1", "slow", 2)])
    got, rename, notes = reconcile(spec, spec)
    assert got == spec and rename == {"n0": "n0", "n1": "n1"} and notes == []
    other = ClusterSpec(nodes=[NodeSpec("m0", "fast", 2)])
    got, rename, notes = reconcile(spec, other)
    assert got is None and rename == {} and len(notes) == 2


def test_fewer_gpus_on_the_stand_in_shrink_the_node_and_the_allocation_is_rechosen():
    old = ClusterSpec(nodes=[node("aaaa0000", "fast", 4)])
    live = ClusterSpec(nodes=[node("bbbb0000", "fast", 2)])
    got, rename, _ = reconcile(old, live)
    assert [(n.name, n.num_gpus) for n in got.nodes] == [("bbbb0000-fast", 2)]
    assert remap_allocation({"aaaa0000-fast": 4}, rename, got) is None      # allocations count GPUs
    assert remap_allocation({"aaaa0000-fast": 2}, rename, got) == {"bbbb0000-fast": 2}


@pytest.mark.parametrize("seed", range(40))
def test_matching_is_a_most_exact_assignment_exhaustively(seed):
    """Small random clusters, all ids new: the number of remembered nodes mapped to a live node
    of the same type and exactly the same count equals the best possible over every assignment
    (brute force), and no live node is used twice."""
    import random
    rng = random.Random(seed)
    types, counts = ["a", "b"], [2, 4]
    old = ClusterSpec(nodes=[node(f"o{i:07d}", rng.choice(types), rng.choice(counts)) for i in range(4)])
    live = ClusterSpec(nodes=[node(f"l{i:07d}", rng.choice(types), rng.choice(counts)) for i in range(4)])
    got, rename, _ = reconcile(old, live)
    assert len(set(rename.values())) == len(rename)
    live_by = {n.name: n for n in live.nodes}
    exact = sum(live_by[rename[o.name]].num_gpus == o.num_gpus for o in old.nodes if o.name in rename)
    best = max(sum(o.gpu_type == live.nodes[j].gpu_type and o.num_gpus == live.nodes[j].num_gpus
                   for o, j in zip(old.nodes, perm)) for perm in itertools.permutations(range(4)))
    assert exact == best
    # every type keeps as many nodes as both sides have of it
    for t in types:
        assert sum(n.gpu_type == t for n in (got.nodes if got else [])) == min(
            sum(n.gpu_type == t for n in old.nodes), sum(n.gpu_type == t for n in live.nodes))


def test_placement_timeout_line_names_what_is_missing():
    bundles = [{"gpu_fast": 1.0, "CPU": 2.0}, {"gpu_fast": 1.0, "CPU": 2.0}]
    assert missing_resources(bundles, {"gpu_fast": 2.0, "CPU": 1.0}) == {"CPU": 3.0}
    assert missing_resources(bundles, {"gpu_fast": 4.0, "CPU": 8.0}) == {}
    msg = placement_timeout_message("n0", "abcdef0123", bundles, 5, {"gpu_fast": 1.0})
    assert "\n" not in msg and "node n0" in msg and "abcdef01" in msg
    assert "missing {'CPU': 4.0, 'gpu_fast': 1.0}" in msg
    msg = placement_timeout_message("n0", None, bundles, 5, {"gpu_fast": 4.0, "CPU": 8.0})
    assert "not together on any one node" in msg
