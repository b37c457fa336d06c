"""Record fixed-batch convergence traces of this project's small job in Pollux's schema.

Trains ``jabasray.models.DigitsCNN`` on scikit-learn's digits in plain PyTorch (no Ray, no engine),
once per global batch B (``--batches``, default 16,64,256), and writes one
``validation-<B>.csv`` per run with Pollux's columns ``progress, iteration, metric, grad_sqr,
grad_var`` plus ``similarity``, one row per pass over the training data (the schema and units
are those of :mod:`jabasray.sim.convergence`, which reads the files back):

* every step computes the per-sample gradients of the batch (``torch.func``: ``vmap`` of
  ``grad`` over ``functional_call``); their mean is the step's gradient (the mean-loss gradient
  of the whole batch), the means of the first and second half are the two GPU groups' gradients
  of SimiGrad/JABAS (section 6.1), and ``jabasray.adaptive.cosine_similarity`` of the two is the
  step's measured Phi;
* ``grad_sqr`` / ``grad_var``: AdaptDL's estimator (``adascale.py``: ``grad_sqr = (count *
  total_sqr - local_sqr) / (count - 1)``, ``grad_var = (local_sqr - total_sqr) * scale /
  (count - 1)``, ``scale = B / M0``) with every sample its own "replica" (count = B): with
  ``S`` the mean squared norm of the per-sample gradients and ``T`` the squared norm of their
  mean, ``|G|^2 ~ (B T - S) / (B - 1)`` and ``sigma^2 / M0 ~ (S - T) B / (B - 1) / M0``, both
  unbiased. A row holds their means over the epoch's steps (AdaptDL keeps an exponential
  average with factor 0.999^scale per step instead, a window of ~1000 / scale steps, longer
  than these runs' epochs);
* ``similarity``: the mean of the steps' measured Phi over the epoch. It is measured from the
  two halves only, the statistics from all per-sample gradients, so the link Phi = 1 / (1 +
  2 B_noise / B) of the convergence model is checked, not assumed;
* ``progress`` as AdaptDL counts it: every step adds the gain r(B) = (grad_var + grad_sqr) /
  (grad_var / s + grad_sqr), s = B / M0, M0 = the smallest batch of ``--batches``, here
  computed from the epoch's row (the statistics the row reports, as Pollux's simulator uses a
  row for its epoch); at B = M0 progress is the step count;
* ``iteration``: optimizer steps so far; ``metric``: validation accuracy after the epoch.

The learning rate follows AdaScale, as in the runs behind Pollux's traces (AdaptDL's default):
``lr(B) = lr * r(B)`` with r from exponential averages of the per-step estimates (AdaptDL's
smoothing 0.999^scale per step, bias corrected); ``--lr-rule none`` keeps ``lr`` at every B.
Every epoch is a fresh permutation of the training set; the ragged last batch is dropped so that
both halves always hold B/2 samples and ``samples = iteration * B`` holds exactly. The run at M0
trains ``--epochs`` epochs; the larger batches train until they reach its final progress (at
most ``--max-epochs``), so every trace covers the same progress, as Pollux's do.

    nice python benchmarks/record_convergence.py                      # 25-45 s on 2 cores
    nice python benchmarks/record_convergence.py --out jabasray/sim/traces/digits

Writes ``validation-<B>.csv`` and ``record.json`` (settings, per-epoch spread of Phi, times) to
``--out`` (default ``<tmp>/jabasray_bench/convergence/digits``).
"""
from __future__ import annotations

import argparse
import csv
import math
import platform
import time
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from common import default_out, positive_ints, write_json
from jabasray.adaptive import cosine_similarity
from jabasray.adaptive.noise import gain_ratio
from jabasray.data import accuracy, load_digits_split
from jabasray.models import DigitsCNN

COLUMNS = ("progress", "iteration", "metric", "grad_sqr", "grad_var", "similarity")
SMOOTHING = 0.999      # AdaptDL's per-step factor of its exponential averages (raised to scale)


def gain(sqr: float, var: float, batch: int, m0: int) -> float:
    """AdaScale's r = (var + sqr) / (var / scale + sqr), scale = B / M0, statistics clipped at 0
    (AdaptDL): :func:`jabasray.adaptive.noise.gain_ratio` with the per-sample trace M0 var."""
    return gain_ratio(max(var, 0.0) * m0, sqr, batch, m0)


class Ema:
    """Bias-corrected exponential average (AdaptDL ``_update_avg``)."""

    def __init__(self) -> None:
        self.biased = self.unbias = 0.0

    def update(self, value: float, factor: float) -> float:
        self.biased = factor * self.biased + (1.0 - factor) * value
        self.unbias = factor * self.unbias + (1.0 - factor)
        return self.value

    @property
    def value(self) -> float:
        return self.biased / self.unbias if self.unbias > 0 else 0.0


def record(batch: int, m0: int, *, epochs: int | None, target_progress: float | None,
           max_epochs: int, lr: float, momentum: float, lr_rule: str, seed: int) -> dict:
    """One fixed-batch run; returns its rows and per-epoch details."""
    if batch < 2 or batch % 2:
        raise ValueError(f"batch must be an even integer >= 2 (two equal halves), got {batch}")
    torch.manual_seed(seed)
    train, val = load_digits_split(seed=seed)
    X, y = train.tensors
    model = DigitsCNN()
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()

    def sample_loss(p: dict, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(model, p, (x.unsqueeze(0),)), t.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    gen = torch.Generator().manual_seed(seed)
    scale = batch / m0
    ema_sqr, ema_var = Ema(), Ema()
    steps, progress, rows, details = 0, 0.0, [], []
    half = batch // 2
    epoch = 0
    while True:
        perm = torch.randperm(len(y), generator=gen)
        sqrs, vars_, phis = [], [], []
        for start in range(0, len(y) - batch + 1, batch):        # ragged tail dropped
            idx = perm[start:start + batch]
            p = {n: q.detach() for n, q in zip(names, params)}
            g = per_sample(p, X[idx], y[idx])
            flat = torch.cat([g[n].reshape(batch, -1) for n in names], dim=1).double()
            g_a, g_b = flat[:half].mean(0), flat[half:].mean(0)
            full = 0.5 * (g_a + g_b)
            s_mean = float((flat * flat).sum(1).mean())           # S: mean |g_i|^2
            t_sqr = float(full @ full)                            # T: |mean g_i|^2
            sqr = (batch * t_sqr - s_mean) / (batch - 1)
            var = (s_mean - t_sqr) * batch / (batch - 1) / m0
            sqrs.append(sqr)
            vars_.append(var)
            phis.append(cosine_similarity(g_a, g_b))
            factor = SMOOTHING ** scale
            r = gain(ema_sqr.update(sqr, factor), ema_var.update(var, factor), batch, m0)
            offset = 0
            for q in params:
                q.grad = full[offset:offset + q.numel()].view_as(q).float().clone()
                offset += q.numel()
            for group in opt.param_groups:
                group["lr"] = lr * (r if lr_rule == "adascale" else 1.0)
            opt.step()
            steps += 1
        epoch += 1
        n = len(sqrs)
        sqr_e, var_e, phi_e = sum(sqrs) / n, sum(vars_) / n, sum(phis) / n
        progress += n * gain(sqr_e, var_e, batch, m0)
        acc = accuracy(model, val)
        rows.append({"progress": progress, "iteration": steps, "metric": acc, "grad_sqr": sqr_e,
                     "grad_var": var_e, "similarity": phi_e})
        phi_sd = math.sqrt(sum((v - phi_e) ** 2 for v in phis) / max(1, n - 1))
        details.append({"epoch": epoch, "steps": n, "phi_std": phi_sd,
                        "phi_predicted": 1.0 / (1.0 + 2.0 * m0 * max(var_e, 0.0) / max(sqr_e, 1e-30) / batch),
                        "lr_last": opt.param_groups[0]["lr"]})
        if epochs is not None and epoch >= epochs:
            break
        if target_progress is not None and progress >= target_progress:
            break
        if epoch >= max_epochs:
            break
    return {"batch": batch, "rows": rows, "epochs": details, "dataset_size": len(y)}


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([repr(float(r[c])) if c != "iteration" else int(r[c]) for c in COLUMNS])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="16,64,256", help="global batch sizes (even), comma-separated")
    ap.add_argument("--epochs", type=int, default=12, help="epochs of the run at the smallest batch")
    ap.add_argument("--max-epochs", type=int, default=60, help="cap for the larger batches")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--lr-rule", choices=("adascale", "none"), default="adascale")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(default_out("convergence/digits")))
    args = ap.parse_args(argv)
    batches = sorted(positive_ints(ap, "--batches", args.batches))
    torch.set_num_threads(1)
    m0 = batches[0]
    t0 = time.perf_counter()
    runs, target = [], None
    for b in batches:
        t = time.perf_counter()
        run = record(b, m0, epochs=args.epochs if b == m0 else None, target_progress=target,
                     max_epochs=args.max_epochs, lr=args.lr, momentum=args.momentum,
                     lr_rule=args.lr_rule, seed=args.seed)
        run["time_s"] = time.perf_counter() - t
        if b == m0:
            target = run["rows"][-1]["progress"]
        write_csv(args.out / f"validation-{b}.csv", run["rows"])
        errs = [abs(e["phi_predicted"] - r["similarity"]) for e, r in zip(run["epochs"], run["rows"])]
        last = run["rows"][-1]
        print(f"B={b}: {len(run['rows'])} epochs, progress {last['progress']:.0f}, val acc "
              f"{last['metric']:.3f}, |Phi predicted - measured| max {max(errs):.3f} "
              f"mean {sum(errs) / len(errs):.3f} ({run['time_s']:.1f} s)")
        runs.append(run)
    doc = {"source": "benchmarks/record_convergence.py", "model": "DigitsCNN", "dataset": "digits",
           "reference_batch": m0, "lr": args.lr, "momentum": args.momentum, "lr_rule": args.lr_rule,
           "seed": args.seed, "machine": platform.platform(), "torch": torch.__version__,
           "runs": [{k: v for k, v in r.items() if k != "rows"} for r in runs]}
    write_json(args.out / "record.json", doc, indent=1, announce=False)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
