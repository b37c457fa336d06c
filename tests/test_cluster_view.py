"""What the cluster can provide (:mod:`jabasray.actors.cluster_view`), without Ray: live nodes
(``ray.nodes()`` records written out) merged with the node types Ray's autoscaler can launch into
the auto-scaler's candidates, the launch charge, and the bundles the job asks Ray for.

Proves: a spec that follows Ray plans with the alive GPU nodes, each with the user's figures of
its GPU type, then ``max_workers`` minus the live nodes of each type as launchable nodes (not
pinned, ``launch_s`` set); a node launched for a candidate keeps that candidate's name once live
and the launchable ones are numbered past it; a hand-written spec is used as given; the
``node_types:`` section of a cluster file; a candidate on launchable nodes is charged the
longest launch time on top of its epoch (and of the re-placement charge), exactly, so a launch
is chosen only when the epoch repays it; the request bundles name the ``gpu_<type>`` resource of
a node that is not there yet. The GPU-seconds held in a window are the GPU nodes' lifetimes
within it (checked slice by slice against the GPUs held at each instant), a node launched for
the job's request paid from the request, a launch not joined yet from its request on. Over a
whole run the GPU-seconds held split exactly into before the first epoch, the epochs, between
them and after the last (a node launched in start-up, one released after the last epoch, one
alive throughout, one launched for the job and never used), read from one set of lifetimes.
"""
from __future__ import annotations

import json

import pytest

from jabasray.actors.cluster_view import (candidate_cluster, follows_ray, launchable_nodes,
                                          request_bundles)
from jabasray.actors.placement import slots_for
from jabasray.planners.autoscale import Allocation, choose_allocation
from jabasray.planners.perf_model import PerfModel
from jabasray.profiler.profile import synthetic_profile
from jabasray.types import DEFAULT_LAUNCH_S, ClusterSpec, NodeSpec, NodeType


def ray_node(node_id: str, resources: dict, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, **resources}}


HEAD = ray_node("h" * 56, {})                                   # no GPUs: never a candidate
FAST = ray_node("f" * 56, {"gpu_fast": 2.0})
SLOW_DEAD = ray_node("d" * 56, {"gpu_slow": 2.0}, alive=False)
TYPES = [NodeType("fast2", "fast", 2, max_workers=2, speed=1.0, tflops=20.0, launch_s=30.0),
         NodeType("slow2", "slow", 2, max_workers=1, speed=0.5, tflops=8.0)]


def test_live_nodes_then_launchable_ones():
    given = ClusterSpec(nodes=[], node_types=TYPES)
    cl = candidate_cluster(given, [HEAD, FAST, SLOW_DEAD])
    assert [(n.name, n.gpu_type, n.num_gpus, n.ray_node_id is not None, n.launch_s) for n in cl.nodes] == [
        ("ffffffff-fast", "fast", 2, True, None),       # live: pinned, nothing to launch
        ("fast2+0", "fast", 2, False, 30.0),            # max 2 fast nodes, one is live
        ("slow2+0", "slow", 2, False, DEFAULT_LAUNCH_S)]   # the dead slow node does not count
    live = cl.nodes[0]
    assert (live.speed, live.tflops) == (1.0, 20.0)    # the user's figures of its GPU type
    assert not live.launched and cl.nodes[1].launched
    assert cl.node_types == TYPES


def test_a_launched_node_keeps_its_candidate_name():
    given = ClusterSpec(nodes=[], node_types=TYPES)
    cl = candidate_cluster(given, [HEAD, FAST], names={"f" * 56: "fast2+0"})
    assert [n.name for n in cl.nodes] == ["fast2+0", "fast2+1", "slow2+0"]
    assert cl.nodes[0].ray_node_id == "f" * 56 and cl.nodes[0].launch_s is None


def test_launchable_counts():
    live = [NodeSpec("a", "fast", 2, ray_node_id="x"), NodeSpec("b", "fast", 2, ray_node_id="y"),
            NodeSpec("c", "fast", 4, ray_node_id="z")]
    assert launchable_nodes(TYPES, live) == [TYPES[1].node(0)]   # fast2 full; 4-GPU node is no fast2
    assert [n.name for n in launchable_nodes([NodeType("t", "fast", 2, max_workers=0)], [])] == []


def test_which_specs_follow_ray():
    pinned = ClusterSpec(nodes=[NodeSpec("a", "fast", 2, ray_node_id="x")], follow_ray=True)
    by_hand = ClusterSpec(nodes=[NodeSpec("a", "fast", 2)])
    part = ClusterSpec(nodes=[NodeSpec("a", "fast", 1, ray_node_id="x")])   # a part of a detected one
    assert follows_ray(pinned) and not follows_ray(by_hand) and not follows_ray(part)
    assert follows_ray(ClusterSpec(nodes=[NodeSpec("a", "fast", 2)], node_types=TYPES))
    assert candidate_cluster(by_hand, [HEAD, FAST]) is by_hand       # used as given
    assert candidate_cluster(part, [HEAD, FAST]) is part
    grown = candidate_cluster(pinned, [HEAD, FAST])
    assert [n.name for n in grown.nodes] == ["ffffffff-fast"]       # the live nodes, now


def test_cluster_file_node_types(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"nodes": [{"name": "a", "gpu_type": "fast", "num_gpus": 2}],
                                "node_types": [{"name": "slow2", "gpu_type": "slow", "num_gpus": 2,
                                                "max_workers": 3, "tflops": 8.0, "launch_s": 60}]}))
    cl = ClusterSpec.from_file(path)
    assert cl.node_types == [NodeType("slow2", "slow", 2, max_workers=3, tflops=8.0, launch_s=60.0)]
    assert ClusterSpec.from_json(cl.to_json()) == cl
    only_types = ClusterSpec.from_mapping({"node_types": [{"gpu_type": "slow", "num_gpus": 2}]})
    assert only_types.nodes == [] and only_types.node_types[0].name == "type0"
    with pytest.raises(ValueError, match="node_types\\[0\\] has unknown field"):
        ClusterSpec.from_mapping({"node_types": [{"gpu_type": "s", "num_gpus": 2, "price": 1}]})
    with pytest.raises(ValueError, match="max_workers"):
        NodeType("t", "s", 2, max_workers=-1)
    with pytest.raises(ValueError, match="launch_s"):
        NodeType("t", "s", 2, launch_s=-1.0)


def model() -> PerfModel:
    base = synthetic_profile("gA", min_local_batch=8, num_batches=4)
    return PerfModel({"gA": base, "gB": base.scaled(0.25, "gB")})


def test_the_launch_is_charged_on_top_of_the_epoch_and_the_switch():
    """Live: 2 slow GPUs (gB); launchable: a node of 2 fast ones (gA). Every candidate that uses
    the launchable node is weighed at its epoch time + launch_s (+ the re-placement charge when
    it is not the current allocation); the choice is the best so weighed, for launch times below
    and above what the faster epoch saves."""
    def cluster(launch_s: float) -> ClusterSpec:
        return ClusterSpec(nodes=[NodeSpec("live", "gB", 2, ray_node_id="x"),
                                  NodeSpec("new", "gA", 2, launch_s=launch_s)])
    m, traj, n = model(), [64], 4096
    free = choose_allocation(cluster(0.0), m, traj, n, 4, 8, prune=False)
    times = {tuple(sorted(c.allocation.node_gpus.items())): c.epoch_time for c in free.candidates}
    assert free.allocation.node_gpus.get("new")          # launched for nothing: the fast node pays
    live_best = min(t for k, t in times.items() if dict(k).get("new", 0) == 0)
    gain = live_best - free.epoch_time
    current = Allocation({"live": 2})
    for launch in (0.5 * gain, 2.0 * gain):
        for switch in (0.0, 0.25 * gain):
            d = choose_allocation(cluster(launch), m, traj, n, 4, 8, current=current,
                                  switch_cost_s=switch)
            for c in d.candidates:
                uses_new = c.allocation.node_gpus.get("new", 0) > 0
                assert c.launch_s == (launch if uses_new else 0.0)
            weighed = {k: t + (launch if dict(k).get("new", 0) else 0.0)
                       + (0.0 if dict(k) == {"live": 2} else switch) for k, t in times.items()}
            best = min(weighed.values())
            chosen = tuple(sorted(d.allocation.node_gpus.items()))
            assert weighed[chosen] == pytest.approx(best, rel=1e-12), (launch, switch)
            assert bool(d.allocation.node_gpus.get("new")) == (launch + switch < gain)
    # the uncharged choice (no re-placement charge) still waits for the launch
    d = choose_allocation(cluster(2.0 * gain), m, traj, n, 4, 8, current=current, switch_cost_s=1e9)
    assert d.uncharged_choice is None or not d.uncharged_choice.node_gpus.get("new")


def test_request_bundles_name_the_resource_of_a_node_to_launch():
    cl = ClusterSpec(nodes=[NodeSpec("live", "slow", 2, ray_node_id="x"),
                            NodeSpec("fast2+0", "fast", 2, launch_s=30.0)])
    alloc = {"live": 1, "fast2+0": 2}
    available = {"CPU": 2.0, "gpu_slow": 2.0}                # no gpu_fast yet
    assert request_bundles(cl, alloc, emulate=True, available=available, cpus=1.0) == [
        {"gpu_slow": 1.0, "CPU": 1.0}, {"gpu_fast": 1.0, "CPU": 1.0}, {"gpu_fast": 1.0, "CPU": 1.0}]
    assert [s.launch_s for s in slots_for(cl, alloc)] == [None, 30.0, 30.0]


def test_nodes_whose_ids_share_a_prefix_have_distinct_names():
    """Fake clusters' node ids agree in their first characters: names take a longer prefix."""
    same = "f" * 51
    nodes = [ray_node(same + "00001", {"gpu_fast": 2.0}), ray_node(same + "00002", {"gpu_fast": 2.0})]
    assert [n.name for n in ClusterSpec.from_ray(nodes).nodes] == [
        same + "00001-fast", same + "00002-fast"]
    given = ClusterSpec(nodes=[], node_types=TYPES)
    cl = candidate_cluster(given, nodes, names={same + "00001": "fast2+0", same + "00002": "fast2+1"})
    assert [n.name for n in cl.nodes] == ["fast2+0", "fast2+1", "slow2+0"]   # fast2 is full


def test_kept_nodes_keep_their_order():
    """``ray.nodes()`` lists nodes in no fixed order; an allocation's ranks follow the cluster's
    node order, so nodes seen before keep theirs."""
    a, b = ray_node("a" * 56, {"gpu_fast": 2.0}), ray_node("b" * 56, {"gpu_fast": 2.0})
    new = ray_node("c" * 56, {"gpu_slow": 2.0})
    names = {"b" * 56: "fast2+0", "a" * 56: "fast2+1"}
    given = ClusterSpec(nodes=[], node_types=TYPES)
    for order in ([a, b, new], [new, b, a]):
        assert [n.name for n in candidate_cluster(given, order, names).nodes] == [
            "fast2+0", "fast2+1", "cccccccc-slow"]


def test_a_node_still_to_launch_is_never_free():
    from jabasray.actors.placement import free_cluster
    cl = ClusterSpec(nodes=[NodeSpec("live", "slow", 2, ray_node_id="x"),
                            NodeSpec("fast2+0", "fast", 2, launch_s=30.0)])
    free = free_cluster(cl, {"x": {"CPU": 4.0, "gpu_slow": 2.0}, "y": {"CPU": 8.0}}, emulate=True,
                        totals={"CPU": 12.0, "gpu_slow": 2.0})
    assert [n.name for n in free.nodes] == ["live"]


def test_refresh_leaves_out_types_without_a_profile_and_says_what_changed(monkeypatch):
    import ray

    from jabasray.actors.cluster_view import ClusterView
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [HEAD, FAST, ray_node("s" * 56, {"gpu_slow": 2.0})])
    given = ClusterSpec(nodes=[NodeSpec("fast", "fast", 2, ray_node_id="f" * 56)], follow_ray=True)
    view = ClusterView(given, emulate=True)
    cl, notes = view.refresh(given, gpu_types={"fast"})
    assert [n.name for n in cl.nodes] == ["fast"] and notes == [
        "node(s) ['ssssssss-slow'] are not candidates: their GPU type has no profile "
        "(restart the run, or pass profiles, to use them)"]
    assert view.refresh(cl, gpu_types={"fast"}) == (cl, [])          # said once
    cl2, notes = view.refresh(cl, gpu_types=None)
    assert [n.name for n in cl2.nodes] == ["fast", "ssssssss-slow"]
    assert notes == ["the cluster offers {'fast': 2, 'ssssssss-slow': 2} (was {'fast': 2}; "
                     "'<type>+<i>': nodes Ray's autoscaler can launch)"]
    by_hand = ClusterView(ClusterSpec(nodes=[NodeSpec("a", "fast", 2)]), emulate=True)
    assert by_hand.refresh(given) == (None, [])


def life(node_id: str, gpus: dict, start_s: float, end_s: float | None = None) -> dict:
    """A :func:`jabasray.actors.ray_internals.node_lifetimes` record."""
    return {"node_id": node_id, "start_s": start_s, "end_s": end_s,
            "resources": {"CPU": 1.0, **gpus}, "labels": {}}


def brute_held(lives, t0: float, t1: float, paid_from: dict, pending, step: float = 0.5) -> float:
    """The GPUs held summed over the midpoints of ``step``-wide slices of [t0, t1] (every event
    of the cases below falls on a multiple of ``step``, so the midpoint sum is exact)."""
    total, k = 0.0, 0
    while t0 + (k + 0.5) * step < t1:
        t = t0 + (k + 0.5) * step
        total += step * sum(n.num_gpus for n in lives if paid_from.get(n.node_id, n.start_s) <= t
                            and (n.end_s is None or t < n.end_s))
        total += step * sum(x.num_gpus for x in pending if x.asked_s <= t)
        k += 1
    return total


@pytest.mark.parametrize("t0, t1", [(0.0, 100.0), (10.0, 12.5), (25.0, 60.0), (70.0, 71.0), (-5.0, 3.0)])
def test_held_gpu_seconds_are_the_lifetimes_within_the_window(t0, t1):
    """A head (no GPU, never counted); a node of 2 GPUs alive throughout; one of 4 "slow" GPUs
    from 10 to 30; one launched for a request at 20 that started at 26 and is alive (paid from
    20); a launch asked at 50 that has not joined: each window's GPU-seconds equal the GPUs
    held summed slice by slice."""
    from jabasray.actors.cluster_view import Launch, held_gpu_seconds, match_launches, node_lives
    lives = node_lives([life("h" * 56, {}, -100.0), life("a" * 56, {"gpu_fast": 2.0}, -100.0),
                        life("b" * 56, {"gpu_slow": 4.0}, 10.0, 30.0),
                        life("c" * 56, {"gpu_fast": 2.0}, 26.0)])
    assert [(n.gpu_type, n.num_gpus) for n in lives] == [("fast", 2), ("slow", 4), ("fast", 2)]
    paid, pending = match_launches(lives, [Launch("fast", 2, 20.0), Launch("fast", 2, 50.0)], {})
    assert paid == {"c" * 56: 20.0} and pending == [Launch("fast", 2, 50.0)]
    got = held_gpu_seconds(lives, t0, t1, paid, pending)
    assert got == pytest.approx(brute_held(lives, t0, t1, paid, pending), abs=1e-9)
    if (t0, t1) == (0.0, 100.0):
        assert got == 2 * 100 + 4 * 20 + 2 * 80 + 2 * 50


def test_a_launch_takes_the_first_node_of_its_type_started_after_the_request():
    """Nodes that started before the request, or of another GPU type or count, are not the
    launched node; two launches take two nodes, earliest first (a node that already ended
    counts: it was held); a pair once made is kept."""
    from jabasray.actors.cluster_view import Launch, match_launches, node_lives
    lives = node_lives([life("a" * 56, {"gpu_fast": 2.0}, 5.0), life("b" * 56, {"gpu_fast": 4.0}, 12.0),
                        life("c" * 56, {"gpu_slow": 2.0}, 11.0), life("d" * 56, {"gpu_fast": 2.0}, 15.0),
                        life("e" * 56, {"gpu_fast": 2.0}, 13.0, 14.0)])
    paid, pending = match_launches(lives, [Launch("fast", 2, 10.0), Launch("fast", 2, 10.5),
                                           Launch("fast", 2, 11.0)], {})
    assert paid == {"e" * 56: 10.0, "d" * 56: 10.5} and pending == [Launch("fast", 2, 11.0)]
    assert match_launches(lives, pending, paid) == (paid, pending)   # no third node: pending


def test_a_fixed_spec_holds_all_its_gpus_and_the_line_says_the_gpu_hours():
    from jabasray.actors.cluster_view import ClusterView
    from jabasray.actors.metrics import EpochRecord, epoch_line
    spec = ClusterSpec(nodes=[NodeSpec("a", "A", 2), NodeSpec("b", "B", 4)])
    assert ClusterView(spec, emulate=True).held_seconds(spec, 100.0, 110.0) == 60.0
    rec = EpochRecord(epoch=0, allocation={"a": 1}, gpu_types=["A"], trajectory=[8],
                      predicted_trajectory=[], train_loss=1.0, val_accuracy=None, time_s=600.0,
                      gpu_seconds=600.0, samples=10, throughput=1.0, held_gpu_seconds=3600.0)
    assert epoch_line(rec).endswith(", 1 GPU-h held")


def test_a_requested_node_is_held_from_the_request_until_it_goes(monkeypatch):
    """Live: the head and a node of 2 "fast" GPUs since t=0. At t=10 the job asks for it and
    for a launchable node of 2 more, which starts at t=16 and ends at t=40 (the request was
    cleared at t=30): 2 GPUs throughout, 2 more from the request until the node ended - while
    it launched, once it had joined, and after the request was cleared until it went."""
    import ray

    from jabasray.actors import cluster_view, ray_internals
    from jabasray.actors.cluster_view import ClusterView
    now = [10.0]
    lives = [life("h" * 56, {}, 0.0), life("f" * 56, {"gpu_fast": 2.0}, 0.0)]
    asked = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [HEAD, FAST])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "gpu_fast": 2.0})
    monkeypatch.setattr(cluster_view, "request_resources", asked.append)
    monkeypatch.setattr(cluster_view.time, "time", lambda: now[0])
    monkeypatch.setattr(ray_internals, "node_lifetimes", lambda: [dict(x) for x in lives])
    given = ClusterSpec(nodes=[], node_types=[NodeType("fast", "fast", 2, max_workers=2)])
    view = ClusterView(given, emulate=True)
    cluster = view.candidates()
    assert [(n.name, n.launched) for n in cluster.nodes] == [("ffffffff-fast", False), ("fast+0", True)]
    assert view.held_seconds(cluster, 0.0, 10.0) == 2 * 10
    view.request(cluster, {"ffffffff-fast": 2, "fast+0": 2})
    assert len(asked[-1]) == 4
    assert view.held_seconds(cluster, 0.0, 15.0) == 2 * 15 + 2 * 5         # launching: paid already
    lives.append(life("e" * 56, {"gpu_fast": 2.0}, 16.0))
    view.request(cluster, {"ffffffff-fast": 2, "fast+0": 2})                # the same: not asked again
    assert len(asked) == 1
    assert view.held_seconds(cluster, 12.0, 20.0) == 2 * 8 + 2 * 8          # joined: from the request
    now[0] = 30.0
    view.release()
    lives[-1] = life("e" * 56, {"gpu_fast": 2.0}, 16.0, 40.0)
    assert asked[-1] == [] and view.launches == []
    assert view.held_seconds(cluster, 0.0, 50.0) == 2 * 50 + 2 * 30        # until it went


def run_lives():
    """A run from t=0 to 100 with epochs in [20, 40] and [45, 80] (the times of the cases of
    :func:`test_a_run_is_held_before_inside_between_and_after_its_epochs`)."""
    from jabasray.actors.cluster_view import Launch, node_lives
    lives = node_lives([life("h" * 56, {}, -50.0),                        # the head: no GPU
                        life("a" * 56, {"gpu_fast": 2.0}, -50.0),         # alive the whole run
                        life("b" * 56, {"gpu_fast": 2.0}, 12.0),          # launched in start-up
                        life("c" * 56, {"gpu_slow": 4.0}, 50.0, 90.0),    # released after the last epoch
                        life("d" * 56, {"gpu_slow": 4.0}, 70.0, 95.0)])   # launched, never used
    launches = [Launch("fast", 2, 5.0), Launch("slow", 4, 42.0), Launch("slow", 4, 60.0),
                Launch("fast", 2, 85.0)]                                  # the last never joins
    return lives, launches


def test_a_run_is_held_before_inside_between_and_after_its_epochs():
    """Per node (GPUs x seconds in each part: before [0, 20], epochs [20, 40] + [45, 80],
    between [40, 45], after [80, 100]):

        a: alive throughout                        2 x (20, 20 + 35, 5, 20)  = 40, 110, 10, 40
        b: asked at 5 (start-up), started at 12    2 x (15, 55, 5, 20)       = 30, 110, 10, 40
        c: asked at 42, started 50, ended 90       4 x (0, 35, 3, 10)        =  0, 140, 12, 40
        d: asked at 60, started 70, ended 95       4 x (0, 20, 0, 15)        =  0,  80,  0, 60
           (launched for the job's request, never placed on: paid from the request)
        a launch asked at 85 that never joined     2 x (0, 0, 0, 15)         =  0,   0,  0, 30

    so 70 + 440 + 32 + 210 = 752 GPU-seconds, each part also equal to the GPUs held summed
    slice by slice. The first epoch's figure is the one recorded at its end; the second has
    none and is counted from the lifetimes."""
    from jabasray.actors.cluster_view import HELD_PARTS, held_gpu_seconds, held_parts, match_launches
    lives, launches = run_lives()
    paid, pending = match_launches(lives, launches, {})
    assert paid == {"b" * 56: 5.0, "c" * 56: 42.0, "d" * 56: 60.0} and len(pending) == 1

    def held(t0, t1):
        return held_gpu_seconds(lives, t0, t1, paid, pending)

    parts = held_parts(held, 0.0, 100.0, [(20.0, 40.0, 80.0), (45.0, 80.0, None)])
    assert parts == {"before_first_epoch": 70.0, "inside_epochs": 440.0, "between_epochs": 32.0,
                     "after_last_epoch": 210.0, "total": 752.0}
    windows = {"before_first_epoch": [(0, 20)], "inside_epochs": [(20, 40), (45, 80)],
               "between_epochs": [(40, 45)], "after_last_epoch": [(80, 100)]}
    for name, spans in windows.items():
        assert parts[name] == sum(brute_held(lives, t0, t1, paid, pending) for t0, t1 in spans)
    assert parts["total"] == brute_held(lives, 0.0, 100.0, paid, pending)
    assert list(parts) == [*HELD_PARTS, "total"]
    # a run without an epoch (a finished run resumed with nothing left) is all start-up
    assert held_parts(held, 0.0, 100.0, []) == {"before_first_epoch": 752.0, "inside_epochs": 0.0,
                                                "between_epochs": 0.0, "after_last_epoch": 0.0,
                                                "total": 752.0}


def test_the_run_figure_reads_the_lifetimes_once_and_counts_the_launched_gpus_left(monkeypatch):
    """The view's run figure is :func:`held_parts` over the lifetimes the GCS gives (the cases
    of :func:`test_a_run_is_held_before_inside_between_and_after_its_epochs`), and of the nodes
    launched for the job only b (2 GPUs) is alive at the end: c and d have gone, a was not
    launched for it. A fixed spec holds its GPUs throughout, nothing launched."""
    import ray

    from jabasray.actors import ray_internals
    from jabasray.actors.cluster_view import ClusterView
    _, launches = run_lives()
    records = [life("h" * 56, {}, -50.0), life("a" * 56, {"gpu_fast": 2.0}, -50.0),
               life("b" * 56, {"gpu_fast": 2.0}, 12.0), life("c" * 56, {"gpu_slow": 4.0}, 50.0, 90.0),
               life("d" * 56, {"gpu_slow": 4.0}, 70.0, 95.0)]
    reads = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_internals, "node_lifetimes", lambda: reads.append(1) or [dict(x) for x in records])
    given = ClusterSpec(nodes=[], node_types=[NodeType("fast", "fast", 2, max_workers=2),
                                              NodeType("slow", "slow", 4, max_workers=2)])
    view = ClusterView(given, emulate=True)
    view.launches = launches
    parts, alive = view.held_in_run(given, 0.0, 100.0, [(20.0, 40.0, 80.0), (45.0, 80.0, None)])
    assert (parts["total"], alive, len(reads)) == (752.0, 2, 1)
    spec = ClusterSpec(nodes=[NodeSpec("a", "A", 2), NodeSpec("b", "B", 4)])
    parts, alive = ClusterView(spec, emulate=True).held_in_run(spec, 0.0, 10.0, [(2.0, 5.0, 18.0)])
    assert (parts["before_first_epoch"], parts["inside_epochs"], parts["after_last_epoch"], alive) == (12.0, 18.0, 30.0, 0)


def test_the_run_line_says_the_gpu_hours_in_all_and_outside_the_epochs():
    from jabasray.actors.metrics import MetricsHistory, RunHeld, held_line
    held = RunHeld(start_s=0.0, end_s=100.0, before_first_epoch=360.0, inside_epochs=7200.0,
                   between_epochs=0.0, after_last_epoch=1440.0, total=9000.0, epochs_counted=[0, 1],
                   launched_gpus_at_end=4)
    assert held_line(held) == ("GPU-hours held: 2.5 GPU-h in all, 0.5 outside the epochs (before the "
                               "first 0.1, between 0, after the last 0.4); 4 GPUs launched for the "
                               "job are held on until Ray's autoscaler removes them (its idle "
                               "timeout), not counted")
    again = MetricsHistory.from_json(MetricsHistory(held=held).to_json())
    assert again.held == held
