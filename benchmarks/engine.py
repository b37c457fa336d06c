"""IIDP engine benchmark (no Ray): measures the compared variants side by side in one run.

1. Overhead: IIDP with one VSW (no GA, no process group) vs a plain PyTorch loop at the same
   batch size (goal: <= 5 % slower), measured like part 4 (windows of ``--window`` steps, order
   rotated, both sides read their losses once per window, per-round ratios).
2. Weight synchronisation for num_vsw = 1..4: the naive scheme (every VSW runs its own
   optimizer on the aggregated gradient, the baseline of JABAS section 4 / 7.4) vs SWS vs OWS.
3. CPU only (skip with ``--no-dist``): two processes over gloo on 127.0.0.1, 2 VSWs each:
   SWS vs OWS vs SWS without comm/backward overlap (all-reduce launched after the whole
   backward), wall time per step and exposed (waited-for) communication time.
4. Batched VSWs vs one plain PyTorch worker (``--parts batched``; CPU and CUDA): n VSWs at
   B_L run by the engine's default (batched: one pass over the n adjacent micro-batches,
   per-VSW BatchNorm; eager) and forced per-VSW, against a plain loop (zero_grad, forward,
   backward, optimizer step) on the same n * B_L samples. On CUDA also the graphed pair: the
   plain loop captured as one CUDA graph (PyTorch's whole-network recipe: warm-up on a side
   stream, static input buffers refilled every step, SGD with its LR a constant of the graph)
   vs the engine's batched step replaying its captured graph (``cuda_graphs="auto"``: SGD
   fused with the LR as a device tensor). Ratios eager vs eager (batched / plain) and graph vs
   graph (batched_graph / plain_graph). Same host work on every side: the loss stays on the
   device and is read once per window (``read_losses``), which is also the only
   synchronisation. Windows of ``--window`` steps (default 50), rounds with the variant order
   rotated, per-round ratios (1.00 = as fast as the plain side, the goal is <= 1/0.95) and
   their median. Models: a small CNN with BatchNorm and a small transformer encoder (CPU),
   ResNet-18 and the small transformer (CUDA).
5. ``--device cuda`` only: throughput vs num_vsw = 1 .. n_max (probed to the memory limit,
   bounded by ``--max-vsw``) at several B_L (``--local-batches``) on the ResNet-18-sized model
   below, with real CUDA streams (analogue of JABAS Fig. 7), in paired rounds of three
   contenders doing the same work: VSWs issued from one thread (the CUDA scheme), VSWs on one
   thread each, and ONE worker with the same total batch n * B_L. Per-round ratios and their
   median are reported.

6. DDP contender (``--parts ddp``): torch's ``DistributedDataParallel`` at the same per-rank
   batch as the engine's step (n VSWs of B_L per rank), what a Ray Train user runs today. CPU:
   2 gloo ranks, the engine's eager step (communication thread) and its eager segments
   (``segmented="on"``) against eager DDP. CUDA: one rank per device (a one-rank NCCL group on
   one GPU), the engine eager and graphed (segments with the all-reduces between them) against
   eager DDP, the engine's single-device graphed step (no process group) and DDP with
   ``static_graph=True`` captured as a CUDA graph (PyTorch's recipe: 11
   eager warm-up iterations; "not measured" with the reason where torch refuses). Paired
   rounds of ``--ddp-window`` steps, order rotated (A B, B A, ...), per-round ratios engine /
   DDP and their median, load average at start and end.

Variants are interleaved round by round (``--rounds``) and the median of the rounds is
reported. Prints ratios and writes ``<tmp>/jabasray_bench/engine.json``.

    python benchmarks/engine.py [--device cpu|cuda] [--quick] [--local-batches 16,32,64] [--max-vsw 16]
    python benchmarks/engine.py --parts ddp [--device cuda]      # the DDP contender only
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common import default_out, positive_ints, write_json
from jabasray.engine import IIDPWorker
from jabasray.engine.buckets import trainable_parameters
from jabasray.engine.graphs import GRAPH_WARMUP_STEPS
from jabasray.engine.iidp import _Timings, read_losses
from jabasray.engine.loader import split_batch
from jabasray.models import MLP



# ----------------------------------------------------------------------------- models
def wide_mlp() -> nn.Module:
    """~2.4M parameters: big enough that the optimizer and weight copies cost something."""
    return MLP(in_features=256, hidden=(1024,) * 3, num_classes=10)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(out)) + self.short(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18 (11.2M parameters), input 3x32x32."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class SmallCNN(nn.Module):
    """Three conv-BatchNorm-ReLU stages and a linear head on 3x16x16 inputs (~60k parameters)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        chans, layers, cin = (16, 32, 64), [], 3
        for c in chans:
            layers += [nn.Conv2d(cin, c, 3, 2 if cin != 3 else 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
            cin = c
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.body(x), 1).flatten(1))


class SmallTransformer(nn.Module):
    """Token embedding + 2 pre-norm encoder layers (d 64, 4 heads) + mean-pool classifier over
    sequences of 16 tokens from a vocabulary of 256 (~110k parameters); no dropout."""

    def __init__(self, classes: int = 10, vocab: int = 256, d: int = 64, seq: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.fc = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.enc(self.emb(tokens) + self.pos).mean(1))


# model name -> (factory, one sample's input: ("float", shape) or ("tokens", (seq, vocab)))
BATCHED_MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[str, tuple[int, ...]]]] = {
    "small_cnn": (SmallCNN, ("float", (3, 16, 16))),
    "small_transformer": (SmallTransformer, ("tokens", (16, 256))),
    "resnet18": (lambda: ResNet18(), ("float", (3, 32, 32))),
}


# ----------------------------------------------------------------------------- naive baseline
class NaiveWorker(IIDPWorker):
    """Every VSW holds its own optimizer and applies it to the aggregated gradient (the scheme
    one-way weight sync replaces): after the all-reduce the mean gradient is copied into every
    VSW's gradient buffers and every VSW steps its own optimizer; no weight copy."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._optimizer_fn = kw.get("optimizer_fn") or a[1]
        self._own: dict[int, torch.optim.Optimizer] = {}

    def _update(self, divisor: float) -> _Timings:
        t = time.perf_counter()
        for b in range(len(self._specs)):
            self._buckets.wait_bucket(b)
        t2 = time.perf_counter()
        main = self._vsws[0].buffers
        if divisor != 1.0:
            for b in range(len(self._specs)):
                main.scale_bucket(b, 1.0 / divisor)
        self.optimizer.step()
        for v in self._vsws[1:]:
            key = id(v.module)
            if key not in self._own:
                self._own[key] = self._optimizer_fn([p for _, p in trainable_parameters(v.module)])
            for b in range(len(self._specs)):
                torch._foreach_copy_(v.buffers.bucket_grads(b), main.bucket_grads(b))
            self._own[key].step()
        return _Timings(comm=t2 - t, optim=time.perf_counter() - t2)


class NoOverlapWorker(IIDPWorker):
    """Ablation: buckets are aggregated and all-reduced only after the whole backward pass
    (no bucket hooks: every bucket completes when the VSW's backward has ended), i.e. no
    comm/backward overlap."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._buckets.hooks_enabled = False


# ----------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step: Callable[[], None], iters: int, device: torch.device) -> tuple[float, float]:
    """Mean (wall seconds, process CPU seconds) per step."""
    _sync(device)
    t, c = time.perf_counter(), time.process_time()
    for _ in range(iters):
        step()
    _sync(device)
    return (time.perf_counter() - t) / iters, (time.process_time() - c) / iters


def _interleaved(variants: dict[str, Callable[[], None]], rounds: int, iters: int, warmup: int,
                 device: torch.device) -> dict[str, float]:
    """Median over rounds of the mean seconds per step; variants alternate within a round.

    On CPU the figure is process CPU time (all threads of this process): the shared 2-core
    dev machine is loaded by other work, which inflates wall time at random; on CUDA it is
    wall time (GPU work does not show in CPU time). Both medians are returned
    (``<name>`` = the figure used, ``<name>:wall``, ``<name>:cpu``).
    """
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            w, c = _time_steps(fn, iters, device)
            wall[k].append(w)
            cpu[k].append(c)
    out = {}
    for k in variants:
        out[f"{k}:wall"] = statistics.median(wall[k])
        out[f"{k}:cpu"] = statistics.median(cpu[k])
        out[k] = out[f"{k}:wall"] if device.type == "cuda" else out[f"{k}:cpu"]
        out[f"{k}:rounds"] = wall[k] if device.type == "cuda" else cpu[k]   # per round, in order
    return out


def _round_ratios(res: dict, num: str, den: str) -> list[float]:
    """Per-round ratios ``num / den`` of an :func:`_interleaved` result (same rounds)."""
    return [a / b for a, b in zip(res[f"{num}:rounds"], res[f"{den}:rounds"])]


def _data(n: int, shape: tuple[int, ...], device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n,) + shape, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)


def _micro_batches(num: int, local_batch: int, shape: tuple[int, ...], device: torch.device,
                   seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num`` micro-batches of ``local_batch`` random samples each."""
    X, y = _data(num * local_batch, shape, device, seed)
    return list(zip(X.split(local_batch), y.split(local_batch)))


def _weight_sync_workers(variants: list[tuple[str, type, str]], num_vsw: int, local_batch: int,
                         device: torch.device | str = "cpu", **worker_kw) -> dict[str, IIDPWorker]:
    """One configured worker per ``(name, worker class, weight_sync)``, all from the same weights."""
    workers = {}
    for name, cls, method in variants:
        torch.manual_seed(0)
        # per-VSW execution: the naive baseline steps every replica's own optimizer
        w = cls(wide_mlp().to(device), _adam, F.cross_entropy, device=device, weight_sync=method,
                vsw_execution="one_thread" if torch.device(device).type == "cuda" else "threads",
                cuda_graphs="off", **worker_kw)
        w.configure(num_vsw, 0, local_batch)
        workers[name] = w
    return workers


def _adam(p):
    return torch.optim.Adam(p, lr=1e-4)


# ----------------------------------------------------------------------------- parts
def bench_overhead(device: torch.device, batch: int, rounds: int, window: int) -> dict:
    """The engine at 1 VSW (no GA, no process group; eager) vs a plain loop at the same batch,
    by the batched part's method: windows of ``window`` steps, the order rotated every round,
    both sides keeping each step's loss on the device and reading the window's losses once at
    its end; per-round ratios (engine / plain) and their median."""
    torch.manual_seed(0)
    plain_model = wide_mlp().to(device)
    iidp_model = wide_mlp().to(device)
    iidp_model.load_state_dict(plain_model.state_dict())
    opt = _adam(plain_model.parameters())
    X, y = _data(batch, (256,), device)

    plain = plain_loop(plain_model, opt, X, y)
    flat_model = wide_mlp().to(device)
    flat_model.load_state_dict(plain_model.state_dict())
    w = IIDPWorker(iidp_model, _adam, F.cross_entropy, device=device, weight_sync="sws", cuda_graphs="off")
    w.configure(1, 0, batch)
    # flat gradient buckets, as in a distributed run (only the all-reduce itself is missing)
    wf = IIDPWorker(flat_model, _adam, F.cross_entropy, device=device, weight_sync="sws", flat_grads=True,
                    cuda_graphs="off")
    wf.configure(1, 0, batch)

    variants = {"plain": plain, "iidp_1vsw": engine_loop(w, [(X, y)]),
                "iidp_1vsw_flat": engine_loop(wf, [(X, y)])}
    for fn in variants.values():              # warm-up (allocator, lazy optimizer state)
        fn(3)
    times = _rotated_rounds(variants, rounds, window, device)
    w.close()
    wf.close()
    ratios = [a / b for a, b in zip(times["iidp_1vsw"], times["plain"])]
    ratios_flat = [a / b for a, b in zip(times["iidp_1vsw_flat"], times["plain"])]
    med = {k: statistics.median(times[k]) * 1e3 for k in variants}
    ratio, ratio_flat = statistics.median(ratios), statistics.median(ratios_flat)
    print(f"[overhead] batch {batch}: plain {med['plain']:.2f} ms, IIDP 1 VSW {med['iidp_1vsw']:.2f} ms "
          f"-> median ratio {ratio:.3f} ({(ratio - 1) * 100:+.1f}%); with flat buckets "
          f"{med['iidp_1vsw_flat']:.2f} ms -> {ratio_flat:.3f} ({rounds} rounds x {window} steps)")
    return {"batch": batch, "window": window, "plain_ms": med["plain"], "iidp_1vsw_ms": med["iidp_1vsw"],
            "iidp_1vsw_flat_ms": med["iidp_1vsw_flat"], "ratio": ratio, "ratio_flat": ratio_flat,
            "ratio_per_round": ratios, "ratio_flat_per_round": ratios_flat,
            "ms_per_step_rounds": {k: [t * 1e3 for t in v] for k, v in times.items()},
            "load_average": os.getloadavg()}


def bench_weight_sync(device: torch.device, local_batch: int, max_vsw: int, rounds: int, iters: int,
                      bucket_cap_mb: float) -> list[dict]:
    rows = []
    for n in range(1, max_vsw + 1):
        workers = _weight_sync_workers([("naive", NaiveWorker, "sws"), ("sws", IIDPWorker, "sws"),
                                        ("ows", IIDPWorker, "ows")], n, local_batch, device,
                                       bucket_cap_mb=bucket_cap_mb)
        mbs = _micro_batches(n, local_batch, (256,), device)
        upd: dict[str, list[float]] = {k: [] for k in workers}

        def make(k):
            def fn() -> None:
                upd[k].append(workers[k].train_step(mbs).update_time)
            return fn
        res = _interleaved({k: make(k) for k in workers}, rounds, iters, 2, device)
        row = {"num_vsw": n, "num_buckets": len(workers["sws"].bucket_plan)}
        for k in workers:
            row[f"{k}_ms"] = res[k] * 1e3
            row[f"{k}_update_wall_ms"] = statistics.median(upd[k]) * 1e3   # engine's update_time
            workers[k].close()
        row["wall_ms"] = {k.split(":")[0]: v * 1e3 for k, v in res.items() if k.endswith(":wall")}
        row["naive_over_sws"] = res["naive"] / res["sws"]
        row["naive_over_ows"] = res["naive"] / res["ows"]
        row["sws_over_ows"] = res["sws"] / res["ows"]
        wall = row["wall_ms"]
        print(f"[weight sync] n_vsw={n}: iteration naive {row['naive_ms']:.1f} / SWS {row['sws_ms']:.1f} / "
              f"OWS {row['ows_ms']:.1f} ms; wall {wall['naive']:.1f} / {wall['sws']:.1f} / {wall['ows']:.1f} ms "
              f"of which update {row['naive_update_wall_ms']:.1f} / {row['sws_update_wall_ms']:.1f} / "
              f"{row['ows_update_wall_ms']:.1f} ms; naive/SWS {row['naive_over_sws']:.2f}, "
              f"naive/OWS {row['naive_over_ows']:.2f}, SWS/OWS {row['sws_over_ows']:.2f}")
        rows.append(row)
    return rows


def _resnet_worker(device: torch.device, num_vsw: int, local_batch: int,
                   execution: str = "auto") -> IIDPWorker:
    torch.manual_seed(0)
    w = IIDPWorker(ResNet18().to(device), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                   F.cross_entropy, device=device, vsw_execution=execution, cuda_graphs="off")
    w.configure(num_vsw, 0, local_batch)
    return w


def probe_resnet_n_max(device: torch.device, local_batch: int, bound: int) -> int:
    """n_max of the ResNet-18 worker at ``local_batch``: the profiler's probe (doubling +
    bisection, one untimed step per probe, OOM = does not fit), at most ``bound``."""
    from jabasray.profiler.measure import oom_probe, probe_max_fitting

    w = _resnet_worker(device, 1, local_batch)

    def fits(n: int) -> bool:
        def step() -> None:
            w.configure(n, 0, local_batch)
            w.train_step(_micro_batches(n, local_batch, (3, 32, 32), device))
        return oom_probe(step, lambda: w.configure(1, 0, local_batch))
    n_max = probe_max_fitting(fits, bound)
    w.configure(1, 0, local_batch)     # drop the replicas before the cache is emptied
    w.close()
    torch.cuda.empty_cache()
    return n_max


def vsw_counts(n_max: int) -> list[int]:
    """The n_vsw points timed: 1, 2, 3, 4, 6, 8, 12, 16, ... up to n_max, and n_max."""
    pts, k = [1, 2, 3, 4], 4
    while k * 2 <= n_max:
        pts += [k * 3 // 2, k * 2]
        k *= 2
    return sorted({n for n in pts if n <= n_max} | {n_max})


def bench_vsw_throughput(device: torch.device, local_batches: list[int], max_vsw: int, rounds: int,
                         iters: int) -> list[dict]:
    """Throughput (samples/s) of ResNet-18 vs num_vsw = 1..n_max at each B_L (JABAS Fig. 7), in
    paired rounds: VSWs issued from one thread (CUDA scheme) vs one thread per VSW vs one worker
    with the same total batch n * B_L."""
    rows = []
    for bl in local_batches:
        n_max = probe_resnet_n_max(device, bl, max_vsw)
        print(f"[vsw throughput] B_L={bl}: n_max={n_max} (probed to the memory limit, bound {max_vsw})")
        base = None
        for n in vsw_counts(n_max):
            workers = {"one_thread": _resnet_worker(device, n, bl, "one_thread"),
                       "threads": _resnet_worker(device, n, bl, "threads"),
                       "one_worker": _resnet_worker(device, 1, n * bl)}
            mbs = _micro_batches(n, bl, (3, 32, 32), device)
            whole = _micro_batches(1, n * bl, (3, 32, 32), device)
            fns = {"one_thread": lambda: workers["one_thread"].train_step(mbs),
                   "threads": lambda: workers["threads"].train_step(mbs),
                   "one_worker": lambda: workers["one_worker"].train_step(whole)}
            res = _interleaved(fns, rounds, iters, 3, device)
            thp = n * bl / res["one_thread"]
            base = base or thp
            vs_one = _round_ratios(res, "one_worker", "one_thread")     # > 1: VSWs faster
            vs_threads = _round_ratios(res, "threads", "one_thread")   # > 1: one_thread faster
            row = {"local_batch": bl, "num_vsw": n, "n_max": n_max,
                   "iteration_ms": {k: res[k] * 1e3 for k in fns},
                   "samples_per_s": thp, "speedup_vs_1_vsw": thp / base,
                   "one_worker_over_vsw_per_round": vs_one,
                   "one_worker_over_vsw_median": statistics.median(vs_one),
                   "threads_over_one_thread_per_round": vs_threads,
                   "threads_over_one_thread_median": statistics.median(vs_threads)}
            rows.append(row)
            print(f"[vsw throughput] ResNet-18 B_L={bl} n_vsw={n}: {thp:.0f} samples/s "
                  f"({thp / base:.2f}x of 1 VSW); one worker at {n * bl} / VSWs: median "
                  f"{row['one_worker_over_vsw_median']:.2f}; threads / one_thread: median "
                  f"{row['threads_over_one_thread_median']:.2f}")
            for w in workers.values():
                w.close()
            workers.clear()
            torch.cuda.empty_cache()
    return rows


def _model_batch(kind: tuple[str, tuple[int, ...]], n: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    what, shape = kind
    x = (torch.randn((n,) + shape, generator=g) if what == "float"
         else torch.randint(0, shape[1], (n, shape[0]), generator=g))
    return x.to(device), torch.randint(0, 10, (n,), generator=g).to(device)


def _rotated_rounds(variants: dict[str, Callable[[], None]], rounds: int, window: int,
                    device: torch.device) -> dict[str, list[float]]:
    """Per round, each variant's mean seconds per step over a window of ``window`` steps; the
    order of the variants rotates by one every round. A variant's window ends with its own read
    of the window's losses (the one synchronisation), included in its time. Returns
    ``{name: [s per round]}`` (wall on CUDA, process CPU time on CPU: the shared CPU machine's
    load inflates wall time at random, CPU time of a single-threaded step does not) and
    ``{name + ":wall": ...}``."""
    names = list(variants)
    out: dict[str, list[float]] = {k: [] for k in names}
    out.update({k + ":wall": [] for k in names})
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            _sync(device)
            t, c = time.perf_counter(), time.process_time()
            variants[k](window)
            wall, cpu = (time.perf_counter() - t) / window, (time.process_time() - c) / window
            out[k].append(wall if device.type == "cuda" else cpu)
            out[k + ":wall"].append(wall)
    return out


def plain_loop(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
               y: torch.Tensor) -> Callable[[int], None]:
    """A plain eager training loop (zero_grad, forward, backward, ``opt.step()``) on the whole
    batch, each step's loss kept on the device and the window's losses read once at its end
    (the same host work as the engine's side)."""
    def run(steps: int) -> None:
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(X), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        read_losses(losses)
    return run


def engine_loop(worker: IIDPWorker, micro: list) -> Callable[[int], None]:
    """The engine's step on ``micro`` (its micro-batches), each step's loss kept on the device
    and the window's losses read once at its end - the host work of :func:`plain_loop`."""
    def run(steps: int) -> None:
        read_losses([worker.train_step(micro).loss_raw for _ in range(steps)])
    return run


def plain_graph_loop(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
                     y: torch.Tensor, warmup: int = 3) -> Callable[[int], None]:
    """A plain training step captured as one CUDA graph, by PyTorch's whole-network recipe:
    ``warmup`` steps on a side stream, capture of forward/backward/``opt.step()`` (gradients
    set to None first), then per step: copy the batch into the static inputs, replay, keep the
    loss (a device copy); the window's losses are read once at its end."""
    static_x, static_y = X.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = F.cross_entropy(model(static_x), static_y)
        static_loss.backward()
        opt.step()

    def run(steps: int) -> None:
        losses = []
        for _ in range(steps):
            static_x.copy_(X, non_blocking=True)
            static_y.copy_(y, non_blocking=True)
            graph.replay()
            losses.append(static_loss.detach().clone())
        read_losses(losses)
    return run


def bench_batched_vs_plain(device: torch.device, model_name: str, local_batches: list[int],
                           counts: list[int], rounds: int, window: int) -> list[dict]:
    """Part 4 of the module notes: n VSWs (batched, and forced per VSW) vs ONE plain worker on
    the same ``n * B_L`` samples, per-round ratios (variant / plain) and their median; on CUDA
    also the engine's graphed batched step vs the plain step as a graph."""
    graphs = device.type == "cuda"
    factory, kind = BATCHED_MODELS[model_name]
    per_vsw_scheme = "one_thread" if device.type == "cuda" else "threads"
    rows = []
    for bl in local_batches:
        for n in counts:
            total = n * bl
            X, y = _model_batch(kind, total, device)
            micro = split_batch((X, y), [bl] * n)        # adjacent views, as the loader hands them
            torch.manual_seed(0)
            plain_model = factory().to(device)
            opt = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)
            workers = {}
            engines = [("batched", "auto", "off"), ("per_vsw", per_vsw_scheme, "off")]
            if graphs:
                engines.append(("batched_graph", "auto", "auto"))
            for name, execution, cuda_graphs in engines:
                torch.manual_seed(0)
                w = IIDPWorker(factory().to(device), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                               F.cross_entropy, device=device, vsw_execution=execution,
                               cuda_graphs=cuda_graphs)
                w.configure(n, 0, bl)
                workers[name] = w

            plain = plain_loop(plain_model, opt, X, y)

            variants = {"plain": plain, "batched": engine_loop(workers["batched"], micro)}
            if n > 1:
                variants["per_vsw"] = engine_loop(workers["per_vsw"], micro)
            if graphs:
                torch.manual_seed(0)
                g_model = factory().to(device)
                g_opt = torch.optim.SGD(g_model.parameters(), lr=0.01, momentum=0.9)
                variants["plain_graph"] = plain_graph_loop(g_model, g_opt, X, y)
                variants["batched_graph"] = engine_loop(workers["batched_graph"], micro)
            for fn in variants.values():          # warm-up (allocator, lazy optimizer state,
                fn(GRAPH_WARMUP_STEPS + 2)        # the engine's graph warm-up and capture)
            graphed = None
            if graphs:                            # does the graphed contender replay a graph?
                graphed = workers["batched_graph"].train_step(micro).graphed
                if not graphed:
                    print(f"[batched vs plain] {model_name} B_L={bl} n={n}: the engine's step is NOT "
                          f"graphed ({workers['batched_graph'].graph_fallback_reason() or 'see the log'}); its "
                          f"'batched_graph' figures are eager")
            times = _rotated_rounds(variants, rounds, window, device)
            row = {"model": model_name, "local_batch": bl, "num_vsw": n, "total_batch": total,
                   "time": "wall" if device.type == "cuda" else "process CPU",
                   "ms_per_step_rounds": {k: [t * 1e3 for t in v] for k, v in times.items()},
                   "load_average": os.getloadavg(), "batched_graph_replays": graphed}
            for k in variants:
                if k in ("plain", "plain_graph"):
                    continue
                den = "plain_graph" if k == "batched_graph" else "plain"   # graph vs graph
                ratios = [a / b for a, b in zip(times[k], times[den])]
                row[f"{k}_over_{den}_per_round"] = ratios
                row[f"{k}_over_{den}_median"] = statistics.median(ratios)
            if graphs:
                ratios = [a / b for a, b in zip(times["plain_graph"], times["plain"])]
                row["plain_graph_over_plain_median"] = statistics.median(ratios)
            rows.append(row)
            extra = (f", per-VSW / plain {row['per_vsw_over_plain_median']:.3f}" if n > 1 else "")
            if graphs:
                extra += (f"; batched+graph / plain graph {row['batched_graph_over_plain_graph_median']:.3f}"
                          f" (plain graph / plain {row['plain_graph_over_plain_median']:.3f})")
            print(f"[batched vs plain] {model_name} B_L={bl} n={n} (plain batch {total}): plain "
                  f"{statistics.median(times['plain']) * 1e3:.2f} ms/step; batched / plain median "
                  f"{row['batched_over_plain_median']:.3f}{extra} ({rounds} rounds x {window} steps)")
            for w in workers.values():
                w.close()
    return rows


def _dist_worker(rank: int, world: int, init_file: str, out_file: str, rounds: int, iters: int,
                 local_batch: int, num_vsw: int, bucket_cap_mb: float) -> None:
    import os

    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        device = torch.device("cpu")
        workers = _weight_sync_workers([("sws", IIDPWorker, "sws"), ("ows", IIDPWorker, "ows"),
                                        ("sws_no_overlap", NoOverlapWorker, "sws")], num_vsw, local_batch,
                                       device, process_group=dist.group.WORLD, bucket_cap_mb=bucket_cap_mb)
        mbs = _micro_batches(num_vsw, local_batch, (256,), device, seed=rank)
        comm: dict[str, list[float]] = {k: [] for k in workers}

        def make(k):
            def fn() -> None:
                comm[k].append(workers[k].train_step(mbs).comm_time)
            return fn
        res = _interleaved({k: make(k) for k in workers}, rounds, iters, 2, device)
        if rank == 0:
            out = {k: res[f"{k}:wall"] * 1e3 for k in workers}
            out.update({f"{k}_exposed_comm_ms": statistics.median(v) * 1e3 for k, v in comm.items()})
            out["num_buckets"] = len(workers["sws"].bucket_plan)
            Path(out_file).write_text(json.dumps(out))
        for w in workers.values():
            w.close()
    finally:
        dist.destroy_process_group()


def bench_distributed(rounds: int, iters: int, local_batch: int = 32, num_vsw: int = 2,
                      bucket_cap_mb: float = 1.0) -> dict:
    """Two CPU processes over gloo (127.0.0.1): SWS vs OWS vs SWS without comm/backward
    overlap; wall time per step (all-reduce time only shows in wall time)."""
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "dist.json")
        mp.spawn(_dist_worker, args=(2, str(Path(tmp) / "store"), out_file, rounds, iters, local_batch,
                                     num_vsw, bucket_cap_mb), nprocs=2, join=True)
        res = json.loads(Path(out_file).read_text())
    res["ows_over_sws"] = res["ows"] / res["sws"]
    res["no_overlap_over_sws"] = res["sws_no_overlap"] / res["sws"]
    print(f"[2-process gloo] {num_vsw} VSWs/process, B_L={local_batch}, {res['num_buckets']} buckets: "
          f"wall SWS {res['sws']:.1f} / OWS {res['ows']:.1f} / SWS without overlap "
          f"{res['sws_no_overlap']:.1f} ms (exposed comm {res['sws_exposed_comm_ms']:.1f} / "
          f"{res['ows_exposed_comm_ms']:.1f} / {res['sws_no_overlap_exposed_comm_ms']:.1f} ms); "
          f"OWS/SWS {res['ows_over_sws']:.2f}, no-overlap/SWS {res['no_overlap_over_sws']:.2f}")
    return res


# ----------------------------------------------------------------------------- DDP contender
DDP_GRAPH_WARMUP = 11    # eager DDP iterations before a capture (PyTorch's CUDA-graph notes on DDP)


def ddp_graph_loop(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
                   y: torch.Tensor) -> Callable[[int], None]:
    """A DDP step (``static_graph=True``, built on a side stream) captured as one CUDA graph
    after :data:`DDP_GRAPH_WARMUP` eager iterations, the NCCL all-reduces inside the graph
    (PyTorch's CUDA-graph notes, "Usage with DistributedDataParallel"); per step the batch is
    copied into the static inputs and the graph replayed. Raises where torch refuses."""
    return plain_graph_loop(model, opt, X, y, warmup=DDP_GRAPH_WARMUP)


def _ddp_rank(rank: int, world: int, init_file: str, out_file: str, models: list[str], counts: list[int],
              local_batch: int, rounds: int, window: int, device_name: str) -> None:
    """One rank of the DDP part: per (model, n), the engine's step (n VSWs of ``local_batch``)
    and DDP on the same ``n * local_batch`` samples per rank, in paired rounds with the order
    rotated (every rank runs the same order, so their collectives match)."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    cuda = device_name == "cuda"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if cuda:   # CUDA-graph capture of NCCL collectives needs the async error handling off
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    rows = []
    try:
        for model_name in models:
            factory, kind = BATCHED_MODELS[model_name]
            for n in counts:
                total = n * local_batch
                X, y = _model_batch(kind, total, device, seed=rank)
                micro = split_batch((X, y), [local_batch] * n)
                variants: dict[str, Callable[[int], None]] = {}
                notes: dict[str, str] = {}
                workers = []
                # (name, cuda_graphs, segmented, with the process group); on CUDA also the
                # single-device graphed step, the reference of the graphed step with a group
                engines = [("jabasray", "off", "off", True)] + (
                    [("jabasray_graphed", "auto", "auto", True), ("jabasray_graphed_1dev", "auto", "off", False)]
                    if cuda else [("jabasray_segments", "off", "on", True)])
                for name, graphs, segmented, grouped in engines:
                    torch.manual_seed(0)
                    w = IIDPWorker(factory().to(device), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                                   F.cross_entropy, device=device,
                                   process_group=dist.group.WORLD if grouped else None,
                                   cuda_graphs=graphs, segmented=segmented)
                    w.configure(n, 0, local_batch)
                    workers.append(w)
                    variants[name] = engine_loop(w, micro)
                torch.manual_seed(0)
                ddp = DDP(factory().to(device), device_ids=[rank] if cuda else None)
                variants["ddp"] = plain_loop(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), X, y)
                if cuda:
                    try:
                        torch.manual_seed(0)
                        side = torch.cuda.Stream()
                        with torch.cuda.stream(side):
                            ddp_g = DDP(factory().to(device), device_ids=[rank], static_graph=True)
                        variants["ddp_graph"] = ddp_graph_loop(
                            ddp_g, torch.optim.SGD(ddp_g.parameters(), lr=0.01, momentum=0.9), X, y)
                    except Exception as e:  # noqa: BLE001 - reported, the rest still runs
                        notes["ddp_graph"] = f"not measured: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                for fn in variants.values():       # warm-up (allocator, optimizer state, the
                    fn(GRAPH_WARMUP_STEPS + 2)     # engine's graph warm-up and capture)
                if cuda:
                    st = workers[1].train_step(micro)
                    if not st.graphed:
                        notes["jabasray_graphed"] = ("NOT graphed: " + str(workers[1].graph_fallback_reason()))
                times = _rotated_rounds(variants, rounds, window, device)
                row = {"model": model_name, "local_batch": local_batch, "num_vsw": n, "per_rank_batch": total,
                       "world": world, "backend": "nccl" if cuda else "gloo",
                       "ms_per_step_rounds": {k: [t * 1e3 for t in v] for k, v in times.items()},
                       "load_average": os.getloadavg(), "notes": notes}
                pairs = [("jabasray", "ddp")] + ([("jabasray_graphed", "ddp_graph"), ("jabasray_graphed", "ddp"),
                                                  ("jabasray_graphed", "jabasray_graphed_1dev")]
                                                 if cuda else [("jabasray_segments", "ddp")])
                for a, b in pairs:
                    for suffix in ("", ":wall"):
                        if a + suffix in times and b + suffix in times:
                            ratios = [u / v for u, v in zip(times[a + suffix], times[b + suffix])]
                            tag = f"{a}_over_{b}{suffix.replace(':', '_')}"
                            row[tag + "_per_round"] = ratios
                            row[tag + "_median"] = statistics.median(ratios)
                rows.append(row)
                if rank == 0:
                    print(f"[ddp] {model_name} n={n} B_L={local_batch} (per-rank batch {total}, {world} "
                          f"{row['backend']} ranks): " + ", ".join(
                              f"{k[:-7]} {v:.3f}" for k, v in row.items() if k.endswith("_median"))
                          + (f"; {notes}" if notes else ""), flush=True)
                for w in workers:
                    w.close()
                del ddp
        if rank == 0:
            Path(out_file).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def bench_ddp(device: torch.device, models: list[str], counts: list[int], local_batch: int, rounds: int,
              window: int) -> list[dict]:
    """The DDP part (module notes, item 6): CPU: 2 gloo ranks; CUDA: one rank per visible
    device (a one-rank NCCL group on one GPU). Per (model, n), per-round ratios engine / DDP
    and their medians, on process CPU time (CPU) or wall time (CUDA), wall time beside."""
    import tempfile

    import torch.multiprocessing as mp
    world = torch.cuda.device_count() if device.type == "cuda" else 2
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "ddp.json")
        mp.spawn(_ddp_rank, args=(world, str(Path(tmp) / "store"), out_file, models, counts, local_batch,
                                  rounds, window, device.type), nprocs=world, join=True)
        return json.loads(Path(out_file).read_text())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="IIDP engine benchmark (no Ray)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="fewer rounds/iterations (smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1: "
                    "VSW threads are the parallelism under test)")
    ap.add_argument("--no-dist", action="store_true", help="skip the 2-process gloo part (CPU)")
    ap.add_argument("--local-batches", default="16,32,64",
                    help="CUDA throughput part: comma-separated B_L values (default 16,32,64)")
    ap.add_argument("--max-vsw", type=int, default=16,
                    help="CUDA throughput part: upper bound of the n_max probe (default 16)")
    ap.add_argument("--parts", default="overhead,weight_sync,dist,batched,throughput,ddp",
                    help="comma-separated parts to run (default all that apply to the device)")
    ap.add_argument("--models", default=None,
                    help="batched part: models (default small_cnn,small_transformer on CPU, "
                         "resnet18,small_transformer on CUDA)")
    ap.add_argument("--vsw", default=None, help="batched part: n values (default 1,2,4)")
    ap.add_argument("--window", type=int, default=50, help="overhead and batched parts: steps per "
                    "window (>= 1)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 21, --quick 2)")
    ap.add_argument("--ddp-window", type=int, default=20, help="ddp part: steps per window (>= 1)")
    ap.add_argument("--ddp-rounds", type=int, default=None,
                    help="ddp part: paired rounds (default 11, --quick 2, or --rounds)")
    ap.add_argument("--ddp-local-batch", type=int, default=32, help="ddp part: B_L (default 32)")
    ap.add_argument("--out", default=default_out('engine.json'))
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - {"overhead", "weight_sync", "dist", "batched", "throughput", "ddp"}
    if unknown:
        ap.error(f"--parts must name overhead, weight_sync, dist, batched, throughput, ddp; "
                 f"got {sorted(unknown)}")
    if args.ddp_window < 1 or args.ddp_local_batch < 1:
        ap.error(f"--ddp-window and --ddp-local-batch must be >= 1, got {args.ddp_window}, "
                 f"{args.ddp_local_batch}")
    if args.window < 1:
        ap.error(f"--window must be >= 1, got {args.window}")
    local_batches = positive_ints(ap, "--local-batches", args.local_batches)
    if args.max_vsw < 1:
        ap.error(f"--max-vsw must be >= 1, got {args.max_vsw}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rounds, iters = (2, 3) if args.quick else (21, 3)
    if args.rounds is not None:
        if args.rounds < 1:
            ap.error(f"--rounds must be >= 1, got {args.rounds}")
        rounds = args.rounds
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()} CPU, torch threads {torch.get_num_threads()}")
    print(f"device {device} ({machine}), torch {torch.__version__}; times are medians of "
          f"{'wall' if device.type == 'cuda' else 'process CPU'} time per step")
    result = {"device": str(device), "machine": machine, "torch": torch.__version__,
              "load_average": os.getloadavg(),
              "rounds": rounds, "iters_per_round": iters}
    if "overhead" in parts:
        result["overhead"] = [bench_overhead(device, b, rounds, args.window) for b in (32, 128)]
    if "weight_sync" in parts:
        result["weight_sync"] = bench_weight_sync(device, 32, 4, rounds, iters, bucket_cap_mb=4.0)
    if device.type == "cpu" and not args.no_dist and "dist" in parts:
        result["distributed_gloo"] = bench_distributed(rounds, iters)
    if "batched" in parts or "ddp" in parts:   # the models and VSW counts both parts run
        models = (args.models.split(",") if args.models else
                  ["resnet18", "small_transformer"] if device.type == "cuda" else ["small_cnn", "small_transformer"])
        bad = [m for m in models if m not in BATCHED_MODELS]
        if bad:
            ap.error(f"--models must be among {sorted(BATCHED_MODELS)}, got {bad}")
        counts = positive_ints(ap, "--vsw", args.vsw) if args.vsw else [1, 2, 4]
    if "batched" in parts:
        result["window"] = args.window
        result["batched_vs_plain"] = [row for m in models for row in bench_batched_vs_plain(
            device, m, local_batches, counts, rounds, args.window)]
        result["load_average_end"] = os.getloadavg()
    if "ddp" in parts:
        ddp_rounds = args.ddp_rounds or (args.rounds if args.rounds is not None else (2 if args.quick else 11))
        result["ddp"] = {"window": args.ddp_window, "rounds": ddp_rounds, "load_average_start": os.getloadavg(),
                         "rows": bench_ddp(device, models, counts, args.ddp_local_batch, ddp_rounds,
                                           args.ddp_window)}
        result["ddp"]["load_average_end"] = os.getloadavg()
    if device.type == "cuda" and "throughput" in parts:
        result["vsw_throughput"] = bench_vsw_throughput(device, local_batches, args.max_vsw,
                                                        rounds, iters)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
