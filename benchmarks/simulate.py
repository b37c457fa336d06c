"""The simulator against real runs, then JABAS against the baselines at 16-256 GPUs.

Two parts (``jabasray simulate`` underneath; no Ray, no torch, deterministic):

``replay RUN_DIR...``: each recorded run (a run folder with ``model.json``, e.g. the README's
main job and the four contenders of ``benchmarks/adaptive.py``) re-simulated with what its driver
had (``jabasray.sim.replay``): are the plans and allocations the same, how far is each epoch's
simulated time from the recorded one, and the time to ``--target``.

``scale``: clusters A and B of the JABAS paper's Table 1 at 16, 64 and 256 GPUs, two of Pollux's
public convergence traces (ResNet-50/ImageNet and ResNet-18/CIFAR-10), the five policies. Time
model: the JABAS quick start's published ResNet-50 profiles of V100 and P100; the other GPU
types derived from the V100's by TFLOPS and memory (``jabasray.sim.clusters.type_profiles``);
for CIFAR-10, ResNet-18 on 32x32 images is taken as ResNet-50's per-sample compute scaled by
their FLOPs per sample (0.56 / 4.1 GFLOPs) and its gradients by their parameters (11.2 M / 25.6 M):
an estimate, said beside every figure. Jobs: ImageNet as the paper's Table 4 for ResNet-50
(gamma 0.1, B_G 256-32768, alpha 0.1, p 100, 90 epochs, target top-1 0.75 - the trace's
ceiling is 0.757, the paper's target 0.76); CIFAR-10 from B_G 128 to 4096 (gamma 0.1, p 100,
100 epochs, target 0.93); every policy keeps the job's min B_L (``--min-local-batch``, 32, the
profiles' smallest size), so on many GPUs the baselines start above B_G^init.
A placement (start, re-placement) takes ``--placement-s`` (30 s).

    python benchmarks/simulate.py replay jabasray_runs/<main> benchmarks/out/adaptive_runs/* --target 0.93
    python benchmarks/simulate.py scale                 # ~2.5 min on one core

Writes ``<tmp>/jabasray_bench/simulate_<part>.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import replace

from common import default_out, write_json

SIZES = (16, 64, 256)
APPS = {   # trace -> (JobConfig fields, target, compute ratio, parameter ratio vs ResNet-50)
    "imagenet": (dict(initial_global_batch=256, min_global_batch=256, max_global_batch=32768,
                      gamma=0.1, alpha=0.1, adapt_interval=100, epochs=90), 0.75, 1.0, 1.0),
    "cifar10": (dict(initial_global_batch=128, min_global_batch=128, max_global_batch=4096,
                     gamma=0.1, alpha=0.1, adapt_interval=100, epochs=100), 0.93, 0.56 / 4.1, 11.2 / 25.6),
}


def model_profiles(compute: float, params: float) -> dict:
    """The quick start's profiles (Table 1 names), compute scaled by ``compute`` and gradient
    bytes by ``params`` (module notes)."""
    from jabasray.commands.simulate import profiles_arg

    out = {}
    for g, p in profiles_arg("jabas-resnet50").items():
        if compute != 1.0:
            p = p.scaled(1.0 / compute)
            p = replace(p, speed=1.0, param_bytes=max(1, int(p.param_bytes * params)),
                        bucket_sizes=[max(1, int(b * params)) for b in p.bucket_sizes])
        out[g] = p
    return out


def scale(args) -> dict:
    from jabasray.config import JobConfig
    from jabasray.planners.perf_model import PerfModel
    from jabasray.sim.clusters import paper_cluster, type_profiles
    from jabasray.sim.compare import compare
    from jabasray.sim.convergence import PACKAGED_DATASET_SIZE, packaged_model

    rows = []
    for app in args.apps:
        fields, target, compute, params = APPS[app]
        measured = model_profiles(compute, params)
        conv = packaged_model(app)
        for name in args.clusters:
            for size in args.sizes:
                cluster = paper_cluster(name, size)
                profiles, notes = type_profiles(measured, cluster, "v100")
                job = JobConfig(min_local_batch=args.min_local_batch, **fields)
                model = PerfModel(profiles, weight_sync=job.weight_sync)
                t0, c0 = time.perf_counter(), time.process_time()
                result = compare(args.policies, job, cluster, PACKAGED_DATASET_SIZE[app], model, conv,
                                 None, placement_s=args.placement_s, target=target)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                row = {"app": app, "cluster": name, "gpus": size, "target": target,
                       "simulation_wall_s": wall, "simulation_cpu_s": cpu,
                       "policy_wall_s": result["simulation_wall_s"], "profile_notes": notes,
                       "policies": result["policies"]}
                rows.append(row)
                line = ", ".join(f"{p} {r['time_vs_jabas']:.2f}/{r['cost_vs_jabas']:.2f}"
                                 if r.get("time_vs_jabas") is not None else f"{p} missed"
                                 for p, r in result["policies"].items())
                print(f"{app} {name}:{size} (time/cost vs JABAS) {line}  [{wall:.0f} s, CPU {cpu:.0f} s]",
                      flush=True)
    return {"rows": rows, "placement_s": args.placement_s}


def replays(args) -> dict:
    from jabasray.sim.replay import replay

    out = []
    for run in args.runs:
        report = replay(run, target=args.target)
        print(f"== {run}")
        for line in report.lines():
            print(line)
        out.append(report.to_dict())
    return {"target": args.target, "runs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    r = sub.add_parser("replay", help="recorded runs re-simulated")
    r.add_argument("runs", nargs="+")
    r.add_argument("--target", type=float, default=None, help="validation accuracy to time")
    s = sub.add_parser("scale", help="Table 1's clusters A and B at 16-256 GPUs")
    s.add_argument("--apps", nargs="+", default=list(APPS), choices=list(APPS))
    s.add_argument("--clusters", nargs="+", default=["A", "B"], choices=["A", "B"])
    s.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    s.add_argument("--policies", nargs="+", default=["static", "simigrad", "pollux", "pollux-as", "jabas"])
    s.add_argument("--placement-s", type=float, default=30.0)
    s.add_argument("--min-local-batch", type=int, default=32,
                   help="every policy's min B_L (default: the profiles' smallest size; below it "
                        "the model follows the line through their two smallest sizes)")
    for p in (r, s):
        p.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    doc = replays(args) if args.part == "replay" else scale(args)
    doc.update({"machine": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                "wall_s": time.perf_counter() - t0})
    write_json(args.out or default_out(f"simulate_{args.part}.json"), doc)


if __name__ == "__main__":
    main()
