"""Correctness of the CUDA code paths (a script for a GPU machine; no Ray).

The test suite proves the engine's semantics on CPU; this script repeats the key equivalences
on a real GPU, where VSWs run on their own CUDA streams, OWS overlaps the shard optimizer with
all-reduce on a side stream, SMA learners run on streams and packs run batched kernels:

1. IIDP step == plain step on the union (SGD momentum, Adam; SWS and OWS; 1..4 VSWs, GA).
2. SMA on CUDA == SMA on CPU for the same model, data and learners (streams change nothing).
3. A pack of K members on CUDA == each member trained alone on CUDA.

Prints one line per check and writes <tmp>/jabasray_bench/cuda_check.json. Exit code 1 on failure.

    python benchmarks/cuda_check.py [--device cuda]
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import default_out, write_json  # noqa: E402
from engine_reference import OPTIMIZERS, make_data, make_model, max_rel_diff, reference_step, split  # noqa: E402
from jabasray.engine import IIDPWorker  # noqa: E402


def check_iidp(device: str) -> list[dict]:
    rows = []
    for opt_name, opt_fn in OPTIMIZERS.items():
        for sync in ("sws", "ows"):
            for num_vsw, num_ga in ((1, 0), (2, 1), (4, 0), (3, 2)):
                b = 8
                model = make_model(0).to(device)
                ref = copy.deepcopy(model)
                ref_opt = opt_fn(ref.parameters())
                w = IIDPWorker(copy.deepcopy(model), opt_fn, F.cross_entropy, device=device,
                               weight_sync=sync, bucket_cap_mb=0.001)
                w.configure(num_vsw=num_vsw, num_ga=num_ga, local_batch_size=b)
                n = num_vsw * (num_ga + 1)
                worst = 0.0
                for step in range(4):
                    X, y = make_data(step, n * b)
                    X, y = X.to(device), y.to(device)
                    w.train_step(split(X, y, [b] * n))
                    reference_step(ref, ref_opt, X, y)
                    worst = max(worst, max_rel_diff(w.model, ref))
                rows.append({"check": "iidp", "optimizer": opt_name, "weight_sync": sync,
                             "num_vsw": num_vsw, "num_ga": num_ga, "max_rel_diff": worst,
                             "ok": worst < 1e-4})
    return rows


def check_sma(device: str) -> list[dict]:
    from jabasray.engine.sma import SMAWorker

    out = {}
    for dev in ("cpu", device):
        model = make_model(1)
        w = SMAWorker(model, F.cross_entropy, lr=0.05, momentum=0.9, device=dev, overlap_sync=False)
        w.configure(num_vsw=3, num_ga=1, local_batch_size=8)
        for step in range(5):
            X, y = make_data(100 + step, 6 * 8)
            w.train_step([(a.to(dev), t.to(dev)) for a, t in split(X, y, [8] * 6)])
        out[dev] = copy.deepcopy(w.model).cpu()
    diff = max_rel_diff(out[device], out["cpu"])
    return [{"check": "sma", "learners": 3, "num_ga": 1, "max_rel_diff_vs_cpu": diff, "ok": diff < 1e-4}]


def check_pack(device: str) -> list[dict]:
    from jabasray.engine.packing import pack
    from jabasray.models import MLP

    rows = []
    makers = [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
              lambda p: torch.optim.Adam(p, lr=1e-3), lambda p: torch.optim.Adagrad(p, lr=0.05)]
    models, alone = [], []
    for k in range(4):
        torch.manual_seed(k)
        m = MLP(act=("relu", "tanh")[k % 2]).to(device)
        models.append(m)
        alone.append(copy.deepcopy(m))
    opts = [makers[k](m.parameters()) for k, m in enumerate(models)]
    alone_opts = [makers[k](m.parameters()) for k, m in enumerate(alone)]
    sizes = [32, 16, 32, 8]
    p = pack(models, opts, sizes, loss_fn=F.cross_entropy)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        X = torch.randn(32, 64, generator=g).to(device)
        y = torch.randint(0, 10, (32,), generator=g).to(device)
        p.train_step(X, y)
        for k, m in enumerate(alone):
            alone_opts[k].zero_grad()
            F.cross_entropy(m(X[:sizes[k]]), y[:sizes[k]]).backward()
            alone_opts[k].step()
    for k in range(4):
        mk, _ = p.free(k)
        diff = max_rel_diff(mk, alone[k])
        rows.append({"check": "pack", "member": k, "max_rel_diff": diff, "ok": diff < 1e-4})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=default_out('cuda_check.json'))
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda_check: no CUDA device; nothing checked", file=sys.stderr)
        return 2
    rows = []
    for fn in (check_iidp, check_sma, check_pack):
        try:
            rows += fn(args.device)
        except Exception as e:  # report and go on with the other checks
            rows.append({"check": fn.__name__, "ok": False, "error": f"{type(e).__name__}: {e}"})
    for r in rows:
        print(json.dumps(r))
    ok = all(r["ok"] for r in rows)
    info = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "all_ok": ok, "rows": rows}
    write_json(args.out, info, announce=False)
    print(f"cuda_check: {sum(r['ok'] for r in rows)}/{len(rows)} checks passed on {info['device']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
