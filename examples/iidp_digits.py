"""IIDP demo on one process: DigitsCNN on scikit-learn's digits with 2 VSWs x 1 GA step.

Every iteration takes ``num_vsw * (num_ga + 1)`` micro-batches of B_L samples from the
deterministic sampler (the last, short iteration of an epoch is ragged), runs them on the
VSWs and updates once with the mean gradient over all decoupled workers.

    python examples/iidp_digits.py [--epochs 8] [--num-vsw 2] [--num-ga 1] [--local-batch 16] [--device cpu]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from jabasray.config import WEIGHT_SYNC_METHODS
from jabasray.data import accuracy, load_digits_split
from jabasray.engine import IIDPSampler, IIDPWorker, gather_micro_batches
from jabasray.models import DigitsCNN


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--num-vsw", type=int, default=2)
    ap.add_argument("--num-ga", type=int, default=1)
    ap.add_argument("--local-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--weight-sync", default="auto", choices=WEIGHT_SYNC_METHODS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i] (VSWs on CUDA streams)")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    train, val = load_digits_split(seed=args.seed)
    worker = IIDPWorker(DigitsCNN(), lambda p: torch.optim.SGD(p, lr=args.lr, momentum=0.9),
                        F.cross_entropy, device=args.device, weight_sync=args.weight_sync)
    worker.configure(args.num_vsw, args.num_ga, args.local_batch)
    sampler = IIDPSampler(len(train), seed=args.seed)
    print(f"IIDP: {worker.num_vsw} VSWs x {worker.num_ga + 1} micro-batches of {args.local_batch} "
          f"-> global batch {worker.num_workers * args.local_batch}; weight sync {worker.weight_sync_method}; "
          f"{len(worker.bucket_plan)} bucket(s)")
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        cursor, losses = 0, []
        while True:
            it = sampler.iteration(epoch, cursor, worker.local_batch_size, [worker.num_workers])
            stats = worker.train_step(gather_micro_batches(train, it.micro_batches), ragged=it.ragged)
            losses.append(stats.loss)
            cursor = it.next_cursor
            if it.epoch_end:
                break
        print(f"epoch {epoch}: {len(losses)} iterations, mean loss {sum(losses) / len(losses):.4f}, "
              f"val acc {accuracy(worker.model, val, device=args.device):.4f} ({time.perf_counter() - t0:.1f}s)")
    acc = accuracy(worker.model, val, device=args.device)
    print(f"final validation accuracy: {acc:.4f}")
    worker.close()
    return acc


if __name__ == "__main__":
    main()
