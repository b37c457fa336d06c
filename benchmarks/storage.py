"""What run storage costs: checkpoints of a ~100 MB model on a local folder vs an S3-compatible
server, and what an epoch-boundary checkpoint costs as a fraction of the epoch.

**Part 1 - save and restore** (no Ray). The worker state of a ~100 MB model (an MLP with four
2900-wide hidden layers, float32, 97.1 MiB of weights; no optimizer state, so the checkpoint is
the model) is checkpointed and restored in paired rounds, the order of the arms rotated every
round:

* ``plain`` - what a plain PyTorch loop does: ``torch.save`` to a local file; restore =
  ``torch.load(weights_only=True)``;
* ``local`` - jabasray on a local folder: :func:`save_checkpoint` (streamed, hashed, fsynced,
  manifest last, keep 2); restore = :func:`latest_checkpoint` (reads every file once to verify
  its SHA-256) + driver and worker state loaded;
* ``s3``    - the same on ``s3://`` served by moto's server mode on 127.0.0.1 (a subprocess
  started here): a multipart upload, and a chunked download to a temporary file for restore.

Per round the ratios local/plain, s3/plain and s3/local of save and of restore; the figures are
their medians.

**Part 2 - the epoch boundary** (``--epochs-run``, Ray). The same model trained by
``JabasTrainer`` (driver in this process, one emulated GPU pair, given perf model, SGD with
momentum - so the checkpoint holds model and momentum, 194 MiB) for ``--epochs`` epochs of
``--samples`` digits, its run on a local folder and on ``s3://``, paired per round. Per epoch:
the time of its checkpoint commit (``save_checkpoint`` at the epoch end) and the epoch's wall time
(training, validation and collecting the worker state from rank 0); the figure is
commit / (epoch + commit), median over the epochs after the first and over the rounds, per
storage (the first epoch's time also holds the actors' placement and the commit of the start
state, ``epoch_0000``; it is recorded but not in the figure).

    flock /tmp/jabasray-bench.lock python benchmarks/storage.py --rounds 5 --epochs-run --epochs 3

Writes JSON to ``--out`` (default /tmp/jabasray_bench/storage.json). Moto is an in-memory
stand-in for S3 on the same machine: its figures say what the protocol path costs here, not
what a real bucket over a network costs.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import default_out, write_json

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

WIDTH, DEPTH = 2900, 4      # MLP(64, (2900,) * 4, 10): 25.4 M parameters, 97.1 MiB float32


def big_model():
    from jabasray.models import MLP
    return MLP(64, (WIDTH,) * DEPTH, 10)


def start_s3() -> tuple[object, dict]:
    from s3_helpers import S3Server
    server = S3Server()
    os.environ.update(server.env())
    server.make_bucket("bench")
    return server, server.env()


# ---------------------------------------------------------------------- part 1
def save_restore(arm: str, where: str, state: object, worker: dict) -> dict:
    import torch

    from jabasray.actors.checkpoint import latest_checkpoint, save_checkpoint

    if arm == "plain":
        path = Path(where) / "model.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            torch.save(worker, fh)
        t1 = time.perf_counter()
        back = torch.load(path, map_location="cpu", weights_only=True)
        t2 = time.perf_counter()
    else:
        t0 = time.perf_counter()
        save_checkpoint(where, state, worker, keep=2)
        t1 = time.perf_counter()
        cp = latest_checkpoint(where)
        cp.load_driver_state()
        back = cp.load_worker_state()
        t2 = time.perf_counter()
    key = next(iter(worker["model"]))
    assert torch.equal(back["model"][key], worker["model"][key])
    return {"save_s": t1 - t0, "restore_s": t2 - t1}


def part1(rounds: int) -> dict:
    from jabasray.actors.checkpoint import DriverState
    from jabasray.storage import resolve
    from jabasray.types import ClusterSpec

    model = big_model()
    worker = {"model": model.state_dict()}
    mb = sum(t.numel() * t.element_size() for t in worker["model"].values()) / 2**20
    cl = ClusterSpec.emulated({"fast": (1, 2, 1.0)})
    local_root = tempfile.mkdtemp(prefix="jabasray_bench_storage_")
    arms = ["plain", "local", "s3"]
    out = []
    for i in range(rounds):
        order = arms[i % 3:] + arms[:i % 3]
        rnd = {"load_avg": os.getloadavg()[0], "order": order}
        for arm in order:
            where = {"plain": local_root, "local": os.path.join(local_root, "run"),
                     "s3": resolve("s3://bench/runs/run")}[arm]
            st = DriverState(epochs_done=i + 1, iteration=0, cluster=cl, allocation={cl.nodes[0].name: 1})
            rnd[arm] = save_restore(arm, where, st, worker)
        for k in ("save_s", "restore_s"):
            rnd[f"local/plain {k}"] = rnd["local"][k] / rnd["plain"][k]
            rnd[f"s3/plain {k}"] = rnd["s3"][k] / rnd["plain"][k]
            rnd[f"s3/local {k}"] = rnd["s3"][k] / rnd["local"][k]
        out.append(rnd)
        print(f"round {i} ({', '.join(order)}; load {rnd['load_avg']:.1f}): " + "; ".join(
            f"{a} save {rnd[a]['save_s']:.2f}s restore {rnd[a]['restore_s']:.2f}s" for a in arms), flush=True)
    ratios = [k for k in out[0] if "/" in k]
    summary = {k: statistics.median(r[k] for r in out) for k in ratios}
    summary.update({f"{a} {k} median": statistics.median(r[a][k] for r in out)
                    for a in arms for k in ("save_s", "restore_s")})
    return {"model_mb": mb, "rounds": out, "summary": summary}


# ---------------------------------------------------------------------- part 2
def timed_run(storage: str, name: str, epochs: int, samples: int) -> dict:
    import jabasray.actors.driver as driver_mod
    from actors_helpers import loss_fn, optimizer_fn, perf_model, tiny_data
    from jabasray.actors.driver import DriverOptions
    from jabasray.actors.trainer import JabasTrainer
    from jabasray.config import JobConfig, RunConfig
    from jabasray.types import ClusterSpec, NodeSpec

    commits: list[tuple[int, float]] = []
    real = driver_mod.save_checkpoint

    def timed(run_dir, state, worker_state, keep=2):
        t0 = time.perf_counter()
        cp = real(run_dir, state, worker_state, keep=keep)
        commits.append((state.epochs_done, time.perf_counter() - t0))
        return cp

    driver_mod.save_checkpoint = timed
    try:
        ds, val = tiny_data(samples)
        job = JobConfig(epochs=epochs, initial_global_batch=32, min_global_batch=32, max_global_batch=32,
                        min_local_batch=4, adapt_interval=4, autoscale=False, lr=0.05, seed=5)
        t0 = time.perf_counter()
        r = JabasTrainer(big_model, ds, optimizer_fn, loss_fn, job,
                         cluster=ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)]),
                         run_config=RunConfig(storage, name), val_dataset=val, perf_model=perf_model(),
                         options=DriverOptions(driver="local")).fit()
        total = time.perf_counter() - t0
    finally:
        driver_mod.save_checkpoint = real
    per_epoch = {e: s for e, s in commits if e >= 1}          # epoch_0000: the start, not an epoch end
    epochs_out = [{"epoch": rec.epoch, "epoch_s": rec.time_s, "commit_s": per_epoch[rec.epoch + 1],
                   "fraction": per_epoch[rec.epoch + 1] / (rec.time_s + per_epoch[rec.epoch + 1])}
                  for rec in r.history.epochs]
    size = sum(p.size() for p in r.run_checkpoint.path.iterdir())
    return {"epochs": epochs_out, "start_commit_s": dict(commits).get(0), "finish_s": total,
            "checkpoint_mb": size / 2**20}


def part2(rounds: int, epochs: int, samples: int) -> dict:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, resources={"gpu_fast": 8},
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    local_root = tempfile.mkdtemp(prefix="jabasray_bench_storage_runs_")
    stores = {"local": local_root, "s3": "s3://bench/runs"}
    out = []
    try:
        for i in range(rounds):
            order = ["local", "s3"] if i % 2 == 0 else ["s3", "local"]
            rnd = {"load_avg": os.getloadavg()[0], "order": order}
            for arm in order:
                rnd[arm] = timed_run(stores[arm], f"epochs{i}", epochs, samples)
                fr = [e["fraction"] for e in rnd[arm]["epochs"] if e["epoch"] >= 1]
                print(f"epochs round {i} {arm}: commits " + ", ".join(
                    f"{e['commit_s']:.2f}s of {e['epoch_s']:.1f}s" for e in rnd[arm]["epochs"]) +
                    f" (fraction median {statistics.median(fr):.3f}; load {rnd['load_avg']:.1f})", flush=True)
            out.append(rnd)
    finally:
        ray.shutdown()
    summary = {}
    for arm in stores:
        eps = [e for r in out for e in r[arm]["epochs"] if e["epoch"] >= 1]
        summary[arm] = {"fraction_median": statistics.median(e["fraction"] for e in eps),
                        "commit_s_median": statistics.median(e["commit_s"] for e in eps),
                        "epoch_s_median": statistics.median(e["epoch_s"] for e in eps),
                        "checkpoint_mb": out[0][arm]["checkpoint_mb"]}
    return {"epochs": epochs, "samples": samples, "rounds": out, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs-run", action="store_true", help="also measure part 2 (Ray, minutes)")
    ap.add_argument("--epoch-rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--out", default=default_out("storage.json"))
    args = ap.parse_args(argv)

    server, _ = start_s3()
    doc = {"machine": platform.platform(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}
    try:
        doc["save_restore"] = part1(args.rounds)
        s = doc["save_restore"]["summary"]
        print("medians: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()), flush=True)
        if args.epochs_run:
            doc["epoch_boundary"] = part2(args.epoch_rounds, args.epochs, args.samples)
            for arm, v in doc["epoch_boundary"]["summary"].items():
                print(f"{arm}: commit {v['commit_s_median']:.2f}s, epoch {v['epoch_s_median']:.1f}s, "
                      f"fraction {v['fraction_median']:.3f} ({v['checkpoint_mb']:.0f} MB checkpoint)")
    finally:
        server.stop()
    doc["load_avg_end"] = os.getloadavg()
    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
