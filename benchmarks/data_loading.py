"""Data loading benchmark (no Ray): samples/s of a file dataset read through the GPU actor's
DataLoader path with 0, 1 and 2 worker processes, vs the in-memory path, on the same plan.

Work per contender and round: one epoch of the exactly-once sampler over ``--images`` PNG files
(32x32 RGB, :func:`jabasray.data.write_image_files`) at B_L = ``--local-batch`` with a layout of
``--workers-per-rank`` decoupled workers (one batch per iteration), in intervals of ``--p``
iterations (the DataLoader drains at every interval boundary, as in training), each batch
split into its micro-batches. ``--compute-ms`` adds a per-iteration sleep standing in for the
GPU's step (a GPU computes without the CPU, so this is where DataLoader workers can overlap);
two scenarios: no compute (pure loading) and with compute.

Contenders run in paired rounds (mem, w0, w1, w2, mem, w0, ...); per round, each file
contender's samples/s is divided by the in-memory one of the same round; the median of these
per-round ratios is reported, with the time to the first batch (what a user waits before
training starts) and the load average.

    python benchmarks/data_loading.py [--rounds 3] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import default_out, write_json
from jabasray.data import ImageFiles, write_image_files
from jabasray.engine.loader import InMemoryBatches, LoaderBatches, split_batch
from jabasray.engine.sampler import IIDPSampler


def materialise(ds: ImageFiles) -> torch.utils.data.TensorDataset:
    """The same samples in memory (what the ``dataset=`` path ships through the object store)."""
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    return torch.utils.data.TensorDataset(torch.stack(xs), torch.tensor(ys))


def one_epoch(source, n: int, local_batch: int, layout: list[int], p: int, compute_s: float
              ) -> tuple[float, float, int]:
    """(seconds, seconds to the first batch, samples) of one epoch read as training reads it."""
    sampler = IIDPSampler(n, seed=0)
    cursor, samples, first = 0, 0, None
    t0 = time.perf_counter()
    while cursor < n:
        its = []
        for _ in range(p):
            if cursor >= n:
                break
            it = sampler.iteration(0, cursor, local_batch, layout)
            its.append(it)
            cursor = it.next_cursor
        for it, batch in zip(its, source.batches([np.concatenate(i.micro_batches) for i in its])):
            parts = split_batch(batch, [len(i) for i in it.micro_batches])
            samples += sum(len(x) for x, _ in parts)
            if first is None:
                first = time.perf_counter() - t0
            if compute_s:
                time.sleep(compute_s)
    return time.perf_counter() - t0, first or 0.0, samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--local-batch", type=int, default=32)
    ap.add_argument("--workers-per-rank", type=int, default=2, help="decoupled workers (layout)")
    ap.add_argument("--p", type=int, default=10, help="iterations per interval")
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "jabasray_bench_images"))
    ap.add_argument("--out", default=default_out('data_loading.json'))
    args = ap.parse_args()
    torch.set_num_threads(1)

    root = write_image_files(Path(args.data_dir), args.images, seed=0)
    files = ImageFiles(root)
    mem = InMemoryBatches(materialise(files))
    n, layout = len(files), [args.workers_per_rank]
    contenders = {"in_memory": lambda: mem}
    for w in (0, 1, 2):
        contenders[f"files_w{w}"] = (lambda w=w: LoaderBatches(ImageFiles(root), num_workers=w))
    doc = {"machine": platform.platform(), "cpus": os.cpu_count(), "images": n,
           "local_batch": args.local_batch, "layout": layout, "p": args.p,
           "load_avg_start": os.getloadavg(), "scenarios": {}}
    for scenario, compute_s in (("loading_only", 0.0), ("with_compute", args.compute_ms / 1000)):
        rows = {k: [] for k in contenders}
        for r in range(args.rounds):
            for name, make in contenders.items():
                src = make()
                try:
                    secs, first, samples = one_epoch(src, n, args.local_batch, layout, args.p, compute_s)
                finally:
                    src.close()
                assert samples == n
                rows[name].append({"samples_per_s": samples / secs, "first_batch_s": first,
                                   "epoch_s": secs})
        ratios = {name: [rows[name][r]["samples_per_s"] / rows["in_memory"][r]["samples_per_s"]
                         for r in range(args.rounds)] for name in contenders}
        summary = {name: {"median_samples_per_s": statistics.median(x["samples_per_s"] for x in rows[name]),
                          "median_first_batch_s": statistics.median(x["first_batch_s"] for x in rows[name]),
                          "ratio_vs_in_memory_per_round": ratios[name],
                          "median_ratio_vs_in_memory": statistics.median(ratios[name])}
                   for name in contenders}
        doc["scenarios"][scenario] = {"compute_s_per_iteration": compute_s, "rounds": rows,
                                      "summary": summary}
        print(f"\n{scenario} (compute {compute_s * 1000:.0f} ms/iteration), {args.rounds} paired rounds")
        print(f"{'contender':<10} {'samples/s':>10} {'ratio vs mem (median)':>22} "
              f"{'per-round ratios':>26} {'first batch s':>14}")
        for name, s in summary.items():
            print(f"{name:<10} {s['median_samples_per_s']:>10.0f} {s['median_ratio_vs_in_memory']:>22.3f} "
                  f"{' '.join(f'{x:.3f}' for x in s['ratio_vs_in_memory_per_round']):>26} "
                  f"{s['median_first_batch_s']:>14.3f}")
    doc["load_avg_end"] = os.getloadavg()
    print(f"\nload average start {doc['load_avg_start']}, end {doc['load_avg_end']}")
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
