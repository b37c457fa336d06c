"""What a similarity threshold gamma costs in samples, from recorded gradient statistics.

SimiGrad's and JABAS's rule (JABAS section 6.1) grows B_G while the two-group similarity Phi is
below gamma and shrinks it above, so it holds B_G where the expected Phi equals gamma:
``B = 2 gamma B_noise / (1 - gamma)`` (:func:`jabasray.sim.convergence.settled_batch`), within
``[--initial, --max]``. By Pollux's statistical efficiency (the progress a sample gives at B),
a run there needs ``E(B0) / E(B)`` times the samples of a run at the initial batch B0 for the
same progress. This script walks a convergence trace (the gradient noise scale at each recorded
epoch of the run at B0) and reports, per gamma, the batch the rule holds and the samples it
needs relative to B0: over the whole trace (progress-weighted) and per row.

    python benchmarks/gamma_efficiency.py                       # digits, B0 64, max 512
    python benchmarks/gamma_efficiency.py --app cifar10 --initial 128 --max 4096

No training, no Ray: the numbers come from the trace alone (``jabasray/sim/traces/<app>``).
Writes ``<tmp>/jabasray_bench/gamma_efficiency.json`` (``--out``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common import default_out, write_json


def walk(model, initial: int, largest: int, gammas: list[float]) -> dict:
    """Per gamma: each row's (progress, B_noise, held batch, E(B0) / E(B)) and the
    progress-weighted samples ratio ``integral dp / E(B) / integral dp / E(B0)``."""
    from jabasray.sim.convergence import settled_batch

    trace = model.traces_[min(model.traces_, key=lambda b: abs(b - initial))]
    edges = [0.0, *(float(p) for p in trace.progress)]
    out = {}
    for gamma in gammas:
        rows, need, base = [], 0.0, 0.0
        for lo, hi in zip(edges, edges[1:]):
            noise = model.noise_scale(hi, initial)
            batch = min(largest, max(initial, settled_batch(noise, gamma)))
            e0, e = model.efficiency(hi, initial), model.efficiency(hi, batch)
            need += (hi - lo) / e
            base += (hi - lo) / e0
            rows.append({"progress": hi, "noise_scale": noise, "batch": batch, "samples_ratio": e0 / e})
        out[str(gamma)] = {"rows": rows, "samples_ratio": need / base,
                           "mean_batch": sum(r["batch"] for r in rows) / len(rows)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--app", default="digits", help="a packaged trace (jabasray/sim/traces/<app>)")
    ap.add_argument("--initial", type=int, default=64, help="B0: initial (and smallest) global batch")
    ap.add_argument("--max", type=int, default=512, help="largest global batch")
    ap.add_argument("--gammas", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    ap.add_argument("--out", type=Path, default=Path(default_out("gamma_efficiency.json")))
    args = ap.parse_args(argv)
    from jabasray.sim.convergence import packaged_model

    result = walk(packaged_model(args.app), args.initial, args.max, args.gammas)
    print(f"{args.app}: the batch the similarity rule holds, and the samples it needs for the same "
          f"progress relative to B0 = {args.initial} (Pollux's efficiency)")
    for gamma, r in result.items():
        per_row = " ".join(f"{row['batch']:.0f}" for row in r["rows"])
        print(f"  gamma {float(gamma):.2f}: samples x{r['samples_ratio']:.2f}, mean batch "
              f"{r['mean_batch']:.0f}; per recorded epoch: {per_row}")
    write_json(args.out, {"benchmark": "gamma_efficiency", "app": args.app, "initial": args.initial,
                          "max": args.max, "gammas": result}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
