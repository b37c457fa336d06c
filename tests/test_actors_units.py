"""Pure logic of the Ray layer (no Ray started): rank layout, allocations, checkpoints,
metrics JSON and plots, emulation arithmetic, the rendezvous store."""
from __future__ import annotations

import pytest
import torch

from jabasray.actors.checkpoint import (DriverState, latest_checkpoint, list_checkpoints,
                                        save_checkpoint)
from jabasray.actors.gpu_actor import emulation_sleep, gather
from jabasray.actors.metrics import EpochRecord, IntervalRecord, MetricsHistory, plot_history
from jabasray.actors.placement import (SOLO_GROUP, bundle_for, drop_gpus, full_allocation, group_gpus,
                                       layout_for, normalize_allocation, slots_for)
from jabasray.actors.rendezvous import Rendezvous, RendezvousServer
from jabasray.types import ClusterSpec, NodeSpec, Plan, WorkerConfig


def cluster() -> ClusterSpec:
    return ClusterSpec(nodes=[NodeSpec("a0", "fast", 4, speed=0.5), NodeSpec("b0", "slow", 2, speed=0.25),
                              NodeSpec("a1", "fast", 2, speed=0.5)])


def test_slots_pair_ranks_and_groups():
    """A pair -> two consecutive ranks (group 0, group 1); nodes in cluster order; unit k of a
    node is its k-th; an odd GPU of a node is a solo unit (one rank, both groups)."""
    slots = slots_for(cluster(), {"a1": 2, "a0": 4})
    assert [(s.rank, s.node, s.group, s.pair, s.local_pair) for s in slots] == [
        (0, "a0", 0, 0, 0), (1, "a0", 1, 0, 0), (2, "a0", 0, 1, 1), (3, "a0", 1, 1, 1),
        (4, "a1", 0, 2, 0), (5, "a1", 1, 2, 0)]
    assert group_gpus(slots) == ["fast", "fast", "fast"]
    assert all(s.speed == 0.5 for s in slots)
    slots = slots_for(cluster(), {"a0": 3, "b0": 1, "a1": 1})
    assert [(s.rank, s.node, s.group, s.pair, s.local_pair) for s in slots] == [
        (0, "a0", 0, 0, 0), (1, "a0", 1, 0, 0), (2, "a0", SOLO_GROUP, 1, 1),
        (3, "b0", SOLO_GROUP, 2, 0), (4, "a1", SOLO_GROUP, 3, 0)]
    assert group_gpus(slots) == ["fast", "fast/solo", "slow/solo", "fast/solo"]
    assert [s.solo for s in slots] == [False, False, True, True, True]


def test_layout_follows_plan_workers_of_each_pair():
    slots = slots_for(cluster(), {"a0": 2, "b0": 2})
    plan = Plan(global_batch_size=8 * 2 * 5, local_batch_size=8,
                workers=[WorkerConfig("fast", 2, 1), WorkerConfig("slow", 1, 0)], iteration_time=1.0)
    layout = layout_for(slots, plan.workers)
    assert layout == [4, 4, 1, 1]
    assert sum(layout) * plan.local_batch_size == plan.global_batch_size
    with pytest.raises(ValueError, match="plan.workers"):
        layout_for(slots, plan.workers[:1])
    # a solo GPU runs its unit's workers for both groups
    slots = slots_for(cluster(), {"a0": 3})
    plan = Plan(global_batch_size=8 * 2 * 5, local_batch_size=8,
                workers=[WorkerConfig("fast", 2, 1), WorkerConfig("fast/solo", 1, 0)], iteration_time=1.0)
    layout = layout_for(slots, plan.workers)
    assert layout == [4, 4, 2]
    assert sum(layout) * plan.local_batch_size == plan.global_batch_size


def test_allocation_validation_and_full_allocation():
    c = cluster()
    assert full_allocation(c) == {"a0": 4, "b0": 2, "a1": 2}
    assert normalize_allocation(c, {"a0": 0, "b0": 1}) == {"b0": 1}
    with pytest.raises(ValueError, match=r"allocation\[a0\]"):
        normalize_allocation(c, {"a0": 5})
    with pytest.raises(ValueError, match="node must be one of"):
        normalize_allocation(c, {"zz": 1})
    with pytest.raises(ValueError, match="at least one GPU"):
        normalize_allocation(c, {"a0": 0})


def test_drop_gpus_removes_one_gpu_and_empty_nodes():
    c = drop_gpus(cluster(), "a0")
    assert [(n.name, n.num_gpus) for n in c.nodes] == [("a0", 3), ("b0", 2), ("a1", 2)]
    c = drop_gpus(drop_gpus(c, "b0"), "b0")
    assert [n.name for n in c.nodes] == ["a0", "a1"]
    single = ClusterSpec(nodes=[NodeSpec("x", "fast", 1)])
    assert drop_gpus(single, "x") is None


def test_bundles_emulated_and_real():
    assert bundle_for("fast", emulate=True) == {"gpu_fast": 1.0}
    assert bundle_for("fast", emulate=True, available={"gpu_fast": 2}) == {"gpu_fast": 1.0}
    assert bundle_for("fast", emulate=True, available={"CPU": 2}) == {"CPU": 0.01}
    assert bundle_for("v100", emulate=False, available={"GPU": 8, "gpu_v100": 4}) == {"GPU": 1.0, "gpu_v100": 1.0}
    assert bundle_for("v100", emulate=False, available={"GPU": 8}) == {"GPU": 1.0}


def test_emulation_sleep_makes_compute_take_compute_over_speed():
    for t, speed in [(0.02, 0.5), (0.01, 0.25), (0.3, 0.1)]:
        assert t + emulation_sleep(t, speed) == pytest.approx(t / speed)
    assert emulation_sleep(0.02, 1.0) == 0.0
    assert emulation_sleep(0.02, 2.0) == 0.0   # faster than the CPU cannot be emulated


def test_gather_tensor_and_generic_datasets_agree():
    X = torch.arange(20.0).view(10, 2)
    y = torch.arange(10)
    td = torch.utils.data.TensorDataset(X, y)

    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return X[i], y[i]

    for idx in ([3, 1, 7], []):
        a, b = gather(td, idx), gather(Plain(), idx)
        assert all(torch.equal(u, v) for u, v in zip(a, b))
        assert len(a[0]) == len(idx)


def test_actor_micro_batches_are_the_sampler_indices_gathered():
    """GPUActor.micro_batches (one gather + one device copy, split per worker) gives each
    decoupled worker exactly its sampler indices, also on a ragged last iteration."""
    from jabasray.actors.gpu_actor import GPUActor
    from jabasray.actors.placement import Slot
    from jabasray.config import JobConfig

    X, y = torch.arange(60.0).reshape(30, 2), torch.arange(30)
    slot = Slot(rank=1, node="n0", gpu_type="fast", speed=1.0, group=1, pair=0)
    actor = GPUActor(slot, 2, JobConfig(seed=3), None, None, None,
                     torch.utils.data.TensorDataset(X, y), torch_threads=torch.get_num_threads())
    for cursor in (0, 27):                      # full, then ragged: 3 samples over 5 workers
        batches, it = actor.micro_batches(0, cursor, 4, [2, 3])
        assert len(batches) == 3 and it.ragged == (cursor == 27)
        for (xb, yb), idx in zip(batches, it.micro_batches):
            assert torch.equal(yb, torch.as_tensor(idx)) and torch.equal(xb, X[idx])


def _history(epochs: int = 2) -> MetricsHistory:
    plan = Plan(32, 8, [WorkerConfig("fast", 2, 0)], 0.1, requested_global_batch_size=30)
    h = MetricsHistory()
    for e in range(epochs):
        for k in range(3):
            h.intervals.append(IntervalRecord(e, k, 3 * e + k, 5, 32 * 5 * k, 30, 32, 8, plan, 1.0 / (k + 1),
                                              100.0, 0.3, 0.05, 0.5, samples=160))
        h.epochs.append(EpochRecord(e, {"a0": 1}, ["fast", "fast"], [30, 33, 36],
                                    [] if e == 0 else [36.0, 38.0, 40.0], 0.5, 0.9, 2.0, 4.0, 480, 240.0))
    return h


def test_metrics_json_round_trip_and_plot(tmp_path):
    h = _history()
    back = MetricsHistory.from_json(h.to_json())
    assert back == h
    assert back.intervals[0].plan.workers[0] == WorkerConfig("fast", 2, 0)
    assert back.total_gpu_seconds == 8.0
    assert back.truncate(1).epochs == h.epochs[:1]
    png = plot_history(h, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_says_what_it_shows(tmp_path, monkeypatch):
    """The B_G panel labels the adaptive rule's request, the B_G* the plans ran (here 32 while
    30-36 were requested) and the forecast; nothing is called 'actual'."""
    from matplotlib.figure import Figure

    saved = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig) or real(fig, *a, **k))
    plot_history(_history(), tmp_path / "p.png")
    labels = [t.get_text() for t in saved[0].axes[0].get_legend().get_texts()]
    assert labels == ["B_G requested (adaptive rule)", "B_G run (plan's B_G*)", "B_G (forecast)"]


def test_checkpoints_are_complete_and_pruned(tmp_path):
    c = cluster()
    for e in range(4):
        st = DriverState(epochs_done=e, iteration=10 * e, cluster=c, allocation={"a0": 1},
                         adaptive={"global_batch": 32 + e}, forecast=[1.0, 2.0], metrics=_history(e))
        save_checkpoint(tmp_path, st, {"w": torch.full((3,), float(e))}, keep=2)
    (tmp_path / "checkpoints" / ".tmp_half").mkdir()          # a crashed write is ignored
    (tmp_path / "checkpoints" / "epoch_0009").mkdir()          # incomplete: no files
    cps = list_checkpoints(tmp_path)
    assert [cp.epochs_done for cp in cps] == [2, 3]
    cp = latest_checkpoint(tmp_path)
    st = cp.load_driver_state()
    assert st.epochs_done == 3 and st.cluster == c and st.adaptive == {"global_batch": 35}
    assert st.metrics == _history(3)
    assert torch.equal(cp.load_worker_state()["w"], torch.full((3,), 3.0))
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_rendezvous_info_round_trip_and_validation():
    """The driver-side store's info travels as JSON to the actors (the all-reduce through it is
    exercised by the Ray tests)."""
    server = RendezvousServer(world_size=2, backend="gloo", generation=3, timeout_s=30, host="127.0.0.1")
    info = Rendezvous.from_json(server.info.to_json())
    assert info == server.info and info.world_size == 2 and info.generation == 3
    with pytest.raises(ValueError, match="backend"):
        Rendezvous("127.0.0.1", 1234, 2, backend="mpi")
    with pytest.raises(ValueError, match="world_size"):
        Rendezvous("127.0.0.1", 1234, 0)
    server.close()


def test_driver_options_validation():
    from jabasray.actors.driver import DriverOptions
    assert DriverOptions().emulate is True and DriverOptions(device="cuda").emulate is False
    with pytest.raises(ValueError, match="^device must be one of"):
        DriverOptions(device="tpu")
    with pytest.raises(ValueError, match="^failure_grace_s must be"):
        DriverOptions(failure_grace_s=0)


class _LocalBatchCap:
    """An iteration-time model whose max B_L is capped (restricts Alg. 1 to one B_L)."""

    def __init__(self, model, cap):
        self._model, self._cap = model, cap

    def max_local_batch(self, gpu):
        return min(int(self._model.max_local_batch(gpu)), self._cap)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.mark.parametrize("bg, pairs", [(64, 1), (70, 1), (77, 2), (200, 2), (96, 3)])
def test_plan_stays_near_requested_batch(bg, pairs):
    """The driver's plan = the fastest per-B_L Alg. 1 plan with |B_G* - B_G| <= alpha/2 * B_G,
    else the closest B_G*; checked against solving every B_L separately (no Ray needed)."""
    from actors_helpers import perf_model
    from jabasray.actors.driver import JabasDriver
    from jabasray.config import JobConfig
    from jabasray.planners.config_solver import solve_configuration

    job = JobConfig(min_local_batch=8, min_global_batch=16, initial_global_batch=64, alpha=0.1)
    c = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2 * pairs)])
    model = perf_model(min_local_batch=8, max_local_batch=64)
    drv = JabasDriver(lambda: None, [0], None, None, job, c, "unused", perf_model=model)
    slots = slots_for(c, {"n0": 2 * pairs})
    plan = drv._plan(slots, bg)
    per_bl = [p for bl in range(8, 65, 8)
              if (p := solve_configuration(bg, group_gpus(slots), _LocalBatchCap(model.for_allocation(2 * pairs, False), bl), bl))]
    near = [p for p in per_bl if abs(p.global_batch_size - bg) <= 0.05 * bg]
    if near:
        assert plan.throughput == max(p.throughput for p in near)
        assert abs(plan.global_batch_size - bg) <= 0.05 * bg
    else:
        assert abs(plan.global_batch_size - bg) == min(abs(p.global_batch_size - bg) for p in per_bl)
    # the unconstrained Alg. 1 may round much further (the reason for the guard)
    free = solve_configuration(bg, group_gpus(slots), model.for_allocation(2 * pairs, False), 8)
    assert abs(plan.global_batch_size - bg) <= abs(free.global_batch_size - bg)


def test_autoscale_decision_maps_to_node_pairs():
    """The driver's adapter turns the planner's decision into {node: pairs}, and the initial
    allocation for B_G^init follows the decision's group H."""
    from actors_helpers import perf_model
    from jabasray.actors.driver import autoscale_allocation
    from jabasray.config import JobConfig
    from jabasray.planners.autoscale import choose_allocation

    c = ClusterSpec(nodes=[NodeSpec("a0", "fast", 4), NodeSpec("b0", "slow", 2)])
    model = perf_model(min_local_batch=8, max_local_batch=64)
    job = JobConfig(min_local_batch=8, initial_global_batch=128, min_global_batch=32, adapt_interval=5)
    traj = [128.0, 140.4, 150.0]
    alloc = autoscale_allocation(c, model, traj, 1000, job)
    d = choose_allocation(c, model, [128, 140, 150], 1000, 5, 8)
    assert alloc == {k: v for k, v in d.allocation.node_gpus.items() if v}
    assert group_gpus(slots_for(c, alloc)) == d.group_gpus


def test_actor_feeds_background_runner_and_guards_allreduce_only_when_hosting(tmp_path):
    """In-process GPUActor (no Ray, one rank, emulated speed 0.5). Without background jobs no
    runner is created and the worker has no comm_guard. Once it hosts one, every foreground
    iteration (engine step + emulation sleep) is reported to the runner exactly once, and the
    worker's comm_guard is the mixin's critical section, which pauses the background job."""
    import time
    from dataclasses import replace

    from torch import nn

    from actors_helpers import loss_fn, model_fn, optimizer_fn, tiny_data
    from jabasray.actors.background import BackgroundJob
    from jabasray.actors.gpu_actor import GPUActor, IntervalRequest
    from jabasray.actors.placement import Slot
    from jabasray.config import JobConfig

    ds, _ = tiny_data(64)
    slot = Slot(rank=0, node="n0", gpu_type="slow", speed=0.5, group=0, pair=0)
    actor = GPUActor(slot, 1, JobConfig(seed=1), model_fn, optimizer_fn, loss_fn, ds, "cpu", True)
    actor.setup(Rendezvous("127.0.0.1", 29500, 1))
    actor.configure(1, 1, 4)
    req = IntervalRequest(epoch=0, cursor=0, num_iterations=2, local_batch=4, layout=[2],
                          iteration=0, base_lr=0.05, base_batch=8, lr_scaling="none",
                          warmup_iterations=0, similarity=False)
    first = actor.run_interval(req)
    assert first.num_iterations == 2 and first.samples == 16
    assert actor.worker.comm_guard is None and getattr(actor, "_bg_runner_obj", None) is None

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g),
                                          torch.randint(0, 3, (32,), generator=g))
    job = BackgroundJob(model_fn=lambda: nn.Linear(4, 3), optimizer_fn=optimizer_fn,
                        loss_fn=nn.functional.cross_entropy, dataset=data, steps=10**6,
                        batch_size=8, memory_mb=1.0)
    actor.bg_set_memory_budget(100.0)
    actor.bg_submit("bg", job)
    runner = actor.bg_runner()
    reported: list[float] = []
    real_report = runner.report_foreground_step

    def report(seconds, colocated=None):
        reported.append(seconds)
        return real_report(seconds, colocated)
    runner.report_foreground_step = report
    try:
        second = actor.run_interval(replace(req, cursor=16, num_iterations=3))
        assert second.num_iterations == 3 and len(reported) == 3
        assert second.emulation_sleep > 0 and sum(reported) >= second.emulation_sleep
        assert actor.worker.comm_guard == actor.bg_foreground_critical
        with actor.worker.comm_guard("allreduce"):
            before = actor.bg_status("bg").step
            time.sleep(0.05)
            assert actor.bg_status("bg").step == before       # background paused meanwhile
    finally:
        actor.bg_cancel("bg")
        runner.close()
        actor.shutdown()
