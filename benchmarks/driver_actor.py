"""What the driver actor costs and how fast it recovers.

Paired rounds on one local Ray instance, the same tiny job each time (MLP on 200 digits, one
emulated GPU pair, given perf model, ``--epochs`` epochs):

* ``local``  - ``DriverOptions(driver="local")``: the driver loop in this process;
* ``actor``  - the default: a detached driver actor, progress streamed back by polling.

Per run: time to the first interval record reaching the caller's callback (time to a result)
and time until ``fit()`` returns (time to finish). Per round the ratio actor/local of both; the
medians of the ratios are the figures. With ``--kill`` every round also runs the actor driver
once more and SIGKILLs its process after the first interval of the last epoch: reported are
the recovery time (kill -> first interval of the restarted incarnation reaching the caller) and
the time to finish of that run.

    python benchmarks/driver_actor.py --rounds 3 --kill        # a few minutes on 2 CPU cores

Writes JSON to ``--out`` (default /tmp/jabasray_bench/driver_actor.json).
"""
from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import default_out, write_json

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


class Clock:
    """DriverCallback measuring when the first interval (and the first one after a restart)
    reached the caller."""

    def __init__(self, t0: float) -> None:
        self.t0, self.first, self.after_kill, self.killed_at = t0, None, None, None
        self.restarted = False

    def on_interval(self, driver, record):
        now = time.perf_counter()
        if self.first is None:
            self.first = now - self.t0
        if self.restarted and self.after_kill is None:
            self.after_kill = now - self.killed_at

    def on_epoch(self, driver, record):
        pass

    def on_event(self, driver, message):
        # the restarted incarnation's first item; intervals of the killed one may still arrive
        # before it (polled late), they do not count
        self.restarted = self.restarted or "driver actor restarted" in message


def one_run(storage: str, name: str, driver: str, epochs: int, kill: bool = False) -> dict:
    import threading

    from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
    from jabasray.actors import run_client
    from jabasray.actors.driver import DriverOptions
    from jabasray.actors.trainer import JabasTrainer
    from jabasray.config import JobConfig, RunConfig
    from jabasray.types import ClusterSpec, NodeSpec

    ds, val = tiny_data(200)
    job = JobConfig(epochs=epochs, initial_global_batch=24, min_global_batch=16, max_global_batch=96,
                    min_local_batch=4, adapt_interval=2, autoscale=False, lr=0.05, seed=5)
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=0.2)])
    t0 = time.perf_counter()
    clock = Clock(t0)
    tr = JabasTrainer(model_fn, ds, optimizer_fn, loss_fn, job, cluster=cluster,
                      run_config=RunConfig(storage, name), val_dataset=val, perf_model=perf_model(),
                      options=DriverOptions(driver=driver), callbacks=[clock])
    if not kill:
        tr.fit()
        return {"first_interval_s": clock.first, "finish_s": time.perf_counter() - t0}
    tr.fit(wait=False)

    def killer():
        while True:
            st = run_client.status(name)
            if st["epoch"] == epochs - 1 and st["samples"] > 0:
                clock.killed_at = time.perf_counter()
                os.kill(st["pid"], signal.SIGKILL)
                return
            time.sleep(0.05)
    k = threading.Thread(target=killer)
    k.start()
    run_client.follow(name, [clock])
    k.join()
    return {"recovery_s": clock.after_kill, "finish_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--kill", action="store_true", help="also measure recovery after killing the driver")
    ap.add_argument("--out", default=default_out('driver_actor.json'))
    args = ap.parse_args(argv)

    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, resources={"gpu_fast": 8},
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    rounds = []
    storage = tempfile.mkdtemp(prefix="jabasray_bench_da_")
    try:
        for i in range(args.rounds):
            rnd = {"load_avg": os.getloadavg()[0]}
            for variant in ("local", "actor"):   # A B in every round
                rnd[variant] = one_run(storage, f"{variant}{i}", variant, args.epochs)
            for k in ("first_interval_s", "finish_s"):
                rnd[f"ratio_{k}"] = rnd["actor"][k] / rnd["local"][k]
            if args.kill:
                rnd["killed"] = one_run(storage, f"killed{i}", "actor", args.epochs, kill=True)
            rounds.append(rnd)
            print(f"round {i}: " + ", ".join(
                f"{v} first {rnd[v]['first_interval_s']:.2f}s finish {rnd[v]['finish_s']:.2f}s"
                for v in ("local", "actor")) + f"; ratios first {rnd['ratio_first_interval_s']:.2f} "
                f"finish {rnd['ratio_finish_s']:.2f}" + (
                f"; killed: recovery {rnd['killed']['recovery_s']:.2f}s finish "
                f"{rnd['killed']['finish_s']:.2f}s" if args.kill else "") +
                f" (load {rnd['load_avg']:.1f})", flush=True)
    finally:
        ray.shutdown()
    summary = {k: statistics.median(r[k] for r in rounds) for k in ("ratio_first_interval_s", "ratio_finish_s")}
    if args.kill:
        summary["recovery_s_median"] = statistics.median(r["killed"]["recovery_s"] for r in rounds)
        summary["killed_finish_s_median"] = statistics.median(r["killed"]["finish_s"] for r in rounds)
    print("median ratios actor/local: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    write_json(args.out, {"machine": platform.platform(), "cpus": os.cpu_count(), "epochs": args.epochs,
                          "rounds": rounds, "summary": summary,
                          "load_avg_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
