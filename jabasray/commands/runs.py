"""``jabasray status|attach|stop NAME``: find a run's driver actor by name.

A run started by ``jabasray train`` or ``JabasTrainer.fit()`` (also under ``ray job submit``)
has a driver actor named after it on the Ray cluster (:mod:`jabasray.actors.driver_actor`).

* ``status [NAME]``: where the run is (state, epoch, samples of the running epoch, B_G, the last
  epoch, recent events); without NAME, the runs that exist.
* ``attach NAME``: show the run's progress (bar, epoch lines, events) until it ends, then its
  summary; Ctrl-C detaches (the run goes on).
* ``stop NAME``: stop the run before its next interval (``--at-epoch-end``: after the running
  epoch's checkpoint); the final checkpoint is the last completed epoch, then its actors are
  released.

They connect to the running Ray cluster (``--ray-address``, ``RAY_ADDRESS`` or the cluster
started with ``ray start`` here); an unknown or finished run is a one-line error naming the runs
that exist.
"""
from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    for name, helptext, func in (
            ("status", "where a running job is (or, without NAME, which runs exist)", status),
            ("attach", "show a running job's progress until it ends (Ctrl-C detaches)", attach),
            ("stop", "stop a running job cleanly (final checkpoint, actors released)", stop)):
        p = subparsers.add_parser(name, help=helptext, description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("name", nargs="?" if name == "status" else None, metavar="NAME",
                       help="the run's name (RunConfig.name / jabasray train --name)")
        p.add_argument("--ray-address", default=None, help="Ray cluster of the run (default: "
                       "RAY_ADDRESS or the cluster started with `ray start` on this machine)")
        if name == "stop":
            p.add_argument("--at-epoch-end", action="store_true",
                           help="let the running epoch finish (and be checkpointed) first")
            p.add_argument("--no-wait", action="store_true", help="return once the stop is requested")
        p.set_defaults(func=func)


def status_lines(st: dict) -> list[str]:
    """Human-readable lines of ``DriverActor.status()``."""
    gb = f", B_G {st['global_batch']}" if st.get("global_batch") else ""
    lines = [f"run {st['name']}: {st['state']}, epoch {min(st['epoch'] + 1, st['epochs'] or 0)}/"
             f"{st['epochs']} ({st['epochs_done']} done; {st['samples']}/{st['dataset_size']} samples "
             f"of the running epoch{gb}), {st['gpu_actors']} GPU actors; driver pid {st['pid']} on "
             f"{st['node']} (incarnation {st['incarnation']}); folder {st['run_dir']}"]
    last = st.get("last_epoch")
    if last:
        acc = f"{last['val_accuracy']:.4f}" if last.get("val_accuracy") is not None else "-"
        lines.append(f"last epoch {last['epoch'] + 1}: val acc {acc}, B_G {min(last['trajectory'])}-"
                     f"{max(last['trajectory'])}, {last['throughput']:.0f} samples/s, allocation "
                     f"{last['allocation']}")
    lines += [f"event: {m}" for m in st.get("events", [])]
    if st.get("error"):
        lines.append(f"error: {st['error']}")
    return lines


def status(args: argparse.Namespace) -> int:
    from ..actors import run_client

    run_client.connect(args.ray_address)
    if not args.name:
        runs = run_client.running_runs()
        print("runs: " + (", ".join(runs) if runs else "none"))
        return 0
    print("\n".join(status_lines(run_client.status(args.name))), flush=True)
    return 0


def attach(args: argparse.Namespace) -> int:
    import logging

    from ..actors import run_client
    from ..actors.callbacks import ConsoleReporter

    run_client.connect(args.ray_address)
    st = run_client.status(args.name)
    print("\n".join(status_lines(st)), flush=True)
    logging.getLogger("jabasray.actors").setLevel(logging.WARNING)   # events come through the reporter
    progress = ConsoleReporter(bar=True)
    progress.start((st["epochs"] or 0) * (st["dataset_size"] or 0))
    try:
        result = run_client.follow(args.name, [progress])
    finally:
        progress.close()
    acc = result.val_accuracy
    print(f"{args.name}: {len(result.history.epochs)} epoch(s) done, "
          f"{'val acc %.4f, ' % acc if acc is not None else ''}checkpoint {result.checkpoint}, "
          f"metrics {result.metrics_path}", flush=True)
    return 0


def stop(args: argparse.Namespace) -> int:
    from ..actors import run_client

    run_client.connect(args.ray_address)
    st = run_client.stop(args.name, at_epoch_end=args.at_epoch_end, wait=not args.no_wait)
    print("\n".join(status_lines(st)), flush=True)
    return 0
