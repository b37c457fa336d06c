"""Burst-parallel execution measured: burst plans vs data parallelism at the same global batch.

On 4 CPU processes (gloo on 127.0.0.1, one thread each) for a VGG-like chain CNN and a residual
CNN (``burst_models.py``):

1. The network is measured (ping-pong of 64 KiB and 4 MiB between ranks 0 and 1, minimum of
   30 -> latency and bandwidth of the planner's ``NetworkModel``); rank 0 profiles the model's layer graph
   (``build_layer_graph``, one thread, per-GPU batch B/g for g = 1, 2, 4) and plans it at two
   amplification limits (``plan_burst``); the data-parallel prediction is the same cost model
   with every layer on 4 GPUs (``evaluate_assignment``, limit not enforced).
2. Paired rounds: in every round each contender (burst at limit 1, burst at limit 2, data
   parallel = every layer on the 4 ranks, through the same executor, which the tests prove
   equal to DDP) runs ``--iters`` iterations; the order rotates every round.  Per round and
   contender: the median iteration time (max over ranks of each iteration's wall time) and
   GPU-seconds per iteration (sum over ranks of the time a rank is not blocked waiting for a
   transfer; DeepPool's "aggregate active GPU time").  Reported: per-round ratios burst/DP
   and their median, and measured vs the planner's prediction (error).
3. Freed time: the same contenders once more, each rank hosting a ``BackgroundRunner`` with a
   small background training job (an MLP); the background runs while a rank waits for
   transfers (and between iterations).  Reported: background samples trained per foreground
   iteration and the foreground iteration time with the background on.

Usage: python benchmarks/burst_exec.py [--rounds 5] [--iters 8]
       [--limits 1.5 3] [--global-batch 32] [--out <tmp>/jabasray_bench/burst_exec.json]
On a GPU machine the same script would need NCCL and one device per rank; not done here (GPU
figures: not measured).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import burst_models  # noqa: E402
from common import default_out, rotated, write_json  # noqa: E402
from jabasray.engine.burst import BurstExecutor  # noqa: E402
from jabasray.engine.multiplex import BackgroundRunner, BackgroundTask, MultiplexPolicy  # noqa: E402
from jabasray.planners.burst import (BurstPlan, BurstProblem, NetworkModel,  # noqa: E402
                                     evaluate_assignment, plan_burst)
from jabasray.profiler.layer_graph import build_layer_graph  # noqa: E402

WORLD = 4
SIZE = 16


def build_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "chain":
        return burst_models.ChainCNN(width=16, hidden=1024, size=SIZE)
    return burst_models.ResidualNet(width=16, blocks=3, size=SIZE)


def measure_network(rank: int, repeats: int = 30) -> NetworkModel:
    """Ping-pong between ranks 0 and 1: one-way time t(n) = d + n / B from n = 64 KiB and
    4 MiB, the minimum over ``repeats`` (robust to other processes on a shared machine)."""
    small, big = 64 << 10, 4 << 20
    times = {}
    for nbytes in (small, big):
        buf = torch.zeros(nbytes // 4)
        dist.barrier()
        if rank in (0, 1):
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                samples.append((time.perf_counter() - t0) / 2)
            times[nbytes] = min(samples)
    got = [None]
    if rank == 0:
        bandwidth = (big - small) / max(times[big] - times[small], 1e-9)
        got = [(bandwidth, max(times[small] - small / bandwidth, 0.0))]
    dist.broadcast_object_list(got, src=0)
    return NetworkModel(*got[0])


def background_task(rank: int) -> BackgroundTask:
    torch.manual_seed(100 + rank)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    return BackgroundTask(f"bg{rank}", model, data, torch.optim.SGD(model.parameters(), lr=0.01),
                          F.cross_entropy, batch_size=16, steps=10 ** 9)


def run_iters(ex: BurstExecutor, iters: int, batch: int, seed: int) -> list[tuple[float, float]]:
    """(step seconds, active seconds) of each iteration on this rank."""
    out = []
    (a, b), (c, d) = ex.shards()
    g = torch.Generator().manual_seed(seed)
    for _ in range(iters):
        X = torch.randn(batch, 3, SIZE, SIZE, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        st = ex.train_step(X[a:b] if b > a else None, y[c:d] if d > c else None)
        out.append((st.step_s, st.step_s - st.wait_s))
    return out


def summarise(per_rank: list[list[tuple[float, float]]]) -> dict:
    """Iteration time = max over ranks per iteration (median over iterations); GPU-sec =
    sum over ranks of the median active time."""
    iters = len(per_rank[0])
    step = statistics.median(max(r[i][0] for r in per_rank) for i in range(iters))
    gpu_sec = sum(statistics.median(x[1] for x in r) for r in per_rank)
    return {"iteration_s": step, "gpu_sec": gpu_sec}


def worker(rank: int, init_file: str, args: argparse.Namespace, out_file: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        net = measure_network(rank)
        report = {"network": {"bandwidth_Bps": net.bandwidth, "latency_s": net.latency}, "models": {}}
        example = torch.randn(8, 3, SIZE, SIZE)
        for name in args.models:
            shared = [None]
            if rank == 0:
                graph = build_layer_graph(build_model(name), example, args.global_batch, [1, 2, 4],
                                          repeats=args.profile_repeats)
                plans = {lim: plan_burst(graph, net, WORLD, lim).to_json() for lim in args.limits}
                prob = BurstProblem(graph, net, WORLD, max(args.limits))
                dp_pred = evaluate_assignment(prob, {n: WORLD for n in prob.order}, enforce_limit=False)
                shared = [(plans, dp_pred.iteration_time,
                           sum(lp.gpus * (lp.comm_in_time + lp.comp_time + lp.sync_time)
                               for lp in dp_pred.layers))]
            dist.broadcast_object_list(shared, src=0)
            plans_json, dp_time, dp_gpu_sec = shared[0]
            plans = {f"burst@{lim:g}": BurstPlan.from_json(js) for lim, js in plans_json.items()}
            names = [lp.name for lp in next(iter(plans.values())).layers]
            plans["data_parallel"] = BurstPlan.uniform(names, WORLD)
            predicted = {k: (p.iteration_time, p.gpu_sec) for k, p in plans.items() if k != "data_parallel"}
            predicted["data_parallel"] = (dp_time, dp_gpu_sec)
            contenders = {}
            for key, plan in plans.items():
                model = build_model(name)
                contenders[key] = BurstExecutor(model, plan, example, args.global_batch, F.cross_entropy,
                                                torch.optim.SGD(model.parameters(), lr=0.01))
                run_iters(contenders[key], 2, args.global_batch, 0)          # warm-up
            keys = list(contenders)
            rounds = []
            for rnd in range(args.rounds):
                order = rotated(keys, rnd)
                row = {}
                for key in order:
                    dist.barrier()
                    mine = run_iters(contenders[key], args.iters, args.global_batch, rnd)
                    everyone = [None] * WORLD
                    dist.all_gather_object(everyone, mine)
                    row[key] = summarise(everyone)
                rounds.append(row)
            background = {}
            for key in keys:
                runner = BackgroundRunner("cpu", MultiplexPolicy(slowdown_target=None, max_background_batch=16))
                runner.pause()                      # held until the first wait
                task = background_task(rank)
                runner.submit(task)
                contenders[key].background = runner
                dist.barrier()
                before = runner.status(task.name).samples
                t0 = time.perf_counter()
                runner.resume()
                mine = run_iters(contenders[key], args.iters, args.global_batch, 99)
                runner.pause()
                wall = time.perf_counter() - t0
                done = runner.status(task.name).samples - before
                runner.close()
                contenders[key].background = None
                everyone = [None] * WORLD
                dist.all_gather_object(everyone, (mine, done, wall))
                summary = summarise([e[0] for e in everyone])
                summary["background_samples_per_iter"] = sum(e[1] for e in everyone) / args.iters
                summary["background_samples_per_rank"] = [e[1] for e in everyone]
                background[key] = summary
            if rank == 0:
                report["models"][name] = {
                    "plans": {k: {"gpu_counts": p.gpu_counts, "predicted_iteration_s": predicted[k][0],
                                  "predicted_gpu_sec": predicted[k][1],
                                  "parallel_blocks": sum(any(b.parallel) for b in p.blocks)}
                              for k, p in plans.items()},
                    "rounds": rounds, "background": background}
        if rank == 0:
            with open(out_file, "w") as fh:
                json.dump(report, fh)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--limits", type=float, nargs=2, default=[1.5, 3.0])
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--profile-repeats", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["chain", "residual"])
    ap.add_argument("--out", default=default_out('burst_exec.json'))
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "report.json")
        mp.spawn(worker, args=(os.path.join(tmp, "store"), args, out_file), nprocs=WORLD, join=True)
        with open(out_file) as fh:
            report = json.load(fh)
    net = report["network"]
    print(f"gloo loopback: {net['bandwidth_Bps'] / 1e9:.2f} GB/s, {net['latency_s'] * 1e6:.0f} us; "
          f"B_G {args.global_batch}, 4 processes on {os.cpu_count()} cores")
    for name, res in report["models"].items():
        print(f"\n{name}")
        for key, plan in res["plans"].items():
            counts = sorted(set(plan["gpu_counts"].values()))
            print(f"  {key:15s} counts {counts} parallel blocks {plan['parallel_blocks']}: predicted "
                  f"{plan['predicted_iteration_s'] * 1e3:.2f} ms, {plan['predicted_gpu_sec'] * 1e3:.2f} GPU-ms")
        keys = list(res["plans"])
        summary = {}
        for key in keys:
            its = [r[key]["iteration_s"] for r in res["rounds"]]
            gs = [r[key]["gpu_sec"] for r in res["rounds"]]
            pred = res["plans"][key]["predicted_iteration_s"]
            summary[key] = {"iteration_s_median": statistics.median(its), "gpu_sec_median": statistics.median(gs),
                            "prediction_error": statistics.median(its) / pred - 1.0}
            line = (f"  {key:15s} measured {statistics.median(its) * 1e3:7.2f} ms/iter "
                    f"({summary[key]['prediction_error']:+.0%} vs predicted), "
                    f"{statistics.median(gs) * 1e3:7.2f} GPU-ms/iter")
            if key != "data_parallel":
                t_ratio = [r[key]["iteration_s"] / r["data_parallel"]["iteration_s"] for r in res["rounds"]]
                g_ratio = [r[key]["gpu_sec"] / r["data_parallel"]["gpu_sec"] for r in res["rounds"]]
                summary[key]["time_ratio_rounds"] = t_ratio
                summary[key]["gpu_sec_ratio_rounds"] = g_ratio
                line += (f"; vs DP per round time {['%.2f' % x for x in t_ratio]} median "
                         f"{statistics.median(t_ratio):.2f}, GPU-sec median {statistics.median(g_ratio):.2f}")
            print(line)
        for key, bg in res["background"].items():
            print(f"  background with {key:15s}: {bg['background_samples_per_iter']:.0f} samples/iter "
                  f"(per rank {bg['background_samples_per_rank']}), foreground "
                  f"{bg['iteration_s'] * 1e3:.2f} ms/iter")
        res["summary"] = summary
    load_after = os.getloadavg()
    print(f"\nload average before {load_before[0]:.1f}, after {load_after[0]:.1f}; "
          f"{time.perf_counter() - t0:.0f} s")
    write_json(args.out, {"config": vars(args), "cpu_count": os.cpu_count(),
                          "load_average_before": load_before, "load_average_after": load_after, **report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
