"""Host work per step of the engine's eager batched step vs a plain PyTorch loop (CPU, no Ray).

On a GPU an eager ResNet-18 step is host-bound: every ATen op the step dispatches costs
Python and launch time on the host, whatever the batch. This benchmark measures that host
work on the CPU with TINY models (compute negligible, so the step is host-bound as on a GPU):

* **ops dispatched per step** (deterministic, counted with a ``TorchDispatchMode``, which sees
  every ATen op the forward, backward and optimizer dispatch, autograd's included): the plain
  loop (``zero_grad(set_to_none=True)``, forward, backward, ``optimizer.step()``, the loss kept
  on the device) on ``n * B_L`` samples vs the engine's eager batched step
  (``IIDPWorker(..., cuda_graphs="off")``, ``n`` VSWs at ``B_L``) on the same samples, with the
  difference engine minus plain broken down by op name. ``kernel ops`` leave out view ops
  (``OpOverload.is_view``: no kernel on a GPU) and profiler markers. Ops per step is the
  figure that transfers to a GPU (each non-view op is a kernel launch there).
* **Python calls per step** (deterministic, ``cProfile``): every Python function and builtin
  a step calls, torch's Python layers included, and the engine's own by module; with the ops,
  the host work that does not depend on the machine's load.
* **host CPU time per step**: rounds of the contenders (plain, engine, plain_flat; order
  rotated every round), each a window of ``--window`` steps timed with ``time.process_time``
  (the machine is shared; CPU time of this single-threaded process is what the step costs the
  host), the window's losses read once at its end on every side; per-round ratios engine /
  plain and their median; the load average is recorded. On a CPU this time also holds the
  kernels' own compute, which is not quite the same on both sides: the engine's parameters
  are views into flat 64-byte-aligned bucket buffers (its weight copies are one ``copy_`` per
  bucket), and on this CPU oneDNN's convolutions run measurably slower on such views than on
  separately allocated weights. ``plain_flat``, the plain loop with its parameters laid out
  the same way (``FlatBuffers``), separates that CPU effect from the engine's host work:
  engine / plain_flat is the engine's own host work.

Both sides use SGD with momentum and ``foreach=True`` (the default on CUDA; on CPU the default
is the per-parameter loop, which would make the optimizer dominate the count). Models: a
ResNet-18-shaped CNN (the 20 convolutions, 20 BatchNorms and shortcuts of
``benchmarks/engine.py``'s ResNet-18, widths 4-32, 8x8 inputs) and ``benchmarks/engine.py``'s
small transformer at d 16, 4 tokens.

    python benchmarks/engine_host.py [--counts 1,2,4,8] [--local-batch 2] [--rounds 7]
        [--window 30] [--models resnet18,transformer] [--device cpu|cuda] [--out PATH]

On a GPU (``--device cuda``) the same contenders run there: the op counts are the same ops
(each a kernel launch), and host CPU time per step is then the host's launch work directly.
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from common import default_out, positive_ints, write_json
from engine import SmallTransformer, _Block, _model_batch
from jabasray.engine import IIDPWorker
from jabasray.engine.buckets import FlatBuffers, make_bucket_specs
from jabasray.engine.loader import split_batch
from jabasray.engine.stats import read_losses


class TinyResNet18(nn.Module):
    """``benchmarks/engine.py``'s CIFAR ResNet-18 (same blocks, strides, BatchNorms) at widths
    ``widths`` instead of 64-512: the same ops per step, negligible compute."""

    def __init__(self, widths: tuple[int, ...] = (4, 8, 16, 32), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, cin = [], widths[0]
        for cout, stride in zip(widths, (1, 2, 2, 2)):
            layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# name -> (factory, one sample's input as benchmarks/engine.py's _model_batch takes it)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[str, tuple[int, ...]]]] = {
    "resnet18": (TinyResNet18, ("float", (3, 8, 8))),
    "transformer": (lambda: SmallTransformer(vocab=32, d=16, seq=4), ("tokens", (4, 32))),
}


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True)


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched while active, by overload-packet name; ``views`` counts
    the view ops among them (no kernel on a GPU)."""

    MARKERS = ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.views = 0
        self.markers = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in self.MARKERS:
            self.markers += 1
        elif getattr(func, "is_view", False):
            self.views += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        return self.total - self.views - self.markers


def count_ops(step: Callable[[], object], steps: int = 2) -> OpCounter:
    """Ops of ONE call of ``step`` (warm); checks that ``steps`` calls dispatch the same ops."""
    counters = []
    for _ in range(steps):
        c = OpCounter()
        with c:
            step()
        counters.append(c)
    if any(c.ops != counters[0].ops for c in counters[1:]):
        raise RuntimeError("ops per step differ between steps (not in steady state)")
    return counters[0]


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
                y: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One plain training step on the whole batch; returns its loss, kept on the device."""
    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def _contenders(model_name: str, n: int, local_batch: int, device: torch.device = torch.device("cpu")):
    """(plain step, engine step, plain_flat step, worker): all build the model from the same
    seed; the plain ones run on the ``n * B_L`` samples the engine's ``n`` VSWs split."""
    factory, kind = MODELS[model_name]
    X, y = _model_batch(kind, n * local_batch, device)
    micro = split_batch((X, y), [local_batch] * n)
    torch.manual_seed(0)
    plain_model = factory().to(device)
    opt = _sgd(plain_model.parameters())
    torch.manual_seed(0)
    w = IIDPWorker(factory().to(device), _sgd, F.cross_entropy, device=device, cuda_graphs="off")
    w.configure(n, 0, local_batch)

    plain = _plain_step(plain_model, opt, X, y)

    def engine() -> torch.Tensor:
        return w.train_step(micro).loss_raw

    torch.manual_seed(0)
    flat_model = factory().to(device)
    FlatBuffers(flat_model, make_bucket_specs(flat_model, w.bucket_plan), flat_grads=False)
    flat_opt = _sgd(flat_model.parameters())

    plain_flat = _plain_step(flat_model, flat_opt, X, y)
    return plain, engine, plain_flat, w


def python_calls(step: Callable[[], object], steps: int = 3) -> tuple[float, dict[str, float]]:
    """Python function calls per step (deterministic, counted by ``cProfile``: every Python
    function and builtin the step calls, torch's Python layers included) and those of the
    engine's own modules by module file; the host work a GPU step pays before its launches."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    st = pstats.Stats(prof)
    own: collections.Counter = collections.Counter()
    for (path, _, _), (_, calls, *_rest) in st.stats.items():
        if "jabasray" in path:
            own[os.path.basename(path)] += calls / steps
    return st.total_calls / steps, dict(own)


def _window(step: Callable[[], torch.Tensor], steps: int) -> float:
    """CPU seconds per step over ``steps`` steps, the losses read once at the end (CUDA:
    the device synchronised first, so that a window starts idle)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    c = time.process_time()
    read_losses([step() for _ in range(steps)])
    return (time.process_time() - c) / steps


def bench(model_name: str, n: int, local_batch: int, rounds: int, window: int,
          device: torch.device = torch.device("cpu")) -> dict:
    plain, engine, plain_flat, w = _contenders(model_name, n, local_batch, device)
    variants = {"plain": plain, "engine": engine, "plain_flat": plain_flat}
    for fn in variants.values():                 # warm-up: optimizer state, traced hooks
        _window(fn, 5)
    ops = {k: count_ops(fn) for k, fn in variants.items()}
    calls = {k: python_calls(fn) for k, fn in variants.items()}
    diff = collections.Counter(ops["engine"].ops)
    diff.subtract(ops["plain"].ops)
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for k in names[r % 3:] + names[:r % 3]:
            times[k].append(_window(variants[k], window))
    ratios = [a / b for a, b in zip(times["engine"], times["plain"])]
    ratios_flat = [a / b for a, b in zip(times["engine"], times["plain_flat"])]
    w.close()
    row = {
        "model": model_name, "device": str(device), "num_vsw": n, "local_batch": local_batch, "plain_batch": n * local_batch,
        "ops_per_step": {k: c.total for k, c in ops.items()},
        "kernel_ops_per_step": {k: c.kernels for k, c in ops.items()},
        "view_ops_per_step": {k: c.views for k, c in ops.items()},
        "engine_minus_plain_by_op": {k: v for k, v in sorted(diff.items()) if v},
        "python_calls_per_step": {k: c[0] for k, c in calls.items()},
        "engine_python_calls_by_module": calls["engine"][1],
        "host_ms_per_step_rounds": {k: [t * 1e3 for t in v] for k, v in times.items()},
        "host_ms_per_step_median": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "engine_over_plain_per_round": ratios,
        "engine_over_plain_median": statistics.median(ratios),
        "engine_over_plain_flat_per_round": ratios_flat,
        "engine_over_plain_flat_median": statistics.median(ratios_flat),
        "load_average": os.getloadavg(),
    }
    k = row["kernel_ops_per_step"]
    print(f"[{model_name}] n={n} B_L={local_batch}: ops/step plain {ops['plain'].total} "
          f"({k['plain']} kernels), engine {ops['engine'].total} ({k['engine']} kernels); "
          f"Python calls/step plain {calls['plain'][0]:.0f}, engine {calls['engine'][0]:.0f}; "
          f"host time engine/plain median {row['engine_over_plain_median']:.3f}, engine/plain_flat "
          f"{row['engine_over_plain_flat_median']:.3f} (plain {row['host_ms_per_step_median']['plain']:.2f} ms); "
          f"diff {row['engine_minus_plain_by_op']}")
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", default="1,2,4,8", help="numbers of VSWs")
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--window", type=int, default=30)
    p.add_argument("--models", default="resnet18,transformer")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the same contenders on the GPU; host CPU time per step then is "
                        "the launch work (and the wait at each window's end, the same on both sides)")
    p.add_argument("--out", default=default_out("engine_host.json"))
    a = p.parse_args(argv)
    counts = positive_ints(p, "--counts", a.counts)
    models = a.models.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad:
        p.error(f"--models must name models from {sorted(MODELS)}, got {bad}")
    if a.local_batch < 1 or a.rounds < 1 or a.window < 1:
        p.error("--local-batch, --rounds and --window must be positive")
    torch.set_num_threads(1)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA device")
    device = torch.device(a.device)
    rows = [bench(m, n, a.local_batch, a.rounds, a.window, device) for m in models for n in counts]
    doc = {"benchmark": "engine_host", "machine": platform.node(), "processor": platform.processor(),
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": 1,
           "args": vars(a), "rows": rows}
    write_json(a.out, doc)
    return doc


if __name__ == "__main__":
    main()
