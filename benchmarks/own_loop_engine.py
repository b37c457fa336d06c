"""The user's own loop against a ``step_fn`` on one engine, without Ray: the hand-over's cost.

One device's engine (:class:`jabasray.engine.iidp.IIDPWorker`, one intra-op thread as in a GPU
actor) trains the job of ``benchmarks/own_loop.py`` (its MLP, optimizer, dataset, loop and
``step_fn``), fed either by a Ray Train-shaped ``train_loop_per_worker`` through
:class:`jabasray.train.actor.LoopCallables` ("loop": per batch the engine hands the batch to the
loop and takes back the loss the loop called ``backward()`` on, then lets the loop finish its
iteration) or by a plain ``step_fn`` ("hooks"). Both do the same arithmetic
(tests/test_train_loop_engine.py), so the difference is the loop's own cost per iteration: the
hand-overs and the loop's Python. Rounds alternate the order (A B, B A, ...); per round and
contender: the median wall seconds and the median process CPU seconds (all threads; what a
loaded machine distorts least) of ``--iterations`` timed iterations after a warm-up. Per-round
ratios loop / hooks and their medians (1.0: no cost); the load average at each round's start.

    python benchmarks/own_loop_engine.py [--rounds 20] [--iterations 200] [--vsw 2] [--ga 1]
                                         [--local-batch 16] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import default_out, rotated, write_json  # noqa: E402
from own_loop import dataset, loop, net, sgd, step_fn  # noqa: E402  (the same job as the Ray benchmark)


class Contender:
    """One engine and how it runs an iteration (``after`` lets a loop finish its iteration)."""

    def __init__(self, kind: str, vsw: int, ga: int, local_batch: int) -> None:
        import torch

        from jabasray.engine.iidp import IIDPWorker
        from jabasray.train import bridge
        from jabasray.train.actor import LoopCallables
        self.kind, self.after = kind, None
        torch.manual_seed(0)
        if kind == "loop":
            calls = LoopCallables(loop, {"epochs": 1}, 1)
            calls.dataset_fn()
            self.worker = IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn)
            self.run = bridge.active()
            self.after = self.run.after_step
        else:
            self.worker = IIDPWorker(net(), sgd, None, step_fn=step_fn)
            self.run = None
        self.worker.configure(vsw, ga, local_batch)
        X, y = dataset().tensors
        n = vsw * (ga + 1)
        g = torch.Generator().manual_seed(1)
        # a fixed pool of iterations, cycled (the same batches for both contenders)
        self.pool = []
        for _ in range(16):
            idx = torch.randperm(len(X), generator=g)[:n * local_batch]
            self.pool.append([(X[idx[k * local_batch:(k + 1) * local_batch]],
                               y[idx[k * local_batch:(k + 1) * local_batch]]) for k in range(n)])
        self.k = 0

    def iteration(self) -> None:
        self.worker.train_step(self.pool[self.k % len(self.pool)])
        self.k += 1
        if self.after is not None:
            self.after(False)

    def timed(self, iterations: int, warmup: int) -> tuple[float, float]:
        """Median wall and process CPU seconds of one iteration."""
        for _ in range(warmup):
            self.iteration()
        wall, cpu = [], []
        for _ in range(iterations):
            t0, c0 = time.perf_counter(), time.process_time()
            self.iteration()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        return statistics.median(wall), statistics.median(cpu)

    def close(self) -> None:
        if self.run is not None:
            self.run.abandon()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iterations", type=int, default=200, help="timed iterations per round and contender")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--vsw", type=int, default=2, help="virtual stream workers")
    ap.add_argument("--ga", type=int, default=1, help="gradient-accumulation steps per VSW (n_GA)")
    ap.add_argument("--local-batch", type=int, default=16, help="B_L")
    ap.add_argument("--out", default=default_out("own_loop_engine.json"))
    args = ap.parse_args(argv)
    for flag in ("rounds", "iterations", "vsw", "local_batch"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.ga < 0 or args.warmup < 0:
        ap.error("--ga and --warmup must be >= 0")
    import torch
    torch.set_num_threads(1)           # as a GPU actor on this machine (GPUActor torch_threads=1)
    names = ["loop", "hooks"]
    contenders = {n: Contender(n, args.vsw, args.ga, args.local_batch) for n in names}
    rounds = []
    doc = {"machine": {"cpus": os.cpu_count()}, "argv": sys.argv[1:] if argv is None else argv,
           "rounds": rounds}
    try:
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            got = {n: contenders[n].timed(args.iterations, args.warmup) for n in rotated(names, r)}
            t = {n: w for n, (w, _) in got.items()}
            c = {n: cp for n, (_, cp) in got.items()}
            rounds.append({"round": r, "order": rotated(names, r), "iteration_s": t, "cpu_s": c,
                           "load": load, "ratio": t["loop"] / t["hooks"],
                           "cpu_ratio": c["loop"] / c["hooks"]})
            print(f"round {r:2d} wall loop {t['loop'] * 1e3:.3f} ms, hooks {t['hooks'] * 1e3:.3f} ms, "
                  f"ratio {t['loop'] / t['hooks']:.3f}; cpu loop {c['loop'] * 1e3:.3f} ms, hooks "
                  f"{c['hooks'] * 1e3:.3f} ms, ratio {c['loop'] / c['hooks']:.3f}; load {load:.1f}",
                  flush=True)
    finally:
        for c in contenders.values():
            c.close()
    doc["summary"] = {}
    for key, per in (("wall", "iteration_s"), ("cpu", "cpu_s")):
        ratios = [rd["ratio" if key == "wall" else "cpu_ratio"] for rd in rounds]
        sm = doc["summary"][key] = {
            "ratios": ratios, "median": statistics.median(ratios),
            "loop_ms": statistics.median(rd[per]["loop"] for rd in rounds) * 1e3,
            "hooks_ms": statistics.median(rd[per]["hooks"] for rd in rounds) * 1e3}
        print(f"loop / hooks per iteration ({key}): median {sm['median']:.3f} "
              f"(loop {sm['loop_ms']:.3f} ms, hooks {sm['hooks_ms']:.3f} ms)")
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
