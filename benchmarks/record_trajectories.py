"""Record real B_G trajectories of this project's adaptive rule (input of benchmarks/forecast.py).

Trains ``jabasray.models.DigitsCNN`` on scikit-learn's digits in plain PyTorch (no Ray, no
engine), the way JABAS adapts B_G (section 6.1): every global batch is split into two halves
(= the two GPU groups), each half's mean-loss gradient is computed separately, the step uses
their sample-weighted mean (= the gradient of the whole batch), and every p iterations the
cosine similarity of the two halves' gradients goes through
``jabasray.adaptive.AdaptiveBatchController`` (our ``next_global_batch`` rule); the learning rate
follows B_G by the job's scaling rule. The per-epoch trajectories (one value per p iterations)
of a few (gamma, alpha) settings are written to ``benchmarks/data/trajectories_digits.json``.

    python benchmarks/record_trajectories.py            # ~1 min on a 2-core CPU
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from torch import nn

from common import write_json
from jabasray.adaptive import AdaptiveBatchController, cosine_similarity
from jabasray.config import JobConfig
from jabasray.data import accuracy, load_digits_split
from jabasray.models import DigitsCNN

HERE = Path(__file__).resolve().parent

# (gamma, alpha): SimiGrad/JABAS thresholds span 0.1..0.9 (JABAS Table 4), alpha = 0.1 default.
SETTINGS = [(0.3, 0.1), (0.5, 0.1), (0.7, 0.1), (0.5, 0.2), (0.9, 0.1), (0.3, 0.2)]


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def record(gamma: float, alpha: float, *, epochs: int, adapt_interval: int, initial: int,
           min_batch: int, max_batch: int, lr: float, seed: int) -> dict:
    """Train once with the adaptive rule; return the setting and its trajectories."""
    torch.manual_seed(seed)
    train, val = load_digits_split(seed=seed)
    X, y = train.tensors
    job = JobConfig(initial_global_batch=initial, min_global_batch=min_batch,
                    max_global_batch=max_batch, min_local_batch=1, adapt_interval=adapt_interval,
                    alpha=alpha, gamma=gamma, lr=lr, lr_scaling="sqrt", epochs=epochs, seed=seed)
    ctl = AdaptiveBatchController(job)
    model = DigitsCNN()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=ctl.lr(0), momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(seed)
    iteration, accs = 0, []
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        cursor = 0
        while cursor < len(y):
            b = ctl.global_batch
            idx = perm[cursor:cursor + b]
            cursor += len(idx)
            half = (len(idx) + 1) // 2
            groups = [idx[:half], idx[half:]]
            grads, sizes = [], []
            for g in groups:                       # group A, group B
                if len(g) == 0:
                    continue
                opt.zero_grad(set_to_none=False)
                loss_fn(model(X[g]), y[g]).backward()
                grads.append(_flat_grad(model).clone())
                sizes.append(len(g))
            full = sum(n * g for n, g in zip(sizes, grads)) / sum(sizes)
            offset = 0
            for p in params:                      # gradient of the whole batch
                p.grad.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            for group in opt.param_groups:
                group["lr"] = ctl.lr(iteration)
            opt.step()
            iteration += 1
            # Adapt every p iterations, on full windows only (not on the ragged epoch tail).
            if iteration % adapt_interval == 0 and len(grads) == 2 and len(idx) == b:
                ctl.update(cosine_similarity(grads[0], grads[1]))
        ctl.end_epoch()
        accs.append(accuracy(model, val))
    return {"gamma": gamma, "alpha": alpha, "adapt_interval": adapt_interval,
            "initial_global_batch": initial, "min_global_batch": min_batch,
            "max_global_batch": max_batch, "lr": lr, "lr_scaling": "sqrt", "epochs": epochs,
            "seed": seed, "dataset_size": len(y), "trajectories": ctl.completed_trajectories,
            "similarities": ctl.similarities[:-1], "val_accuracy": accs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--adapt-interval", type=int, default=1, help="p (iterations)")
    ap.add_argument("--initial", type=int, default=16)
    ap.add_argument("--min-batch", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "data" / "trajectories_digits.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    runs = []
    for gamma, alpha in SETTINGS:
        t = time.perf_counter()
        run = record(gamma, alpha, epochs=args.epochs, adapt_interval=args.adapt_interval,
                     initial=args.initial, min_batch=args.min_batch, max_batch=args.max_batch,
                     lr=args.lr, seed=args.seed)
        runs.append(run)
        lens = [len(tr) for tr in run["trajectories"]]
        print(f"gamma={gamma:.1f} alpha={alpha:.1f}: windows/epoch {lens}, "
              f"last B_G {run['trajectories'][-1][-1]}, val acc {run['val_accuracy'][-1]:.3f} "
              f"({time.perf_counter() - t:.1f} s)")
    doc = {"source": "benchmarks/record_trajectories.py", "model": "DigitsCNN", "dataset": "digits",
           "machine": platform.platform(), "torch": torch.__version__, "runs": runs}
    write_json(args.out, doc, indent=1, announce=False)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
