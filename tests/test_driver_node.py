"""Where the driver actor runs: on the head node, as the README says, also when a worker node
offers more CPUs. A ``ray.cluster_utils.Cluster`` of a head (1 CPU) and a worker (4 CPUs),
started once for the module.

Ray 2.60 places an actor that asks for no resource on any node, whatever its soft node
affinity (about half of such actors land on the worker), so each of several drivers started
here must say it runs on the head. The drivers are given an empty job (their construction fails
at once): where the actor lands is decided before its job is read, and each one ends as soon as
the test collected its error.
"""
from __future__ import annotations

import time

import pytest

from actors_helpers import running_cluster
from jabasray.actors import run_client
from jabasray.actors.driver import DriverOptions

pytestmark = pytest.mark.multinode

DRIVERS = 6      # an actor placed by chance passes all six with probability 1/64


@pytest.fixture(scope="module")
def cluster(without_session_ray):
    with running_cluster(dict(num_cpus=1, include_dashboard=False), [dict(num_cpus=4)]) as c:
        yield c


def head_node_id() -> str:
    import ray
    return next(n["NodeID"] for n in ray.nodes()
                if n["Alive"] and "node:__internal_head__" in n["Resources"])


def settled_status(name: str, timeout: float = 180.0) -> dict:
    """The status of run ``name`` once its driver has read its job (here: failed on it)."""
    t0 = time.monotonic()
    while True:
        st = run_client.status(name)
        if st["state"] == "failed":
            return st
        assert time.monotonic() - t0 < timeout, f"run {name} still {st['state']}"
        time.sleep(0.2)


def test_the_driver_actor_runs_on_the_head_node(cluster):
    head = head_node_id()
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
