"""The same job through the user's own loop (``jabasray.train``) and through the hooks API.

One job - an MLP on scikit-learn's digits (or generated rows of its shape), B_G adapting on an
emulated GPU pair, the driver in this process - trained by ``JabasTorchTrainer`` with a Ray
Train-shaped ``train_loop_per_worker`` ("loop") and by ``JabasTrainer`` with ``model_fn``,
``dataset_fn`` and ``step_fn`` ("hooks"), which serve the same samples and compute the same
updates (tests/test_train_loop.py). Both plan with the same hand-made profile (no profiling
run), so they run the same plans and the comparison is the loop's own cost: the hand-overs
between the loop and the engine in each GPU actor, the loop's Python per batch. Paired rounds,
the order rotated every round (A B, B A, ...); per run: the wall time of ``fit()`` (Ray already
up; actor start included), the median interval time (driver side) and the median seconds per iteration, and the
load average. Per-round ratios loop / hooks and their medians (1.0: no cost).

    python benchmarks/own_loop.py [--rounds 6] [--epochs 3] [--samples 1500] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import default_out, rotated, write_json  # noqa: E402

SAMPLES = [1500]          # rows of the job's dataset (set by --samples; read on the actors)


def dataset():
    """The first ``SAMPLES[0]`` digits rows (cycled when more are asked for)."""
    import torch

    from jabasray.data import load_digits_split
    X, y = load_digits_split(image=False)[0].tensors
    idx = torch.arange(SAMPLES[0]) % len(X)
    return torch.utils.data.TensorDataset(X[idx], y[idx])


def net():
    from jabasray.models import MLP
    return MLP(64, (128, 128), 10)


def sgd(params):
    import torch
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def step_fn(model, batch):
    import torch.nn.functional as F
    x, y = batch
    return F.cross_entropy(model(x), y)


def loop(config):
    import torch
    import torch.nn.functional as F

    from jabasray.train import epochs, prepare_data_loader, prepare_model, prepare_optimizer
    loader = prepare_data_loader(torch.utils.data.DataLoader(dataset(), batch_size=64, shuffle=True))
    model = prepare_model(net())
    optimizer = prepare_optimizer(sgd(model.parameters()))
    for _ in epochs(config["epochs"], model=model, optimizer=optimizer):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def perf_model():
    """A plausible profile of one GPU type (compute linear in B_L, 4 VSWs fit): both contenders
    plan with it."""
    from jabasray.planners.perf_model import PerfModel
    from jabasray.profiler.profile import AllReduceFit, BatchProfile, Profile
    batches = [BatchProfile(b, 4, 1e-3 * b, 2.5e-3 * b) for b in range(8, 65, 8)]
    fit = AllReduceFit(1.0, 1e-4)
    return PerfModel({"fast": Profile("bench", "fast", 8, batches, 1e-3, 2e-4, [20000], 20000, fit, fit)})


def run_once(kind: str, epochs: int, root: str) -> dict:
    from jabasray.actors.driver import DriverOptions
    from jabasray.actors.trainer import JabasTrainer
    from jabasray.config import JobConfig, RunConfig
    from jabasray.train import JabasTorchTrainer
    from jabasray.types import ClusterSpec

    job = JobConfig(epochs=epochs, initial_global_batch=64, min_global_batch=32, max_global_batch=256,
                    min_local_batch=8, adapt_interval=5, autoscale=False, seed=0)
    common = dict(job_config=job, cluster=ClusterSpec.emulated({"fast": (1, 2, 1.0)}),
                  run_config=RunConfig(root, f"{kind}_{time.monotonic_ns()}"), perf_model=perf_model(),
                  options=DriverOptions(driver="local", evaluate=False), verbose=0)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    if kind == "loop":
        result = JabasTorchTrainer(loop, train_loop_config={"epochs": epochs}, **common).fit()
    else:
        result = JabasTrainer(net, optimizer_fn=sgd, dataset_fn=dataset, step_fn=step_fn, **common).fit()
    wall = time.perf_counter() - t0
    iv = result.history.intervals
    return {"wall_s": wall, "interval_s": statistics.median(r.time_s for r in iv),
            "iteration_s": statistics.median(r.time_s / r.num_iterations for r in iv),
            "intervals": len(iv), "final_loss": iv[-1].loss,
            "load_start": load, "load_end": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1500, help="dataset rows (digits, cycled)")
    ap.add_argument("--out", default=default_out("own_loop.json"))
    args = ap.parse_args(argv)
    for flag in ("rounds", "epochs", "samples"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    SAMPLES[0] = args.samples
    import ray
    from ray import cloudpickle

    from jabasray.actors.trainer import emulated_resources
    from jabasray.types import ClusterSpec

    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the actors cannot import this file
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             resources=emulated_resources(ClusterSpec.emulated({"fast": (1, 2, 1.0)})),
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    names = ["loop", "hooks"]
    rounds = []
    doc = {"machine": {"cpus": os.cpu_count()}, "argv": sys.argv[1:] if argv is None else argv,
           "rounds": rounds}
    try:
        with tempfile.TemporaryDirectory() as root:
            for r in range(args.rounds):
                runs = {}
                for name in rotated(names, r):
                    runs[name] = res = run_once(name, args.epochs, root)
                    print(f"round {r} {name:5s} wall {res['wall_s']:6.2f} s, interval {res['interval_s']:.4f} s, "
                          f"iteration {res['iteration_s']:.4f} s, load {res['load_start']:.1f}-"
                          f"{res['load_end']:.1f}", flush=True)
                rounds.append({"round": r, "order": rotated(names, r), "runs": runs})
                write_json(args.out, doc, announce=False)
    finally:
        ray.shutdown()

    summary = {}
    for key in ("wall_s", "interval_s", "iteration_s"):
        ratios = [rd["runs"]["loop"][key] / rd["runs"]["hooks"][key] for rd in rounds]
        summary[key] = {"ratios": ratios, "median": statistics.median(ratios)}
        print(f"loop / hooks {key}: {', '.join(f'{x:.3f}' for x in ratios)} "
              f"(median {summary[key]['median']:.3f})")
    doc["summary"] = summary
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
