"""Several policies on one job and cluster: a run folder per policy and a comparison.

:func:`compare` simulates each policy (:mod:`.policies`) on the same job, cluster, time model
and convergence model, writes ``<out>/<policy>/metrics.json`` (the real run's schema) and
``trajectory.png`` (:func:`jabasray.actors.metrics.plot_history`), and ``<out>/comparison.json``
and ``comparison.png``: per policy the time to the target, the time to the end, GPU-hours, cost
by Eq. 8 (price weight x GPU-seconds), re-placements, the final metric and GPUs in use over time;
time and cost also normalised to JABAS, as the JABAS paper's Fig. 10 reports them.
"""
from __future__ import annotations

import io
import json
import logging
import time
from typing import Any, Sequence

from ..actors.metrics import plot_history, save_metrics
from ..config import JobConfig
from ..storage import StoragePath, as_storage_path
from ..types import ClusterSpec
from .loop import SimRun, simulate
from .policies import POLICIES, make_policy

log = logging.getLogger(__name__)


def check_policies(names: Sequence[str]) -> list[str]:
    """The policy names, each one of :data:`.policies.POLICIES` (one-line ValueError)."""
    names = [n.strip() for n in names if n.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ValueError(f"policies must be a comma-separated list of {list(POLICIES)}, got {names or '[]'}")
    return list(dict.fromkeys(names))


def compare(policies: Sequence[str], job: JobConfig, cluster: ClusterSpec, dataset_size: int,
            model: Any, convergence: Any, out_dir: str | StoragePath | None = None, *,
            placement_s: float = 30.0, eval_s: float = 0.0, target: float | None = None,
            stop_at_target: bool = True, progress: Any = None) -> dict:
    """Simulate every policy of ``policies`` (module notes); returns the comparison (JSON)
    and, given ``out_dir``, writes the run folders and the comparison there. ``progress``:
    an optional callable ``(policy, SimRun, seconds)`` called after each policy."""
    names = check_policies(policies)
    runs: dict[str, SimRun] = {}
    wall: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        runs[name] = simulate(make_policy(name), job, cluster, dataset_size, model, convergence,
                              placement_s=placement_s, eval_s=eval_s, target=target,
                              stop_at_target=stop_at_target)
        wall[name] = time.perf_counter() - t0
        log.info("simulated %s in %.1f s", name, wall[name])
        if progress is not None:
            progress(name, runs[name], wall[name])
    result = comparison(runs, target)
    result["simulation_wall_s"] = wall
    result["cluster"] = {"nodes": len(cluster.nodes), "gpus": sum(n.num_gpus for n in cluster.nodes),
                         "types": {t: sum(n.num_gpus for n in cluster.nodes if n.gpu_type == t)
                                   for t in cluster.gpu_types}}
    if out_dir is not None:
        out = as_storage_path(out_dir)
        for name, run in runs.items():
            save_metrics(run.history, out / name / "metrics.json")
            plot_history(run.history, out / name / "trajectory.png")
        (out / "comparison.json").write_text(json.dumps(result, indent=1))
        plot_comparison(result, out / "comparison.png")
    return result


def comparison(runs: dict[str, SimRun], target: float | None) -> dict:
    """The comparison of simulated runs (module notes): rows per policy, and their time and
    cost normalised to JABAS's - to the target when there is one (None for a policy, or for
    all, where it or JABAS did not reach it: a run that misses the target is not faster), else
    to the end of the epochs. A run that stops at the target costs what it held until then."""
    rows = {name: run.summary() for name, run in runs.items()}
    ref = rows.get("jabas")
    key = "time_to_target_s" if target is not None else "time_s"
    for row in rows.values():
        if ref is None:
            break
        ok = row[key] is not None and ref[key]
        row["time_vs_jabas"] = row[key] / ref[key] if ok else None
        row["cost_vs_jabas"] = row["cost"] / ref["cost"] if ok and ref["cost"] else None
    return {"target": target, "policies": rows}


def plot_comparison(result: dict, path: str | StoragePath) -> StoragePath:
    """``comparison.png``: (left) time to target and cost of each policy normalised to JABAS,
    as in the JABAS paper's Fig. 10; (right) GPUs in use over the simulated time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["policies"]
    names = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if any(rows[n].get("time_vs_jabas") is not None for n in names):
        xs = range(len(names))
        ax1.bar([x - 0.2 for x in xs], [rows[n]["time_vs_jabas"] or 0.0 for n in names], 0.4, label="time")
        ax1.bar([x + 0.2 for x in xs], [rows[n]["cost_vs_jabas"] or 0.0 for n in names], 0.4, label="cost")
        ax1.set_xticks(list(xs), [n if rows[n]["time_vs_jabas"] is not None else f"{n}\n(missed)"
                                  for n in names])
        ax1.axhline(1.0, color="grey", lw=0.6)
        ax1.set_ylabel("normalised to JABAS")
        ax1.set_title("Time to target and cost (Eq. 8)" if result.get("target") is not None
                      else "Time and cost (Eq. 8)")
        ax1.legend()
    for i, n in enumerate(names):
        pts = rows[n]["gpus_over_time"]
        if pts:
            end = rows[n]["time_s"]
            xs_ = [p[0] / 3600 for p in pts] + [end / 3600]
            ys_ = [p[1] for p in pts] + [pts[-1][1]]
            ax2.step(xs_, ys_, where="post", label=n, color=f"C{i}")
    ax2.set_xlabel("simulated hours")
    ax2.set_ylabel("GPUs in use")
    ax2.set_title("GPUs over time")
    ax2.legend(loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=90, format="png")
    plt.close(fig)
    return as_storage_path(path).write_bytes(buf.getvalue())


__all__ = ["compare", "comparison", "plot_comparison", "check_policies"]
