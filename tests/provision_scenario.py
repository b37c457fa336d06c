"""The job of ``test_cluster_provision.py``, run in a child interpreter on the fake autoscaling
cluster (``autoscaling_cluster.FakeAutoscalingCluster.run_child``): the test process never
connects to that cluster (see the notes of ``autoscaling_cluster``).

``python provision_scenario.py OUT.json RUN_DIR``: connects to ``JABASRAY_TEST_ADDRESS``, runs
the job, writes what the test checks to OUT.json (plain facts: the nodes the GCS saw, the
records of the run, how long the launched nodes took to go after it), exits 0; any exception
exits non-zero with its traceback on stderr.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, tiny_data  # noqa: E402
from jabasray.actors.driver import DriverCallback, DriverOptions, JabasDriver  # noqa: E402
from jabasray.config import JobConfig  # noqa: E402
from jabasray.types import ClusterSpec, NodeType  # noqa: E402

SPEEDS = {"fast": 1.0, "slow": 0.5}
SAMPLES = 96
LAUNCH_S = 5.0
GONE_S = 120.0   # the launched nodes must be gone this long after the run (idle timeout 6 s)


def is_head(node: dict) -> bool:
    return "node:__internal_head__" in node.get("Resources", {})


def alive() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]


class Watch(DriverCallback):
    """The alive nodes at every interval."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_interval(self, driver, record):
        self.seen.append(sorted(n["NodeID"] for n in alive()))


def main(out_path: str, run_dir: str) -> None:
    ray.init(address=os.environ["JABASRAY_TEST_ADDRESS"], log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    out: dict = {"alive_before": [n["NodeID"] for n in alive()]}
    spec = ClusterSpec(nodes=[], node_types=[
        NodeType("fast", "fast", 2, max_workers=2, speed=SPEEDS["fast"], launch_s=LAUNCH_S),
        NodeType("slow", "slow", 2, max_workers=2, speed=SPEEDS["slow"], launch_s=LAUNCH_S)])
    ds, _ = tiny_data(SAMPLES)
    job = JobConfig(epochs=2, initial_global_batch=16, min_global_batch=8, max_global_batch=32,
                    min_local_batch=4, adapt_interval=2, autoscale=True, seed=1,
                    replacement_cost_s=1e6)          # the second epoch stays where the first ran
    watch = Watch()
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, spec, run_dir,
                      perf_model=perf_model(SPEEDS), callbacks=[watch],
                      options=DriverOptions(placement_timeout_s=120, record_samples=True))
    hist = drv.run()
    out["epochs"] = [{"allocation": e.allocation, "replaced": e.replaced,
                      "served": sorted(i for r in hist.intervals if r.epoch == e.epoch for i in r.served),
                      "served_exactly_once": e.served_exactly_once,
                      "time_s": e.time_s, "train_time_s": e.train_time_s,
                      "held_gpu_seconds": e.held_gpu_seconds,
                      "launch_s": [c["launch_s"] for c in e.decision.get("candidates", [])]}
                     for e in hist.epochs]
    out["names"] = dict(drv.view.names)              # Ray node id -> the name the job knows it by
    out["requested_after"] = drv.view.requested
    out["seen"] = watch.seen
    out["nodes"] = [{"id": n["NodeID"], "head": is_head(n),
                     "gpus": {k: v for k, v in n["Resources"].items() if k.startswith("gpu_")}}
                    for n in ray.nodes()]           # every node the GCS saw, dead ones too
    t0 = time.monotonic()
    while len(alive()) > 1 and time.monotonic() - t0 < GONE_S:
        time.sleep(1)
    out["alive_after"] = [n["NodeID"] for n in alive()]
    with open(out_path, "w") as f:
        json.dump(out, f)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
