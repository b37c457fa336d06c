"""LIBRA planner benchmark (pure CPU; the planner has no device work).

1. Planner runtime: the co-optimisation DP (Eq. 23, Algorithm 1) vs exhaustive enumeration of
   all fusions into <= K groups x all thread allocations, on growing layer counts; with the
   quality ratio T_hat / T* and the Theorem 1 bound. Then the DP alone at paper scale
   (K = 10, Z = 150, threads 128..4096).
2. Model-predicted backward time (Eq. 8-15) of LIBRA's plan vs the default size-capped fusion
   (25 MiB, DDP-like) with a fixed thread count, LIBRA-M (Eq. 17 threads on the default fusion)
   and Algorithm 1 as printed (first group only at a chunk edge), on synthetic ResNet-50-,
   VGG-16- and BERT-base-like layer profiles under a V100 / 50 Gb RDMA-like contention model.

Usage: python benchmarks/libra.py [--quick]   -> prints ratios, writes <tmp>/jabasray_bench/libra.json
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np

from common import write_json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "libra.json"))
    args = ap.parse_args()
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
    write_json(args.out, out)


if __name__ == "__main__":
    main()
