"""GPU campaign: on a machine with one GPU, every GPU check of the repository in one command,
within a fixed time budget (default 7.5 minutes), leaving logs, JSON and one summary table.

    python benchmarks/gpu_campaign.py OUTDIR [--budget 450] [--only a,b] [--dry-run]

A GPU may be lent for as little as 15 minutes, the machine's start included, and one command
may run at most 10: the default budget fits one command with the start and the transfers. Steps,
in priority order - first what decides the goals still open (measured once on an H200 before
the changes they check, or never), then the rest:

0. ``engine_gpu_checks``: the ``cuda`` tests of the engine's multi-GPU work (the segmented
   graphed step with a one-rank NCCL group equals the eager step and never synchronises the
   host; IIDP over NCCL beside a background job, the foreground never waiting on a background
   event; background graphs in pieces equal eager) and ``engine_ddp``:
   ``benchmarks/engine.py --parts ddp`` (ResNet-18 and the small transformer, n = 1, 4, 16 at B_L 32: the engine eager and graphed with the group against
   eager DDP, DDP ``static_graph`` as a CUDA graph, and the single-device graphed step);
1. ``engine_resnet18`` / ``engine_overhead``: ``benchmarks/engine.py`` on the GPU - plain eager
   loop, plain graphed loop, per-VSW, batched, batched + graph - for n = 1, 2, 4 and 8
   (ResNet-18, B_L 32), windows of 50 steps, 3 rounds (goal: n VSWs at least 0.95x one plain
   worker on n x B_L, eager vs eager and graph vs graph); the engine at 1 VSW vs a plain step
   (goal: within 5 %);
2. where Ray Tune imports (Ray Train needs pydantic beside Ray): ``tune_evidence_mlp``, the
   packed-trials evidence: packed ASHA against Tune's ASHA with 1/8 of the GPU per trial (what
   Tune users do today), the CIFAR-sized MLP, R = 27, full packs of 8 (12 trials admitted per
   device), 1000 steps per unit, one round (goal: 2.7x Tune's trials, best accuracy within 0.5
   point); ``benchmarks/hyperband.py`` keeps each contender's run in its JSON as soon as it
   ends, so a run cut at its limit keeps what it measured;
3. ``cuda_tests``: every ``cuda``-marked test (``pytest -m cuda tests/``; collection errors of
   modules that need Ray where Ray is missing do not stop the others);
4. where Ray Tune imports: ``train`` (``jabasray train --device cuda``, one epoch, on the GPU Ray
   detects) and ``tune`` (a small sweep with all three contenders - Tune with a whole GPU per
   trial, with 1/8 of it, packed - R = 9, 50 steps per unit);
5. ``profiling``: profiler + iteration-time model vs measured steps, graphed and eager
   (``benchmarks/perf_model.py``); ``engine_host``: the ops dispatched and host time per step,
   engine vs plain loop (``benchmarks/engine_host.py``);
6. ``packing``: Pack's IMPV vs K and the graphed vs eager packed step (``benchmarks/packing.py``);
7. ``engine_transformer`` (n = 1, 4, 16, B_L 32) and ``engine_resnet18_n16``;
8. ``multiplex`` / ``multiplex_gpu_bound``: background multiplexing beside the small and a
   GPU-bound foreground;
9. optional (only when named in ``--only``): ``tune_evidence_cnn``, the same evidence on the
   small CNN (e.g. ``--only tune_evidence_cnn --budget 300`` in a second command).

Every step is a subprocess in its own session with its own timeout: ``min(nominal, what is
left of the budget - a reserve for the summary)``; a step that would get less than
``MIN_STEP_S`` is skipped (reported as such). Each writes ``OUTDIR/<step>.log`` (stdout and
stderr) and, for benchmarks, ``OUTDIR/<step>.json``; the campaign writes ``OUTDIR/campaign.json``
(every step: command, status, seconds, return code) and ``OUTDIR/summary.md`` (one table: step,
status, seconds, headline figures read from its JSON or log). ``--dry-run`` prints the plan
(no GPU needed, nothing run, nothing written).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 450          # 7.5 minutes: one command, with the machine's start, in 15 minutes of device time
RESERVE_S = 10          # kept for the summary after the last step
MIN_STEP_S = 20         # a step that would get less is skipped


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]            # {out} is replaced by OUTDIR, {py} by this Python
    timeout_s: int                   # nominal limit
    needs_ray: bool = False
    json: bool = True                # writes OUTDIR/<name>.json
    optional: bool = False           # runs only when named in --only (longer evidence runs)


def _bench(script: str, *args: str) -> tuple[str, ...]:
    return ("{py}", f"benchmarks/{script}", *args)


def _tune_evidence(workload: str, timeout_s: int, optional: bool) -> Step:
    """The packed-trials evidence on ``workload``: packed ASHA against Tune's ASHA with 1/8 of
    the GPU per trial, R = 27, full packs of 8 (12 trials admitted per device), 1000 steps per
    unit, one round. Packed first: a run cut at its limit has measured the technique, and with
    no warm-up round the first contender pays Ray's cold start (workers, imports), which counts
    against the technique, not for it."""
    name = f"tune_evidence_{workload.removeprefix('cifar_')}"
    return Step(name, _bench("hyperband.py", "--device", "cuda", "--workload", workload, "--R", "27",
                             "--steps-per-unit", "1000", "--members", "8", "--trials-per-device", "12",
                             "--num-cpus", "16", "--contenders", "packed_asha,tune_asha_shared",
                             "--rounds", "1", "--out", f"{{out}}/{name}.json"),
                timeout_s, needs_ray=True, optional=optional)


STEPS: tuple[Step, ...] = (
    # the checks of the engine's multi-GPU work first: graphed steps with a process group
    # (segments), no host sync, the foreground never waiting on background events
    Step("engine_gpu_checks", ("{py}", "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                               "--junitxml", "{out}/engine_gpu_checks.xml", "tests/test_cuda.py",
                               "tests/test_engine_host_sync.py", "-k",
                               "segmented or nccl or host_sync or synchronise or background_job"), 90,
         json=False),
    Step("engine_ddp", _bench("engine.py", "--device", "cuda", "--parts", "ddp", "--models",
                              "resnet18,small_transformer", "--vsw", "1,4,16", "--ddp-local-batch", "32",
                              "--ddp-rounds", "3", "--ddp-window", "20", "--out", "{out}/engine_ddp.json"), 150),
    Step("engine_resnet18", _bench("engine.py", "--device", "cuda", "--parts", "batched",
                                   "--models", "resnet18", "--vsw", "1,2,4,8", "--local-batches", "32",
                                   "--rounds", "3", "--window", "50", "--out", "{out}/engine_resnet18.json"), 90),
    Step("engine_overhead", _bench("engine.py", "--device", "cuda", "--parts", "overhead", "--rounds", "5",
                                   "--out", "{out}/engine_overhead.json"), 30),
    _tune_evidence("cifar_mlp", 240, optional=False),
    Step("cuda_tests", ("{py}", "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                        "--continue-on-collection-errors", "--junitxml", "{out}/cuda_tests.xml",
                        "tests/"), 120, json=False),
    Step("train", ("{py}", "-m", "jabasray.cli", "train", "--device", "cuda", "--epochs", "1",
                   "--no-progress", "--storage-path", "{out}/runs", "--name", "campaign"), 90,
         needs_ray=True, json=False),
    Step("tune", _bench("hyperband.py", "--device", "cuda", "--workload", "cifar_mlp", "--R", "9",
                        "--steps-per-unit", "50", "--members", "8", "--num-cpus", "8",
                        "--contenders", "tune_asha,tune_asha_shared,packed_asha", "--rounds", "1",
                        "--out", "{out}/tune.json"), 150, needs_ray=True),
    Step("profiling", _bench("perf_model.py", "--device", "cuda", "--steps", "10", "--out",
                             "{out}/profiling.json"), 60),
    Step("engine_host", _bench("engine_host.py", "--device", "cuda", "--rounds", "5", "--window", "30",
                               "--counts", "1,2,4,8", "--out", "{out}/engine_host.json"), 90),
    # 2 rounds: 3 rounds of K = 2, 8, 32 (MLP and CNN, same and mixed optimizers) took more than
    # 45 s on an H200, most of it the sequential K = 32 contender
    Step("packing", _bench("packing.py", "--device", "cuda", "--ks", "2,8,32", "--repeats", "2",
                           "--steps", "20", "--out", "{out}/packing.json"), 75),
    Step("engine_transformer", _bench("engine.py", "--device", "cuda", "--parts", "batched",
                                      "--models", "small_transformer", "--vsw", "1,4,16",
                                      "--local-batches", "32", "--rounds", "3", "--window", "50",
                                      "--out", "{out}/engine_transformer.json"), 60),
    Step("engine_resnet18_n16", _bench("engine.py", "--device", "cuda", "--parts", "batched",
                                       "--models", "resnet18", "--vsw", "16", "--local-batches", "32",
                                       "--rounds", "3", "--window", "50", "--out",
                                       "{out}/engine_resnet18_n16.json"), 60),
    Step("multiplex", _bench("multiplex.py", "--device", "cuda", "--rounds", "3", "--steps", "100",
                             "--out", "{out}/multiplex.json"), 60),
    Step("multiplex_gpu_bound", _bench("multiplex.py", "--device", "cuda", "--foreground", "gpu",
                                       "--rounds", "3", "--steps", "60", "--out",
                                       "{out}/multiplex_gpu_bound.json"), 60),
    _tune_evidence("cifar_cnn", 300, optional=True),
)


def ray_problem() -> str | None:
    """None when Ray Tune and Ray Train import with this Python (tried in a subprocess, so that
    the campaign itself never holds Ray), else why not in one line: Ray missing, or one of the
    packages it needs (Ray Train needs pydantic) missing beside it."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not importable"
    r = subprocess.run([sys.executable, "-c", "import ray.tune, ray.train"], capture_output=True,
                       text=True, timeout=120)
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
    return f"Ray Tune does not import: {last}"


def plan(ray_missing: str | None, only: set[str] | None = None) -> list[tuple[Step, str | None]]:
    """``(step, why it is skipped or None)`` for every step, in order; ``ray_missing``: why
    the steps that need Ray cannot run (None: they can)."""
    out = []
    for s in STEPS:
        if only is not None and s.name not in only:
            out.append((s, "not in --only"))
        elif s.optional and only is None:
            out.append((s, "optional: name it in --only"))
        elif s.needs_ray and ray_missing:
            out.append((s, ray_missing))
        else:
            out.append((s, None))
    return out


def step_timeout(nominal: int, remaining: float) -> int | None:
    """The limit a step runs under: ``min(nominal, remaining - RESERVE_S)``; ``None`` (skip)
    when that is below ``MIN_STEP_S``."""
    t = int(min(nominal, remaining - RESERVE_S))
    return t if t >= MIN_STEP_S else None


def command(step: Step, out: Path) -> list[str]:
    return [a.replace("{out}", str(out)).replace("{py}", sys.executable) for a in step.argv]


@dataclass
class Outcome:
    name: str
    command: list[str]
    status: str                      # ok | failed | timeout | skipped
    seconds: float = 0.0
    returncode: int | None = None
    note: str = ""                   # skip reason
    headline: str = ""               # figures for the table
    limit_s: int | None = None


def run_step(step: Step, out: Path, limit: int, env: dict[str, str]) -> Outcome:
    """Run one step in its own session (killed as a group at its limit); log to OUTDIR."""
    cmd = command(step, out)
    log = out / f"{step.name}.log"
    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, status = None, "timeout"
    return Outcome(step.name, cmd, status, time.monotonic() - t0, rc, limit_s=limit)


# ------------------------------------------------------------------------------ headlines
def _pytest_counts(text: str) -> str:
    """``"41 passed, 2 failed, 3 skipped"`` from pytest's last summary line ('' if none)."""
    lines = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
    if not lines:
        return ""
    return ", ".join(m.group(0) for m in re.finditer(r"\d+ (passed|failed|skipped|errors?|deselected)",
                                                       lines[-1]))


def _engine(doc: dict) -> str:
    """Per (model, B_L, n): eager batched / plain and graph batched / plain graph (medians)."""
    parts = []
    for r in doc.get("batched_vs_plain", []):
        s = f"{r['model']} B_L{r['local_batch']} n{r['num_vsw']}: eager {r['batched_over_plain_median']:.2f}"
        if "batched_graph_over_plain_graph_median" in r:
            s += f", graph {r['batched_graph_over_plain_graph_median']:.2f}"
        parts.append(s)
    for r in doc.get("overhead", []):
        parts.append(f"1 VSW / plain at batch {r['batch']}: {r['ratio']:.2f}")
    return "; ".join(parts)


def _packing(doc: dict) -> str:
    rows = doc.get("rows") or doc.get("results") or []
    out = []
    for r in rows if isinstance(rows, list) else []:
        if isinstance(r, dict) and "IMPV_median_of_rounds" in r:
            g = r.get("graph_speedup_median_of_rounds")
            out.append(f"{r.get('model', '?')}/{r.get('optimizers', '?')} K{r.get('K', '?')}: "
                       f"IMPV {r['IMPV_median_of_rounds']:+.2f}"
                       + (f", graphed/eager x{g:.2f}" if isinstance(g, (int, float)) else ""))
    return "; ".join(out)


def _tune(doc: dict) -> str:
    """Tune's trials / packed trials (> 1: packed faster), medians of the rounds: to finish and
    to within 1 point, for each Tune contender that ran; for a run cut before its summary, each
    finished contender's own figures."""
    summary = doc.get("summary")
    if summary is None:
        return "; ".join(f"{name} (cut run): finish {r['wall_s']:.0f} s, best {r['best_accuracy']:.4f}, "
                         f"{r['units_trained']} units"
                         for row in doc.get("rounds", []) for name, r in row.items())
    out = []
    for base in ("tune_asha", "tune_asha_shared", "tune_hyperband"):
        other = "packed_hyperband" if base == "tune_hyperband" else "packed_asha"
        finish, within = (summary.get(f"{base}/{other} {k}") for k in ("wall_s", "time_to_within_1pt_s"))
        if finish:
            out.append(f"{base}/{other}: finish {finish['median']:.2f}x, within 1 pt "
                       f"{within['median']:.2f}x" if within else
                       f"{base}/{other}: finish {finish['median']:.2f}x")
    return "; ".join(out)


def _engine_host(doc: dict) -> str:
    """Per (model, n): kernels (non-view ops) per step engine / plain, host time ratio (median)."""
    out = []
    for r in doc.get("rows", []):
        k = r["kernel_ops_per_step"]
        s = f"{r['model']} n{r['num_vsw']}: kernels {k['engine']}/{k['plain']}"
        if "engine_over_plain_median" in r:
            s += f", host x{r['engine_over_plain_median']:.2f}"
        out.append(s)
    return "; ".join(out)


def _engine_ddp(doc: dict) -> str:
    """Per (model, n): the engine / DDP medians (eager; graphed vs DDP graph; graphed with the
    group vs the single-device graphed step)."""
    out = []
    for r in doc.get("ddp", {}).get("rows", []):
        figs = [f"{k[:-len('_median')].replace('_over_', '/')} {v:.2f}" for k, v in r.items()
                if k.endswith("_median") and not k.endswith("_wall_median")]
        out.append(f"{r['model']} n{r['num_vsw']}: " + ", ".join(figs))
    return "; ".join(out)


def _profiling(doc: dict) -> str:
    """Mean relative error of the iteration-time model per execution profiled and run."""
    by = doc.get("mean_rel_error_by_cuda_graphs") or {"?": doc["mean_rel_error"]}
    return "; ".join(f"cuda_graphs={mode}: mean error {err * 100:.1f} %" for mode, err in by.items())


HEADLINES: dict[str, Callable[[dict], str]] = {
    "engine_resnet18": _engine, "engine_resnet18_n16": _engine, "engine_transformer": _engine,
    "engine_overhead": _engine, "engine_ddp": _engine_ddp,
    "packing": _packing, "tune": _tune, "tune_evidence_mlp": _tune, "tune_evidence_cnn": _tune, "profiling": _profiling, "engine_host": _engine_host,
}


def headline(step: Step, out: Path) -> str:
    """Figures for the summary table; never raises (a missing or odd file gives '')."""
    try:
        if step.name == "cuda_tests":
            return _pytest_counts((out / f"{step.name}.log").read_text(errors="replace")[-4000:])
        path = out / f"{step.name}.json"
        if step.json and path.exists():
            fn = HEADLINES.get(step.name)
            return fn(json.loads(path.read_text())) if fn else f"JSON: {path.name}"
    except Exception as e:  # noqa: BLE001 - the table must still be written
        return f"(no headline: {type(e).__name__})"
    return ""


def summary_table(outcomes: list[Outcome], machine: str, total_s: float) -> str:
    """The markdown summary: one row per step."""
    lines = [f"# GPU campaign ({machine})", "",
             f"Total {total_s:.0f} s. Logs `<step>.log`, JSON `<step>.json`, this table `summary.md`.", "",
             "| step | status | seconds | limit | figures |", "|---|---|---|---|---|"]
    for o in outcomes:
        status = o.status + (f" (rc {o.returncode})" if o.status == "failed" else "")
        if o.status == "skipped":
            status += f": {o.note}"
        fig = o.headline.replace("|", "/")
        lines.append(f"| {o.name} | {status} | {o.seconds:.0f} | {o.limit_s or ''} | {fig} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--budget", type=int, default=BUDGET_S, help=f"seconds for all steps (default {BUDGET_S})")
    ap.add_argument("--only", default=None, help="comma-separated step names (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run and write nothing")
    args = ap.parse_args(argv)
    names = {s.name for s in STEPS}
    only = set(args.only.split(",")) if args.only else None
    if only is not None and only - names:
        ap.error(f"--only must name steps among {', '.join(s.name for s in STEPS)}; got {sorted(only - names)}")
    if args.budget < MIN_STEP_S + RESERVE_S:
        ap.error(f"--budget must be >= {MIN_STEP_S + RESERVE_S} seconds, got {args.budget}")
    out = Path(args.outdir).resolve()
    steps = plan(ray_problem(), only)
    if args.dry_run:
        start = 0
        for s, skip in steps:
            if skip:
                print(f"skip  {s.name}: {skip}")
                continue
            # a step starts when the earlier ones are done; it runs if MIN_STEP_S are left then
            print(f"run   {s.name} (limit {s.timeout_s} s; starts by {start} s at the latest): "
                  f"{' '.join(command(s, out))}")
            start += s.timeout_s
        print(f"budget {args.budget} s: every step gets min(its limit, what is left - {RESERVE_S} s); "
              f"steps that would get < {MIN_STEP_S} s are skipped")
        return 0

    import torch
    if not torch.cuda.is_available():
        print("gpu_campaign: no CUDA device (torch.cuda.is_available() is False); use --dry-run to "
              "see the plan", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, load average {os.getloadavg()}"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["JABASRAY_BENCH_OUT"] = str(out)
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    for s, skip in steps:
        left = args.budget - (time.monotonic() - t0)
        limit = None if skip else step_timeout(s.timeout_s, left)
        if skip or limit is None:
            outcomes.append(Outcome(s.name, command(s, out), "skipped",
                                    note=skip or f"budget spent ({left:.0f} s left)"))
            continue
        print(f"[campaign] {s.name} (limit {limit} s) ...", flush=True)
        o = run_step(s, out, limit, env)
        o.headline = headline(s, out)
        print(f"[campaign] {s.name}: {o.status} in {o.seconds:.0f} s {o.headline}", flush=True)
        outcomes.append(o)
        (out / "campaign.json").write_text(json.dumps(
            {"machine": machine, "budget_s": args.budget, "steps": [asdict(x) for x in outcomes]}, indent=2))
    total = time.monotonic() - t0
    table = summary_table(outcomes, machine, total)
    (out / "summary.md").write_text(table)
    (out / "campaign.json").write_text(json.dumps(
        {"machine": machine, "budget_s": args.budget, "total_s": total,
         "load_average_end": os.getloadavg(), "steps": [asdict(x) for x in outcomes]}, indent=2))
    print(table)
    return 0 if all(o.status in ("ok", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
