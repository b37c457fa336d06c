"""``jabasray plan``: the JABAS configuration (and optionally the allocation) for a global batch.

No torch or ray import: it reads a cluster spec and profiles and runs the planners.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..config import WEIGHT_SYNC_METHODS
from ..planners.autoscale import OBJECTIVES, Allocation, choose_allocation
from ..planners.config_solver import unit_model
from ..planners.plan_policy import DEFAULT_TOLERANCE, solve_for_batch
from ..planners.perf_model import PerfModel, emulated_profiles
from ..profiles import Profile, load_profiles
from ..types import ClusterSpec, Plan
from ..validation import check_float, check_int

HELP = """\
Predict the best IIDP configuration (local batch B_L, VSWs and GA steps per GPU; JABAS Alg. 1)
for a global batch size on a cluster, from profiles made by `jabasray profile`. The plan is the
one the driver runs for that batch (the same policy, jabasray.planners.solve_for_batch).

Profiles: --profile may be given several times, and each file may hold one profile or
{"profiles": [...]} (as `jabasray profile --emulate ...` writes). Every GPU type of the cluster
needs a profile of that gpu_type, unless --emulate is given: then the first profile is scaled by
each node's `speed` (Profile.scaled) to stand for every GPU type of the cluster.

Allocation: by default all GPUs of the cluster (pairs per node). `--allocation auto` runs the
auto-scaler (section 6.3) for a constant trajectory (the global batch for the whole epoch of
--dataset-size samples) and reports the chosen allocation; `--allocation NODE=GPUS,...` fixes one
(any GPU count: a node's GPUs form pairs, an odd one runs both similarity groups itself).
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="predict the best configuration for a global batch",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True, help="cluster spec (YAML or JSON): {nodes: [...]}")
    p.add_argument("--profile", required=True, action="append", metavar="FILE",
                   help="profile JSON (repeatable; a file may hold several profiles)")
    p.add_argument("--global-batch", required=True, type=int, help="requested global batch size B_G")
    p.add_argument("--min-local-batch", type=int, default=None,
                   help="min B_L (default: the profiles' min_local_batch)")
    p.add_argument("--allocation", default="all",
                   help="'all' (default), 'auto' (auto-scaler) or NODE=GPUS[,NODE=GPUS...]")
    p.add_argument("--objective", default="time", choices=OBJECTIVES, help="auto-scaler objective")
    p.add_argument("--cost-budget", type=float, default=None, help="for --objective time_under_budget")
    p.add_argument("--dataset-size", type=int, default=50000, help="samples per epoch (auto-scaler)")
    p.add_argument("--adapt-interval", type=int, default=100, help="p: iterations per B_G (auto-scaler)")
    p.add_argument("--weight-sync", default="auto", choices=WEIGHT_SYNC_METHODS)
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="the plan policy's tolerance: the fastest B_L whose B_G* is within this fraction "
                        "of --global-batch wins, else the closest B_G* (default %(default)s = alpha/2 of "
                        "the default job; the driver uses its job's alpha/2)")
    p.add_argument("--emulate", action="store_true",
                   help="scale the first profile by each node's speed for every GPU type")
    p.add_argument("--drop-odd-gpu", action="store_true",
                   help="deprecated, no effect: every GPU count is planned")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _profiles_for(cluster: ClusterSpec, files: list[str], emulate: bool) -> dict[str, Profile]:
    profiles = load_profiles(files)
    if emulate:
        base = next(iter(profiles.values()))
        speeds = {n.gpu_type: n.speed for n in cluster.nodes}
        return emulated_profiles(base, speeds)
    missing = [t for t in cluster.gpu_types if t not in profiles]
    if missing:
        raise ValueError(f"profile: no profile for GPU type(s) {missing} (have {sorted(profiles)}); "
                         "give one per type with --profile, or --emulate to scale one by node speed")
    return profiles


def _parse_allocation(text: str, cluster: ClusterSpec) -> Allocation:
    gpus = {n.name: 0 for n in cluster.nodes}
    for item in text.split(","):
        name, sep, num = item.partition("=")
        if not sep or name.strip() not in gpus:
            raise ValueError(f"allocation must be 'all', 'auto' or NODE=GPUS,... with NODE in "
                             f"{list(gpus)}, got {text!r}")
        try:
            gpus[name.strip()] = int(num)
        except ValueError:
            raise ValueError(f"allocation: GPUs for node {name.strip()} must be an integer, got {num!r}") from None
    alloc = Allocation(gpus)
    alloc.group_gpus(cluster)  # validates GPUs per node
    return alloc


def _table(plan: Plan, alloc: Allocation, model: PerfModel) -> str:
    lines = [f"allocation: {', '.join(f'{n}={g} GPU(s)' for n, g in alloc.node_gpus.items() if g)} "
             f"({alloc.num_gpus} GPUs, {'multi' if alloc.multi_node else 'single'}-node)",
             f"global batch: requested {plan.requested_global_batch_size}, used {plan.global_batch_size} "
             f"(B_L {plan.local_batch_size} x {plan.num_workers_per_group} workers x 2 groups)",
             f"iteration time: {plan.iteration_time * 1e3:.3f} ms   throughput: {plan.throughput:.1f} samples/s"
             f"   weight sync: {plan.weight_sync}",
             "",
             f"{'node':<16} {'gpu':<10} {'n_vsw':>5} {'n_ga':>5} {'workers':>7} {'time(ms)':>9}"]
    units = unit_model(model)
    nodes = [n for n, g in alloc.node_gpus.items() for _ in range(g // 2 + g % 2)]
    for node, w in zip(nodes, plan.workers):
        t = units.iteration_time(w.gpu, plan.local_batch_size, w.num_vsw, w.num_ga)
        lines.append(f"{node:<16} {w.gpu:<10} {w.num_vsw:>5} {w.num_ga:>5} {w.num_workers:>7} {t * 1e3:>9.3f}")
    lines.append("(each row is one unit per group: both GPUs of a pair run this configuration; "
                 "a <type>/solo GPU runs it twice, once per group)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check_int("global_batch", args.global_batch, min_value=1)
    check_int("dataset_size", args.dataset_size, min_value=1)
    check_int("adapt_interval", args.adapt_interval, min_value=1)
    check_float("tolerance", args.tolerance, min_value=0)
    if args.cost_budget is not None:
        check_float("cost_budget", args.cost_budget, min_value=0, min_exclusive=True)
    if args.drop_odd_gpu:
        print("jabasray plan: --drop-odd-gpu is deprecated and has no effect: every GPU count is planned",
              file=sys.stderr)
    cluster = ClusterSpec.from_file(args.cluster)
    profiles = _profiles_for(cluster, args.profile, args.emulate)
    if args.min_local_batch is None:
        mins = {p.min_local_batch for p in profiles.values()}
        if len(mins) > 1:
            raise ValueError(f"min_local_batch differs between profiles ({sorted(mins)}); pass --min-local-batch")
        min_bl = mins.pop()
    else:
        min_bl = check_int("min_local_batch", args.min_local_batch, min_value=1)
    model = PerfModel(profiles, weight_sync=args.weight_sync)
    decision = None
    if args.allocation == "auto":
        decision = choose_allocation(cluster, model, [args.global_batch], args.dataset_size,
                                     args.adapt_interval, min_bl, objective=args.objective,
                                     cost_budget=args.cost_budget, tolerance=args.tolerance)
        alloc = decision.allocation
    elif args.allocation == "all":
        alloc = Allocation({n.name: n.num_gpus for n in cluster.nodes})   # every GPU
    else:
        alloc = _parse_allocation(args.allocation, cluster)
    group = alloc.group_gpus(cluster)
    m = model.for_allocation(alloc.num_gpus, alloc.multi_node)
    if decision is not None:   # the auto-scaler has already solved B_G on the chosen allocation
        plan = decision.plans[args.global_batch]
    else:
        plan = solve_for_batch(args.global_batch, group, m, min_bl, tolerance=args.tolerance)
    if args.json:
        out = {"requested_global_batch": args.global_batch,
               "allocation": alloc.to_dict(), "group_gpus": group, "plan": plan.to_dict(),
               "throughput": plan.throughput}
        if decision is not None:
            out["autoscale"] = {"objective": decision.objective, "epoch_time": decision.epoch_time,
                                "cost": decision.cost, "iterations": decision.iterations,
                                "candidates": [c.to_dict() for c in decision.candidates]}
        print(json.dumps(out, indent=2))
    else:
        print(_table(plan, alloc, m))
        if plan.requested_global_batch_size != args.global_batch:
            print(f"note: global batch {args.global_batch} is below the smallest global batch these GPUs "
                  f"run; the driver runs {plan.requested_global_batch_size}")
        if decision is not None:
            print(f"\nauto-scaler ({decision.objective}): predicted epoch {decision.epoch_time:.3f} s, "
                  f"cost {decision.cost:.4g}, {len(decision.candidates)} candidate allocations")
    return 0
