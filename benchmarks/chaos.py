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
    args = ap.parse_args()

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


if __name__ == "__main__":
    main()
