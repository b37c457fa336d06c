"""A run on a cluster whose Ray node ids change under it (``ray.cluster_utils.Cluster``).

Proves: a run checkpointed on one cluster, the whole cluster shut down and a new one started
(every Ray node id new), resumes - from the spec detected on the old cluster (the driver-restart
case: stale ids) - on the new nodes, matched by GPU type and count, and finishes with every
sample served exactly once per epoch and the completed epoch kept; a pinned node that left
between two placements makes the driver re-plan on the live cluster instead of raising.

One cluster at a time: the module's fixture hands out a starter, and each started cluster is
shut down before the next one starts (the point of the test is that they differ). The pinned-node
test runs first: the two nodes it leaves (fast head, slow node) are the shape the restart test
starts from, so that test's first cluster is the one left running when there is one (a Ray
cluster costs seconds to start) and a new one otherwise.
"""
from __future__ import annotations

import sys

import pytest
from ray import cloudpickle

from actors_helpers import (assert_each_sample_once_per_epoch, loss_fn, model_fn, optimizer_fn,
                            perf_model, start_cluster, tiny_data)
from jabasray.actors.checkpoint import latest_checkpoint
from jabasray.actors.driver import DriverCallback, DriverOptions, JabasDriver
from jabasray.actors.placement import ray_cluster_spec
from jabasray.config import JobConfig

pytestmark = pytest.mark.multinode

SPEEDS = {"fast": 1.0, "slow": 0.5}


@pytest.fixture(scope="module")
def clusters(without_session_ray):
    """``start(extra_fast_node=False, reuse=False)`` -> a new Cluster: a head with 1 emulated
    "fast" GPU and a node with 1 "slow" one (optionally one more "fast" node), Ray connected to
    it; the previous one is shut down first. With ``reuse``, the cluster already running is
    returned instead when its live nodes are exactly that head and slow node. One GPU per node:
    the runs still span nodes and types, with the fewest GPU-actor processes to start."""
    ray = without_session_ray
    from ray.cluster_utils import Cluster

    live: list = []

    def stop() -> None:
        if ray.is_initialized():
            ray.shutdown()
        while live:
            live.pop().shutdown()

    def two_node_shape() -> bool:
        gpus = sorted(tuple(sorted((k, v) for k, v in n["Resources"].items() if k.startswith("gpu_")))
                      + (("head",) if "node:__internal_head__" in n["Resources"] else ())
                      for n in ray.nodes() if n["Alive"])
        return gpus == [(("gpu_fast", 1.0), "head"), (("gpu_slow", 1.0),)]

    def start(extra_fast_node: bool = False, reuse: bool = False):
        if reuse and not extra_fast_node and live and ray.is_initialized() and two_node_shape():
            return live[-1]
        stop()
        nodes = [dict(num_cpus=1, resources={"gpu_slow": 1})]
        if extra_fast_node:
            nodes.append(dict(num_cpus=0, resources={"gpu_fast": 1}))
        c = start_cluster(Cluster, dict(num_cpus=1, include_dashboard=False,
                                        resources={"gpu_fast": 1}), nodes)
        live.append(c)
        ray.init(address=c.address, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        c.wait_for_nodes()
        return c

    try:
        yield start
    finally:
        stop()


def alive_ids() -> set[str]:
    import ray
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def job(epochs: int) -> JobConfig:
    return JobConfig(epochs=epochs, initial_global_batch=32, min_global_batch=16,
                     max_global_batch=64, min_local_batch=4, adapt_interval=2, autoscale=False,
                     seed=1)


def driver(cluster, run_dir, epochs: int, callbacks=(), **opts) -> JabasDriver:
    ds, val = tiny_data(240)
    return JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job(epochs), cluster, run_dir,
                       val_dataset=val, perf_model=perf_model(SPEEDS), callbacks=list(callbacks),
                       options=DriverOptions(failure_grace_s=10, placement_timeout_s=60,
                                             record_samples=True, **opts))


class Where(DriverCallback):
    """Records the Ray node of every placed actor at each epoch's first interval."""

    def __init__(self) -> None:
        self.nodes: dict[int, list[str]] = {}

    def on_interval(self, drv, record):
        import ray
        if record.interval == 0:
            self.nodes[record.epoch] = [p["node_id"] for p in ray.get(
                [a.ping.remote() for a in drv.gpu_actors()])]


class RemoveAfterEpoch(DriverCallback):
    """After epoch ``epoch``'s checkpoint: remove ``node`` from the Ray cluster (it holds none of
    the run's actors' work in flight: the next placement finds it gone)."""

    def __init__(self, cluster, node, epoch: int) -> None:
        self.cluster, self.node, self.epoch = cluster, node, epoch

    def on_epoch(self, drv, record):
        if self.node is not None and record.epoch == self.epoch:
            self.cluster.remove_node(self.node)
            self.node = None


def test_a_pinned_node_gone_at_placement_replans(clusters, tmp_path):
    """Three nodes (fast head, slow, extra fast); every epoch re-places its actors. After epoch 0
    the extra fast node leaves: epoch 1's placement finds it gone, re-plans on the two live
    nodes and finishes; both epochs served every sample once."""
    c = clusters(extra_fast_node=True)
    spec = ray_cluster_spec(speeds=SPEEDS)
    import ray
    extra_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "gpu_fast" in n["Resources"]
                    and "node:__internal_head__" not in n["Resources"])
    extra = next(n for n in c.list_all_nodes() if n.node_id == extra_id)
    extra_name = next(n.name for n in spec.nodes if n.ray_node_id == extra_id)
    hook = RemoveAfterEpoch(c, extra, epoch=0)
    hist = driver(spec, tmp_path / "gone", epochs=2, callbacks=[hook], force_replacement=True).run()
    assert [e.epoch for e in hist.epochs] == [0, 1]
    assert extra_name in hist.epochs[0].allocation and len(hist.epochs[0].gpu_types) == 3
    assert extra_name not in hist.epochs[1].allocation and len(hist.epochs[1].gpu_types) == 2
    replans = [m for m in hist.events if "re-planned on the live cluster" in m]
    assert len(replans) == 1 and "left the Ray cluster" in replans[0]
    assert not [m for m in hist.events if "failure" in m]     # no actor failure, no epoch redone
    assert_each_sample_once_per_epoch(hist, 240)


def test_resume_after_the_whole_cluster_restarted(clusters, tmp_path):
    """Epoch 0 on cluster A; A shut down; cluster B (same shape, new ids) started; the run is
    resumed with A's detected spec (every id dead) for 2 epochs: epoch 0 is kept from the
    checkpoint (not retrained), epoch 1 runs on B's nodes - each of A's nodes replaced by B's
    node of its type - and each epoch served every sample once."""
    start = clusters
    start(reuse=True)                              # cluster A: the one left running, if any
    spec_a = ray_cluster_spec(speeds=SPEEDS)
    ids_a = alive_ids()
    hist_a = driver(spec_a, tmp_path / "run", epochs=1).run()
    assert [e.epoch for e in hist_a.epochs] == [0]
    ep0_served = sorted(i for r in hist_a.intervals for i in r.served)

    start()                                        # cluster B: all ids new
    ids_b = alive_ids()
    assert not ids_a & ids_b
    where = Where()
    hist = driver(spec_a, tmp_path / "run", epochs=2, callbacks=[where]).run()

    assert [e.epoch for e in hist.epochs] == [0, 1]
    assert sorted(i for r in hist.intervals if r.epoch == 0 for i in r.served) == ep0_served
    assert 0 not in where.nodes                    # epoch 0 was not trained again
    assert_each_sample_once_per_epoch(hist, 240)
    spec_b = ray_cluster_spec(speeds=SPEEDS)
    by_type = {n.gpu_type: n.name for n in spec_b.nodes}
    assert hist.epochs[1].allocation == {by_type["fast"]: 1, by_type["slow"]: 1}
    assert sorted(hist.epochs[1].gpu_types) == ["fast", "slow"]
    assert sorted(where.nodes[1]) == sorted(n.ray_node_id for n in spec_b.nodes)
    assert any(m.startswith("cluster reconciled with the live Ray nodes") for m in hist.events)
    assert any(m.startswith("resumed from") for m in hist.events)
    cp = latest_checkpoint(tmp_path / "run")
    assert cp.epochs_done == 2
    assert {n.ray_node_id for n in cp.load_driver_state().cluster.nodes} <= ids_b

    # the live cluster passed on resume (B detected) is used as it is: nothing to reconcile
    hist3 = driver(spec_b, tmp_path / "run", epochs=3).run()
    assert [e.epoch for e in hist3.epochs] == [0, 1, 2]
    assert hist3.epochs[2].allocation == hist.epochs[1].allocation
    assert_each_sample_once_per_epoch(hist3, 240)


# Ray workers cannot import this test module: ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
