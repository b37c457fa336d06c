"""Placement and re-placement time of GPU actors vs the number of actors, on several Ray nodes.

A ``ray.cluster_utils.Cluster`` of five raylets on this machine, each a node with 2 emulated
GPUs (``gpu_fast``), stands for a five-node cluster. For n = 2, 4, 8 actors (1, 2, 4 GPU pairs on
as many nodes) every round times, in alternating order (A B C / C B A), three ways to reach the
same placed, set-up job (``ActorPool.place``: placement groups ready, GPU actors started, joined
in one gloo process group, model built):

* ``pinned``: a fresh placement where every pair's placement group names its node (the
  ``ray.io/node-id`` label selector; a cluster detected from Ray);
* ``unpinned``: the same allocation without node ids (a cluster file; Ray picks the nodes);
* ``replace``: the re-placement after an allocation change that moves ONE pair to another node
  (from nodes 1..k to nodes 0..k-1): the other pairs keep their actors, which only join the new
  process group; timed from the change to the set-up job.

Per round it reports ``pinned / unpinned`` (the cost of pinning) and ``replace / pinned`` (what
keeping pairs saves over placing everything anew), then the medians of the per-round ratios.
Time to a result here is the time until the job can train (what ``place`` returns after).

Usage: ``python benchmarks/placement.py [--rounds 3] [--out PATH]``.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from common import default_out, write_json

NODES = 5          # raylets, 2 emulated GPUs each
SIZES = (2, 4, 8)  # actors
KEYS = ("pinned", "unpinned", "replace", "pinned_over_unpinned", "replace_over_pinned")


def make_pool(job, data_ref):
    import ray
    import torch

    from jabasray.actors.gpu_actor import GPUActor
    from jabasray.actors.pool import ActorPool
    from jabasray.models import MLP

    remote = ray.remote(GPUActor)

    def make(slot, world, opts):
        return remote.options(**opts).remote(slot, world, job, lambda: MLP(64, (32,), 10),
                                             lambda p: torch.optim.SGD(p, lr=0.05),
                                             torch.nn.functional.cross_entropy, data_ref, "cpu", True)

    return ActorPool(make, "cpu", True, placement_timeout_s=120, collective_timeout_s=120,
                     failure_grace_s=10, label="bench")


def timed_place(job, data_ref, slots, before=None) -> float:
    """Seconds of ``pool.place(slots)`` (after placing ``before`` untimed, if given)."""
    pool = make_pool(job, data_ref)
    try:
        if before is not None:
            pool.place(before)
        t0 = time.perf_counter()
        pool.place(slots)
        return time.perf_counter() - t0
    finally:
        pool.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=default_out('placement.json'))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")

    import ray
    import torch
    from ray.cluster_utils import Cluster

    from jabasray.actors.placement import ray_cluster_spec, slots_for
    from jabasray.config import JobConfig
    from jabasray.types import ClusterSpec

    t_start = time.perf_counter()
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False,
                                                          resources={"gpu_fast": 2}))
    for _ in range(NODES - 1):
        c.add_node(num_cpus=0, resources={"gpu_fast": 2})
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    c.wait_for_nodes()
    cluster_up = time.perf_counter() - t_start
    try:
        pinned_spec = ray_cluster_spec(speeds={"fast": 1.0})
        order = [n.name for n in pinned_spec.nodes]
        unpinned_spec = ClusterSpec(nodes=[replace(n, ray_node_id=None) for n in pinned_spec.nodes])
        job = JobConfig(seed=0, initial_global_batch=32, min_global_batch=8, min_local_batch=4)
        data = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
        data_ref = ray.put(data)
        timed_place(job, data_ref, slots_for(pinned_spec, {order[0]: 2}))   # warm-up, not recorded
        rows = []

        def save(rows: list[dict], announce: bool = False) -> dict:
            summary = {}
            for n in SIZES:
                mine = [r for r in rows if r["actors"] == n]
                if mine:
                    summary[n] = {key: statistics.median(r[key] for r in mine) for key in KEYS}
            write_json(args.out, {"args": vars(args), "nodes": NODES, "cluster_start_s": cluster_up,
                                  "loadavg_now": os.getloadavg(), "rounds": rows,
                                  "median": {str(k): v for k, v in summary.items()}},
                       announce=announce)
            return summary

        def contenders(n: int) -> dict:
            k = n // 2
            target = {name: 2 for name in order[:k]}          # allocations count GPUs: a pair each
            before = {name: 2 for name in order[1:k + 1]}
            return {
                "pinned": lambda: timed_place(job, data_ref, slots_for(pinned_spec, target)),
                "unpinned": lambda: timed_place(job, data_ref, slots_for(unpinned_spec, target)),
                "replace": lambda: timed_place(job, data_ref, slots_for(pinned_spec, target),
                                               before=slots_for(pinned_spec, before)),
            }

        for r in range(args.rounds):       # rounds outside: a run cut short has every size
            for n in SIZES:
                runs = contenders(n)
                names = list(runs) if r % 2 == 0 else list(reversed(runs))
                times = {name: runs[name]() for name in names}
                row = {"actors": n, "round": r, "order": names, **times,
                       "pinned_over_unpinned": times["pinned"] / times["unpinned"],
                       "replace_over_pinned": times["replace"] / times["pinned"],
                       "loadavg": os.getloadavg()[0]}
                rows.append(row)
                print(f"n={n} round {r}: pinned {times['pinned']:.2f}s unpinned {times['unpinned']:.2f}s "
                      f"replace {times['replace']:.2f}s  pinned/unpinned "
                      f"{row['pinned_over_unpinned']:.2f} replace/pinned {row['replace_over_pinned']:.2f} "
                      f"(load {row['loadavg']:.1f})", flush=True)
                save(rows)   # after every round: a run cut short still leaves its rounds
        for n, s in save(rows, announce=True).items():   # medians of the per-round figures
            print(f"n={n} median: pinned {s['pinned']:.2f}s unpinned {s['unpinned']:.2f}s "
                  f"replace {s['replace']:.2f}s; ratios pinned/unpinned {s['pinned_over_unpinned']:.2f} "
                  f"replace/pinned {s['replace_over_pinned']:.2f}")
    finally:
        ray.shutdown()
        c.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
