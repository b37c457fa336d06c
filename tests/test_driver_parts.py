"""The pieces split out of the driver, without Ray: the restart point after a GPU actor failure
(actors/recovery.py) and the job's plan policy with its caches and online correction
(planners/job_planner.py). Exact bookkeeping against the functions they are built on."""
from __future__ import annotations

import math

import pytest

from actors_helpers import perf_model
from jabasray.actors.checkpoint import DriverState, save_checkpoint
from jabasray.actors.fanout import ActorFailure
from jabasray.actors.placement import full_allocation, slots_for
from jabasray.actors.recovery import dead_slots, describe_failure, failed_gpus, restart_point
from jabasray.config import FailureConfig, JobConfig
from jabasray.errors import JobFailed
from jabasray.planners import epoch_time, solve_for_batch
from jabasray.planners.correction import CorrectedModel, OnlineCorrection
from jabasray.planners.job_planner import JobPlanner, initial_trajectory
from jabasray.types import ClusterSpec, NodeSpec

CLUSTER = ClusterSpec(nodes=[NodeSpec("a0", "fast", 4), NodeSpec("b0", "slow", 2, ray_node_id="gone"),
                             NodeSpec("c0", "slow", 2, ray_node_id="live")])


def _failure(ranks):
    return ActorFailure(ranks, RuntimeError("died"))


def _checkpoint(run_dir, cluster=CLUSTER):
    state = DriverState(epochs_done=1, iteration=7, cluster=cluster, allocation=full_allocation(cluster),
                        forecast=[64.0])
    save_checkpoint(run_dir, state, None)


def test_failure_policy_tells_a_dead_node_from_a_dead_actor_and_a_burst():
    """failed_gpus: a single dead actor on a live node costs its GPU after drop_gpu_after
    failures of that GPU (counted per GPU); several dead at once on live nodes (a collective
    abort) drop nothing; actors of a node that left are not charged (the node goes whole)."""
    slots = slots_for(CLUSTER, full_allocation(CLUSTER))          # ranks 0-3 on a0, 4-5 b0, 6-7 c0
    alive = {"live"}
    strikes: dict = {}
    lost, why = failed_gpus([slots[1], slots[0], slots[3]], alive, strikes, FailureConfig())
    assert lost == [] and "3 ranks failed at once" in why and strikes == {}
    lost, why = failed_gpus([slots[4], slots[5]], alive, strikes, FailureConfig())
    assert lost == [] and "left the cluster" in why and strikes == {}
    lost, why = failed_gpus([slots[6]], alive, strikes, FailureConfig())
    assert lost == [slots[6]] and why == "without that GPU" and strikes == {"c0/0": 1}
    twice = FailureConfig(drop_gpu_after=2)
    strikes = {}
    assert failed_gpus([slots[2]], alive, strikes, twice)[0] == []          # a0/2: 1st failure kept
    assert failed_gpus([slots[3]], alive, strikes, twice)[0] == []          # a0/3: its own count
    assert failed_gpus([slots[2]], alive, strikes, twice)[0] == [slots[2]]  # a0/2 again: dropped
    assert strikes == {"a0/2": 2, "a0/3": 1}
    never = FailureConfig(drop_gpu_after=-1)
    assert all(failed_gpus([slots[0]], alive, strikes, never)[0] == [] for _ in range(5))
    with pytest.raises(ValueError, match=r"^drop_gpu_after must be >= 1 or -1 \(never\), got 0$"):
        FailureConfig(drop_gpu_after=0)


def test_restart_point_applies_the_failure_policy_and_drops_dead_ray_nodes(tmp_path):
    _checkpoint(tmp_path)
    slots = slots_for(CLUSTER, full_allocation(CLUSTER))          # ranks 0-3 on a0, 4-5 b0, 6-7 c0
    dropped = dead_slots(slots, _failure([1, 0, 3, 9]))            # rank 9 does not exist
    assert [s.rank for s in dropped] == [1, 0, 3]                  # 3 GPUs of a0
    cp, state, skipped = restart_point(tmp_path, _failure([1, 0, 3]), dropped, alive_nodes={"live"})
    assert cp.epochs_done == 1 and skipped == []
    assert (state.epochs_done, state.iteration, state.forecast) == (1, 7, [64.0])
    # three ranks at once on a live node: a0 keeps every GPU; b0's Ray node is gone; c0 stays
    assert [(n.name, n.num_gpus) for n in state.cluster.nodes] == [("a0", 4), ("c0", 2)]
    _, state, _ = restart_point(tmp_path, _failure([2]), [slots[2]], alive_nodes={"live"})
    assert [(n.name, n.num_gpus) for n in state.cluster.nodes] == [("a0", 3), ("c0", 2)]   # one GPU
    assert describe_failure(_failure([6]), dead_slots(slots, _failure([6]))) == \
        "GPU actor failure: rank 6 (slow on c0) (RuntimeError)"


def test_restart_point_fails_in_one_line_without_checkpoint_or_gpu(tmp_path):
    slots = slots_for(CLUSTER, full_allocation(CLUSTER))
    with pytest.raises(JobFailed, match=r"^GPU actor failure: rank 0 \(fast on a0\) \(RuntimeError\); "
                                        r"no intact checkpoint in .* to restart from$"):
        restart_point(tmp_path, _failure([0]), dead_slots(slots, _failure([0])), alive_nodes=set())
    two = ClusterSpec(nodes=[NodeSpec("a0", "fast", 2)])
    _checkpoint(tmp_path, two)
    _, state, _ = restart_point(tmp_path, _failure([1]), slots_for(two, {"a0": 2})[1:], alive_nodes=set())
    assert [(n.name, n.num_gpus) for n in state.cluster.nodes] == [("a0", 1)]   # its partner goes on
    one = ClusterSpec(nodes=[NodeSpec("a0", "fast", 1)])
    _checkpoint(tmp_path, one)
    with pytest.raises(JobFailed, match=r"no GPU left; last checkpoint .*epoch_0001 \(1 epoch\(s\) done"):
        restart_point(tmp_path, _failure([0]), slots_for(one, {"a0": 1}), alive_nodes=set())


def test_job_planner_plans_with_the_corrected_model_and_drops_stale_plans():
    job = JobConfig(min_local_batch=8, min_global_batch=16, initial_global_batch=64, alpha=0.1,
                    adapt_interval=5)
    base = perf_model(min_local_batch=8, max_local_batch=64)
    correction = OnlineCorrection(smoothing=0.5, threshold=2.0)
    planner = JobPlanner(job, 3000, correction=correction)
    planner.use_model(base)
    gpus = ["fast", "slow"]
    first = planner.plan(96, gpus, False)
    assert first == solve_for_batch(96, gpus, base.for_allocation(4, False), 8, tolerance=0.05)
    assert planner.plan(96, gpus, False) is first                     # cached
    assert planner.reprofile_note() is None
    # the measured interval took 3x the prediction: log c = 0.5 log 3 for both types
    planner.observe(gpus, first.iteration_time, 3 * first.iteration_time)
    assert correction.factor("fast") == pytest.approx(math.sqrt(3), rel=1e-12)
    again = planner.plan(96, gpus, False)
    assert again is not first
    assert again == solve_for_batch(96, gpus, CorrectedModel(base, correction).for_allocation(4, False), 8,
                                    tolerance=0.05)
    assert again.iteration_time == pytest.approx(math.sqrt(3) * first.iteration_time, rel=1e-12)
    traj = [int(b) for b in initial_trajectory(job, 3000)]
    assert traj == [64] * math.ceil(3000 / (5 * 64))
    assert planner.epoch_time(gpus, False, None) == pytest.approx(
        math.sqrt(3) * epoch_time(gpus, base.for_allocation(4, False), traj, 3000, 5, 8, tolerance=0.05).epoch_time,
        rel=1e-9)
    # the same measurement again, now against the corrected prediction: c = 3^(1/2 + 1/4) > 2
    planner.observe(gpus, again.iteration_time, 3 * first.iteration_time)
    assert correction.factor("slow") == pytest.approx(3 ** 0.75, rel=1e-12)
    assert planner.reprofile_note() == "model off by more than x2 (fast x2.28, slow x2.28): re-profiling"
    planner.use_model(base)                                           # re-profiled: factors reset
    assert correction.factor("fast") == 1.0 and planner.plan(96, gpus, False) == first
