"""Provisioning through Ray's autoscaler, on a fake autoscaling cluster of this machine
(``autoscaling_cluster``): a head without GPUs, two worker node types (``fast``: 2 emulated
"fast" GPUs, ``slow``: 2 "slow" ones, at most 2 nodes each, an idle timeout of 6 s) whose fake
node provider starts a raylet per launched node.

The job runs in a child interpreter (``provision_scenario.py``) with the cluster's environment;
this process only starts the cluster, reads what the child wrote and ends the cluster's
processes: nothing of the cluster (a connection, an environment variable, an address file, a
process) outlives the module. One cluster and one run for the module; the tests below check
different facts of that run.

Proves: a job given only the node types (no GPU node is alive) plans on launchable nodes
(charged their launch time), ``fit``'s request to Ray's autoscaler launches exactly the nodes
of the chosen allocation and the actors train on them (each epoch serves every sample once);
the launched nodes keep their candidates' names, so a second epoch on the same allocation
keeps its actors; after the run the request is cleared and the autoscaler lets the nodes go
(the head alone within its idle timeout). The GPU-hours reported are those of the nodes held:
epoch 1, with both launched nodes alive throughout, holds their 4 GPUs for the whole epoch, and
so does epoch 0 from its request on (a node is paid from its launch, not from when it joins).
"""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from autoscaling_cluster import FakeAutoscalingCluster

pytestmark = pytest.mark.multinode

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_TYPES = {
    "fast": {"resources": {"CPU": 1, "gpu_fast": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
    "slow": {"resources": {"CPU": 1, "gpu_slow": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
}
SAMPLES = 96        # provision_scenario.SAMPLES
CHILD_S = 400       # the whole job with its node launches; generous for a loaded 2-core machine


def _environment() -> dict[str, str]:
    """This process's environment, less the variable pytest itself sets per test."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _current_cluster_file() -> str | None:
    """The machine's current-cluster file (what a later ``ray.init()`` would connect to)."""
    from ray._common.utils import get_ray_address_file
    path = get_ray_address_file(None)
    return open(path).read() if os.path.exists(path) else None


@pytest.fixture(scope="module")
def run(without_session_ray, tmp_path_factory):
    """The scenario's facts (``provision_scenario.py``), from one run on one cluster."""
    folder = tmp_path_factory.mktemp("provision")
    env, current = _environment(), _current_cluster_file()
    cluster = FakeAutoscalingCluster(WORKER_TYPES)
    try:
        cluster.start()
        done = cluster.run_child(os.path.join(HERE, "provision_scenario.py"),
                                 [str(folder / "out.json"), str(folder / "run")], CHILD_S)
        if done.returncode != 0:
            pytest.fail(f"the job on the autoscaling cluster failed (exit {done.returncode}):\n"
                        f"{done.stderr[-4000:]}\n--- Ray logs of the cluster ---\n{cluster.log_digest()}",
                        pytrace=False)
        yield json.loads((folder / "out.json").read_text())
    finally:
        left = cluster.stop()
        assert not left, f"processes of the autoscaling cluster still alive: {left}"
        # nothing else left behind for the modules after this one
        assert not os.path.exists(cluster.temp) and _environment() == env
        assert _current_cluster_file() == current


def test_only_the_head_before_the_run(run):
    assert len(run["alive_before"]) == 1


def test_fit_launches_exactly_the_nodes_of_the_chosen_allocation(run):
    first = run["epochs"][0]["allocation"]
    assert first and all("+" in name for name in first)      # launchable nodes, chosen at start
    launched = [n for n in run["nodes"] if not n["head"]]
    # the nodes the GCS saw besides the head are those the allocation names, of their types
    by_name = {run["names"][n["id"]]: n for n in launched}
    assert set(by_name) == set(first), (by_name, first)
    for name, gpus in first.items():
        node_type = name.split("+")[0]
        assert by_name[name]["gpus"] == {f"gpu_{node_type}": 2.0}
        assert gpus <= 2
    assert Counter(name.split("+")[0] for name in first) == \
        Counter(next(iter(n["gpus"]))[4:] for n in launched)
    # every interval ran with the allocation's nodes alive
    ids = {n["id"] for n in launched}
    assert run["seen"] and all(ids <= set(seen) for seen in run["seen"])


def test_a_second_epoch_on_the_same_allocation_keeps_its_actors(run):
    first, second = run["epochs"]
    assert second["allocation"] == first["allocation"] and not second["replaced"]


def test_each_epoch_serves_every_sample_once(run):
    for e in run["epochs"]:
        assert e["served"] == list(range(SAMPLES)) and e["served_exactly_once"] is True


def test_candidates_on_nodes_to_launch_are_charged_their_launch_time(run):
    # after epoch 0 the chosen nodes are live: what still has to be launched is charged 5 s
    charged = run["epochs"][0]["launch_s"]
    assert 5.0 in charged and set(charged) <= {0.0, 5.0}


def test_the_request_is_cleared_and_the_nodes_go(run):
    assert run["requested_after"] is None
    assert len(run["alive_after"]) == 1, \
        f"{len(run['alive_after'])} nodes alive 120 s after the run (idle timeout 6 s)"


def test_the_gpu_hours_reported_are_those_of_the_nodes_held(run):
    first, second = run["epochs"]
    gpus = sum(first["allocation"].values())
    assert gpus == 4
    # epoch 1: every GPU of both nodes for the whole epoch (nodes alive before it began)
    assert second["held_gpu_seconds"] == pytest.approx(gpus * second["time_s"], rel=1e-9)
    # epoch 0: the nodes held from the request (the epoch's first step) on, launch included
    assert gpus * (first["time_s"] - 1.0) <= first["held_gpu_seconds"] <= gpus * first["time_s"] * (1 + 1e-9)
    assert first["time_s"] - first["train_time_s"] > 1.0     # ... which took a while
