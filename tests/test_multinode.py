"""Several Ray nodes on one machine: a ``ray.cluster_utils.Cluster`` of three raylets (two
nodes with 2 emulated "fast" GPUs each, one with 2 "slow" GPUs), started once for the module.

Proves: the cluster is detected from Ray (nodes, types, counts, node ids); an allocation places
each GPU pair's actors on the node it names, also when another node offers the same resources;
an allocation change keeps the pairs that stay and moves the others across nodes; a node that
leaves in the middle of an epoch makes the driver drop its GPUs, restore the last checkpoint and
finish without losing a completed epoch. Actors carry names that say run, node and rank.
The all-reduce fit measured on the placed actors: a run placed across two nodes (one fast GPU,
one slow: 2 actors) times all-reduces with the job's backend (gloo) on its own placed actors
(the ranks answer from the nodes the actors run on), fits the inter-node Eq. 3 to the slowest
rank's times exactly as ``AllReduceFit.fit`` does on the recorded measurement, and the model the
plans use then has Eq. 4 over that fit as its comm time; a run on one node fits the intra-node
Eq. 3, a second placement of the same (backend, world size, span) measures nothing, and a
resumed run (a new driver on the run's checkpoint) measures nothing and plans with the
checkpointed fit; every epoch record says which fit its plans used. (These share this module's
cluster instead of starting their own Cluster of two raylets; the inter-node fit is read from the
node-loss test's run, whose first placement spans fast2 and slow: one run for both.)

Where the driver actor runs: on the head node, as the README says, also when a worker node
offers more CPUs (the second fast node has 4 CPUs, the head 1). Ray 2.60 places an actor that
asks for no resource on any node, whatever its soft node affinity (about half of such actors
land on another node), so each of several drivers started here must say it runs on the head.
The drivers are given an empty job (their construction fails at once): where the actor lands is
decided before its job is read, and each one ends as soon as the test collected its error.
(This too shares the module's cluster instead of starting a Cluster of its own.)
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace

import pytest
from ray import cloudpickle

from actors_helpers import loss_fn, model_fn, optimizer_fn, profile, running_cluster, tiny_data
from jabasray.actors.allreduce_fit import fit_description, measurement_sizes, record_fit
from jabasray.actors.checkpoint import latest_checkpoint
from jabasray.actors.driver import DriverCallback, DriverOptions, JabasDriver
from jabasray.actors.placement import place_actors, ray_cluster_spec, release, slots_for
from jabasray.config import JobConfig
from jabasray.profiles import AllReduceFit
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.multinode

SPEEDS = {"fast": 1.0, "slow": 0.5}


@pytest.fixture(scope="module")
def cluster(without_session_ray):
    """Three raylets; the head (fast, 1 CPU) hosts the test's driver. GPU actors need no CPU
    (emulated GPUs are custom resources); the second fast node offers 4 CPUs, more than the
    head, for the driver-actor placement test."""
    with running_cluster(dict(num_cpus=1, include_dashboard=False, resources={"gpu_fast": 2}),
                         [dict(num_cpus=4, resources={"gpu_fast": 2}),
                          dict(num_cpus=0, resources={"gpu_slow": 2})]) as c:
        yield c


def node_ids(c) -> dict[str, str]:
    """``{"head"|"fast2"|"slow": Ray node id}``, told apart by their resources (the fixture's
    Cluster keeps its worker nodes in a set, so their order says nothing)."""
    import ray
    out = {}
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        res = n["Resources"]
        key = "head" if "node:__internal_head__" in res else ("slow" if "gpu_slow" in res else "fast2")
        out[key] = n["NodeID"]
    return out


def cluster_node(c, node_id: str):
    """The ``ray.cluster_utils`` node object of a Ray node id (what ``remove_node`` takes)."""
    return next(n for n in c.list_all_nodes() if n.node_id == node_id)


def spec_name(spec: ClusterSpec, ray_node_id: str) -> str:
    return next(n.name for n in spec.nodes if n.ray_node_id == ray_node_id)


class Where:
    """The lightest actor that says where it runs."""

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()


def test_cluster_is_detected_from_ray(cluster):
    ids = node_ids(cluster)
    spec = ray_cluster_spec(speeds=SPEEDS)
    got = sorted((n.ray_node_id, n.gpu_type, n.num_gpus, n.speed) for n in spec.nodes)
    assert got == sorted([(ids["head"], "fast", 2, 1.0), (ids["fast2"], "fast", 2, 1.0),
                          (ids["slow"], "slow", 2, 0.5)])
    assert spec.gpu_types == ["fast", "slow"]
    assert all(n.name == f"{n.ray_node_id[:8]}-{n.gpu_type}" for n in spec.nodes)


def test_allocation_places_actors_on_its_nodes_and_a_change_moves_them(cluster):
    """{fast2: 1, slow: 1}: 2 actors on the second fast node (not on the head, which has the
    same gpu_fast resources) and 2 on the slow node. Then {head: 1, fast2: 1}: the fast2 pair
    keeps its actors (same handles, same node), the slow pair is released, the head gets 2 new
    actors."""
    import ray

    ids = node_ids(cluster)
    spec = ray_cluster_spec(speeds=SPEEDS)
    head, fast2, slow = (spec_name(spec, ids[k]) for k in ("head", "fast2", "slow"))
    remote = ray.remote(num_cpus=0)(Where)

    def make(slot, opts):
        return remote.options(**opts).remote()

    first = slots_for(spec, {fast2: 2, slow: 2})
    placement, new = place_actors(first, make, emulate=True, timeout_s=60)
    try:
        assert new == [0, 1, 2, 3]
        where = ray.get([a.node_id.remote() for a in placement.actors])
        assert where == [s.ray_node_id for s in first]          # rank r runs on its slot's node
        assert sorted(where) == sorted([ids["fast2"]] * 2 + [ids["slow"]] * 2)

        second = slots_for(spec, {head: 2, fast2: 2})
        placement2, new = place_actors(second, make, emulate=True, timeout_s=60, reuse=placement)
        kept = [a for a, s in zip(placement.actors, first) if s.node == fast2]
        fast2_ranks = [s.rank for s in second if s.node == fast2]
        assert [placement2.actors[r] for r in fast2_ranks] == kept        # same actors
        assert sorted(new) == sorted(s.rank for s in second if s.node == head)
        where = ray.get([a.node_id.remote() for a in placement2.actors])
        assert where == [s.ray_node_id for s in second]
        assert sorted(where) == sorted([ids["head"]] * 2 + [ids["fast2"]] * 2)
        for a in [a for a, s in zip(placement.actors, first) if s.node == slow]:   # released
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(a.node_id.remote(), timeout=30)
        placement = placement2
    finally:
        release(placement)


# ------------------------------------------------------------------ the all-reduce fit
# (the inter-node fit: on the node-loss run, ``node_lost_run`` below)
# Profiled local batches 4 and 8 (not 4..32): a run given profiles times its step at every
# profiled point on its placed actors after each placement (interval_costs.probe_points: 5
# points instead of 17); the all-reduce fit, its buckets and the plans' feasibility (B_G 16-64
# over 2 GPUs with up to 4 VSWs each) do not depend on the larger batches.
AR_PROFILES = {"fast": profile("fast", 1.0, max_local_batch=8), "slow": profile("slow", 0.5, max_local_batch=8)}


def ar_job(epochs: int) -> JobConfig:
    return JobConfig(epochs=epochs, initial_global_batch=32, min_global_batch=16, max_global_batch=64,
                     min_local_batch=4, adapt_interval=2, autoscale=False, seed=1)


def ar_driver(run_dir, epochs: int, cluster: ClusterSpec, callbacks=(), **opts) -> JabasDriver:
    ds, _ = tiny_data(96)
    return JabasDriver(model_fn, ds, optimizer_fn, loss_fn, ar_job(epochs), cluster, run_dir,
                       profiles=AR_PROFILES, callbacks=list(callbacks),
                       options=DriverOptions(failure_grace_s=10, placement_timeout_s=60,
                                             evaluate=False, **opts))


class PlacedAt(DriverCallback):
    """At every epoch's first interval: (pid, node id) of every placed actor, rank order."""

    def __init__(self) -> None:
        self.epochs: dict[int, list[tuple[int, str]]] = {}

    def on_interval(self, drv, record):
        import ray
        if record.interval == 0:
            pings = ray.get([a.ping.remote() for a in drv.gpu_actors()])
            self.epochs[record.epoch] = [(p["pid"], p["node_id"]) for p in pings]


def ar_reference(rec: dict, multi_node: bool) -> AllReduceFit:
    """Eq. 3 fitted to the recorded measurement: the slowest rank per size."""
    slowest = [max(ts) for ts in zip(*rec["rank_times"])]
    prof = AR_PROFILES["fast"]
    k = (prof.allreduce_inter if multi_node else prof.allreduce_intra).bandwidth
    return AllReduceFit.fit(rec["sizes"], slowest, num_gpus=len(rec["rank_times"]), bandwidth=k)


def eq4(fit: AllReduceFit, gpu: str, n: int) -> float:
    return sum(fit.time(b, n) for b in AR_PROFILES[gpu].bucket_sizes)


def test_one_node_fits_intra_once_and_a_resumed_run_does_not_measure_again(cluster, tmp_path):
    spec = ClusterSpec(nodes=[NodeSpec("f", "fast", 2, speed=1.0)])
    run = tmp_path / "intra"
    where = PlacedAt()
    first = ar_driver(run, 2, spec, [where], force_replacement=True)   # fresh actors every epoch
    hist = first.run()

    # two placements of the same key (new processes at epoch 2), one measurement
    assert any("epoch 2: re-placing actors" in m for m in hist.events)
    assert {p for p, _ in where.epochs[0]}.isdisjoint(p for p, _ in where.epochs[1])
    assert first.allreduce.measured == ["gloo/2/intra"]
    rec = first.allreduce.records["gloo/2/intra"]
    assert rec["nodes"] == [node for _, node in where.epochs[0]] and len(set(rec["nodes"])) == 1
    fit = ar_reference(rec, multi_node=False)
    assert record_fit(rec) == fit
    assert first.planner.alloc_model(2, False).comm_time("fast") == eq4(fit, "fast", 2)
    described = fit_description("measured", fit, 2, False)
    assert [e.allreduce_fit for e in hist.epochs] == [described, described]

    resumed = ar_driver(run, 3, spec)                              # a new driver on the checkpoint
    hist = resumed.run()
    assert any("resumed from" in m for m in hist.events)
    assert resumed.allreduce.measured == [] and resumed.allreduce.records == first.allreduce.records
    assert resumed.planner.alloc_model(2, False).comm_time("fast") == eq4(fit, "fast", 2)
    assert [e.allreduce_fit for e in hist.epochs] == [described] * 3


# ------------------------------------------------------------------ where the driver actor runs
DRIVERS = 6      # an actor placed by chance passes all six with probability 1/64


def head_node_id() -> str:
    import ray
    return next(n["NodeID"] for n in ray.nodes()
                if n["Alive"] and "node:__internal_head__" in n["Resources"])


def settled_status(name: str, timeout: float = 180.0) -> dict:
    """The status of run ``name`` once its driver has read its job (here: failed on it)."""
    from jabasray.actors import run_client
    t0 = time.monotonic()
    while True:
        st = run_client.status(name)
        if st["state"] == "failed":
            return st
        assert time.monotonic() - t0 < timeout, f"run {name} still {st['state']}"
        time.sleep(0.2)


def test_the_driver_actor_runs_on_the_head_node(cluster):
    import ray

    from jabasray.actors import run_client

    head = head_node_id()
    cpus = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]}
    assert max(cpus.values()) > cpus[head]           # a worker node offers more CPUs
    names = [f"pinned{i}" for i in range(DRIVERS)]
    for name in names:
        run_client.start_run(name, (), {}, DriverOptions())
    where = {}
    for name in names:
        where[name] = settled_status(name)["node_id"]
        with pytest.raises(TypeError):     # the empty job's error; the actor then exits
            run_client.follow(name)
    assert all(node == head for node in where.values()), \
        f"driver actors off the head node {head[:8]}: " \
        f"{ {n: w[:8] for n, w in where.items() if w != head} }"
    assert run_client.running_runs() == []


class RemoveNodeOnce(DriverCallback):
    """At interval 1 of ``epoch``: record where every actor runs and what it is called, then
    remove ``node`` from the Ray cluster (its raylet and the actors on it die)."""

    def __init__(self, cluster, node, epoch: int) -> None:
        self.cluster, self.node, self.epoch = cluster, node, epoch
        self.seen: list[tuple[int, str, str]] = []     # (rank, node id, slot's ray node id)
        self.names: list[str] = []

    def on_interval(self, driver, record):
        import ray
        if self.node is None or record.epoch != self.epoch or record.interval != 1:
            return
        pings = ray.get([a.ping.remote() for a in driver.gpu_actors()])
        self.seen = [(p["rank"], p["node_id"], s.ray_node_id) for p, s in zip(pings, driver.slots())]
        self.names = sorted(ray.util.list_named_actors())
        self.cluster.remove_node(self.node)
        self.node = None


@pytest.fixture(scope="module")
def node_lost_run(cluster, tmp_path_factory):
    """One run shared by the inter-node fit test and the node-loss test (each checks its own
    facts of it; one run instead of two saves a driver and two GPU-actor processes): a job on
    one GPU of fast2 and one of slow (2 actors: the fewest processes that span two nodes), with
    the profiles of ``AR_PROFILES`` (so the all-reduce fit is measured on its placed actors at
    its first placement); in the middle of epoch 1 the slow node leaves. The last tests of the
    module: the slow node is gone after it. ``(drv, hist, ds, hook, where, run_dir, fast2, slow, ids)``."""
    ids = node_ids(cluster)
    spec = ray_cluster_spec(speeds=SPEEDS)
    fast2, slow = spec_name(spec, ids["fast2"]), spec_name(spec, ids["slow"])
    job_cluster = ClusterSpec(nodes=[replace(spec.node(fast2), num_gpus=1), replace(spec.node(slow), num_gpus=1)])
    ds, val = tiny_data(240)
    job = JobConfig(epochs=2, initial_global_batch=32, min_global_batch=16, max_global_batch=64,
                    min_local_batch=4, adapt_interval=2, autoscale=False, seed=1)
    slow_node = cluster_node(cluster, ids["slow"])
    hook = RemoveNodeOnce(cluster, slow_node, epoch=1)
    where = PlacedAt()
    run_dir = tmp_path_factory.mktemp("mn") / "mn"
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, job_cluster, run_dir,
                      val_dataset=val, profiles=AR_PROFILES,
                      options=DriverOptions(failure_grace_s=10, placement_timeout_s=60),
                      callbacks=[hook, where])
    hist = drv.run()
    return drv, hist, ds, hook, where, run_dir, fast2, slow, ids


def test_a_run_across_nodes_measures_the_inter_node_fit_on_its_actors(node_lost_run):
    drv, hist, _, _, where, run_dir, _, _, _ = node_lost_run

    assert drv.allreduce.measured == ["gloo/2/inter"]          # the job's backend, 2 ranks, 2 nodes
    rec = drv.allreduce.records["gloo/2/inter"]
    placed = where.epochs[0]
    assert rec["nodes"] == [node for _, node in placed] and len(set(rec["nodes"])) == 2
    assert rec["sizes"] == measurement_sizes(AR_PROFILES["fast"].bucket_sizes) == [2500, 5000, 10000, 20000]
    assert len(rec["rank_times"]) == 2 and all(len(t) == 4 and min(t) > 0 for t in rec["rank_times"])
    fit = ar_reference(rec, multi_node=True)
    assert record_fit(rec) == fit and fit.num_gpus == 2
    model = drv.planner.alloc_model(2, True)                   # what the plans on f + s use
    for g in ("fast", "slow"):
        assert model.comm_time(g) == eq4(fit, g, 2)
        assert model.comm_time(g) != eq4(AR_PROFILES[g].allreduce_inter, g, 2)
    assert hist.epochs[0].allreduce_fit == fit_description("measured", fit, 2, True)
    assert hist.epochs[0].allreduce_fit["source"] == "measured"
    assert latest_checkpoint(run_dir).load_driver_state().allreduce_fits == drv.allreduce.records


def test_node_lost_mid_epoch_driver_drops_its_gpus_and_finishes(node_lost_run):
    """The job runs on one GPU of fast2 and one of slow (2 actors: the fewest processes that
    span two nodes); in the middle of epoch 1 the slow node leaves.
    The driver drops that node's GPUs, reloads the epoch-1 checkpoint, redoes epoch 1 on fast2
    alone and finishes: epoch 0 is kept as trained, epoch 1 is trained once, completely."""
    drv, hist, ds, hook, _, run_dir, fast2, slow, ids = node_lost_run

    # before the loss: every actor ran on the node its slot names; names say run, node, rank
    assert sorted(n for _, n, _ in hook.seen) == sorted([ids["fast2"], ids["slow"]])
    assert all(node == pinned for _, node, pinned in hook.seen)
    assert len(hook.names) == 2 and all(n.startswith("jabasray:mn-") for n in hook.names)
    assert sorted(n.split(":", 3)[3] for n in hook.names) == sorted([f"{fast2}:rank0", f"{slow}:rank1"])

    assert [e.epoch for e in hist.epochs] == [0, 1]
    assert hist.epochs[0].allocation == {fast2: 1, slow: 1}
    assert hist.epochs[0].gpu_types == ["fast", "slow"]
    assert hist.epochs[1].allocation == {fast2: 1} and hist.epochs[1].gpu_types == ["fast"]
    fail = [m for m in hist.events if "failure" in m]
    assert len(fail) == 1 and f"on {slow}" in fail[0] and "restarting epoch 2" in fail[0]
    ep0 = [r for r in hist.intervals if r.epoch == 0]
    ep1 = [r for r in hist.intervals if r.epoch == 1]
    assert sum(r.samples for r in ep0) == len(ds) and sum(r.samples for r in ep1) == len(ds)
    assert [r.interval for r in ep1] == list(range(len(ep1)))
    cp = latest_checkpoint(run_dir)
    assert cp.epochs_done == 2
    assert [n.name for n in cp.load_driver_state().cluster.nodes] == [fast2]
    assert drv.gpu_actors() == []


# Ray workers cannot import this test module: ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
