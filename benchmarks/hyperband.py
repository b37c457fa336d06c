"""Packed trials vs Ray Tune's own schedulers, all written as a Tune user writes them.

Contenders (each a ``tune.Tuner`` run on the same local Ray instance, ``num_cpus=2``):

* ``A tune_asha``: Tune's ``ASHAScheduler(max_t=R, grace_period=1, reduction_factor=eta)``;
  function trainable (:func:`jabasray.tuner.make_trainable`) reporting every unit with a
  checkpoint every unit (as Tune's docs show), 1 CPU per trial, ``reuse_actors=True``;
* ``B tune_hyperband``: the same trainable under Tune's ``HyperBandScheduler(max_t=R,
  reduction_factor=eta)`` (with the finished-bracket fix of :mod:`jabasray.tuner.schedulers`,
  which D uses too: without it either contender can hang when a trial ends at max_t);
* ``C packed_asha``: :func:`jabasray.tuner.packed` (trials packed per CPU "device",
  ``--members`` per device) under the same ``ASHAScheduler``, with ``SimilaritySearch`` order;
* ``D packed_hyperband``: :class:`jabasray.tuner.PackedHyperband` (Tune's HyperBandScheduler +
  kNN order per bracket) with packed trials.
* ``tune_asha_shared`` (only when named; ``--device cuda``): A with ``1 / --members`` of a GPU
  per trial -- what Tune users do today to share one GPU among small trials;
* ``packed_asha_sync`` (only when named in ``--contenders``): C with ``run_ahead=False`` --
  every unit waits for all its members' trials to ask -- to measure what running one unit
  ahead of Tune gains (``packed_asha_sync/packed_asha`` ratios).
* ``packed_asha_plain`` (only when named): C with A's search order (``BasicVariantGenerator``
  over the same points) instead of ``SimilaritySearch``: what the order does to ASHA's
  promotions and to the packs.
* ``packed_asha_wave`` (only when named): C with ``SimilaritySearch(first_wave=members x
  devices)`` (or ``--first-wave``): the trials beyond the first wave start only after the first
  result, so the first wave's processes do not share the CPUs with them while starting (time to
  the first result; ``packed_asha/packed_asha_wave`` ratios).

Same work: every contender gets the SAME configurations (the Hyperband sample for R, eta from
the Table 3 space, seeded; ASHA runs them as its ``num_samples``), the same spec (``--workload``:
MLP-3 on digits, or on generated CIFAR-sized images a 1.7M-parameter MLP or a small CNN,
:mod:`jabasray.tuner.cifar_sized`; ``--steps-per-unit`` steps per unit) and reads the same data; the units each one
actually trains are reported (schedulers decide differently). Rounds are paired: A B C D,
A B C D, ... (the order rotates each round); per-round ratios and their median are reported,
never the best of each side from different rounds. For every run: wall time to finish, time
until the best-so-far metric is within 1 point of that run's final best, time to the fixed
``--target`` accuracy, best accuracy, units trained and seconds per unit trained (schedulers
decide differently, so the contenders' amounts of work differ), load average, and for packed
contenders what the coordinators did (``jabasray.tuner.coordinator_stats``: units, members
per unit, discarded speculative units, seconds training and idle).

Packed contenders call ``packed(..., pack="auto")`` by default (``--pack on``: always pack):
the cost model decides whether and how many trials to pack (at most ``--members``), and when
packing does not pay each trial trains alone, as Tune's own; every packed run records that
decision (``decision``) and the seconds ``packed()`` took to make it (``decide_s``: measuring
the costs the first time, read from the cache afterwards; outside the timed run).

Unit sizes (``--unit-sizes 25ms,250ms,2.5s``): the same comparison at three sizes of unit,
each with its own steps per unit and R (:data:`UNIT_SIZES`: the digits MLP with 10 steps,
R = 27, 49 configurations; 300 steps, R = 9, 17; 3000 steps, R = 3, 5),
one JSON document with one comparison per size (``unit_sizes``). On 2 quiet cores the whole
default comparison (4 contenders, 2 paired rounds, one warm-up per size) takes about 7-8
minutes; ``--smoke`` shrinks every size to R = 3 and 1 step per unit with no warm-up.

    python benchmarks/hyperband.py [--rounds 2] [--R 81] [--out /tmp/x.json]
    python benchmarks/hyperband.py --unit-sizes 25ms,250ms,2.5s --rounds 2
    python benchmarks/hyperband.py --unit-sizes 25ms --smoke --rounds 1 --contenders tune_asha,packed_asha
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import default_out, rotated, write_json  # noqa: E402

CONTENDERS = ("tune_asha", "tune_hyperband", "packed_asha", "packed_hyperband")
# the same-configurations comparison at three unit sizes: the same model (MLP-3 on digits) and
# space, units of 10, 300 and 3000 steps -- about 25 ms (with Tune's report, as the 10-step
# units users measured), 250 ms and 2.5 s on a quiet 2-core machine; R keeps each size's sweep
# within ~2.5 minutes for 4 contenders x 2 rounds
UNIT_SIZES = {"25ms": {"workload": "digits_mlp", "steps_per_unit": 10, "R": 27},
              "250ms": {"workload": "digits_mlp", "steps_per_unit": 300, "R": 9},
              "2.5s": {"workload": "digits_mlp", "steps_per_unit": 3000, "R": 3}}
SMOKE = {"workload": "digits_mlp", "steps_per_unit": 1, "R": 3}
EXTRA_CONTENDERS = ("tune_asha_shared", "packed_asha_sync", "packed_asha_plain", "packed_asha_wave")   # only when named


def workload_spec(name: str, steps_per_unit: int, seed: int, device: str):
    """The TrainingSpec of ``--workload``: digits_mlp | cifar_mlp | cifar_cnn."""
    from jabasray.tuner.cifar_sized import cifar_mlp_spec, small_cnn_spec
    from jabasray.tuner.digits import digits_mlp_spec
    make = {"digits_mlp": digits_mlp_spec, "cifar_mlp": cifar_mlp_spec, "cifar_cnn": small_cnn_spec}[name]
    return make(steps_per_unit=steps_per_unit, seed=seed, device=device)


def trajectory_stats(points: list[tuple[float, float]], target: float) -> dict:
    """From ``(seconds since start, metric)`` results (in arrival order): the best metric, the
    time of the first result, the first time the best-so-far is within 0.01 (1 point) of the
    best, the first time it reaches ``target`` (None if never)."""
    best = max(m for _, m in points)
    best_so_far, t_within, t_target = float("-inf"), None, None
    for t, m in sorted(points):
        best_so_far = max(best_so_far, m)
        if t_within is None and best_so_far >= best - 0.01:
            t_within = t
        if t_target is None and best_so_far >= target:
            t_target = t
    return {"best_accuracy": best, "time_to_first_result_s": min(t for t, _ in points),
            "time_to_within_1pt_s": t_within, "time_to_target_s": t_target}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--R", type=int, default=81, help="max units per configuration (a power of eta)")
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--steps-per-unit", type=int, default=100)
    ap.add_argument("--members", type=int, default=4, help="packed trials per CPU device")
    ap.add_argument("--trials-per-device", type=int, default=None,
                    help="trials Tune runs per device for packed contenders (>= --members; more "
                         "than --members keeps packs full while members wait at decision points; "
                         "default --members)")
    ap.add_argument("--cpus-per-device", type=float, default=1.0,
                    help="CPUs of one packed CPU device (a node of C CPUs has C // this coordinators)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of a packed CPU device's coordinator (default --cpus-per-device)")
    ap.add_argument("--first-wave", type=int, default=None,
                    help="packed_asha_wave's first wave: trials started before the first result "
                         "(default --members x devices: every seat of every pack)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.9, help="fixed target accuracy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: on a Ray node with GPUs; Tune's trials take one GPU each, packed "
                         "trials 1/members of one")
    ap.add_argument("--workload", choices=("digits_mlp", "cifar_mlp", "cifar_cnn"), default="digits_mlp",
                    help="the model and data every contender trains (cifar_*: generated 3x32x32 images)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--pack", choices=("auto", "on"), default="auto",
                    help="packed contenders: packed(pack='auto') (the cost model decides whether and how "
                         "many to pack, at most --members) or pack=True (always --members per device)")
    ap.add_argument("--unit-sizes", default="",
                    help=f"comma list among {', '.join(UNIT_SIZES)}: run the comparison at each unit "
                         "size (its workload, steps per unit and R override those flags)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (R=3, 1 step per unit, digits) and no warm-up: checks the script runs")
    ap.add_argument("--out", default=default_out('hyperband.json'))
    args = ap.parse_args(argv)
    contenders = [c for c in args.contenders.split(",") if c]
    for c in contenders:
        if c not in CONTENDERS + EXTRA_CONTENDERS:
            print(f"contenders must be among {', '.join(CONTENDERS + EXTRA_CONTENDERS)}, got {c!r}",
                  file=sys.stderr)
            return 2
    if "tune_asha_shared" in contenders and args.device != "cuda":
        print("contenders: tune_asha_shared (1/--members of a GPU per trial) needs --device cuda",
              file=sys.stderr)
        return 2

    if args.unit_sizes:
        for size in args.unit_sizes.split(","):
            if size not in UNIT_SIZES:
                print(f"--unit-sizes must be among {', '.join(UNIT_SIZES)}, got {size!r}", file=sys.stderr)
                return 2
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device is visible", file=sys.stderr)
            return 2
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        if not args.unit_sizes:
            out = compare(args, contenders)
        else:
            out = {"machine": machine_line(args), "args": vars(args), "load_avg_start": os.getloadavg(),
                   "unit_sizes": {}}
            for size in args.unit_sizes.split(","):
                preset = dict(UNIT_SIZES[size], **(SMOKE if args.smoke else {}))
                print(f"== unit size {size}: {preset}", flush=True)
                sized = argparse.Namespace(**{**vars(args), **preset, "out": None})
                out["unit_sizes"][size] = compare(sized, contenders)
                write_json(args.out, out, announce=False)
            out["load_avg_end"] = os.getloadavg()
    finally:
        ray.shutdown()
    write_json(args.out, out)
    return 0


def machine_line(args) -> str:
    gpu = "no GPU" if args.device == "cpu" else __import__("torch").cuda.get_device_name(0)
    return f"{platform.machine()} {os.cpu_count()}-core CPU, {gpu}, Ray num_cpus={args.num_cpus}"


def compare(args, contenders: list[str]) -> dict:
    """One comparison of ``contenders`` on the same configurations (module docstring), in
    paired rounds on the running Ray instance; returns its JSON document (written to
    ``args.out`` after every run when ``args.out`` is set)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    from jabasray.planners.pack_opt import TABLE3_SPACE
    from jabasray.tuner import (PackedHyperband, SimilaritySearch, coordinator_stats, hyperband_schedule,
                                make_trainable, packed)
    from jabasray.tuner.digits import TABLE3_PARAM_VALUES
    from jabasray.tuner.schedulers import hyperband_scheduler

    storage = tempfile.mkdtemp(prefix="jabasray_hb_bench_")
    spec = workload_spec(args.workload, args.steps_per_unit, args.seed, args.device)
    space = {k: tune.choice(v) for k, v in TABLE3_PARAM_VALUES.items()}
    n_configs = sum(b.num_configs for b in hyperband_schedule(args.R, args.eta))
    configs = TABLE3_SPACE.sample(n_configs, random.Random(args.seed))
    stream_batch = max(TABLE3_PARAM_VALUES["batch_size"])
    data = spec.data_fn()
    def plain_trainable(resources: dict):
        # a new trainable per resource request: tune.with_resources marks the object it wraps
        return tune.with_resources(tune.with_parameters(
            make_trainable(spec, stream_batch=stream_batch, max_units=args.R), data=data), resources)
    plain = plain_trainable({"cpu": 1, "gpu": 1} if args.device == "cuda" else {"cpu": 1})
    # what Tune users do to share one GPU: a fraction of it (and of the CPUs) per trial
    shared = (plain_trainable({"cpu": args.num_cpus / args.members, "gpu": 1 / args.members})
              if args.device == "cuda" else None)

    class Recorder(tune.Callback):
        def __init__(self) -> None:
            self.t0 = time.perf_counter()
            self.points: list[tuple[float, float]] = []
            self.units: dict[str, int] = {}

        def on_trial_result(self, iteration, trials, trial, result, **info):
            self.points.append((time.perf_counter() - self.t0, float(result["accuracy"])))
            self.units[trial.trial_id] = max(self.units.get(trial.trial_id, 0), int(result["units"]))

    # packed CPU devices as packed() counts them; the first wave of packed_asha_wave
    devices = 1 if args.device == "cuda" else max(1, int(args.num_cpus // args.cpus_per_device))
    first_wave = args.members * devices if args.first_wave is None else args.first_wave

    def tune_config(name: str):
        asha = dict(max_t=args.R, grace_period=1, reduction_factor=args.eta)
        if name in ("tune_asha", "tune_asha_shared"):
            return plain if name == "tune_asha" else shared, tune.TuneConfig(metric="accuracy", mode="max", num_samples=len(configs), reuse_actors=True,
                                          search_alg=BasicVariantGenerator(points_to_evaluate=[dict(c) for c in configs]),
                                          scheduler=ASHAScheduler(**asha))
        if name == "tune_hyperband":
            return plain, tune.TuneConfig(metric="accuracy", mode="max", num_samples=len(configs), reuse_actors=True,
                                          search_alg=BasicVariantGenerator(points_to_evaluate=[dict(c) for c in configs]),
                                          scheduler=hyperband_scheduler(max_t=args.R, reduction_factor=args.eta))
        trainable = packed(spec, max_units=args.R, param_space=space, members_per_device=args.members,
                           run_ahead=name != "packed_asha_sync", trials_per_device=args.trials_per_device,
                           cpus_per_device=args.cpus_per_device, threads=args.threads,
                           pack=True if args.pack == "on" else "auto", num_samples=len(configs),
                           reduction_factor=args.eta)
        if name == "packed_asha_plain":
            return trainable, tune.TuneConfig(
                metric="accuracy", mode="max", num_samples=len(configs), reuse_actors=True,
                scheduler=ASHAScheduler(**asha), max_concurrent_trials=len(configs),
                search_alg=BasicVariantGenerator(points_to_evaluate=[dict(c) for c in configs]))
        if name in ("packed_asha", "packed_asha_sync", "packed_asha_wave"):
            return trainable, tune.TuneConfig(
                metric="accuracy", mode="max", num_samples=len(configs), reuse_actors=True,
                scheduler=ASHAScheduler(**asha), max_concurrent_trials=len(configs),
                search_alg=SimilaritySearch(group_size=args.members, batch_size=len(configs), points=configs,
                                            first_wave=first_wave if name == "packed_asha_wave" else None,
                                            trainable=trainable))
        hb = PackedHyperband(args.R, args.eta, members_per_device=args.members, points=configs,
                             trainable=trainable)
        return trainable, hb.tune_config("accuracy", "max", reuse_actors=True)

    def run(name: str, rnd: int) -> dict:
        t_decide = time.perf_counter()
        trainable, tc = tune_config(name)      # packed(): the packing decision (costs cached after the first)
        decide_s = time.perf_counter() - t_decide
        rec = Recorder()
        t0 = time.perf_counter()
        rec.t0 = t0
        grid = tune.Tuner(trainable, param_space=space, tune_config=tc,
                          run_config=tune.RunConfig(name=f"{name}_{rnd}", storage_path=storage, verbose=0,
                                                    callbacks=[rec])).fit()
        wall = time.perf_counter() - t0
        best = grid.get_best_result()
        # what the packing coordinators did (ended now, so no contender's run sees another's)
        stats = list(coordinator_stats(release=True).values()) if name.startswith("packed") else []
        decision = next((s["decision"] for s in stats if s.get("decision")), None)
        coord = {k: sum(s[k] for s in stats) for k in ("units_run", "member_units", "units_discarded", "units_unclaimed",
                                                       "set_aside", "busy_s")}
        coord["idle_s"] = {r: sum(s["idle_s"].get(r, 0.0) for s in stats)
                           for r in sorted({r for s in stats for r in s["idle_s"]})}
        units = sum(rec.units.values())
        return {"wall_s": wall, "trials": len(grid), "errors": grid.num_errors,
                "units_trained": units, "s_per_unit": wall / units, "reports": len(rec.points),
                "trials_by_units": {str(u): n for u, n in sorted(Counter(rec.units.values()).items())},
                "coordinators": coord if stats else None, "decide_s": decide_s,
                "decision": ({k: decision[k] for k in ("pack", "members_per_device", "trials_at_once",
                                                       "predicted_s", "alone_s", "reason")} if decision else None),
                **trajectory_stats(rec.points, args.target),
                "best_config": {k: best.config[k] for k in TABLE3_PARAM_VALUES},
                "load_avg_after": os.getloadavg()[0]}

    out: dict = {"machine": machine_line(args), "args": vars(args), "configs": len(configs),
                 "load_avg_start": os.getloadavg(), "rounds": []}
    try:
        if not args.smoke and "tune_asha" in contenders:
            run("tune_asha", -1)                        # warm-up: Ray workers, imports
        for rnd in range(args.rounds):
            order = rotated(contenders, rnd)
            row: dict = {}
            out["rounds"].append(row)
            for name in order:
                r = run(name, rnd)
                row[name] = r
                print(f"[round {rnd}] {name:17s} finish {r['wall_s']:6.1f} s | first result "
                      f"{r['time_to_first_result_s']:6.1f} s | within 1 pt "
                      f"{r['time_to_within_1pt_s']:6.1f} s | target {r['time_to_target_s']} | best "
                      f"{r['best_accuracy']:.4f} | {r['units_trained']} units, {r['trials']} trials, "
                      f"{r['errors']} errors | load {r['load_avg_after']:.1f}", flush=True)
                if r["decision"]:
                    print(f"          decision: {r['decision']['reason']}", flush=True)
                if r["coordinators"]:
                    print(f"          coordinators: {r['coordinators']}", flush=True)
                # every finished run kept, even if a later one is cut (a last round may be partial)
                if args.out:
                    write_json(args.out, out, announce=False)
    finally:
        shutil.rmtree(storage, ignore_errors=True)

    def ratios(base: str, other: str, key: str) -> list[float] | None:
        if base not in contenders or other not in contenders:
            return None
        vals = []
        for row in out["rounds"]:
            a, b = row[base][key], row[other][key]
            vals.append(a / b if a is not None and b else float("nan"))
        return vals

    summary = {}
    for base, other in (("tune_asha", "packed_asha"), ("tune_asha_shared", "packed_asha"),
                        ("tune_hyperband", "packed_hyperband"),
                        ("tune_asha", "packed_hyperband"), ("packed_asha_sync", "packed_asha"),
                        ("tune_asha", "packed_asha_plain"), ("packed_asha", "packed_asha_wave"),
                        ("tune_asha", "packed_asha_wave")):
        for key in ("wall_s", "time_to_first_result_s", "time_to_within_1pt_s", "time_to_target_s", "s_per_unit"):
            r = ratios(base, other, key)
            if r is not None:
                summary[f"{base}/{other} {key}"] = {"per_round": r, "median": statistics.median(r)}
    for name in contenders:
        summary[f"{name} best_accuracy"] = [row[name]["best_accuracy"] for row in out["rounds"]]
        summary[f"{name} units_trained"] = [row[name]["units_trained"] for row in out["rounds"]]
    out["summary"] = summary
    out["load_avg_end"] = os.getloadavg()
    for k, v in summary.items():
        if isinstance(v, dict):
            print(f"{k}: per round {', '.join(f'{x:.2f}' for x in v['per_round'])}; median {v['median']:.2f}x")
        else:
            print(f"{k}: {v}")
    return out


if __name__ == "__main__":
    sys.exit(main())
