"""LIBRA planner benchmark (pure CPU; the planner has no device work).

1. Planner runtime: the co-optimisation DP (Eq. 23, Algorithm 1) vs exhaustive enumeration of
   all fusions into <= K groups x all thread allocations, on growing layer counts; with the
   quality ratio T_hat / T* and the Theorem 1 bound. Then the DP alone at paper scale
   (K = 10, Z = 150, threads 128..4096).
2. Model-predicted backward time (Eq. 8-15) of LIBRA's plan vs the default size-capped fusion
   (25 MiB, DDP-like) with a fixed thread count, LIBRA-M (Eq. 17 threads on the default fusion)
   and Algorithm 1 as printed (first group only at a chunk edge), on synthetic ResNet-50-,
   VGG-16- and BERT-base-like layer profiles under a V100 / 50 Gb RDMA-like contention model.

3. ``--measured``: MEASURED iteration time of the bucket plan the driver sends with
   ``bucket_planner="libra"`` (:func:`jabasray.profiler.buckets.libra_bucket_plan`: the model's
   layer profile, the profile's Eq. 3 fit and its measured gloo contention) vs the engine's 25 MB
   size-capped buckets, on 2 and 4 gloo processes of this machine. Every rank holds both
   IIDP workers (same weights, same data, SWS for both, so only the buckets differ); in each
   round both run ``--iters`` steps back to back, the order alternating (A B, B A, ...); a
   round's ratio is size time / LIBRA time (> 1: LIBRA faster); the median over rounds is
   reported with the load average. JSON goes outside the repository by default.

Usage: python benchmarks/libra.py [--quick]   -> prints ratios, writes <tmp>/jabasray_bench/libra.json
       python benchmarks/libra.py --measured [--rounds R --iters I]
                                  [--model mlp10mb|mlp48mb]
                                  -> writes <tmp>/jabasray_bench/libra_side_by_side_<model>.json
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from common import default_out, write_json
from jabasray.planners import libra
from jabasray.planners.libra import (LayerProfile, allocate_threads, co_optimize, default_plan,
                                     evaluate_plan, exhaustive_plan, plan_buckets, theorem1_bound)
from jabasray.planners.libra_model import CommParams, ComputeParams, ContentionModel

THREADS = [128, 256, 512, 1024, 2048, 4096]   # Sec. V-A: powers of 2 from 128 to 4096


def contention_model(num_workers: int = 8) -> ContentionModel:
    """V100 + 50 Gb RDMA-like: ~6 GB/s peak, 4096 threads cost computation ~half its speed."""
    return ContentionModel(compute=ComputeParams(1.0, 1.2e-4),
                           overlapped=CommParams(6.0e9, 5.5e9, 0.05),
                           alone=CommParams(6.25e9, 5.8e9, 0.06),
                           num_workers=num_workers, hop_latency=5e-6)


# ----------------------------------------------------------------------------- synthetic models
def _scale(layers: list[tuple[str, float, float]], backward_s: float) -> list[LayerProfile]:
    """(name, flops, params) in forward order -> LayerProfiles in backward order, total b = backward_s."""
    total = sum(f for _, f, _ in layers)
    return [LayerProfile(n, backward_s * f / total, 4.0 * p) for n, f, p in reversed(layers)]


def resnet50_like() -> list[LayerProfile]:
    layers = [("conv1", 118e6, 9408)]
    hw, cin = 56 * 56, 64
    for stage, (blocks, width) in enumerate(zip([3, 4, 6, 3], [64, 128, 256, 512])):
        for blk in range(blocks):
            if stage > 0 and blk == 0:
                hw //= 4
            for k, (ci, co, ks) in enumerate([(cin, width, 1), (width, width, 3), (width, 4 * width, 1)]):
                p = ci * co * ks * ks
                layers.append((f"layer{stage + 1}.{blk}.conv{k + 1}", p * hw, p + 2 * co))
            if blk == 0:
                p = cin * 4 * width
                layers.append((f"layer{stage + 1}.{blk}.downsample", p * hw, p + 8 * width))
            cin = 4 * width
    layers.append(("fc", 2048 * 1000, 2048 * 1000 + 1000))
    return _scale(layers, 0.060)                  # ~60 ms backward, batch 32 on a V100


def vgg16_like() -> list[LayerProfile]:
    cfg = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56), (256, 256, 56),
           (256, 256, 56), (256, 512, 28), (512, 512, 28), (512, 512, 28), (512, 512, 14), (512, 512, 14),
           (512, 512, 14)]
    layers = [(f"conv{i}", ci * co * 9 * s * s, ci * co * 9 + co) for i, (ci, co, s) in enumerate(cfg)]
    layers += [("fc1", 25088 * 4096, 25088 * 4096 + 4096), ("fc2", 4096 * 4096, 4096 * 4096 + 4096),
               ("fc3", 4096 * 1000, 4096 * 1000 + 1000)]
    return _scale(layers, 0.120)


def bert_base_like() -> list[LayerProfile]:
    layers = [("embeddings", 1e6, 30522 * 768 + 512 * 768 + 2 * 768)]
    for i in range(12):
        layers.append((f"encoder.{i}.attention", 4 * 768 * 768 * 128, 4 * 768 * 768 + 6 * 768))
        layers.append((f"encoder.{i}.ffn", 2 * 768 * 3072 * 128, 2 * 768 * 3072 + 3072 + 3 * 768))
    layers.append(("pooler", 768 * 768, 768 * 768 + 768))
    return _scale(layers, 0.070)


def random_layers(rng: np.random.Generator, n: int) -> list[LayerProfile]:
    return [LayerProfile(f"l{i}", float(rng.uniform(1e-3, 1e-2)), float(rng.uniform(1e6, 5e7)))
            for i in range(n)]


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------- parts
def runtime_vs_exhaustive(sizes: list[int], K: int, Z: int, threads: list[int]) -> list[dict]:
    rng = np.random.default_rng(0)
    model = contention_model()
    rows = []
    for L in sizes:
        layers = random_layers(rng, L)
        dp, t_dp = _timed(lambda: co_optimize(model, layers, threads, max_groups=K, num_chunks=Z))
        ex, t_ex = _timed(lambda: exhaustive_plan(model, layers, threads, max_groups=K))
        row = {"layers": L, "max_groups": K, "num_chunks": Z, "threads": len(threads),
               "dp_s": t_dp, "exhaustive_s": t_ex, "speedup": t_ex / t_dp,
               "quality": dp.backward_time / ex.backward_time, "bound": theorem1_bound(K, Z)}
        rows.append(row)
        print(f"  L={L:3d}  DP {t_dp:8.3f}s  exhaustive {t_ex:8.3f}s  speedup x{row['speedup']:8.1f}  "
              f"T_hat/T* {row['quality']:.5f} (bound {row['bound']:.4f})")
    return rows


def dp_scaling(sizes: list[int], K: int, Z: int) -> list[dict]:
    rng = np.random.default_rng(1)
    model = contention_model()
    rows = []
    for L in sizes:
        layers = random_layers(rng, L)
        _, t_co = _timed(lambda: co_optimize(model, layers, THREADS, max_groups=K, num_chunks=Z))
        buckets = [[x.name for x in layers[i:i + max(1, L // K)]] for i in range(0, L, max(1, L // K))]
        _, t_th = _timed(lambda: allocate_threads(model, layers, buckets, THREADS, num_chunks=Z))
        rows.append({"layers": L, "max_groups": K, "num_chunks": Z, "threads": len(THREADS),
                     "coopt_s": t_co, "thread_dp_s": t_th, "groups_for_thread_dp": len(buckets)})
        print(f"  L={L:3d}  co-opt DP (Eq. 23) {t_co:7.3f}s   "
              f"thread DP (Eq. 17, {len(buckets)} groups) {t_th:7.4f}s")
    return rows


def predicted_backward(K: int, Z: int) -> list[dict]:
    rows = []
    for num_workers in (8, 64):
        model = contention_model(num_workers)
        profiles = (("resnet50", resnet50_like()), ("vgg16", vgg16_like()), ("bert_base", bert_base_like()))
        for name, layers in profiles:
            lib, t_plan = _timed(lambda: plan_buckets(model, layers, THREADS, max_groups=K, num_chunks=Z,
                                                      bucket_cap_mb=25.0, default_threads=4096))
            coopt = co_optimize(model, layers, THREADS, max_groups=K, num_chunks=Z)
            d4096 = default_plan(model, layers, 4096, 25.0)
            d512 = default_plan(model, layers, 512, 25.0)
            d128 = default_plan(model, layers, 128, 25.0)
            libm = allocate_threads(model, layers, d4096.buckets, THREADS, num_chunks=Z)
            # Algorithm 1 exactly as printed (first bucket starts only at a chunk edge)
            names = [x.name for x in layers]
            b = np.array([x.backward_time for x in layers])
            c = np.array([x.grad_bytes for x in layers])
            res = libra._fusion_dp(model, b, c, np.array(THREADS, dtype=float), min(K, len(layers)), Z,
                                   fixed=False, exact_first=False)
            alg1 = evaluate_plan(model, layers, [names[s:e] for s, e in res.bounds],
                                 [THREADS[j] for j in res.thread_idx]).total
            single = evaluate_plan(model, layers, [names], [4096]).total      # SE-like: one bucket
            compute = float(b.sum())
            row = {"model": name, "num_workers": num_workers, "layers": len(layers),
                   "grad_mb": float(c.sum()) / 2 ** 20, "compute_s": compute,
                   "libra_s": lib.backward_time, "libra_method": lib.method, "libra_buckets": lib.num_buckets,
                   "libra_threads": lib.threads, "coopt_s": coopt.backward_time,
                   "alg1_as_printed_s": alg1, "libra_m_s": libm.backward_time,
                   "default4096_s": d4096.backward_time, "default512_s": d512.backward_time,
                   "default128_s": d128.backward_time, "default_buckets": d4096.num_buckets,
                   "single_bucket_s": single, "plan_s": t_plan}
            for key in ("default4096_s", "default512_s", "default128_s", "libra_m_s", "single_bucket_s"):
                row[f"{key[:-2]}_over_libra"] = row[key] / lib.backward_time
            row["alg1_over_coopt"] = alg1 / coopt.backward_time
            rows.append(row)
            print(f"  {name:9s} N={num_workers:2d}  compute {compute * 1e3:6.1f} ms  "
                  f"LIBRA {lib.backward_time * 1e3:6.1f} ms ({lib.method}, {lib.num_buckets} buckets)  "
                  f"default@4096 x{row['default4096_over_libra']:.3f}  "
                  f"default@512 x{row['default512_over_libra']:.3f}  "
                  f"default@128 x{row['default128_over_libra']:.3f}  "
                  f"LIBRA-M x{row['libra_m_over_libra']:.3f}  "
                  f"one bucket x{row['single_bucket_over_libra']:.3f}  "
                  f"Alg.1-as-printed/coopt x{row['alg1_over_coopt']:.4f}  plan {t_plan:.2f}s")
    return rows


# ----------------------------------------------------------------------------- measured, side by side
SIDE_MODELS = {"mlp10mb": dict(in_features=512, hidden=(1024, 1024, 1024), num_classes=10),      # 1 bucket of 25 MB
               "mlp48mb": dict(in_features=1024, hidden=(2048, 2048, 2048, 1024), num_classes=10)}  # 2 buckets
SIDE_MODEL = dict(SIDE_MODELS["mlp10mb"])   # set by --model; spawned ranks get it as an argument
SIDE_BATCH = 32


def _side_model(cfg: dict | None = None):
    from jabasray.models import MLP
    return MLP(**(cfg or SIDE_MODEL))


def _side_sample(n: int, seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, SIDE_MODEL["in_features"], generator=g), torch.randint(0, 10, (n,), generator=g)


def _side_rank(rank: int, world: int, init_file: str, plans: dict, rounds: int, iters: int, out_file: str,
               model_cfg: dict) -> None:
    """One rank: both workers, paired rounds; rank 0 writes the per-round times (max over ranks)."""
    import json
    import os
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from jabasray.engine import IIDPWorker

    torch.set_num_threads(1)
    SIDE_MODEL.update(model_cfg)            # a spawned rank starts from the module default
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        workers = {}
        for name, plan in plans.items():
            torch.manual_seed(0)
            workers[name] = IIDPWorker(_side_model(), lambda ps: torch.optim.SGD(ps, lr=0.01), F.cross_entropy,
                                       process_group=dist.group.WORLD, weight_sync="sws",
                                       bucket_plan=plan, bucket_cap_mb=25.0)
            workers[name].configure(1, 0, SIDE_BATCH)
        batch = [_side_sample(SIDE_BATCH, seed=rank)]
        for w in workers.values():               # warm-up
            for _ in range(2):
                w.train_step(batch)
        names = list(plans)
        times = {n: [] for n in names}
        loads = []
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            loads.append(os.getloadavg()[0])
            for n in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    workers[n].train_step(batch)
                times[n].append((time.perf_counter() - t0) / iters)
        flat = torch.tensor([t for n in names for t in times[n]], dtype=torch.float64)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)     # a step ends when its slowest rank does
        if rank == 0:
            vals = flat.tolist()
            doc = {n: vals[i * rounds:(i + 1) * rounds] for i, n in enumerate(names)}
            doc["load_average_per_round"] = loads
            doc["buckets"] = {n: len(w.bucket_nbytes) for n, w in workers.items()}
            doc["bucket_bytes"] = {n: list(w.bucket_nbytes) for n, w in workers.items()}
            with open(out_file, "w") as f:
                json.dump(doc, f)
    finally:
        dist.destroy_process_group()


def side_by_side(worlds: list[int], rounds: int, iters: int, cache_dir: str) -> list[dict]:
    import json
    import multiprocessing as mp
    import os
    import statistics
    import tempfile

    import torch.nn.functional as F

    from jabasray.engine.buckets import default_bucket_plan
    from jabasray.planners.libra import plan_buckets
    from jabasray.profiler.buckets import GLOO_THREADS, contention_from_profile, libra_bucket_plan
    from jabasray.profiler.contention import layer_profiles
    from jabasray.profiler.measure import profile_model

    t0 = time.perf_counter()
    # the driver's CPU path: profile with the host's all-reduce fit and gloo contention (cached)
    prof = profile_model(_side_model, _side_sample, loss_fn=F.cross_entropy, min_local_batch=SIDE_BATCH,
                         max_local_batch=SIDE_BATCH, max_num_vsw=1, warmup=1, repeats=3,
                         contention=True, cache_dir=cache_dir)
    print(f"profile (all-reduce fit + gloo contention, cached in {cache_dir}): {time.perf_counter() - t0:.1f}s; "
          f"contention x{prof.contention.comm_overlapped[-1] / prof.contention.comm_alone[-1]:.2f} all-reduce, "
          f"x{prof.contention.compute_overlapped / prof.contention.compute_alone:.2f} compute")
    net = _side_model()
    x, y = _side_sample(SIDE_BATCH)
    rows = []
    for world in worlds:
        libra = libra_bucket_plan(_side_model, _side_sample, F.cross_entropy, prof, world, 25.0)
        size = default_bucket_plan(net, 25.0)
        predicted = plan_buckets(contention_from_profile(prof, world), layer_profiles(net, x, y, F.cross_entropy),
                                 GLOO_THREADS, bucket_cap_mb=25.0)
        ctx = mp.get_context("spawn")
        with tempfile.TemporaryDirectory(prefix="jabas-libra-bench-") as tmp:
            out_file = os.path.join(tmp, "out.json")
            plans = {"size": size, "libra": libra}
            procs = [ctx.Process(target=_side_rank, args=(r, world, os.path.join(tmp, "init"), plans, rounds,
                                                          iters, out_file, dict(SIDE_MODEL)))
                     for r in range(world)]
            t1 = time.perf_counter()
            for p in procs:
                p.start()
            for p in procs:
                p.join(600)
            bad = [p.exitcode for p in procs if p.exitcode != 0]
            if bad:
                raise RuntimeError(f"side-by-side run on {world} processes failed (exit codes {bad})")
            doc = json.loads(open(out_file).read())
        ratios = [s_ / l_ for s_, l_ in zip(doc["size"], doc["libra"])]
        row = {"world_size": world, "rounds": rounds, "iters_per_round": iters,
               "size_step_s": doc["size"], "libra_step_s": doc["libra"], "ratio_size_over_libra": ratios,
               "median_ratio": statistics.median(ratios),
               "median_size_step_s": statistics.median(doc["size"]),
               "median_libra_step_s": statistics.median(doc["libra"]),
               "buckets": doc["buckets"], "bucket_bytes": doc["bucket_bytes"],
               "predicted_backward_libra_s": predicted.backward_time,
               "predicted_backward_size_s": predicted.baseline_time,
               "load_average_per_round": doc["load_average_per_round"],
               "wall_s": time.perf_counter() - t1}
        rows.append(row)
        print(f"N={world}: LIBRA {doc['buckets']['libra']} bucket(s) vs size {doc['buckets']['size']}; "
              f"step median size {row['median_size_step_s'] * 1e3:.1f} ms, LIBRA {row['median_libra_step_s'] * 1e3:.1f} ms; "
              f"ratio size/LIBRA per round {['%.3f' % r for r in ratios]}, median x{row['median_ratio']:.3f}; "
              f"load {['%.1f' % v for v in doc['load_average_per_round']]}")
    return rows


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--out", default=None, help="JSON output (default: <tmp>/jabasray_bench/libra.json; "
                    "with --measured <tmp>/jabasray_bench/libra_side_by_side_<model>.json)")
    ap.add_argument("--measured", action="store_true",
                    help="measured side by side: LIBRA's buckets vs 25 MB size buckets on 2 and 4 gloo processes")
    ap.add_argument("--worlds", default="2,4", help="--measured: gloo process counts")
    ap.add_argument("--rounds", type=int, default=8, help="--measured: paired rounds")
    ap.add_argument("--iters", type=int, default=4, help="--measured: steps per contender per round")
    ap.add_argument("--cache-dir", default=default_out("cache"), help="--measured: profile cache")
    ap.add_argument("--model", default="mlp10mb", choices=sorted(SIDE_MODELS), help="--measured: the model")
    args = ap.parse_args()
    if args.measured:
        SIDE_MODEL.clear()
        SIDE_MODEL.update(SIDE_MODELS[args.model])
        load_before = os.getloadavg()
        rows = side_by_side([int(w) for w in args.worlds.split(",")], args.rounds, args.iters, args.cache_dir)
        write_json(args.out or default_out(f"libra_side_by_side_{args.model}.json"),
                   {"machine": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "model": args.model, "model_config": SIDE_MODEL, "batch": SIDE_BATCH, "load_average_before": load_before,
                    "load_average_after": os.getloadavg(), "rows": rows})
        return
    ex_sizes = [4, 6, 8] if args.quick else [4, 6, 8, 10, 12]
    scale_sizes = [10, 25] if args.quick else [10, 25, 50, 100]
    print("1a. co-optimisation DP vs exhaustive (K=4, Z=150, J=4 thread choices)")
    part1 = runtime_vs_exhaustive(ex_sizes, K=4, Z=150, threads=[128, 512, 2048, 4096])
    print("1b. DP runtime at paper scale (K=10, Z=150, J=6)")
    part1b = dp_scaling(scale_sizes, K=10, Z=150)
    print("2. model-predicted backward time, ratios = baseline / LIBRA (>1: LIBRA faster)")
    part2 = predicted_backward(K=10, Z=150)
    out = {"machine": platform.platform(), "processor": platform.processor(),
           "runtime_vs_exhaustive": part1, "dp_scaling": part1b, "predicted_backward": part2}
    write_json(args.out or default_out("libra.json"), out)


if __name__ == "__main__":
    main()
