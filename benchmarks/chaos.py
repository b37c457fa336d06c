"""Chaos benchmark: N short `jabasray train` runs, each hit by random faults at random
moments, and what survived.

Setup: one local Ray instance (this process) with the emulated GPU resources of a two-type,
two-pair cluster; every run is a `jabasray train --script tiny.py` child process connected to it
(`--ray-address`), training a tiny MLP on synthetic data. A reference run without faults comes
first (it also fills the shared profile cache, so no run profiles again).

Faults, drawn per run from a seeded RNG (each run gets one to three, at random moments of its
expected duration):
* ``actor``: SIGKILL one GPU actor process (``ray::GPUActor`` in its process title);
* ``driver``: SIGKILL the `jabasray train` process, then start it again with ``--resume``;
* ``corrupt``: after a driver kill, damage the newest checkpoint (truncate or flip a byte of
  ``worker.pt``) before resuming, so the resume must fall back to the one before.

Measured per run: finished (exit 0 with every epoch in metrics.json); completed epochs lost: at
every resume, the epochs recorded in metrics.json before the kill (each one written after its
checkpoint) minus the epochs the resume started from, not counting an epoch whose checkpoint this
script corrupted itself; and, for runs without an actor kill (same GPUs, so training is
deterministic), whether the final weights equal the reference run's bit for bit.

    python benchmarks/chaos.py --runs 20 --out /tmp/chaos.json

``--suite cluster``: faults of a multi-node cluster, on a ``ray.cluster_utils.Cluster`` (a head
with 2 emulated "fast" GPUs, a node with 2 "slow" ones; the cluster is detected from Ray, so every
node is pinned by its Ray node id), one in-process run per fault, kinds in turn:
* ``driver_node``: the driver actor runs on a node of its own (``driver_node``), which is removed
  from the cluster at a random interval; Ray restarts the driver elsewhere;
* ``cluster_restart``: at a random interval the whole cluster is shut down and a new one started
  (every Ray node id new); the run is started again with the spec detected on the old cluster;
* ``hang``: one GPU actor blocks forever in the user's step at a random interval (the interval's
  deadline turns it into an actor failure);
* ``kill2``: two of the four GPU actors are killed at once at a random interval.
Each run trains 2 epochs of 192 samples; the fault hits in epoch 1 (after its first interval, or
for the driver-node and cluster faults a random 0-1 s after the driver reported epoch 1 under
way). Completed epochs lost per run: the epochs committed (newest checkpoint) when the fault hit,
minus the epochs the run resumed or restarted from (read from its events).

    python benchmarks/chaos.py --suite cluster --runs 20 --out /tmp/chaos.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import default_out, write_json

TINY_SCRIPT = textwrap.dedent('''
    """Tiny deterministic job for benchmarks/chaos.py."""
    import torch


    def _data(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 16, generator=g)
        w = torch.randn(16, 4, generator=g)
        return torch.utils.data.TensorDataset(x, (x @ w).argmax(1))


    def model_fn():
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


    def dataset():
        return _data(384, 0)


    def val_dataset():
        return _data(128, 1)
''')

CLUSTER = ("nodes:\n  - {name: f0, gpu_type: fast, num_gpus: 2, speed: 1.0}\n"
           "  - {name: s0, gpu_type: slow, num_gpus: 2, speed: 0.5}\n")
JOB = ["--epochs", "3", "--initial-global-batch", "32", "--min-global-batch", "16",
       "--max-global-batch", "96", "--min-local-batch", "8", "--adapt-interval", "4"]
RESUMED = re.compile(r"resumed from \S+ after (\d+) epoch")


def gpu_actor_pids() -> list[int]:
    """PIDs of live GPU actor processes (Ray sets their title to ``ray::GPUActor...``)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if cmd.startswith(b"ray::GPUActor"):
            pids.append(int(d.name))
    return pids


def epochs_recorded(run_dir: Path) -> int:
    try:
        return len(json.loads((run_dir / "metrics.json").read_text())["epochs"])
    except (OSError, ValueError, KeyError):
        return 0


def newest_checkpoint_dir(run_dir: Path) -> Path | None:
    cps = sorted((run_dir / "checkpoints").glob("epoch_*"))
    return cps[-1] if cps else None


def corrupt(cp: Path, rng: random.Random) -> str:
    w = cp / "worker.pt"
    data = bytearray(w.read_bytes())
    if rng.random() < 0.5:
        w.write_bytes(bytes(data[: len(data) // 2]))
        return "truncated"
    data[rng.randrange(len(data))] ^= 0xFF
    w.write_bytes(bytes(data))
    return "flipped"


class Runner:
    def __init__(self, work: Path, address: str) -> None:
        self.work, self.address = work, address
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.env.pop("RAY_ADDRESS", None)

    def command(self, name: str, resume: bool) -> list[str]:
        cmd = [sys.executable, "-m", "jabasray.cli", "train", "--script", str(self.work / "tiny.py"),
               "--cluster", str(self.work / "cluster.yaml"), "--storage-path", str(self.work / "runs"),
               "--name", name, "--ray-address", self.address, "--no-progress",
               # the driver in the killed process (the driver actor outlives its client by design;
               # its own restarts are tested in tests/test_driver_actor.py)
               "--driver", "local", *JOB]
        return cmd + (["--resume"] if resume else [])

    def attempt(self, name: str, resume: bool, actor_kill_at: float | None,
                driver_kill_at: float | None, log: list[str]) -> tuple[int | None, str]:
        """One `jabasray train` process; returns (exit code or None when we killed it, stderr)."""
        p = subprocess.Popen(self.command(name, resume), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=self.env, cwd=self.work)
        t0 = time.monotonic()
        events = sorted([(t, k) for t, k in ((actor_kill_at, "actor"), (driver_kill_at, "driver"))
                         if t is not None])
        killed = False
        for t, kind in events:
            while p.poll() is None and time.monotonic() - t0 < t:
                time.sleep(0.05)
            if p.poll() is not None:
                break
            if kind == "actor":
                pids = gpu_actor_pids()
                if pids:
                    os.kill(random.choice(pids), signal.SIGKILL)
                    log.append(f"actor killed at {time.monotonic() - t0:.1f}s")
                else:
                    log.append(f"actor kill at {t:.1f}s: no actor alive")
            else:
                p.kill()
                killed = True
                log.append(f"driver killed at {time.monotonic() - t0:.1f}s")
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            log.append("attempt timed out")
            return 124, err
        return (None if killed else p.returncode), err


def final_weights(run_dir: Path):
    from jabasray.actors.checkpoint import latest_checkpoint
    cp = latest_checkpoint(run_dir)
    return cp.load_worker_state()["model"] if cp is not None else None


def same_weights(a, b) -> bool:
    import torch
    return a is not None and b is not None and a.keys() == b.keys() and \
        all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=default_out('chaos.json'))
    ap.add_argument("--work", default=None, help="work folder (default: a new temp folder)")
    ap.add_argument("--suite", choices=("process", "cluster"), default="process",
                    help="process: kills of processes on one Ray instance; cluster: faults of a "
                         "multi-node cluster (module notes)")
    ap.add_argument("--speed-scale", type=float, default=1.0,
                    help="cluster suite: emulated GPU speeds times this (smaller: slower epochs, "
                         "so that faults timed from outside land within them on a fast host)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="cluster suite: start no run after this many seconds")
    args = ap.parse_args()
    if args.suite == "cluster":
        return cluster_suite(args)

    import ray

    work = Path(args.work or tempfile.mkdtemp(prefix="jabasray_chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "tiny.py").write_text(TINY_SCRIPT)
    (work / "cluster.yaml").write_text(CLUSTER)
    ctx = ray.init(num_cpus=2, include_dashboard=False, resources={"gpu_fast": 2, "gpu_slow": 2},
                   runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}, log_to_driver=False)
    runner = Runner(work, ctx.address_info["gcs_address"])
    rng = random.Random(args.seed)
    t_start = time.monotonic()
    try:
        refs, ref_time = [], 0.0
        for name in ("warmup", "reference"):    # the first also fills the profile cache
            t0 = time.monotonic()
            rc, err = runner.attempt(name, False, None, None, [])
            ref_time = time.monotonic() - t0
            if rc != 0:
                raise SystemExit(f"{name} run failed: {err.strip().splitlines()[-1:]}")
            refs.append(final_weights(work / "runs" / name))
        ref = refs[-1]
        deterministic = same_weights(refs[0], refs[1])
        print(f"reference run: {ref_time:.1f}s; two fault-free runs give equal weights: "
              f"{deterministic}", flush=True)
        runs = []
        for i in range(args.runs):
            runs.append(chaos_run(runner, f"run{i:02d}", rng, ref_time, ref))
            r = runs[-1]
            print(f"run {i:2d}: faults {','.join(r['faults']) or '-':<28} finished {r['finished']!s:<5} "
                  f"lost {r['epochs_lost']} weights {r['weights_equal_reference']} "
                  f"({r['time_s']:.0f}s)  {'; '.join(r['log'])}", flush=True)
    finally:
        ray.shutdown()
    compared = [r for r in runs if r["weights_equal_reference"] is not None]
    summary = {
        "runs": len(runs), "finished": sum(r["finished"] for r in runs),
        "completed_epochs_lost": sum(r["epochs_lost"] for r in runs),
        "faults": {k: sum(r["faults"].count(k) for r in runs) for k in ("actor", "driver", "corrupt")},
        "weights_compared": len(compared),
        "weights_equal": sum(bool(r["weights_equal_reference"]) for r in compared),
        "reference_time_s": ref_time, "fault_free_runs_equal": deterministic, "total_time_s": time.monotonic() - t_start,
        "load_average": os.getloadavg(),
    }
    print(f"runs finished: {summary['finished']}/{summary['runs']}; completed epochs lost: "
          f"{summary['completed_epochs_lost']}; final weights equal to the uninterrupted run: "
          f"{summary['weights_equal']}/{summary['weights_compared']} deterministic runs (no actor "
          f"kill); faults {summary['faults']}; {summary['total_time_s']:.0f}s, load average "
          f"{summary['load_average'][0]:.2f}")
    write_json(args.out, {"summary": summary, "runs": runs, "machine": "2-core CPU dev machine"})


def chaos_run(runner: Runner, name: str, rng: random.Random, ref_time: float, ref) -> dict:
    """One run with 1-3 random faults; returns its record."""
    kinds = rng.sample(["actor", "driver", "corrupt"], rng.randint(1, 3))
    if "corrupt" in kinds and "driver" not in kinds:
        kinds.append("driver")               # a corrupt checkpoint matters at a resume
    run_dir = runner.work / "runs" / name
    log: list[str] = []
    lost, redone, t0 = 0, 0, time.monotonic()
    pending = list(kinds)
    resume, attempts, rc, corrupted_epoch = False, 0, None, None
    while attempts < 6:
        attempts += 1
        actor_at = rng.uniform(0.0, ref_time) if "actor" in pending else None
        # a corruption still to do needs another driver kill (the last came before any checkpoint)
        driver_at = rng.uniform(0.0, ref_time) \
            if ("driver" in pending or "corrupt" in pending) else None
        pending = [k for k in pending if k not in ("actor", "driver")]
        before = epochs_recorded(run_dir)
        rc, err = runner.attempt(name, resume and run_dir.is_dir(), actor_at, driver_at, log)
        m = RESUMED.search(err) if resume else None
        if resume and (m or rc is not None):   # a resume killed before it resumed says nothing
            start = int(m.group(1)) if m else 0
            expected = before if corrupted_epoch is None or corrupted_epoch > before \
                else corrupted_epoch - 1
            lost += max(0, expected - start)
            redone += max(0, before - start)
            corrupted_epoch = None
        if rc is None:                       # we killed the driver
            if "corrupt" in pending:
                cp = newest_checkpoint_dir(run_dir)
                if cp is not None:
                    how = corrupt(cp, rng)
                    corrupted_epoch = int(cp.name.split("_")[1])
                    log.append(f"{how} {cp.name}")
                    pending.remove("corrupt")
            resume = True
            continue
        break
    finished = rc == 0 and epochs_recorded(run_dir) == int(JOB[1])
    if rc not in (0, None):
        tail = err.strip().splitlines()[-1:] if err.strip() else []
        log.append(f"exit {rc}: {tail[0][:200] if tail else ''}")
    done = [k for k, pat in (("actor", "actor killed"), ("driver", "driver killed"),
                             ("corrupt", ("truncated", "flipped"))) for line in log
            if line.startswith(pat)]
    deterministic = "actor" not in done     # same GPUs throughout: the same arithmetic
    equal = same_weights(final_weights(run_dir), ref) if (deterministic and finished) else None
    return {"name": name, "planned": kinds, "faults": done, "finished": finished, "epochs_lost": lost,
            "epochs_redone": redone, "attempts": attempts,
            "weights_equal_reference": equal, "time_s": time.monotonic() - t0, "log": log}


# ----------------------------------------------------------------------------- cluster suite

CLUSTER_KINDS = ("driver_node", "cluster_restart", "hang", "kill2")
# >= 2 intervals per epoch; emulated 10-20x slower than the host (sleeps), so that a fault
# timed from outside lands within the epoch
C_EPOCHS, C_SAMPLES, C_SPEEDS = 2, 192, {"fast": 0.1, "slow": 0.05}
RESUMED_ACTOR = re.compile(r"resumed automatically from epoch_(\d+)")
RESTARTING = re.compile(r"restarting epoch (\d+)")


def _synthetic(n: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ w).argmax(1))


def c_model_fn():
    import torch
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def c_optimizer_fn(params):
    import torch
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def c_loss_fn(out, y):
    import torch
    return torch.nn.functional.cross_entropy(out, y)


class HangOnce:
    """The user's step: blocks for an hour in the first step after ``armed`` exists, in the one
    actor that creates ``taken`` first."""

    def __init__(self, armed: str, taken: str) -> None:
        self.armed, self.taken = armed, taken

    def __call__(self, model, batch):
        if os.path.exists(self.armed):
            try:
                os.close(os.open(self.taken, os.O_CREAT | os.O_EXCL))
                time.sleep(3600)
            except FileExistsError:
                pass
        inputs, targets = batch
        return c_loss_fn(model(inputs), targets)


def c_perf_model():
    """A hand-made iteration-time model (no profiling: the plans are not what is measured)."""
    from jabasray.planners.perf_model import PerfModel
    from jabasray.profiler.profile import AllReduceFit, BatchProfile, Profile

    def prof(t: str, speed: float) -> Profile:
        batches = [BatchProfile(b, 4, 1e-3 * b / speed, 2.5e-3 * b / speed) for b in range(4, 33, 4)]
        fit = AllReduceFit(1.0, 1e-4)
        return Profile("chaos", t, 4, batches, 1e-3 / speed, 2e-4 / speed, [20000], 20000, fit, fit)
    return PerfModel({t: prof(t, s) for t, s in C_SPEEDS.items()})


def c_job():
    from jabasray.config import JobConfig
    return JobConfig(epochs=C_EPOCHS, initial_global_batch=32, min_global_batch=16,
                     max_global_batch=64, min_local_batch=4, adapt_interval=2, autoscale=False, seed=1)


class ChaosCluster:
    """The benchmark's ``ray.cluster_utils.Cluster``, started again on demand."""

    def __init__(self) -> None:
        self.c = None

    def stop(self) -> None:
        import ray
        if ray.is_initialized():
            ray.shutdown()
        if self.c is not None:
            self.c.shutdown()
            self.c = None

    def start(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.stop()
        for attempt in range(4):   # a raylet may miss Ray's 30 s startup on a loaded host: again
            c = Cluster(initialize_head=False)
            try:
                c.add_node(num_cpus=2, include_dashboard=False, resources={"gpu_fast": 2})
                c.add_node(num_cpus=1, resources={"gpu_slow": 2})
                break
            except Exception:  # noqa: BLE001 - Ray's startup timeout is a bare Exception
                c.shutdown()
                if attempt == 3:
                    raise
        ray.init(address=c.address, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        c.wait_for_nodes()
        self.c = c


def committed_epochs(run_dir: Path) -> int:
    from jabasray.actors.checkpoint import latest_checkpoint
    cp = latest_checkpoint(run_dir)
    return cp.epochs_done if cp is not None else 0


def resume_point(events: list[str], after: int = 0) -> int | None:
    """The epochs the run went on from after its fault: the first restart/resume event at or
    after index ``after`` (a driver restart, a resume, an epoch restarted after an actor failure)."""
    for m in events[after:]:
        for pat, off in ((RESUMED_ACTOR, 0), (RESUMED, 0), (RESTARTING, -1)):
            hit = pat.search(m)
            if hit:
                return int(hit.group(1)) + off
    return None


class Trigger:
    """A driver callback that runs ``action`` once, at the first interval at or past ``target``
    (epoch, interval), after noting the epochs committed then."""

    def __init__(self, target: tuple[int, int], run_dir: Path, action) -> None:
        self.target, self.run_dir, self.action = target, run_dir, action
        self.before: int | None = None
        self.events: list[str] = []
        self.fired_at_event = 0

    def on_interval(self, driver, record) -> None:
        if self.before is None and (record.epoch, record.interval) >= self.target:
            self.before = committed_epochs(self.run_dir)
            self.fired_at_event = len(self.events)
            self.action(driver)

    def on_epoch(self, driver, record) -> None:
        pass

    def on_event(self, driver, message: str) -> None:
        self.events.append(message)


def cluster_run(cc: ChaosCluster, kind: str, name: str, target: tuple[int, int], work: Path) -> dict:
    """One run of ``kind`` with its fault at ``target``; returns its record."""
    import ray
    from ray import cloudpickle

    from jabasray.actors import run_client
    from jabasray.actors.driver import DriverOptions, JabasDriver
    from jabasray.actors.hooks import JobHooks
    from jabasray.actors.placement import ray_cluster_spec
    from jabasray.actors.trainer import JabasTrainer
    from jabasray.config import RunConfig

    if __name__ != "__main__":                 # Ray workers cannot import this script
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    run_dir = work / "runs" / name
    ds, val = _synthetic(C_SAMPLES, 0), _synthetic(64, 1)
    spec = ray_cluster_spec(speeds=C_SPEEDS)
    t0 = time.monotonic()
    note, hist = "", None

    def trainer(options, callbacks=(), hooks=None):
        return JabasTrainer(c_model_fn, ds, c_optimizer_fn, c_loss_fn, c_job(), cluster=spec,
                            run_config=RunConfig(str(work / "runs"), name), val_dataset=val,
                            perf_model=c_perf_model(), options=options, callbacks=callbacks,
                            verbose=0)

    def wait_until_in(epoch: int) -> None:
        """Until the run trained in ``epoch`` (status polling), then a random 0-1 s more."""
        while True:
            st = run_client.status(name)
            if st["state"] in ("finished", "failed") or st["epoch"] > epoch or (
                    st["epoch"] == epoch and st["samples"] > 0):
                break
            time.sleep(0.1)
        time.sleep(random.Random(name).uniform(0.0, 1.0))

    trig = Trigger(target, run_dir, lambda drv: None)
    if kind == "driver_node":
        host = cc.c.add_node(num_cpus=1)
        cc.c.wait_for_nodes()
        trainer(DriverOptions(driver="actor", driver_node=host.node_id, failure_grace_s=5)).fit(wait=False)
        wait_until_in(target[0])
        cc.c.remove_node(host)
        trig.before = committed_epochs(run_dir)   # the driver is gone: nothing more is committed
        hist = run_client.follow(name, [trig]).history
        events = trig.events                   # what the follower saw: the new incarnation's
    elif kind == "cluster_restart":
        trainer(DriverOptions(driver="actor")).fit(wait=False)
        wait_until_in(target[0])
        cc.stop()                              # the whole cluster gone
        trig.before = committed_epochs(run_dir)
        cc.start()                             # a new one: every Ray node id new
        hist = trainer(DriverOptions(driver="actor")).fit().history   # the old cluster's spec
        events = list(hist.events)
    else:
        armed, taken = work / f"{name}.armed", work / f"{name}.taken"

        def act(drv):
            if kind == "hang":
                armed.touch()
            else:
                actors = drv.gpu_actors()
                for a in random.Random(name).sample(actors, 2):
                    ray.kill(a, no_restart=True)
        trig = Trigger(target, run_dir, act)
        hooks = JobHooks(step_fn=HangOnce(str(armed), str(taken))) if kind == "hang" else None
        drv = JabasDriver(c_model_fn, ds, c_optimizer_fn, c_loss_fn, c_job(), spec, run_dir,
                          val_dataset=val, perf_model=c_perf_model(), hooks=hooks, callbacks=[trig],
                          options=DriverOptions(call_timeout_s=8, failure_grace_s=5))
        hist = drv.run()
        events = trig.events
    start = resume_point(events, trig.fired_at_event) \
        if trig.before is not None else None
    fault_hit = trig.before is not None and trig.before < C_EPOCHS   # not after the run's end
    lost = max(0, trig.before - start) if fault_hit and start is not None else 0
    if fault_hit and start is None:
        note = "no resume event after the fault (it hit after the last interval)"
    finished = hist is not None and [e.epoch for e in hist.epochs] == list(range(C_EPOCHS))
    return {"name": name, "kind": kind, "target": list(target), "fault_hit": fault_hit,
            "committed_at_fault": trig.before, "resumed_from": start, "epochs_lost": lost,
            "finished": finished, "allocations": [e.allocation for e in hist.epochs] if hist else [],
            "time_s": time.monotonic() - t0, "note": note,
            "events": [m[:240] for m in events if any(w in m for w in (
                "restart", "resumed", "failure", "re-planned", "reconciled"))]}


def cluster_suite(args) -> None:
    """``--suite cluster`` (module notes)."""
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")   # a loaded 2-core host
    work = Path(args.work or tempfile.mkdtemp(prefix="jabasray_chaos_cluster_"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for t in C_SPEEDS:
        C_SPEEDS[t] *= args.speed_scale
    cc = ChaosCluster()
    cc.start()
    t_start, runs = time.monotonic(), []
    load_start = os.getloadavg()
    try:
        for i in range(args.runs):
            if args.budget_s and time.monotonic() - t_start > args.budget_s:
                print(f"time budget of {args.budget_s:.0f}s spent: {i} of {args.runs} runs done", flush=True)
                break
            kind = CLUSTER_KINDS[i % len(CLUSTER_KINDS)]
            target = (rng.randint(1, C_EPOCHS - 1), 0)   # within that epoch (its first interval
                                                         # done, or a random 0-1 s into it)
            try:
                r = cluster_run(cc, kind, f"c{i:02d}_{kind}", target, work)
            except Exception as e:  # noqa: BLE001 - a run that fails is a result
                r = {"name": f"c{i:02d}_{kind}", "kind": kind, "target": list(target),
                     "finished": False, "epochs_lost": None, "error": f"{type(e).__name__}: {e}"[:400]}
                if cc.c is None:
                    cc.start()
            runs.append(r)
            print(f"run {i:2d} {kind:<16} fault at {tuple(target)} finished {r['finished']!s:<5} "
                  f"committed {r.get('committed_at_fault')} resumed from {r.get('resumed_from')} "
                  f"lost {r['epochs_lost']} ({r.get('time_s', 0):.0f}s) {r.get('error', r.get('note', ''))}",
                  flush=True)
    finally:
        cc.stop()
    summary = {"runs": len(runs), "runs_planned": args.runs,
               "finished": sum(bool(r["finished"]) for r in runs),
               "completed_epochs_lost": sum(r["epochs_lost"] or 0 for r in runs),
               "runs_without_a_loss_figure": sum(r["epochs_lost"] is None for r in runs),
               "faults_within_the_run": sum(bool(r.get("fault_hit")) for r in runs),
               "faults": {k: sum(r["kind"] == k for r in runs) for k in CLUSTER_KINDS},
               "total_time_s": time.monotonic() - t_start, "load_average_start": load_start,
               "load_average_end": os.getloadavg()}
    print(f"cluster suite: {summary['finished']}/{summary['runs']} runs finished; completed epochs "
          f"lost: {summary['completed_epochs_lost']}; {summary['total_time_s']:.0f}s; load average "
          f"{load_start[0]:.1f} -> {summary['load_average_end'][0]:.1f}")
    write_json(args.out, {"suite": "cluster", "summary": summary, "runs": runs, "seed": args.seed,
                          "speeds": C_SPEEDS, "epochs": C_EPOCHS, "samples": C_SAMPLES,
                          "machine": "2-core CPU VM, emulated GPUs (shared with other jobs)"})


if __name__ == "__main__":
    main()
