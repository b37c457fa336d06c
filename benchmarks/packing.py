"""IMPV of the pack primitive (Pack paper Eq. 1-3): K packed vs K sequential training steps.

    T_s(Seq)  = sum_k T_s(model k)          (Eq. 1: each model alone, one after the other)
    T_s(Pack) = T_s(Pack(model 1..K))       (Eq. 2: one PackedModel.train_step)
    IMPV      = (T_s(Seq) - T_s(Pack)) / T_s(Seq)   (Eq. 3)

for K = 2, 4, 8, a small MLP (digits-sized, 64-64-64-10) and a small CNN (DigitsCNN), every
member with its own learning rate; "same" = one optimizer type (Adam), "mixed" = SGD /
momentum / Adam / Adagrad round-robin. Also measured: plain torch.func ensembling of the same
models (stack_module_state + vmap(functional_call) + one SGD-style update on the stacked
tensors), the reference the pack primitive's batched path is modelled on.

The variants run interleaved in ONE process (repeats alternate between them); we report the
minimum over repeats (other processes on a shared machine only ever add time; medians are in
the JSON too). No Ray. ``--device cuda`` runs on a GPU.

    python benchmarks/packing.py [--device cpu|cuda] [--batch 32] [--repeats 7] [--steps 50] [--ks 2,4,8]

``IMPV_median_of_rounds`` is the median of per-round (paired) IMPVs; ``IMPV`` the older
best-of-repeats figure, kept for comparison with earlier rows of RESULTS.md.

On a CUDA device the pack's step is replayed as a CUDA graph (``cuda_graphs="auto"``, the
default); the same pack with ``cuda_graphs="off"`` runs as a further contender ``pack_eager``,
and ``graph_speedup_median_of_rounds`` is the median of per-round ``T(pack_eager) / T(pack)``.
The order of the variants rotates every round.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn
from torch.func import functional_call, stack_module_state

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import default_out, positive_ints, write_json  # noqa: E402
from jabasray.engine.packing import pack  # noqa: E402
from jabasray.models import MLP, DigitsCNN  # noqa: E402

F = nn.functional
OPTS = [lambda p, lr: torch.optim.SGD(p, lr=lr), lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
        lambda p, lr: torch.optim.Adam(p, lr=lr), lambda p, lr: torch.optim.Adagrad(p, lr=lr)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _members(model_name: str, K: int, opt_mix: str, device: str):
    torch.manual_seed(0)
    models, opts = [], []
    for k in range(K):
        m = (MLP(hidden=(64, 64, 64)) if model_name == "mlp" else DigitsCNN(channels=16, hidden=64)).to(device)
        lr = 1e-3 * (k + 1)
        o = torch.optim.Adam(m.parameters(), lr=lr) if opt_mix == "same" else OPTS[k % 4](m.parameters(), lr)
        models.append(m)
        opts.append(o)
    return models, opts


def _time(fn, steps: int, device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / steps


def measure(model_name: str, K: int, opt_mix: str, device: str, batch: int, repeats: int, steps: int) -> dict:
    models, opts = _members(model_name, K, opt_mix, device)
    seq_models = [copy.deepcopy(m) for m in models]
    seq_opts = [type(o)(m.parameters(), **o.defaults) for o, m in zip(opts, seq_models)]
    graphs = device.startswith("cuda")               # graphed vs eager pack: a GPU-only pair
    eager_models = [copy.deepcopy(m) for m in models] if graphs else []
    eager_opts = [type(o)(m.parameters(), **o.defaults) for o, m in zip(opts, eager_models)]
    packed = pack(models, opts, [batch] * K)
    packed_eager = pack(eager_models, eager_opts, [batch] * K, cuda_graphs="off") if graphs else None
    ens_models = [copy.deepcopy(m) for m in models]
    params, _ = stack_module_state(ens_models)
    base = copy.deepcopy(ens_models[0]).to("meta")
    lrs = torch.tensor([1e-3 * (k + 1) for k in range(K)], device=device)

    def ens_loss(p, x, y):
        return F.cross_entropy(functional_call(base, p, (x,)), y)
    ens_grad = torch.func.vmap(torch.func.grad(ens_loss), in_dims=(0, None, None))

    shape = (batch, 64) if model_name == "mlp" else (batch, 1, 8, 8)
    x = torch.rand(shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def seq_step():
        for m, o in zip(seq_models, seq_opts):        # Eq. 1: model k alone, one after another
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()

    def pack_step():
        packed.train_step_tensor(x, y)                 # Eq. 2

    def pack_eager_step():
        packed_eager.train_step_tensor(x, y)

    def ens_step():                                     # torch.func ensembling + stacked SGD
        g = ens_grad(params, x, y)
        with torch.no_grad():
            for n in params:
                params[n].sub_(lrs.view(-1, *([1] * (params[n].dim() - 1))) * g[n])

    variants = {"seq": seq_step, "pack": pack_step, "torch_func": ens_step}
    if graphs:
        variants["pack_eager"] = pack_eager_step
    for fn in variants.values():                        # warm-up (folded-execution check, and
        for _ in range(6):                              # the graph's warm-up and capture)
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(repeats):                            # interleaved repeats, order rotated
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(_time(variants[k], steps, device))
    # min over interleaved repeats: the machine is shared, other processes only ever ADD time
    best = {k: min(v) for k, v in times.items()}
    medians = {f"median_{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}
    # paired: seq and pack of the SAME repeat (round), then the median of those ratios
    impv_rounds = [(s_ - p_) / s_ for s_, p_ in zip(times["seq"], times["pack"])]
    return {"model": model_name, "K": K, "optimizers": opt_mix, "batch": batch, **medians,
            "IMPV_per_round": impv_rounds, "IMPV_median_of_rounds": statistics.median(impv_rounds),
            "T_seq_ms": best["seq"] * 1e3, "T_pack_ms": best["pack"] * 1e3,
            "T_torch_func_ms": best["torch_func"] * 1e3,
            "IMPV": (best["seq"] - best["pack"]) / best["seq"],
            "IMPV_torch_func": (best["seq"] - best["torch_func"]) / best["seq"],
            "speedup": best["seq"] / best["pack"],
            **(_graph_figures(times, packed) if graphs else {})}


def _graph_figures(times: dict[str, list[float]], packed) -> dict:
    """Graphed (``pack``) vs eager (``pack_eager``) pack: per-round ratios and their median."""
    ratios = [e / g for e, g in zip(times["pack_eager"], times["pack"])]
    return {"pack_graphed": packed.last_step_graphed, "graph_fallback": packed.graph_fallback_reason(),
            "graph_speedup_per_round": ratios,
            "graph_speedup_median_of_rounds": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--ks", default="2,4,8", help="comma-separated pack sizes K (default 2,4,8)")
    ap.add_argument("--out", default=default_out('packing.json'))
    args = ap.parse_args(argv)
    ks = positive_ints(ap, "--ks", args.ks)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device available")
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    rows = []
    for model_name in ("mlp", "cnn"):
        for opt_mix in ("same", "mixed"):
            for K in ks:
                r = measure(model_name, K, opt_mix, args.device, args.batch, args.repeats, args.steps)
                rows.append(r)
                print(f"{model_name:4s} K={K} opt={opt_mix:5s}  seq {r['T_seq_ms']:7.3f} ms  "
                      f"pack {r['T_pack_ms']:7.3f} ms  IMPV {r['IMPV']:+.2f} ({r['speedup']:.2f}x; "
                      f"median of paired rounds {r['IMPV_median_of_rounds']:+.2f})  "
                      f"torch.func {r['T_torch_func_ms']:7.3f} ms (IMPV {r['IMPV_torch_func']:+.2f})",
                      flush=True)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.processor() or platform.machine()} CPU, {args.threads} torch thread(s)"
    write_json(args.out, {"device": dev, "torch": torch.__version__, "args": vars(args), "rows": rows,
                          "load_average": {"before": load_before, "after": os.getloadavg()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
