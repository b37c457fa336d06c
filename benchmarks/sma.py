"""Crossbow SMA (flat and hierarchical) vs S-SGD vs IIDP on 2 devices: epochs and time to accuracy.

Contenders, for every m in ``--learners`` (all on digits with DigitsCNN, G = 2 devices emulated
by two gloo processes with one thread each, learner / VSW batch b = ``--batch``):

  * ``sma_flat_m{m}``: ``SMAWorker(sma_sync="flat")``, m learners per device (Alg. 1 over
    k = 2m learners, alpha = 1/k);
  * ``sma_hier_m{m}``: ``SMAWorker(sma_sync="hierarchical")``, m learners per device against
    a local reference model, SMA across the 2 reference models (Crossbow 3.3);
  * ``iidp_m{m}``: ``IIDPWorker`` with m VSWs of batch b per device and the user's momentum SGD:
    data-parallel S-SGD at batch 2mb on the two devices;
  * ``ssgd_m{m}``: plain ``torch.optim.SGD`` (momentum) at batch 2mb on rank 0 alone (rank 1
    idles): the same arithmetic as ``iidp_m{m}`` on one device.

Every contender consumes the same 2mb samples per iteration in the same order (a seeded
permutation per epoch; micro-batch j of an iteration goes to rank j // m), so "the same total
batch" holds exactly. Each run records epochs and training seconds (evaluation excluded) until
the evaluated model (SMA: the central model z) first reaches each target accuracy (``--targets``),
evaluated every ``--eval-every`` of an epoch on rank 0; it stops at the last target or
``--max-epochs``.

Paired rounds: one round per seed; every contender runs once per round (order rotated from
round to round); ratios are taken per round against ``ssgd_m{m}`` of the same m and seed, and
their median is reported, beside the mean and spread (min-max) of each contender. The load
average is recorded before and after. On CPU the learners of a device run one after the other,
so SMA's time advantage (learners running concurrently on one GPU, Crossbow section 4) cannot
show; epochs to accuracy (statistical efficiency) can.

    python benchmarks/sma.py [--learners 1,2,4] [--seeds 0,1,2] [--targets 0.95,0.97]
                             [--out /tmp/jabasray_bench/sma.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from common import default_out, rotated, write_json
from jabasray.data import accuracy, load_digits_split
from jabasray.engine.iidp import IIDPWorker
from jabasray.engine.sma import SMAWorker
from jabasray.models import DigitsCNN

WORLD = 2
MOMENTUM = 0.9
KINDS = ("ssgd", "iidp", "sma_flat", "sma_hier")


def contenders(learners: list[int]) -> list[tuple[str, str, int]]:
    return [(f"{kind}_m{m}", kind, m) for m in learners for kind in KINDS]


def run_one(kind: str, m: int, seed: int, rank: int, train, val, args) -> dict | None:
    """One training run; every rank calls it; rank 0 returns the record."""
    b = args.batch
    torch.manual_seed(seed)
    model = DigitsCNN()
    ce = nn.functional.cross_entropy
    if kind == "ssgd":
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM)

        def step(mbs):
            if rank != 0:
                return
            x = torch.cat([x for x, _ in mbs])
            y = torch.cat([y for _, y in mbs])
            opt.zero_grad(set_to_none=True)
            ce(model(x), y).backward()
            opt.step()
        evaluated, close = model, None
    elif kind == "iidp":
        worker = IIDPWorker(model, lambda p: torch.optim.SGD(p, lr=args.lr, momentum=MOMENTUM), ce,
                            process_group=dist.group.WORLD)
        worker.configure(m, 0, b)

        def step(mbs):
            worker.train_step(mbs[rank * m:(rank + 1) * m])
        evaluated, close = worker.model, worker.close
    else:
        worker = SMAWorker(model, ce, lr=args.lr / (1 - MOMENTUM), momentum=MOMENTUM,
                           process_group=dist.group.WORLD,
                           sma_sync="flat" if kind == "sma_flat" else "hierarchical")
        worker.configure(m, 0, b)

        def step(mbs):
            worker.train_step(mbs[rank * m:(rank + 1) * m])
        evaluated, close = worker.model, None

    X, Y = train.tensors
    n = len(Y)
    per_iter = WORLD * m * b
    iters_per_epoch = n // per_iter                       # the ragged tail is dropped
    eval_every = max(1, int(iters_per_epoch * args.eval_every))
    gen = torch.Generator().manual_seed(seed + 1)
    targets = sorted(args.targets)
    reached: dict[str, dict | None] = {f"{t:g}": None for t in targets}
    train_time, it, curve = 0.0, 0, []
    stop = torch.zeros(1)
    for _ in range(args.max_epochs):
        perm = torch.randperm(n, generator=gen)
        for k in range(iters_per_epoch):
            idx = perm[k * per_iter:(k + 1) * per_iter].split(b)
            mbs = [(X[i], Y[i]) for i in idx]
            t0 = time.perf_counter()
            step(mbs)
            train_time += time.perf_counter() - t0
            it += 1
            if it % eval_every:
                continue
            if rank == 0:
                acc = accuracy(evaluated, val)
                ep = it / iters_per_epoch
                curve.append((round(ep, 3), round(acc, 4)))
                for t in targets:
                    if reached[f"{t:g}"] is None and acc >= t:
                        reached[f"{t:g}"] = {"epochs": ep, "seconds": train_time}
                stop.fill_(float(all(v is not None for v in reached.values())))
            dist.broadcast(stop, 0)
            if stop.item():
                break
        if stop.item():
            break
    if close is not None:
        close()
    if rank != 0:
        return None
    return {"reached": reached, "curve": curve, "iterations": it, "seconds_total": train_time}


def _rank_main(rank: int, args, init_file: str, out_file: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        train, val = load_digits_split(0.2, seed=0, image=True)
        names = contenders(args.learners)
        runs = []
        for rnd, seed in enumerate(args.seeds):
            for name, kind, m in rotated(names, rnd):                # order rotated per round
                rec = run_one(kind, m, seed, rank, train, val, args)
                if rank == 0:
                    rec.update(name=name, kind=kind, m=m, seed=seed, round=rnd)
                    runs.append(rec)
                    got = ", ".join(f"{t}: " + ("-" if v is None else f"{v['epochs']:.2f} ep "
                                                f"{v['seconds']:.1f} s") for t, v in rec["reached"].items())
                    print(f"round {rnd} seed {seed} {name:12s} {got}", flush=True)
        if rank == 0:
            torch.save(runs, out_file)
    finally:
        dist.destroy_process_group()


def summarise(runs: list[dict], args) -> dict:
    """Per contender and target: reached count, mean and min-max of epochs and seconds, and the
    median over rounds of the per-round ratios against ssgd_m{m} (same m, same seed)."""
    by = {(r["name"], r["seed"]): r for r in runs}
    out: dict[str, dict] = {}
    for name, kind, m in contenders(args.learners):
        row: dict = {"kind": kind, "m": m, "samples_per_iteration": WORLD * m * args.batch}
        for t in (f"{t:g}" for t in sorted(args.targets)):
            hits = [by[(name, s)]["reached"][t] for s in args.seeds]
            ok = [h for h in hits if h is not None]
            entry: dict = {"reached": f"{len(ok)}/{len(hits)}"}
            for key in ("epochs", "seconds"):
                vals = [h[key] for h in ok]
                entry[key] = ({"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
                              if vals else None)
                ratios = []
                for s in args.seeds:
                    base = by[(f"ssgd_m{m}", s)]["reached"][t]
                    mine = by[(name, s)]["reached"][t]
                    if base is not None and mine is not None and base[key] > 0:
                        ratios.append(mine[key] / base[key])
                entry[f"{key}_ratio_vs_ssgd"] = {"per_round": ratios,
                                                 "median": statistics.median(ratios) if ratios else None}
            row[t] = entry
        out[name] = row
    return out


def print_table(summary: dict, args) -> None:
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
    for t in (f"{t:g}" for t in sorted(args.targets)):
        print(f"\ntarget {t}: epochs mean [min-max] (median ratio vs ssgd same m) | "
              f"train seconds mean [min-max] (median ratio)")
        for name, row in summary.items():
            e = row[t]
            ep, sec = e["epochs"], e["seconds"]
            eps = "-" if ep is None else f"{ep['mean']:.2f} [{ep['min']:.2f}-{ep['max']:.2f}]"
            secs = "-" if sec is None else f"{sec['mean']:.1f} [{sec['min']:.1f}-{sec['max']:.1f}]"
            print(f"  {name:12s} {e['reached']:>4s}  {eps:20s} ({f(e['epochs_ratio_vs_ssgd']['median'])})"
                  f"  | {secs:18s} ({f(e['seconds_ratio_vs_ssgd']['median'])})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="batch of one learner / VSW (b)")
    ap.add_argument("--learners", default="1,2,4", help="m: learners (VSWs) per device")
    ap.add_argument("--lr", type=float, default=0.02,
                    help="S-SGD/IIDP lr (momentum 0.9); SMA learners use lr/(1-0.9), the same "
                         "effective step (Alg. 1 has momentum on z only)")
    ap.add_argument("--targets", default="0.95,0.97")
    ap.add_argument("--max-epochs", type=int, default=15)
    ap.add_argument("--eval-every", type=float, default=0.25, help="fraction of an epoch")
    ap.add_argument("--seeds", default="0,1,2", help="one paired round per seed")
    ap.add_argument("--out", default=default_out('sma.json'))
    args = ap.parse_args()
    try:
        args.learners = [int(v) for v in args.learners.split(",")]
        args.seeds = [int(s) for s in args.seeds.split(",")]
        args.targets = [float(t) for t in args.targets.split(",")]
    except ValueError as e:
        ap.error(f"--learners, --seeds and --targets take comma-separated numbers ({e})")
    if min(args.learners) < 1 or args.batch < 1 or not all(0 < t <= 1 for t in args.targets):
        ap.error("--learners and --batch must be >= 1 and --targets in (0, 1]")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "runs.pt")
        mp.spawn(_rank_main, args=(args, os.path.join(tmp, "init"), raw), nprocs=WORLD, join=True)
        runs = torch.load(raw)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()
    summary = summarise(runs, args)
    print(f"\n2 gloo processes x 1 thread, b={args.batch}, lr={args.lr} (SMA learners "
          f"{args.lr / (1 - MOMENTUM):g}), seeds={args.seeds}; wall {wall:.0f} s; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print_table(summary, args)
    write_json(args.out, {"args": {k: v for k, v in vars(args).items()}, "wall_seconds": wall,
                          "loadavg_before": load_before, "loadavg_after": load_after,
                          "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
