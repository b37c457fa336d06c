"""The adaptive benchmark's job in plain PyTorch: which accuracy gap is the rule's own.

``benchmarks/adaptive.py`` runs DigitsCNN on digits through the whole system (Ray actors,
VSWs, emulated GPUs). This script runs the same job in one process, without jabasray's engine,
so that many seeds and epoch budgets are cheap and the system is out of the picture:

* ``static_<B>``: B_G fixed at B (``--static-batches``; the first is the reference, static small);
* ``adaptive_<rule>``: SimiGrad's rule as JABAS section 6.1 states it
  (:func:`jabasray.adaptive.next_global_batch`: every p iterations, Phi of the two halves of
  the global batch at the window's last iteration; Phi < gamma grows B_G by alpha, else shrinks,
  within [min B_G, max B_G]) with the LR rule ``none`` (the default), ``sqrt``, ``linear`` or
  ``adascale``: the LR times AdaScale's gain ratio r (:mod:`jabasray.adaptive.noise`),
  estimated from the same two halves and smoothed over windows by an exponential moving
  average (``--ema``) of both the noise trace and |g|^2, as AdaScale and Pollux smooth theirs.

Same job as the benchmark: SGD momentum 0.9, LR 0.1 at B_G 64 with a linear warm-up over 10
iterations, p = 5, alpha = 0.1, gamma = 0.5, B_G in [64, 512]; each seed fixes the model's
initialisation and the data order (the same for every contender of that seed). What differs
from the system: B_G runs as requested (the system's plan rounds it to a multiple of its
workers' B_L), and the data order is torch's, not the system's sampler.

    python benchmarks/adaptive_reference.py --seeds $(seq 0 9) --epochs 15 --out /tmp/ref.json

Writes per seed and contender the validation accuracy after every epoch, the B_G trajectory
and the optimizer steps; the summary holds, per contender and epoch, each seed's difference to
the reference (points) and the median.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from pathlib import Path

from common import default_out, write_json


def train(seed: int, epochs: int, *, batch: int, adaptive: bool, lr_rule: str, args) -> dict:
    """One run; returns val accuracy per epoch, the B_G of every window per epoch, steps."""
    import torch
    import torch.nn.functional as F

    from jabasray.adaptive import lr_factor, next_global_batch
    from jabasray.adaptive.noise import gain_ratio, noise_estimates
    from jabasray.data import load_digits_split
    from jabasray.models import DigitsCNN

    train_set, val_set = load_digits_split()
    x, y = train_set.tensors
    xv, yv = val_set.tensors
    n = len(y)
    torch.manual_seed(seed)
    model = DigitsCNN()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    order = torch.Generator().manual_seed(1000 + seed)
    b0, bg = args.small, batch
    trace = sq_norm = None                         # smoothed noise estimates (adascale)
    it = in_window = 0
    accs, trajectories, lrs = [], [], []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=order)
        cursor, traj = 0, []
        while cursor < n:
            idx = perm[cursor:cursor + bg]
            cursor += len(idx)
            if lr_rule == "adascale":
                gain = 1.0 if trace is None else gain_ratio(trace, sq_norm, bg, b0)
                factor = gain * lr_factor(b0, bg, "none", it, args.warmup)
            else:
                factor = lr_factor(b0, bg, lr_rule, it, args.warmup)
            for group in opt.param_groups:
                group["lr"] = args.lr * factor
            in_window += 1
            opt.zero_grad()
            if adaptive and in_window == args.p and len(idx) >= 2:
                # the window's last iteration: the two halves' gradients (the two groups)
                h = len(idx) // 2
                ga = torch.autograd.grad(F.cross_entropy(model(x[idx[:h]]), y[idx[:h]]), params)
                gb = torch.autograd.grad(F.cross_entropy(model(x[idx[h:]]), y[idx[h:]]), params)
                a = torch.cat([t.flatten() for t in ga]).double()
                b = torch.cat([t.flatten() for t in gb]).double()
                sq_a, sq_b, dot = float(a @ a), float(b @ b), float(a @ b)
                phi = dot / math.sqrt(sq_a * sq_b) if sq_a > 0 and sq_b > 0 else 0.0
                t_est, n_est = noise_estimates(sq_a, sq_b, dot, h)
                trace = t_est if trace is None else args.ema * trace + (1 - args.ema) * t_est
                sq_norm = n_est if sq_norm is None else args.ema * sq_norm + (1 - args.ema) * n_est
                w = (len(idx) - h) / len(idx)
                for p_, u, v in zip(params, ga, gb):
                    p_.grad = (1 - w) * u + w * v          # the batch's mean gradient
            else:
                F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            it += 1
            if in_window == args.p:
                in_window = 0
                traj.append(bg)
                if adaptive:
                    bg = next_global_batch(bg, phi, args.gamma, args.alpha, b0, args.max_batch)
            lrs.append(args.lr * factor)
        with torch.no_grad():
            accs.append(float((model(xv).argmax(1) == yv).float().mean()))
        trajectories.append(traj)
    return {"val_accuracy": accs, "trajectories": trajectories, "steps": it,
            "max_lr": max(lrs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--small", type=int, default=64, help="B_0: static small and initial B_G")
    ap.add_argument("--static-batches", type=int, nargs="+", default=[64, 85, 100],
                    help="static contenders; the first is the reference (static small)")
    ap.add_argument("--rules", nargs="+", default=["none", "sqrt", "adascale"],
                    choices=["none", "sqrt", "linear", "adascale"], help="adaptive contenders' LR rules")
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--p", type=int, default=5)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--gamma", type=float, default=0.5)
    ap.add_argument("--ema", type=float, default=0.7, help="adascale: weight of the past per window")
    ap.add_argument("--budgets", type=int, nargs="+", default=[6, 12, 15],
                    help="epochs whose per-seed differences are printed")
    ap.add_argument("--out", type=Path, default=Path(default_out("adaptive_reference.json")))
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(1)
    contenders = {f"static_{b}": dict(batch=b, adaptive=False, lr_rule="none")
                  for b in args.static_batches}
    contenders.update({f"adaptive_{r}": dict(batch=args.small, adaptive=True, lr_rule=r)
                       for r in args.rules})
    ref = f"static_{args.static_batches[0]}"
    runs: dict[str, dict[int, dict]] = {name: {} for name in contenders}
    t0 = time.perf_counter()
    for seed in args.seeds:
        for name, kw in contenders.items():
            runs[name][seed] = train(seed, args.epochs, args=args, **kw)
        print(f"seed {seed}: " + ", ".join(f"{k} {runs[k][seed]['val_accuracy'][-1]:.3f}"
                                           for k in contenders), flush=True)
    summary = {}
    for name in contenders:
        per_epoch = []
        for e in range(args.epochs):
            diffs = [round(100 * (runs[name][s]["val_accuracy"][e] - runs[ref][s]["val_accuracy"][e]), 2)
                     for s in args.seeds]
            per_epoch.append({"epoch": e + 1, "diff_points_per_seed": diffs,
                              "median_diff_points": statistics.median(diffs),
                              "median_accuracy": statistics.median(
                                  runs[name][s]["val_accuracy"][e] for s in args.seeds)})
        summary[name] = per_epoch
    print(f"\nmedian val accuracy per epoch; difference to {ref} in points (median over "
          f"{len(args.seeds)} seeds)")
    for name, rows in summary.items():
        print(f"  {name:18s} " + " ".join(f"{r['median_accuracy']:.3f}" for r in rows))
    for e in args.budgets:
        if e > args.epochs:
            continue
        print(f"\nafter {e} epochs: per-seed difference to {ref} (points) | median")
        for name, rows in summary.items():
            if name == ref:
                continue
            r = rows[e - 1]
            print(f"  {name:18s} {' '.join(f'{d:+5.1f}' for d in r['diff_points_per_seed'])} | "
                  f"{r['median_diff_points']:+.2f}")
    doc = {"benchmark": "adaptive_reference", "machine": f"{platform.platform()} ({os.cpu_count()}-core CPU)",
           "load_average_end": os.getloadavg(), "wall_s": time.perf_counter() - t0,
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "reference": ref, "summary": summary, "runs": runs}
    write_json(args.out, doc, indent=1, announce=False)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
