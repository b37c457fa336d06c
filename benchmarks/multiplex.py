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
    ``+priority`` -> ``+pacing`` -> ``+graphs`` -> ``+feedback`` -> ``+small_batch``.
Reported per variant: foreground samples/s, its slowdown vs ``fg_alone``, background
samples/s, and total (fg + bg) samples/s relative to ``fg_alone``.

    python benchmarks/multiplex.py [--device cpu|cuda] [--steps 150] [--width 32]
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


def make_model(args) -> nn.Module:
    return DigitsCNN(channels=args.width, hidden=4 * args.width).to(args.device)


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


class Foreground:
    def __init__(self, args) -> None:
        torch.manual_seed(0)
        self.args = args
        self.model = make_model(args)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
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
            for i in range(steps):
                ctx = runner.foreground_step() if (runner is not None and feedback) else contextlib.nullcontext()
                with ctx:
                    self.step(i, runner)
                    if cuda:
                        torch.cuda.current_stream().synchronize()   # a step ends when its work ends
            if cuda:
                torch.cuda.current_stream().synchronize()
            return time.perf_counter() - t0


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
        return {"fg_sps": args.steps * args.fg_batch / sec, "bg_sps": 0.0}
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
    return {"naive": naive, "+priority": prio, "+pacing": pacing, "+graphs": graphs,
            "+feedback": feedback, "+small_batch": replace(feedback, max_background_batch=small)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--fg-batch", type=int, default=128)
    ap.add_argument("--bg-batch", type=int, default=128)
    ap.add_argument("--small-batch", type=int, default=16)
    ap.add_argument("--target", type=float, default=0.18)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--out", default=default_out('multiplex.json'))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        args.device = "cuda:0"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device available")
    load_before = os.getloadavg()
    fg = Foreground(args)
    variants: dict[str, MultiplexPolicy | None | str] = {"fg_alone": None, "bg_alone": "bg"}
    variants.update(policies(args))
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    bg_seconds = 1.0
    for _ in range(args.rounds):       # interleaved rounds: a load change hits every variant
        for name, pol in variants.items():
            if pol == "bg":
                rounds[name].append(measure_bg_alone(args, seconds=bg_seconds))
            else:
                rounds[name].append(measure(args, pol, fg))
                if name == "fg_alone":
                    bg_seconds = max(0.5, args.steps * args.fg_batch / rounds[name][-1]["fg_sps"])
    results = {}
    for name, rs in rounds.items():
        r = dict(rs[-1])
        r["fg_sps"] = statistics.median(x["fg_sps"] for x in rs)
        r["bg_sps"] = statistics.median(x["bg_sps"] for x in rs)
        r["rounds"] = rs
        results[name] = r
    base = results["fg_alone"]["fg_sps"]
    for name, rs in rounds.items():     # paired: the variant vs fg_alone of the SAME round
        if name not in ("fg_alone", "bg_alone"):
            per = [a["fg_sps"] / r["fg_sps"] - 1.0 for a, r in zip(rounds["fg_alone"], rs) if r["fg_sps"]]
            results[name]["fg_slowdown_per_round"] = per
            results[name]["fg_slowdown_median_of_rounds"] = statistics.median(per) if per else None
    print(f"median of {args.rounds} interleaved rounds; device={args.device} width={args.width} fg_batch={args.fg_batch} "
          f"bg_batch={args.bg_batch} small={args.small_batch} steps={args.steps}")
    print(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; 'paired%' = "
          f"median over rounds of the slowdown vs fg_alone of the same round")
    print(f"{'variant':14s} {'fg sps':>9s} {'fg slow%':>9s} {'paired%':>9s} {'bg sps':>9s} {'total/fg':>9s}")
    for name, r in results.items():
        r["fg_slowdown"] = (base / r["fg_sps"] - 1.0) if r["fg_sps"] else None
        r["total_vs_fg_alone"] = (r["fg_sps"] + r["bg_sps"]) / base
        slow = "-" if r["fg_slowdown"] is None else f"{100 * r['fg_slowdown']:.1f}"
        paired = r.get("fg_slowdown_median_of_rounds")
        paired = "-" if paired is None else f"{100 * paired:.1f}"
        print(f"{name:14s} {r['fg_sps']:9.0f} {slow:>9s} {paired:>9s} {r['bg_sps']:9.0f} "
              f"{r['total_vs_fg_alone']:9.2f}")
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    write_json(args.out, {"args": vars(args), "device": device_name, "results": results,
                          "load_average": {"before": load_before, "after": os.getloadavg()}})


if __name__ == "__main__":
    main()
