"""SMA under adaptive batching: when to restart (JobConfig.sma_restart), by convergence.

One GPU actor in this process (no Ray, 2 SMA learners, Crossbow Alg. 1) trains an MLP on
digits while B_G moves as adaptive batching moves it: every ``--interval`` iterations the global
batch changes along a fixed trajectory (32 -> 48 -> 64 -> ... -> 256, the sqrt LR rule follows
it), the same for every contender. Contenders: ``schedule`` (default: a B_G change only
rescales gamma), ``batch`` (restart from z at every B_G change), ``never``. Each round is one
seed; the contenders run in an order rotated every round. Per contender and round: the
validation accuracy of the central model z after every epoch and the epochs to ``--target``.

    flock /tmp/jabasray-bench.lock python benchmarks/sma_restart.py   # ~1-2 min on 2 cores
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch

from common import default_out, write_json

RULES = ("schedule", "batch", "never")


def trajectory(interval_index: int) -> int:
    """B_G of the k-th interval: 32, 48, 64, ... (+16 every interval), capped at 256."""
    return min(256, 32 + 16 * interval_index)


def run(rule: str, seed: int, epochs: int, interval: int, lr: float) -> dict:
    from jabasray.actors.gpu_actor import GPUActor, IntervalRequest
    from jabasray.actors.placement import Slot
    from jabasray.actors.rendezvous import Rendezvous
    from jabasray.config import JobConfig
    from jabasray.data import load_digits_split
    from jabasray.models import MLP

    train, val = load_digits_split(image=False)
    n = len(train)
    job = JobConfig(seed=seed, sync="sma", sma_learners=2, sma_restart=rule, initial_global_batch=32,
                    min_global_batch=32, max_global_batch=256, min_local_batch=8, adapt_interval=interval)
    slot = Slot(rank=0, node="n0", gpu_type="cpu", speed=1.0, group=0, pair=0)
    actor = GPUActor(slot, 1, job, lambda: MLP(64, (64,), 10),
                     lambda p: torch.optim.SGD(p, lr=lr), torch.nn.functional.cross_entropy,
                     train, "cpu", False)
    actor.setup(Rendezvous("127.0.0.1", 29500, 1))
    accs, restarts, k, it = [], 0, 0, 0
    Xv, yv = val.tensors
    t0 = time.perf_counter()
    try:
        for epoch in range(epochs):
            cursor = 0
            while cursor < n:
                bg = trajectory(k)
                actor.configure(2, 0, bg // 2)
                req = IntervalRequest(epoch=epoch, cursor=cursor, iteration=it, local_batch=bg // 2,
                                      layout=[2], num_iterations=min(interval, math.ceil((n - cursor) / bg)),
                                      base_lr=None, base_batch=32, lr_scaling="sqrt",
                                      warmup_iterations=0, similarity=False)
                reply = actor.run_interval(req)
                restarts += len(reply.sma_restarts)
                cursor, it, k = reply.end_cursor, it + reply.num_iterations, k + 1
            with torch.no_grad():
                z = actor.worker.model
                accs.append(float((z(Xv).argmax(1) == yv).float().mean()))
    finally:
        actor.shutdown()
    return {"val_accuracy": accs, "restarts": restarts, "seconds": time.perf_counter() - t0}


def epochs_to(accs: list[float], target: float) -> int | None:
    return next((i + 1 for i, a in enumerate(accs) if a >= target), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--interval", type=int, default=10, help="iterations between B_G changes (p)")
    ap.add_argument("--lr", type=float, default=0.1, help="the user's LR at B_G 32")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--out", default=default_out("sma_restart.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    rounds = []
    for r, seed in enumerate(args.seeds):
        order = list(RULES[r % len(RULES):] + RULES[:r % len(RULES)])
        runs = {rule: run(rule, seed, args.epochs, args.interval, args.lr) for rule in order}
        rounds.append({"seed": seed, "order": order, "runs": runs})
        print(f"seed {seed}: " + "; ".join(
            f"{rule} acc {[round(a, 3) for a in v['val_accuracy']]} restarts {v['restarts']}"
            for rule, v in runs.items()), flush=True)
    summary = {}
    for rule in RULES:
        ep = [epochs_to(rd["runs"][rule]["val_accuracy"], args.target) for rd in rounds]
        final = [rd["runs"][rule]["val_accuracy"][-1] for rd in rounds]
        diff = [rd["runs"][rule]["val_accuracy"][-1] - rd["runs"]["schedule"]["val_accuracy"][-1]
                for rd in rounds]
        summary[rule] = {"epochs_to_target": ep, "final_accuracy": final,
                         "final_minus_schedule": diff,
                         "median_final_minus_schedule": statistics.median(diff),
                         "restarts": [rd["runs"][rule]["restarts"] for rd in rounds]}
        print(f"{rule:9s} epochs to {args.target}: {ep}; final acc - schedule's (per round): "
              f"{[round(d, 3) for d in diff]}, median {statistics.median(diff):+.3f}; "
              f"restarts {summary[rule]['restarts']}")
    write_json(args.out, {"benchmark": "sma_restart", "machine": f"{platform.platform()} "
                          f"({os.cpu_count()}-core CPU, no GPU)", "args": vars(args),
                          "load_average": {"before": load, "after": os.getloadavg()},
                          "summary": summary, "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
