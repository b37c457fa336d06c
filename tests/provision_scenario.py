"""The job of ``test_cluster_provision.py``, run in a child interpreter on the fake autoscaling
cluster (``autoscaling_cluster.FakeAutoscalingCluster.run_child``): the test process never
connects to that cluster (see the notes of ``autoscaling_cluster``).

``python provision_scenario.py OUT.json RUN_DIR``: connects to ``JABASRAY_TEST_ADDRESS``, runs
the job, writes what the test checks to OUT.json (plain facts: the nodes the GCS saw and their
lifetimes, the records of the run and its GPU-seconds held, the requests to Ray's autoscaler,
the nodes alive at every interval, how long the launched nodes took to go after it), exits 0; any exception exits
non-zero with its traceback on stderr.

The job's global batch follows :data:`SCRIPT` (one B_G per epoch: 8, 32, 8, 8) instead of the
adaptive rule, and the forecaster forecasts the script's next epoch: the batch the rule would
take from the measured gradient similarity is not predictable enough to make the auto-scaler
grow and then shrink on a schedule, and both are tested on their own (``test_adaptive.py``,
``test_forecast.py``). What decides and provisions is the driver's own code: the auto-scaler
over the candidates (live and launchable nodes), the planner's model (the emulated speeds
slowed :data:`MODEL_SLOWDOWN` times, so that a 5 s launch is repaid by an epoch at B_G 32 on
4 GPUs instead of 2, and B_G 8 cannot use more than 2 GPUs of local batch 4), the requests.
In epoch 2, after the shrink, :class:`Watch` holds the epoch at its first interval until the
node the job let go has left (at most :data:`RELEASE_S`), so that the node count drops
mid-run, as it does when epochs are longer than the autoscaler's idle timeout.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, tiny_data  # noqa: E402
from jabasray.actors import cluster_view, driver, ray_internals  # noqa: E402
from jabasray.actors.driver import DriverCallback, DriverOptions, JabasDriver  # noqa: E402
from jabasray.adaptive import AdaptiveBatchController  # noqa: E402
from jabasray.config import JobConfig  # noqa: E402
from jabasray.types import ClusterSpec, NodeType  # noqa: E402

SPEEDS = {"fast": 1.0, "slow": 0.5}
MODEL_SLOWDOWN = 1000.0
SAMPLES = 96
LAUNCH_S = 5.0
SCRIPT = [8, 32, 8, 8]   # B_G per epoch: grow after epoch 0, shrink after epoch 1
ADAPT_INTERVAL = 2
RELEASE_S = 60.0         # the node let go must leave within this (idle timeout 3 s)
GONE_S = 120.0           # the launched nodes must be gone this long after the run


def scripted(epoch: int) -> int:
    return SCRIPT[min(epoch, len(SCRIPT) - 1)]


class ScriptedBatch(AdaptiveBatchController):
    """B_G of :data:`SCRIPT` for the epoch being run, whatever Phi says."""

    def propose(self, phi: float) -> int:
        return scripted(self.epoch)

    def end_epoch(self) -> list[int]:
        closed = super().end_epoch()
        self._state.global_batch = scripted(self.epoch)
        return closed


def scripted_forecast(trajectories, job, dataset_size):
    """The next epoch's B_G of :data:`SCRIPT`, one value per interval of p iterations."""
    b = scripted(len(trajectories))
    return [float(b)] * math.ceil(dataset_size / (b * job.adapt_interval))


def is_head(node: dict) -> bool:
    return "node:__internal_head__" in node.get("Resources", {})


def alive() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]


class Watch(DriverCallback):
    """The alive nodes at every interval; in epoch 2, at its first interval, waits until a
    GPU node the allocation does not use has left, noting the time around each read."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.polls: list[dict] = []   # {"t0", "t1", "alive"}: a read of ray.nodes() between t0 and t1

    def on_interval(self, driver, record):
        if record.epoch == 2 and record.interval == 0:
            used = {s.ray_node_id for s in driver.slots()}
            deadline = time.monotonic() + RELEASE_S
            while time.monotonic() < deadline:
                t0 = time.time()
                nodes = alive()
                self.polls.append({"t0": t0, "t1": time.time(),
                                   "alive": sorted(n["NodeID"] for n in nodes)})
                if {n["NodeID"] for n in nodes if not is_head(n)} <= used:
                    break
                time.sleep(0.2)
        self.seen.append({"epoch": record.epoch, "interval": record.interval,
                          "alive": sorted(n["NodeID"] for n in alive())})


def main(out_path: str, run_dir: str) -> None:
    ray.init(address=os.environ["JABASRAY_TEST_ADDRESS"], log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    out: dict = {"alive_before": [n["NodeID"] for n in alive()]}
    requests, held = [], []
    real_request, real_held = cluster_view.request_resources, cluster_view.ClusterView.held_seconds

    def request(bundles):
        requests.append({"t": time.time(), "bundles": [dict(b) for b in bundles]})
        real_request(bundles)

    def held_seconds(view, current, t0, t1):
        got = real_held(view, current, t0, t1)
        held.append({"t0": t0, "t1": t1, "gpu_seconds": got})
        return got

    cluster_view.request_resources = request
    cluster_view.ClusterView.held_seconds = held_seconds
    driver.AdaptiveBatchController = ScriptedBatch
    driver.forecast_next_epoch = scripted_forecast
    spec = ClusterSpec(nodes=[], node_types=[
        NodeType("fast", "fast", 2, max_workers=2, speed=SPEEDS["fast"], launch_s=LAUNCH_S),
        NodeType("slow", "slow", 2, max_workers=2, speed=SPEEDS["slow"], launch_s=LAUNCH_S)])
    ds, _ = tiny_data(SAMPLES)
    job = JobConfig(epochs=len(SCRIPT), initial_global_batch=SCRIPT[0], min_global_batch=min(SCRIPT),
                    max_global_batch=max(SCRIPT), min_local_batch=4, adapt_interval=ADAPT_INTERVAL,
                    autoscale=True, seed=1, replacement_cost_s=0.0)
    watch = Watch()
    model = perf_model({t: s / MODEL_SLOWDOWN for t, s in SPEEDS.items()})
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, spec, run_dir, perf_model=model,
                      callbacks=[watch], options=DriverOptions(placement_timeout_s=120, record_samples=True))
    hist = drv.run()
    out["epochs"] = [{"allocation": e.allocation, "replaced": e.replaced,
                      "trajectory": e.trajectory,
                      "served": sorted(i for r in hist.intervals if r.epoch == e.epoch for i in r.served),
                      "served_exactly_once": e.served_exactly_once,
                      "time_s": e.time_s, "train_time_s": e.train_time_s,
                      "held_gpu_seconds": e.held_gpu_seconds, "start_s": e.start_s,
                      "decision": e.decision}
                     for e in hist.epochs]
    out["held"] = held
    out["run_held"] = hist.held.to_dict()   # the whole run's GPU-seconds held, in parts
    out["requests"] = requests
    out["names"] = dict(drv.view.names)              # Ray node id -> the name the job knows it by
    out["requested_after"] = drv.view.requested
    out["paid_from"] = dict(drv.view.paid_from)       # launched node id -> when the job asked for it
    out["seen"], out["polls"] = watch.seen, watch.polls
    t0 = time.monotonic()
    while len(alive()) > 1 and time.monotonic() - t0 < GONE_S:
        time.sleep(0.2)
    out["alive_after"] = [n["NodeID"] for n in alive()]
    out["lifetimes"] = ray_internals.node_lifetimes()   # every node's start and end, as the GCS recorded them
    out["nodes"] = [{"id": x["node_id"], "head": "node:__internal_head__" in x["resources"],
                     "gpus": {k: v for k, v in x["resources"].items()       # not placement groups'
                              if k.startswith("gpu_") and "_group_" not in k}}
                    for x in out["lifetimes"]]           # every node the GCS saw, dead ones too
    with open(out_path, "w") as f:
        json.dump(out, f)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
