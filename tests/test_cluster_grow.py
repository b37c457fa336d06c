"""The live cluster read again at every epoch end, on a ``ray.cluster_utils.Cluster``: a head
with 2 CPUs and one emulated "slow" GPU; a node with one "fast" GPU added by hand mid-run.

Proves: a job given the cluster detected from Ray (`ray_cluster_spec`: it follows Ray) starts on the slow GPU,
the node added during epoch 1 is a candidate of the auto-scaler's decision at that epoch's end
(the event names it, the decision record lists it) and is used when it pays (a 4x faster GPU,
re-placement charged nothing); every placement first asks Ray's autoscaler for the allocation's
bundles (``request_resources``), and the request is cleared when the run ends.
"""
from __future__ import annotations

import pytest

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, running_cluster, tiny_data
from jabasray.actors import cluster_view
from jabasray.actors.driver import DriverCallback, DriverOptions, JabasDriver
from jabasray.actors.placement import ray_cluster_spec
from jabasray.config import JobConfig

pytestmark = pytest.mark.multinode

SPEEDS = {"fast": 1.0, "slow": 0.25}


@pytest.fixture(scope="module")
def cluster(without_session_ray):
    with running_cluster(dict(num_cpus=2, include_dashboard=False, resources={"gpu_slow": 1}), []) as c:
        yield c


class AddNode(DriverCallback):
    """Adds a node with one "fast" GPU after interval 0 of epoch 0, once."""

    def __init__(self, cluster) -> None:
        self.cluster, self.done = cluster, False

    def on_interval(self, driver, record):
        if not self.done and record.epoch == 0:
            self.done = True
            self.cluster.add_node(num_cpus=1, resources={"gpu_fast": 1})
            self.cluster.wait_for_nodes()


def test_a_node_added_mid_run_is_a_candidate_at_the_next_epoch_end(cluster, tmp_path, monkeypatch):
    requests = []
    real = cluster_view.request_resources
    monkeypatch.setattr(cluster_view, "request_resources",
                        lambda bundles: (requests.append([dict(b) for b in bundles]), real(bundles)))
    spec = ray_cluster_spec(speeds=SPEEDS)
    assert [n.gpu_type for n in spec.nodes] == ["slow"]
    ds, _ = tiny_data(96)
    job = JobConfig(epochs=2, initial_global_batch=16, min_global_batch=8, max_global_batch=32,
                    min_local_batch=4, adapt_interval=2, autoscale=True, replacement_cost_s=0.0, seed=1)
    add = AddNode(cluster)
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, spec, tmp_path / "grow",
                      perf_model=perf_model(SPEEDS), callbacks=[add], options=DriverOptions())
    hist = drv.run()
    assert add.done and len(hist.epochs) == 2
    slow = spec.nodes[0].name
    fast = next(n.name for n in drv.view.candidates().nodes if n.gpu_type == "fast")
    assert hist.epochs[0].allocation == {slow: 1}
    decision = hist.epochs[0].decision
    assert any(fast in c["allocation"] for c in decision["candidates"])
    assert hist.epochs[1].allocation.get(fast) == 1          # the 4x faster GPU pays
    assert any("the cluster offers" in m and fast in m for m in hist.events)
    # a request per placed allocation, then cleared
    assert requests[0] == [{"gpu_slow": 1.0}]
    assert {"gpu_fast": 1.0} in requests[1]
    assert requests[-1] == [] and drv.view.requested is None
