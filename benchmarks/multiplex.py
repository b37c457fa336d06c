"""Foreground throughput alone vs with a background learner, and total throughput (DeepPool
section 5 / Fig. 11 analogue). No Ray.

Foreground: a training loop of DigitsCNN (width ``--width``) on random 8x8 inputs, batch
``--fg-batch``; each step is forward+backward (``foreground_op("compute")``), a gradient
"all-reduce" stand-in (flatten + scale, ``foreground_op("allreduce")``: a paused op when the
policy lists it) and the optimizer step. Background: the same model (as in DeepPool's
evaluation) trained by a ``BackgroundRunner`` job.

Variants, in one run:
  * ``fg_alone``, ``bg_alone``: each job in isolation (samples/s);
  * CPU: ``naive`` (plain collocation) and ``deeppool`` (all mechanisms: pauses during the
    all-reduce, slowdown feedback with an 18% target, small background batch);
  * CUDA (``--device cuda``): mechanisms added in turn, as in Fig. 11: ``naive`` ->
    ``+priority`` -> ``+pacing`` -> ``+graphs`` -> ``+feedback`` -> ``+small_batch``
    -> ``+pieces`` (the background graph in ``--graph-pieces`` pieces, one launched at a time).
Rounds are paired: every round runs every variant once, in an order rotated by one each
round, and every figure is a ratio to the same round's ``fg_alone`` (or ``bg_alone``):
per variant the foreground slowdown (fg_alone's samples/s / the variant's - 1), the background's
share of its throughput alone, and total (fg + bg) samples/s / fg_alone's; the table shows each
ratio's median over rounds with the rounds' [min, max].

Foreground (``--foreground``): ``host`` (default), the small DigitsCNN above, whose CUDA step is
bound by the host's kernel launches (its device-busy fraction is reported); ``gpu``, a
GPU-bound foreground (width ``--fg-width``, default 256, batch ``--fg-batch``, default 4096 with
``gpu``) whose step is dominated by kernel time, the case DeepPool's background multiplexing is
about (CUDA only).

    python benchmarks/multiplex.py [--device cpu|cuda] [--foreground host|gpu] [--rounds 5]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import replace

import torch
from torch import nn
from torch.utils.data import TensorDataset

from common import default_out, write_json
from jabasray.engine.multiplex import BackgroundRunner, BackgroundTask, MultiplexPolicy
from jabasray.models import DigitsCNN


def make_model(args, width: int | None = None) -> nn.Module:
    width = width or args.width
    return DigitsCNN(channels=width, hidden=4 * width).to(args.device)


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


class Foreground:
    def __init__(self, args) -> None:
        torch.manual_seed(0)
        self.args = args
        self.model = make_model(args, args.fg_width)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.device_busy: float | None = None   # CUDA: kernel time / wall time of the last run
        data = make_data(args.fg_batch * 8, seed=1)
        self.batches = [(x.to(args.device), y.to(args.device))
                        for x, y in zip(data.tensors[0].split(args.fg_batch),
                                        data.tensors[1].split(args.fg_batch))]

    def step(self, i: int, runner: BackgroundRunner | None) -> None:
        x, y = self.batches[i % len(self.batches)]
        op = runner.foreground_op if runner is not None else (lambda name: contextlib.nullcontext())
        with op("compute"):
            self.opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(self.model(x), y).backward()
        with op("allreduce"):     # stand-in for the gradient all-reduce of a distributed job
            flat = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
            flat.mul_(1.0)
        self.opt.step()

    def run(self, steps: int, runner: BackgroundRunner | None, feedback: bool) -> float:
        """Seconds for ``steps`` steps (after a short warm-up)."""
        cuda = self.args.device.startswith("cuda")
        stream_ctx = (torch.cuda.stream(runner.foreground_stream)
                      if cuda and runner is not None and runner.foreground_stream is not None
                      else contextlib.nullcontext())
        with stream_ctx:
            for i in range(5):
                self.step(i, runner)
            # the foreground's own stream, never torch.cuda.synchronize(): a device-wide sync
            # waits for the background job too, and fails while it captures its CUDA graph
            if cuda:
                torch.cuda.current_stream().synchronize()
            t0 = time.perf_counter()
            busy = 0.0
            for i in range(steps):
                ctx = runner.foreground_step() if (runner is not None and feedback) else contextlib.nullcontext()
                with ctx:
                    if cuda:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                    self.step(i, runner)
                    if cuda:
                        end.record()
                        torch.cuda.current_stream().synchronize()   # a step ends when its work ends
                        busy += start.elapsed_time(end) / 1e3
            if cuda:
                torch.cuda.current_stream().synchronize()
            wall = time.perf_counter() - t0
            self.device_busy = busy / wall if cuda else None
            return wall


def bg_task(args, batch: int) -> BackgroundTask:
    torch.manual_seed(1)
    model = make_model(args)
    return BackgroundTask(name="bg", model=model, dataset=make_data(4096, seed=2),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                          loss_fn=nn.functional.cross_entropy, batch_size=batch, steps=10**9)


def start_bg(args, runner: BackgroundRunner) -> None:
    """Submit the background job and wait until it is past its first (warm-up) steps."""
    runner.submit(bg_task(args, args.bg_batch))
    while runner.status("bg").step < 3:
        time.sleep(0.005)


def measure(args, policy: MultiplexPolicy | None, fg: Foreground) -> dict:
    if policy is None:                                   # foreground alone
        sec = fg.run(args.steps, None, feedback=False)
        return {"fg_sps": args.steps * args.fg_batch / sec, "bg_sps": 0.0,
                "fg_device_busy": fg.device_busy}
    runner = BackgroundRunner(args.device, policy)
    try:
        start_bg(args, runner)
        s0 = runner.status("bg").samples
        t0 = time.perf_counter()
        sec = fg.run(args.steps, runner, feedback=policy.slowdown_target is not None)
        s1 = runner.status("bg").samples
        wall = time.perf_counter() - t0
        st = runner.status("bg")
        out = {"fg_sps": args.steps * args.fg_batch / sec, "bg_sps": (s1 - s0) / wall,
               "bg_delay_s": runner.controller.delay, "bg_graphed": st.graphed,
               "sensitive_ops": sorted(runner.sensitive_ops), "bg_error": st.error}
        runner.cancel("bg")
        return out
    finally:
        runner.close()


def measure_bg_alone(args, seconds: float) -> dict:
    with BackgroundRunner(args.device, MultiplexPolicy.naive()) as runner:
        start_bg(args, runner)
        s0, t0 = runner.status("bg").samples, time.perf_counter()
        time.sleep(seconds)
        s1, t1 = runner.status("bg").samples, time.perf_counter()
        runner.cancel("bg")
    return {"fg_sps": 0.0, "bg_sps": (s1 - s0) / (t1 - t0)}


def policies(args) -> dict[str, MultiplexPolicy]:
    naive = MultiplexPolicy.naive()
    small = args.small_batch
    if not args.device.startswith("cuda"):
        return {"naive": naive,
                "deeppool": MultiplexPolicy(max_background_batch=small, slowdown_target=args.target)}
    prio = replace(naive, stream_priority=True)
    pacing = replace(prio, max_outstanding=2)
    graphs = replace(pacing, cuda_graphs=True)
    feedback = replace(graphs, slowdown_target=args.target, pause_ops=("allreduce",),
                       op_slowdown_threshold=1.5, drain_on_pause=True)
    small_batch = replace(feedback, max_background_batch=small)
    out = {"naive": naive, "+priority": prio, "+pacing": pacing, "+graphs": graphs,
           "+feedback": feedback, "+small_batch": small_batch}
    if args.graph_pieces > 1:     # the captured background step in pieces, one launched at a time
        out["+pieces"] = replace(small_batch, graph_pieces=args.graph_pieces)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--fg-batch", type=int, default=None,
                    help="foreground batch (default 128; 4096 with --foreground gpu)")
    ap.add_argument("--foreground", choices=["host", "gpu"], default="host",
                    help="host: the small, launch-bound foreground; gpu: a GPU-bound one (CUDA)")
    ap.add_argument("--fg-width", type=int, default=None,
                    help="foreground model width (default --width; 256 with --foreground gpu)")
    ap.add_argument("--bg-batch", type=int, default=128)
    ap.add_argument("--small-batch", type=int, default=16)
    ap.add_argument("--target", type=float, default=0.18)
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds, order rotated")
    ap.add_argument("--graph-pieces", type=int, default=4,
                    help="CUDA: also the last policy with the background graph in this many pieces "
                         "(1: no such variant)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--out", default=default_out('multiplex.json'))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        args.device = "cuda:0"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device available")
    if args.foreground == "gpu" and not args.device.startswith("cuda"):
        ap.error("--foreground gpu needs --device cuda")
    gpu_bound = args.foreground == "gpu"
    args.fg_batch = args.fg_batch or (4096 if gpu_bound else 128)
    args.fg_width = args.fg_width or (256 if gpu_bound else args.width)
    load_before = os.getloadavg()
    fg = Foreground(args)
    variants: dict[str, MultiplexPolicy | None | str] = {"fg_alone": None, "bg_alone": "bg"}
    variants.update(policies(args))
    names = list(variants)
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    orders = []
    bg_seconds = 1.0                   # bg_alone runs as long as the latest fg_alone did
    for k in range(args.rounds):       # paired rounds; the order rotates by one every round
        order = names[k % len(names):] + names[:k % len(names)]
        orders.append(order)
        for name in order:
            pol = variants[name]
            if pol == "bg":
                rounds[name].append(measure_bg_alone(args, seconds=bg_seconds))
            else:
                rounds[name].append(measure(args, pol, fg))
                if name == "fg_alone":
                    bg_seconds = max(0.5, args.steps * args.fg_batch / rounds[name][-1]["fg_sps"])
    results = paired_summary(rounds)
    print(f"{args.rounds} paired rounds (order rotated); device={args.device} foreground={args.foreground} "
          f"fg_width={args.fg_width} fg_batch={args.fg_batch} bg_batch={args.bg_batch} "
          f"small={args.small_batch} steps={args.steps}")
    print(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; every figure "
          f"is the median over rounds of a ratio to the same round's fg_alone/bg_alone [min, max]")
    busy = [r.get("fg_device_busy") for r in rounds["fg_alone"]]
    if busy and busy[0] is not None:
        print(f"foreground alone: device busy {statistics.median(busy):.0%} of its wall time "
              f"(median over rounds)")
    print(f"{'variant':14s} {'fg slowdown':>22s} {'bg / bg alone':>22s} {'total / fg alone':>22s}")
    for name, r in results.items():
        print(f"{name:14s} {fmt_spread(r['fg_slowdown'], pct=True):>22s} "
              f"{fmt_spread(r['bg_vs_bg_alone']):>22s} {fmt_spread(r['total_vs_fg_alone']):>22s}")
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    write_json(args.out, {"args": vars(args), "device": device_name, "orders": orders,
                          "rounds": rounds, "results": results,
                          "load_average": {"before": load_before, "after": os.getloadavg()}})


def spread(values: list[float]) -> dict | None:
    """Median of per-round values with their min and max (None without values)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "per_round": values}


def fmt_spread(s: dict | None, pct: bool = False) -> str:
    if s is None:
        return "-"
    f = (lambda v: f"{100 * v:+.1f}%") if pct else (lambda v: f"{v:.2f}")
    return f"{f(s['median'])} [{f(s['min'])}, {f(s['max'])}]"


def paired_summary(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant, ratios to the same round's fg_alone / bg_alone: foreground slowdown
    (fg_alone sps / variant sps - 1), background sps / bg_alone sps, total (fg + bg) sps /
    fg_alone sps; each as :func:`spread` over rounds."""
    fg0 = [r["fg_sps"] for r in rounds["fg_alone"]]
    bg0 = [r["bg_sps"] for r in rounds["bg_alone"]]
    out = {}
    for name, rs in rounds.items():
        slow = [a / r["fg_sps"] - 1.0 for a, r in zip(fg0, rs) if r["fg_sps"]] \
            if name not in ("fg_alone", "bg_alone") else []
        bg = [r["bg_sps"] / b for b, r in zip(bg0, rs) if b] if name != "fg_alone" else []
        total = [(r["fg_sps"] + r["bg_sps"]) / a for a, r in zip(fg0, rs) if a]
        out[name] = {"fg_slowdown": spread(slow), "bg_vs_bg_alone": spread(bg),
                     "total_vs_fg_alone": spread(total)}
    return out


if __name__ == "__main__":
    main()
