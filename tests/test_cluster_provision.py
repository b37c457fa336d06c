"""Provisioning through Ray's autoscaler, on a fake autoscaling cluster of this machine
(``autoscaling_cluster``): a head without GPUs, two worker node types (``fast``: 2 emulated
"fast" GPUs, ``slow``: 2 "slow" ones, at most 2 nodes each, an idle timeout of 3 s) whose fake
node provider starts a raylet per launched node.

The job runs in a child interpreter (``provision_scenario.py``) with the cluster's environment;
this process only starts the cluster, reads what the child wrote and ends the cluster's
processes: nothing of the cluster (a connection, an environment variable, an address file, a
process) outlives the module. One cluster and one run for the module; the tests below check
different facts of that run. The run's global batch follows a script (8, 32, 8, 8 per epoch;
the scenario's notes say why); the auto-scaler decides on it.

Proves: a job given only the node types (no GPU node is alive) plans on launchable nodes
(charged their launch time) and ``fit``'s request to Ray's autoscaler launches exactly the node
of the chosen allocation; when the batch grows and the model says a second node repays its
launch, the job asks for it, the autoscaler launches it and the next epoch trains on both; when
the batch shrinks, the job lowers its request and the autoscaler lets the node it no longer
uses go while the run goes on (the node count drops mid-run); an epoch on the same allocation
keeps its actors; every epoch serves every sample once; after the run the request is cleared
and the head is alone again. The GPU-seconds each epoch reports as held equal those computed
here from the nodes' lifetimes as the GCS recorded them after the run (a launched node paid
from the request that asked for it), and the GCS's end of the node let go lies between the last
read that saw it alive and the first that did not. So does the run's figure, from the driver's
start to the run's end, part by part (before, inside, between and after the epochs: parts that
sum to it exactly), and it names the GPUs the job still held at its end.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from autoscaling_cluster import FakeAutoscalingCluster

pytestmark = pytest.mark.multinode

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_TYPES = {
    "fast": {"resources": {"CPU": 1, "gpu_fast": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
    "slow": {"resources": {"CPU": 1, "gpu_slow": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
}
SAMPLES = 96        # provision_scenario.SAMPLES
# how long a node no request needs stays idle before the autoscaler removes it: the scenario
# waits for that twice (the node let go mid-run, the last node after the run); the nodes the job
# asks for are kept whatever the timeout (Ray's autoscaler never ends a node that
# request_resources needs)
IDLE_S = 3.0
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
    cluster = FakeAutoscalingCluster(WORKER_TYPES, idle_timeout_s=IDLE_S)
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


def gpu_nodes(run) -> dict[str, dict]:
    """The launched nodes by the name the job knows them by."""
    return {run["names"][n["id"]]: n for n in run["nodes"] if not n["head"]}


def test_only_the_head_before_the_run(run):
    assert len(run["alive_before"]) == 1


def test_the_batch_grows_then_shrinks_and_the_allocation_follows(run):
    ep = run["epochs"]
    assert [e["trajectory"] for e in ep] == [[8] * 6, [32] * 2, [8] * 6, [8] * 6]
    first, grown, shrunk, last = (e["allocation"] for e in ep)
    assert first == {"fast+0": 2}                              # launchable, chosen at start
    assert grown == {"fast+0": 2, "fast+1": 2}
    assert len(shrunk) == 1 and set(shrunk) < set(grown) and sum(shrunk.values()) == 2
    assert last == shrunk
    assert [e["replaced"] for e in ep] == [False, True, True, False]   # the last keeps its actors


def test_the_second_node_is_launched_because_the_model_says_it_pays(run):
    decision = run["epochs"][0]["decision"]
    assert {k: v for k, v in decision["chosen"].items() if v} == {"fast+0": 2, "fast+1": 2}
    by_alloc = {tuple(sorted((k, v) for k, v in c["allocation"].items() if v)): c
                for c in decision["candidates"]}
    stay, grow = by_alloc[(("fast+0", 2),)], by_alloc[(("fast+0", 2), ("fast+1", 2))]
    assert stay["launch_s"] == 0.0 and grow["launch_s"] == 5.0    # fast+0 is live: only fast+1 launches
    # staying is slower than growing with the launch charged (or pruned by a bound that says so)
    pruned = re.fullmatch(r"pruned: at least ([0-9.]+) s, slower than the best", stay["reason"])
    stay_s = stay["epoch_time_s"] if stay["epoch_time_s"] is not None else float(pruned.group(1))
    assert grow["epoch_time_s"] + grow["launch_s"] < stay_s
    assert {c["launch_s"] for c in decision["candidates"]} == {0.0, 5.0}


def test_each_request_asks_for_the_bundles_of_the_allocation_then_none(run):
    asked = [r["bundles"] for r in run["requests"]]
    assert asked == [[{"gpu_fast": 1.0}] * 2, [{"gpu_fast": 1.0}] * 4, [{"gpu_fast": 1.0}] * 2, []]
    assert run["requested_after"] is None


def test_the_autoscaler_launches_exactly_the_nodes_asked_for(run):
    nodes = gpu_nodes(run)
    assert set(nodes) == {"fast+0", "fast+1"}
    assert all(n["gpus"] == {"gpu_fast": 2.0} for n in nodes.values())
    ids = {name: n["id"] for name, n in nodes.items()}
    head = next(n["id"] for n in run["nodes"] if n["head"])
    seen = {}
    for s in run["seen"]:
        seen.setdefault(s["epoch"], []).append(set(s["alive"]))
    shrunk = next(iter(run["epochs"][2]["allocation"]))
    # every interval ran with its allocation's nodes alive, and no node it did not ask for
    assert all(a == {head, ids["fast+0"]} for a in seen[0])
    assert all(a == {head, ids["fast+0"], ids["fast+1"]} for a in seen[1])
    assert all(a == {head, ids[shrunk]} for a in seen[2] + seen[3])


def test_the_node_let_go_leaves_mid_run(run):
    polls = run["polls"]
    gone = next(name for name in gpu_nodes(run) if name not in run["epochs"][2]["allocation"])
    gone_id = gpu_nodes(run)[gone]["id"]
    assert gone_id in polls[0]["alive"] and gone_id not in polls[-1]["alive"]
    # it left while epoch 2 ran: the epoch's window holds its end
    end = next(x["end_s"] for x in run["lifetimes"] if x["node_id"] == gone_id)
    window = run["held"][2]
    assert window["t0"] < end < window["t1"]
    # the GCS's end lies between the last read that saw the node alive and the first that did not
    last_alive = max(p["t0"] for p in polls if gone_id in p["alive"])
    first_gone = min(p["t1"] for p in polls if gone_id not in p["alive"])
    assert last_alive <= end <= first_gone


def test_each_epoch_serves_every_sample_once(run):
    for e in run["epochs"]:
        assert e["served"] == list(range(SAMPLES)) and e["served_exactly_once"] is True


def test_the_request_is_cleared_and_the_nodes_go(run):
    assert len(run["alive_after"]) == 1, \
        f"{len(run['alive_after'])} nodes alive 120 s after the run (idle timeout {IDLE_S:g} s)"


def reference_held(run, t0: float, t1: float) -> float:
    """GPU-seconds of the launched nodes in [t0, t1], from their lifetimes as the GCS recorded
    them after the run, each paid from when the job asked for it."""
    life = {x["node_id"]: x for x in run["lifetimes"]}
    total = 0.0
    for name, node in gpu_nodes(run).items():
        x, asked = life[node["id"]], run["paid_from"][node["id"]]
        assert x["start_s"] >= asked and x["end_s"] is not None   # launched after, gone by now
        total += sum(node["gpus"].values()) * max(0.0, min(x["end_s"], t1) - max(asked, t0))
    return total


def test_a_launched_node_is_paid_from_the_request_that_asked_for_it(run):
    """fast+0 from the first request, fast+1 from the second (the grown allocation's): the
    time the job noted right before the call its request went through (the scenario's spy)."""
    asked = {"fast+0": run["requests"][0]["t"], "fast+1": run["requests"][1]["t"]}
    for name, node in gpu_nodes(run).items():
        assert asked[name] - 1.0 < run["paid_from"][node["id"]] <= asked[name]


def test_the_gpu_hours_reported_are_those_of_the_nodes_held(run):
    held = run["held"]
    assert len(held) == len(run["epochs"])
    for e, window in zip(run["epochs"], held):
        assert window["t1"] - window["t0"] == pytest.approx(e["time_s"], abs=1e-6)
        # the GCS's records read at the epoch's end and after the run: equal up to the float
        # rounding of unix times (~1.8e9 s carry ~2.4e-7 s: 1e-5 GPU-s bounds a few terms)
        assert e["held_gpu_seconds"] == window["gpu_seconds"]
        assert e["held_gpu_seconds"] == pytest.approx(reference_held(run, window["t0"], window["t1"]),
                                                      rel=0, abs=1e-5)
    first, grown, shrunk, last = run["epochs"]
    # epoch 0: its node paid from the request (the epoch's first step), its launch included
    assert 2 * (first["time_s"] - 1.0) <= first["held_gpu_seconds"] <= 2 * first["time_s"]
    assert first["time_s"] - first["train_time_s"] > 1.0
    assert 2 * grown["time_s"] < grown["held_gpu_seconds"] < 4 * grown["time_s"]
    # epoch 2 held both nodes until one went; epoch 3 one node throughout
    assert 2 * shrunk["time_s"] < shrunk["held_gpu_seconds"] < 4 * shrunk["time_s"]
    assert last["held_gpu_seconds"] == pytest.approx(2 * last["time_s"], rel=0, abs=1e-5)


def test_the_run_total_is_the_nodes_held_from_its_start_to_its_end(run):
    """The run's figure, part by part, equals the GPU-seconds computed here from the nodes'
    lifetimes over the same spans (the epochs' windows as each epoch recorded its own); the
    parts sum to the total exactly. Nothing is held before the first epoch (the head has no
    GPU; the first launch is asked for in epoch 0), the launched nodes between the epochs and
    after the last. Not counted, and said: the node the job held at its end stays until the
    autoscaler removes it, its 2 GPUs the ones the figure names."""
    h, epochs = run["run_held"], run["epochs"]
    windows = [(w["t0"], w["t1"]) for w in run["held"]]
    assert [(e["start_s"], e["start_s"] + e["time_s"]) for e in epochs] == windows
    assert h["epochs_counted"] == [0, 1, 2, 3]
    assert h["total"] == h["before_first_epoch"] + h["inside_epochs"] + h["between_epochs"] + h["after_last_epoch"]
    assert h["inside_epochs"] == sum(e["held_gpu_seconds"] for e in epochs)
    gaps = [(a[1], b[0]) for a, b in zip(windows, windows[1:])]
    expected = {"before_first_epoch": reference_held(run, h["start_s"], windows[0][0]),
                "between_epochs": sum(reference_held(run, t0, t1) for t0, t1 in gaps),
                "after_last_epoch": reference_held(run, windows[-1][1], h["end_s"]),
                "total": reference_held(run, h["start_s"], h["end_s"])}
    for name, value in expected.items():   # 1e-5: the float rounding of unix times, as above
        assert h[name] == pytest.approx(value, rel=0, abs=1e-5), name
    assert h["before_first_epoch"] == 0.0 and h["between_epochs"] > 0 and h["after_last_epoch"] > 0
    life = {x["node_id"]: x for x in run["lifetimes"]}
    left = [n for n in gpu_nodes(run).values() if life[n["id"]]["end_s"] > h["end_s"]]
    assert h["launched_gpus_at_end"] == sum(sum(n["gpus"].values()) for n in left) == 2
    assert reference_held(run, h["end_s"], float("inf")) > 0   # held on after the run, not counted
