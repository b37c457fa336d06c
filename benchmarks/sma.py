"""S-SGD vs Crossbow SMA learners at small batch on digits (Crossbow Fig. 12-13 analogue).

Variants, measured side by side in one run (no Ray):
  * ``ssgd_b{B}``: synchronous mini-batch SGD with momentum (one device: torch.optim.SGD) at
    batch B = b (the learners' batch) and B = m*b (the same samples per iteration as m learners);
  * ``sma_m{m}``: ``SMAWorker`` with m learners of batch b each (alpha = 1/m, mu = 0.9).
For each: epochs and seconds (training only, evaluation excluded) until the central/plain model
reaches ``--target`` validation accuracy, evaluated every ``--eval-every`` of an epoch.
Ratios are against ``ssgd_b{b}``. On CPU the learners of one device run one after the other,
so SMA's time advantage only shows on a GPU where they run concurrently (Crossbow section 4).

    python benchmarks/sma.py [--device cpu|cuda] [--batch 8] [--learners 1,2,4] [--target 0.95]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from common import write_json
from jabasray.data import accuracy, load_digits_split
from jabasray.engine.sma import SMAWorker
from jabasray.models import DigitsCNN


def batches_of(n: int, size: int, gen: torch.Generator) -> list[torch.Tensor]:
    perm = torch.randperm(n, generator=gen)
    return [perm[i:i + size] for i in range(0, n - size + 1, size)]     # drop the ragged tail


def run_ssgd(train, val, batch, lr, args, seed):
    torch.manual_seed(seed)
    model = DigitsCNN().to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return _loop(train, val, batch, 1, args, seed, model, lambda mbs: _sgd_step(model, opt, mbs))


def _sgd_step(model, opt, mbs):
    (x, y), = mbs
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


def run_sma(train, val, batch, m, lr, args, seed):
    torch.manual_seed(seed)
    worker = SMAWorker(DigitsCNN(), nn.functional.cross_entropy, lr=lr, momentum=0.9,
                       device=args.device)
    worker.configure(m, 0, batch)
    return _loop(train, val, batch, m, args, seed, worker.model, worker.train_step)


def _loop(train, val, batch, per_iter, args, seed, eval_model, step_fn):
    X, Y = (t.to(args.device) for t in train.tensors)
    gen = torch.Generator().manual_seed(seed + 1)
    n = len(Y)
    iters_per_epoch = n // (batch * per_iter)
    eval_every = max(1, int(iters_per_epoch * args.eval_every))
    train_time, it, curve = 0.0, 0, []
    reached = None
    for epoch in range(args.max_epochs):
        idx = batches_of(n, batch, gen)
        for k in range(iters_per_epoch):
            mbs = [(X[i], Y[i]) for i in idx[k * per_iter:(k + 1) * per_iter]]
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step_fn(mbs)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            train_time += time.perf_counter() - t0
            it += 1
            if it % eval_every == 0:
                acc = accuracy(eval_model, val, device=args.device)
                ep = it / iters_per_epoch
                curve.append((round(ep, 3), round(acc, 4)))
                if reached is None and acc >= args.target:
                    reached = {"epochs": ep, "seconds": train_time}
                    if not args.full_curve:
                        return {"reached": reached, "curve": curve, "iterations": it}
    return {"reached": reached, "curve": curve, "iterations": it}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8, help="batch of one learner (b)")
    ap.add_argument("--learners", default="1,2,4")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--sma-lr", type=float, default=None,
                    help="learners' lr; default lr/(1-0.9): the same effective step as "
                         "momentum SGD (Alg. 1 has no momentum on the learners, only on z)")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--max-epochs", type=int, default=12)
    ap.add_argument("--eval-every", type=float, default=0.25, help="fraction of an epoch")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--full-curve", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "sma.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    train, val = load_digits_split(0.2, seed=0, image=True)
    ms = [int(v) for v in args.learners.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    b = args.batch
    sma_lr = args.sma_lr if args.sma_lr is not None else args.lr / (1 - 0.9)
    variants: dict[str, callable] = {f"ssgd_b{b}": lambda s: run_ssgd(train, val, b, args.lr, args, s)}
    for m in ms:
        if m > 1:
            variants[f"ssgd_b{m * b}"] = (lambda s, m=m: run_ssgd(train, val, m * b, args.lr, args, s))
    for m in ms:
        variants[f"sma_m{m}"] = (lambda s, m=m: run_sma(train, val, b, m, sma_lr, args, s))
    results: dict[str, dict] = {}
    for name, fn in variants.items():
        runs = [fn(s) for s in seeds]
        ok = [r["reached"] for r in runs if r["reached"] is not None]
        results[name] = {
            "runs": runs,
            "reached": f"{len(ok)}/{len(runs)}",
            "epochs_to_target": sum(r["epochs"] for r in ok) / len(ok) if ok else None,
            "seconds_to_target": sum(r["seconds"] for r in ok) / len(ok) if ok else None,
        }
    base = results[f"ssgd_b{b}"]
    print(f"device={args.device} b={b} lr={args.lr} sma_lr={sma_lr} target={args.target} seeds={seeds}")
    print(f"{'variant':12s} {'reached':>7s} {'epochs':>8s} {'seconds':>8s} {'ep/ssgd':>8s} {'s/ssgd':>8s}")
    for name, r in results.items():
        ep, sec = r["epochs_to_target"], r["seconds_to_target"]
        rep = ep / base["epochs_to_target"] if ep and base["epochs_to_target"] else None
        rsec = sec / base["seconds_to_target"] if sec and base["seconds_to_target"] else None
        r["epochs_ratio_vs_ssgd"], r["seconds_ratio_vs_ssgd"] = rep, rsec
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
        print(f"{name:12s} {r['reached']:>7s} {f(ep):>8s} {f(sec):>8s} {f(rep):>8s} {f(rsec):>8s}")
    write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
