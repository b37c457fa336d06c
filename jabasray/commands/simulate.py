"""``jabasray simulate``: what JABAS would do with a job on a cluster, and what it would cost,
beside static data parallelism, SimiGrad, Pollux and Pollux-AS - on a simulated clock, deciding
with the driver's own planners (:mod:`jabasray.sim`).

    jabasray simulate --cluster A:64 --profiles jabas-resnet50 --convergence imagenet --out sim/
    jabasray simulate --cluster my_cluster.yaml --profiles profiles/ --convergence traces/ \\
        --policies jabas,simigrad --dataset-size 50000 --epochs 30 --target 0.9 --out sim/
    jabasray simulate --replay jabasray_runs/<name> [--target 0.95]

``--cluster``: a cluster file (YAML/JSON, :meth:`jabasray.types.ClusterSpec.from_file`; give each
node's ``tflops`` for Eq. 8 and ``memory_gb``) or a cluster of the JABAS paper's Table 1 with its
size (``A:16``, ``B:256``). ``--profiles``: a folder of ``jabasray profile`` JSON files, a folder
in the JABAS profiler's layout (``cluster_info.json``, ``cluster_comp_profile_data/`` ...), or
``jabas-resnet50`` (the JABAS quick start's published V100/P100 profiles, shipped); GPU types
without a profile are derived from a measured one by TFLOPS and memory (printed).
``--convergence``: a folder of ``validation-<B>.csv`` traces (Pollux's schema, or
``benchmarks/record_convergence.py``'s) or a shipped app (``imagenet``, ``cifar10``, ``bert``,
``digits``, whose dataset size and M0 are then the defaults). Writes ``<out>/<policy>/``
(``metrics.json``, ``trajectory.png``) and ``<out>/comparison.json`` / ``comparison.png``, and
prints one line per policy. ``--replay`` re-simulates a recorded run (its ``model.json``) and
prints the simulated beside the recorded epoch times, and whether every decision was the same.
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from .train import add_job_arguments, job_config_from_args, profiles_from

log = logging.getLogger(__name__)

# The job of the JABAS paper's ResNet-50 runs on cluster A (Table 4: gamma 0.1, B_G in
# [256, 32768] - printed 32678 -, alpha 0.1, p 100) for 90 epochs from B_G 256
SIM_DEFAULTS = {"initial_global_batch": 256, "min_global_batch": 256, "max_global_batch": 32768,
                "gamma": 0.1, "alpha": 0.1, "adapt_interval": 100, "epochs": 90}
SHIPPED_PROFILES = {"jabas-resnet50": "ResNet-50 on V100 and P100 (the JABAS quick start)"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="simulate JABAS and the baselines on a cluster (no GPUs)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replay", metavar="RUN_DIR", help="re-simulate a recorded run beside what it ran")
    p.add_argument("--cluster", help="cluster file, or A[:GPUS] / B[:GPUS] (the JABAS paper's Table 1)")
    p.add_argument("--profiles", help="folder of profile JSON files, a JABAS profile folder, or "
                   f"{' / '.join(SHIPPED_PROFILES)}")
    p.add_argument("--reference-type", default=None, help="the measured GPU type the others are "
                   "derived from (default: the first one the cluster holds)")
    p.add_argument("--convergence", help="folder of validation-<B>.csv traces, or a shipped app "
                   "(imagenet, cifar10, bert, digits)")
    p.add_argument("--reference-batch", type=int, default=None,
                   help="M0 of the traces (default: the shipped app's, else the smallest trace batch)")
    p.add_argument("--policies", default="static,simigrad,pollux,pollux-as,jabas",
                   help="comma-separated, of static, simigrad, pollux, pollux-as, jabas (default: all)")
    p.add_argument("--dataset-size", type=int, default=None,
                   help="samples per epoch (default: the shipped app's)")
    p.add_argument("--target", type=float, default=None,
                   help="the validation metric to reach; time to target is measured to it "
                        "(simulations stop there unless --no-stop-at-target)")
    p.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--placement-s", type=float, default=30.0,
                   help="seconds a placement (start or re-placement: checkpoint, actors, restore) "
                        "takes (default %(default)s)")
    p.add_argument("--eval-s", type=float, default=0.0, help="seconds of each epoch's end (validation, checkpoint)")
    p.add_argument("--out", default=None, help="output folder (default: sim_<cluster> / the run's "
                   "folder's replay.json for --replay)")
    add_job_arguments(p, SIM_DEFAULTS, "in JobConfig")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.replay:
        return _replay(args)
    missing = [f"--{n}" for n in ("cluster", "profiles", "convergence") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} must be given (or --replay RUN_DIR)")
    from ..planners.perf_model import PerfModel
    from ..sim.clusters import cluster_from_arg, type_profiles
    from ..sim.compare import check_policies, compare

    policies = check_policies(args.policies.split(","))
    cluster = cluster_from_arg(args.cluster)
    convergence, app = convergence_from(args.convergence, args.reference_batch)
    dataset_size = args.dataset_size or _app_size(app)
    if dataset_size is None or dataset_size < 1:
        raise ValueError(f"--dataset-size must be given (a number of samples >= 1) for traces of "
                         f"{args.convergence}, got {dataset_size}")
    measured = profiles_arg(args.profiles)
    profiles, notes = type_profiles(measured, cluster, args.reference_type)
    defaults = dict(SIM_DEFAULTS)
    defaults.setdefault("min_local_batch", min(p.min_local_batch for p in profiles.values()))
    job = job_config_from_args(args, defaults)
    if args.target is None:
        log.info("no --target: times to the end of %d epochs", job.epochs)
    model = PerfModel(profiles, weight_sync=job.weight_sync)
    for line in notes:
        print(f"profile {line}")
    out = Path(args.out or f"sim_{args.cluster.replace(':', '_').replace('/', '_')}")

    def progress(name: str, sim: Any, seconds: float) -> None:
        row = sim.summary()
        tt = "not reached" if row["time_to_target_s"] is None else f"{row['time_to_target_s'] / 3600:.2f} h"
        print(f"{name:>9}: to target {tt}, {row['time_s'] / 3600:.2f} h to the end of {row['epochs']} "
              f"epochs, {row['gpu_hours']:.1f} GPU-h, cost {row['cost']:.4g}, {row['replacements']} "
              f"re-placements, final metric {row['final_metric']:.4g} (simulated in {seconds:.1f} s)",
              flush=True)

    result = compare(policies, job, cluster, dataset_size, model, convergence, out, placement_s=args.placement_s,
                     eval_s=args.eval_s, target=args.target, stop_at_target=args.stop_at_target,
                     progress=progress)
    what = "time to target" if args.target is not None else "time"
    for name, row in result["policies"].items():
        if row.get("time_vs_jabas") is not None:
            print(f"{name:>9}: {what} x{row['time_vs_jabas']:.2f}, cost x{row['cost_vs_jabas']:.2f} of JABAS")
        elif "jabas" in result["policies"]:
            print(f"{name:>9}: no ratio to JABAS (the target was missed)")
    print(f"wrote {out}/comparison.json, comparison.png and a run folder per policy")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from ..sim.replay import replay

    report = replay(args.replay, target=args.target)
    for line in report.lines():
        print(line)
    out = Path(args.out) if args.out else Path(args.replay) / "replay.json"
    out.write_text(json.dumps(report.to_dict(), indent=1))
    print(f"wrote {out}")
    return 0


def convergence_from(arg: str, reference_batch: int | None) -> tuple[Any, str | None]:
    """``--convergence``: a shipped app's model (and the app's name) or a folder's."""
    from ..sim.convergence import PACKAGED_REFERENCE_BATCH, ConvergenceModel, load_trace_dir, packaged_model

    if arg in PACKAGED_REFERENCE_BATCH:
        kw = {"reference_batch": reference_batch} if reference_batch else {}
        return packaged_model(arg, **kw), arg
    if not Path(arg).is_dir():
        raise ValueError(f"--convergence must be a folder of validation-<B>.csv traces or one of "
                         f"{sorted(PACKAGED_REFERENCE_BATCH)}, got {arg!r}")
    return ConvergenceModel(reference_batch=reference_batch).fit(load_trace_dir(arg)), None


def _app_size(app: str | None) -> int | None:
    from ..sim.convergence import PACKAGED_DATASET_SIZE
    return PACKAGED_DATASET_SIZE.get(app) if app else None


def profiles_arg(arg: str) -> dict:
    """``--profiles``: the shipped quick-start profiles, a JABAS profile folder, or ours."""
    from ..sim.clusters import paper_type
    from ..sim.jabas_profiles import load_jabas_profiles, quickstart_profiles

    if arg in SHIPPED_PROFILES:
        measured = quickstart_profiles()
    elif Path(arg, "cluster_info.json").is_file():
        measured = load_jabas_profiles(arg)
    else:
        return profiles_from(arg)
    # the JABAS profiler names types as CUDA does ("Tesla V100-PCIE-16GB"): Table 1's names
    return {paper_type(name): replace(p, gpu_type=paper_type(name)) for name, p in measured.items()}

