"""A node that drains mid-epoch, on a ``ray.cluster_utils.Cluster``: a head with 2 CPUs and a
worker node with 1 CPU, each with two emulated "fast" GPUs (one pair: what SMA and burst
parallelism place on); the worker node is the one drained (the head holds the GCS and this
process's connection). Two raylets, not three: one node start fewer for the module.

The drain is what a spot node's preemption notice is to Ray: a drain request to the GCS (what
``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds`` sends,
the call the autoscaler and KubeRay make; sent here from the test process) after which Ray
schedules nothing new on the node and whoever asked kills it at the deadline; here the test
removes it once the job has left (and adds a fresh worker node for the next test).

Proves, in each mode - IIDP data parallelism (the default), Crossbow SMA learners and DeepPool
burst parallelism: a job on both nodes whose worker node is drained after interval 0 of epoch 0
writes a mid-epoch checkpoint, re-plans on the other node and goes on with the epoch there,
before the node goes: the node is removed (its raylet killed) one interval later and no actor
fails; the drain costs no completed sample (each epoch serves every sample exactly once, by the
indices the actors report and by the driver's digest check; the intervals' cursors run
contiguously from 0 to the dataset's end: no interval is redone). IIDP also runs
epoch 1 on the node that stayed. The GPU-hours reported follow the nodes held: all four GPUs
until the drained node went, then two; epoch 1 holds two GPUs throughout.
"""
from __future__ import annotations

import time

import pytest

from actors_helpers import (assert_each_sample_once_per_epoch, loss_fn, model_fn, optimizer_fn,
                            perf_model, running_cluster, tiny_data)
from jabasray.actors.checkpoint import MID_EPOCH
from jabasray.actors.driver import DriverCallback, DriverOptions, JabasDriver
from jabasray.actors.placement import ray_cluster_spec
from jabasray.config import JobConfig

pytestmark = pytest.mark.multinode

SAMPLES = 128
GPU_NODE = dict(num_cpus=1, resources={"gpu_fast": 2})
MODES = {   # mode -> (its JobConfig fields, epochs): B_G 16, 2 iterations an interval in each
    "iidp": (dict(), 2),
    "sma": (dict(sync="sma", sma_learners=1), 1),
    "burst": (dict(parallelism="burst", amp_limit=3.0, adaptive=False, lr_scaling="none"), 1),
}


@pytest.fixture(scope="module")
def cluster(without_session_ray):
    with running_cluster(dict(num_cpus=2, include_dashboard=False, resources=GPU_NODE["resources"]),
                         [GPU_NODE]) as c:
        yield c


@pytest.fixture
def two_nodes(cluster):
    """The cluster with two GPU nodes, the head and a worker (a test before this one removed
    the worker)."""
    while len(cluster.worker_nodes) < 1:
        cluster.add_node(**GPU_NODE)
    cluster.wait_for_nodes()
    return cluster


def drain(address: str, node_id: str, deadline_s: int) -> None:
    """What ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds``
    sends: the same request to the GCS through the same client the CLI builds, from this
    process (a CLI process would take seconds to start on a loaded machine)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    accepted, why = ray._raylet.GcsClient(address=address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "spot notice",
        time.time_ns() // 1_000_000 + deadline_s * 1000)
    assert accepted, why


class DrainThenRemove(DriverCallback):
    """After interval 0 of epoch 0: a preemption drain of the worker node (the node of the last
    rank not on the head); after interval 1: that node removed, noting what the job held then."""

    def __init__(self, cluster, run_dir) -> None:
        self.cluster, self.run_dir = cluster, run_dir
        self.node_id = self.name = None
        self.removed_while: dict | None = None

    def on_interval(self, driver, record):
        if record.epoch != 0:
            return
        if record.interval == 0:
            head = self.cluster.head_node.node_id
            slot = [s for s in driver.slots() if s.ray_node_id != head][-1]
            self.node_id, self.name = slot.ray_node_id, slot.node
            drain(self.cluster.address, self.node_id, deadline_s=120)
        elif record.interval == 1:
            self.removed_while = {
                "nodes_used": sorted({s.node for s in driver.slots()}),
                "mid_epoch_checkpoint": (self.run_dir / "checkpoints" / MID_EPOCH).is_dir()}
            node = next(n for n in self.cluster.worker_nodes if n.node_id == self.node_id)
            self.cluster.remove_node(node)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_node_drained_mid_epoch_costs_no_completed_sample(two_nodes, tmp_path, mode):
    fields, epochs = MODES[mode]
    spec = ray_cluster_spec(speeds={"fast": 1.0})
    assert sorted(n.num_gpus for n in spec.nodes) == [2, 2]
    ds, _ = tiny_data(SAMPLES)
    job = JobConfig(epochs=epochs, initial_global_batch=16, min_global_batch=16, max_global_batch=16,
                    min_local_batch=4, adapt_interval=2, autoscale=False, seed=1, **fields)
    run_dir = tmp_path / "drain"
    cb = DrainThenRemove(two_nodes, run_dir)
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, spec, run_dir,
                      perf_model=None if mode == "burst" else perf_model({"fast": 1.0}), callbacks=[cb],
                      options=DriverOptions(record_samples=True, evaluate=False, sma_autotune=False))
    hist = drv.run()
    other = next(n.name for n in spec.nodes if n.name != cb.name)
    # the job left before the node went, from a mid-epoch checkpoint
    assert cb.removed_while == {"nodes_used": [other], "mid_epoch_checkpoint": True}
    ep0 = [r for r in hist.intervals if r.epoch == 0]
    assert ep0[0].samples == 32
    assert any("drain" in e and cb.name in e and "mid-epoch checkpoint at sample 32" in e
               for e in hist.events), hist.events
    assert not any("failure" in e for e in hist.events), hist.events
    # no completed sample lost or redone
    assert [r.interval for r in ep0] == list(range(len(ep0)))
    assert [r.cursor for r in ep0] == [sum(r.samples for r in ep0[:i]) for i in range(len(ep0))]
    assert sum(r.samples for r in ep0) == SAMPLES
    assert_each_sample_once_per_epoch(hist, SAMPLES)
    assert hist.epochs[0].allocation == {other: 2} and hist.epochs[0].replaced
    ep = hist.epochs
    # all 4 GPUs held until the drained node went, 2 after (unix times of ~1.8e9 s carry
    # ~2.4e-7 s of float resolution: 1e-5 GPU-s bounds the rounding of the window)
    assert 2 * ep[0].time_s < ep[0].held_gpu_seconds < 4 * ep[0].time_s
    if epochs > 1:
        assert ep[1].allocation == {other: 2}
        assert ep[1].held_gpu_seconds == pytest.approx(2 * ep[1].time_s, abs=1e-5)
