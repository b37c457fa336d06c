"""The all-reduce fit measured on the placed actors, on a ``ray.cluster_utils.Cluster`` of two
raylets (a head with 2 emulated "fast" GPUs, a node with 1 emulated "slow" one), started once.

Proves: a run placed across both nodes times all-reduces with the job's backend (gloo) on its
own placed actors (the ranks answer from the nodes the actors run on), fits the inter-node Eq. 3
to the slowest rank's times exactly as ``AllReduceFit.fit`` does on the recorded measurement, and
the model the plans use then has Eq. 4 over that fit as its comm time; a run on one node fits the
intra-node Eq. 3, a second placement of the same (backend, world size, span) measures nothing,
and a resumed run (a new driver on the run's checkpoint) measures nothing and plans with the
checkpointed fit; every epoch record says which fit its plans used.
"""
from __future__ import annotations

import pytest

from actors_helpers import loss_fn, model_fn, optimizer_fn, profile, running_cluster, tiny_data
from jabasray.actors.allreduce_fit import fit_description, measurement_sizes, record_fit
from jabasray.actors.checkpoint import latest_checkpoint
from jabasray.actors.driver import DriverCallback, DriverOptions, JabasDriver
from jabasray.config import JobConfig
from jabasray.profiles import AllReduceFit
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.multinode

PROFILES = {"fast": profile("fast", 1.0), "slow": profile("slow", 0.5)}


@pytest.fixture(scope="module")
def cluster(without_session_ray):
    """GPU actors need no CPU (emulated GPUs are custom resources); the test runs the driver."""
    with running_cluster(dict(num_cpus=1, include_dashboard=False, resources={"gpu_fast": 2}),
                         [dict(num_cpus=1, resources={"gpu_slow": 1})]) as c:
        yield c


def job(epochs: int) -> JobConfig:
    return JobConfig(epochs=epochs, initial_global_batch=32, min_global_batch=16, max_global_batch=64,
                     min_local_batch=4, adapt_interval=2, autoscale=False, seed=1)


def driver(run_dir, epochs: int, cluster: ClusterSpec, callbacks=(), **opts) -> JabasDriver:
    ds, _ = tiny_data(96)
    return JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job(epochs), cluster, run_dir,
                       profiles=PROFILES, callbacks=list(callbacks),
                       options=DriverOptions(failure_grace_s=10, placement_timeout_s=60,
                                             evaluate=False, **opts))


class Where(DriverCallback):
    """At every epoch's first interval: (pid, node id) of every placed actor, rank order."""

    def __init__(self) -> None:
        self.epochs: dict[int, list[tuple[int, str]]] = {}

    def on_interval(self, drv, record):
        import ray
        if record.interval == 0:
            pings = ray.get([a.ping.remote() for a in drv.gpu_actors()])
            self.epochs[record.epoch] = [(p["pid"], p["node_id"]) for p in pings]


def reference(rec: dict, multi_node: bool) -> AllReduceFit:
    """Eq. 3 fitted to the recorded measurement: the slowest rank per size."""
    slowest = [max(ts) for ts in zip(*rec["rank_times"])]
    prof = PROFILES["fast"]
    k = (prof.allreduce_inter if multi_node else prof.allreduce_intra).bandwidth
    return AllReduceFit.fit(rec["sizes"], slowest, num_gpus=len(rec["rank_times"]), bandwidth=k)


def eq4(fit: AllReduceFit, gpu: str, n: int) -> float:
    return sum(fit.time(b, n) for b in PROFILES[gpu].bucket_sizes)


def test_a_run_across_nodes_measures_the_inter_node_fit_on_its_actors(cluster, tmp_path):
    spec = ClusterSpec(nodes=[NodeSpec("f", "fast", 1, speed=1.0), NodeSpec("s", "slow", 1, speed=0.5)])
    where = Where()
    drv = driver(tmp_path / "inter", 1, spec, [where])
    hist = drv.run()

    assert drv.allreduce.measured == ["gloo/2/inter"]          # the job's backend, 2 ranks, 2 nodes
    rec = drv.allreduce.records["gloo/2/inter"]
    placed = where.epochs[0]
    assert rec["nodes"] == [node for _, node in placed] and len(set(rec["nodes"])) == 2
    assert rec["sizes"] == measurement_sizes(PROFILES["fast"].bucket_sizes) == [2500, 5000, 10000, 20000]
    assert len(rec["rank_times"]) == 2 and all(len(t) == 4 and min(t) > 0 for t in rec["rank_times"])
    fit = reference(rec, multi_node=True)
    assert record_fit(rec) == fit and fit.num_gpus == 2
    model = drv.planner.alloc_model(2, True)                   # what the plans on f + s use
    for g in ("fast", "slow"):
        assert model.comm_time(g) == eq4(fit, g, 2)
        assert model.comm_time(g) != eq4(PROFILES[g].allreduce_inter, g, 2)
    assert hist.epochs[0].allreduce_fit == fit_description("measured", fit, 2, True)
    assert hist.epochs[0].allreduce_fit["source"] == "measured"
    assert latest_checkpoint(tmp_path / "inter").load_driver_state().allreduce_fits == drv.allreduce.records


def test_one_node_fits_intra_once_and_a_resumed_run_does_not_measure_again(cluster, tmp_path):
    spec = ClusterSpec(nodes=[NodeSpec("f", "fast", 2, speed=1.0)])
    run = tmp_path / "intra"
    where = Where()
    first = driver(run, 2, spec, [where], force_replacement=True)   # fresh actors every epoch
    hist = first.run()

    # two placements of the same key (new processes at epoch 2), one measurement
    assert any("epoch 2: re-placing actors" in m for m in hist.events)
    assert {p for p, _ in where.epochs[0]}.isdisjoint(p for p, _ in where.epochs[1])
    assert first.allreduce.measured == ["gloo/2/intra"]
    rec = first.allreduce.records["gloo/2/intra"]
    assert rec["nodes"] == [node for _, node in where.epochs[0]] and len(set(rec["nodes"])) == 1
    fit = reference(rec, multi_node=False)
    assert record_fit(rec) == fit
    assert first.planner.alloc_model(2, False).comm_time("fast") == eq4(fit, "fast", 2)
    described = fit_description("measured", fit, 2, False)
    assert [e.allreduce_fit for e in hist.epochs] == [described, described]

    resumed = driver(run, 3, spec)                              # a new driver on the checkpoint
    hist = resumed.run()
    assert any("resumed from" in m for m in hist.events)
    assert resumed.allreduce.measured == [] and resumed.allreduce.records == first.allreduce.records
    assert resumed.planner.alloc_model(2, False).comm_time("fast") == eq4(fit, "fast", 2)
    assert [e.allreduce_fit for e in hist.epochs] == [described] * 3
