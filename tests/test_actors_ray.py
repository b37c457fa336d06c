"""GPU actors on the session Ray instance: the two-group similarity collective against an
in-process reference, fault recovery by killing an actor, and input checks that need Ray."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from actors_helpers import KillOnce, loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.checkpoint import latest_checkpoint
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.actors.gpu_actor import GPUActor, IntervalRequest
from jabasray.actors.placement import place_actors, release, slots_for
from jabasray.actors.rendezvous import RendezvousServer
from jabasray.config import JobConfig
from jabasray.engine.sampler import iteration_indices
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.ray


def reference_phi(dataset, slots, layout, local_batch, seed, epoch=0):
    """Phi computed in one process: every rank's local gradient = sum over its micro-batches of
    the gradient of the micro-batch mean loss (same initial weights: model_fn under seed);
    group g = sum over its ranks (a solo rank: the first half of its micro-batches, i.e. of its
    VSWs, in group 0, the second half in group 1); Phi = cosine(group 0, group 1) in float64."""
    torch.manual_seed(seed)
    model = model_fn()
    X, y = dataset.tensors
    groups = [None, None]
    losses = []
    for s in slots:
        it = iteration_indices(seed, epoch, 0, local_batch, layout, s.rank, len(dataset))
        half = len(it.micro_batches) // 2
        for i, idx in enumerate(it.micro_batches):
            model.zero_grad()
            t = torch.as_tensor(idx)
            loss = loss_fn(model(X[t]), y[t])
            loss.backward()
            losses.append(loss.item())
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
            g = (0 if i < half else 1) if s.solo else s.group
            groups[g] = flat if groups[g] is None else groups[g] + flat
    a, b = groups
    return float(a @ b / (a.norm() * b.norm())), float(np.mean(losses))


def test_group_similarity_one_collective_matches_reference(ray_session):
    """Two pairs (4 actors), unequal layout [3, 3, 1, 1]: the Phi every actor returns equals
    the reference cosine of the two group sums; the loss equals the mean micro-batch loss.
    Then re-placed as 3 GPUs (pair 0 kept, pair 1 released, a new solo actor): the solo GPU
    runs 2 VSWs x 2 GA steps and forms both groups from its VSW halves; Phi and the loss equal
    the float64 reference again (the pair + solo case of
    test_solo_gpu_similarity_from_vsw_halves_matches_reference, on actors this test has)."""
    import ray

    ds, _ = tiny_data(200)
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 4, speed=1.0)])
    slots = slots_for(cluster, {"n0": 4})
    job = JobConfig(seed=3, initial_global_batch=32, min_global_batch=8, min_local_batch=4)
    remote = ray.remote(GPUActor)
    ref = ray.put(ds)

    def make(slot, opts):
        return remote.options(**opts).remote(slot, len(slots), job, model_fn, optimizer_fn, loss_fn,
                                             ref, "cpu", False)

    placement, new = place_actors(slots, make, emulate=True, timeout_s=60)
    try:
        assert new == [0, 1, 2, 3]
        server = RendezvousServer(len(slots), "gloo", generation=1, timeout_s=60)
        ray.get([a.setup.remote(server.info, s) for a, s in zip(placement.actors, slots)])
        layout = [3, 3, 1, 1]          # pair 0: 3 workers per GPU (n_vsw=1, n_ga=2); pair 1: 1
        cfg = {3: (1, 2), 1: (1, 0)}
        ray.get([a.configure.remote(*cfg[w], 4) for a, w in zip(placement.actors, layout)])
        req = IntervalRequest(epoch=0, cursor=0, num_iterations=1, local_batch=4, layout=layout,
                              iteration=0, base_lr=0.05, base_batch=32, lr_scaling="none",
                              warmup_iterations=0)
        replies = ray.get([a.run_interval.remote(req) for a in placement.actors])
        phi_ref, loss_ref = reference_phi(ds, slots, layout, 4, seed=3)
        assert {r.phi for r in replies} == {replies[0].phi}
        assert replies[0].phi == pytest.approx(phi_ref, abs=1e-5)
        assert replies[0].loss == pytest.approx(loss_ref, rel=1e-5)
        assert [r.samples for r in replies] == [4 * w for w in layout]
        assert {r.end_cursor for r in replies} == {4 * sum(layout)}

        # shrink to one pair plus a solo GPU: pair 0's actors are kept (same handles, no new
        # process), pair 1's are released, the solo GPU gets a new actor; the kept ones re-join
        # a new group with it and train again
        small = slots_for(cluster, {"n0": 3})
        assert [s.solo for s in small] == [False, False, True]
        kept, new = place_actors(small, make, emulate=True, reuse=placement)
        assert new == [2] and kept.actors[:2] == placement.actors[:2]
        assert kept.actors[2] not in placement.actors
        for a in placement.actors[2:]:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(a.ping.remote(), timeout=30)
        placement = kept
        server2 = RendezvousServer(3, "gloo", generation=2, timeout_s=60)
        ray.get([a.setup.remote(server2.info, s) for a, s in zip(kept.actors, small)])
        cfg2 = [(1, 1), (1, 1), (2, 1)]       # solo: 2 VSWs (one per group)
        layout2 = [m * (ga + 1) for m, ga in cfg2]
        ray.get([a.configure.remote(m, ga, 4) for a, (m, ga) in zip(kept.actors, cfg2)])
        req2 = IntervalRequest(epoch=0, cursor=0, num_iterations=1, local_batch=4, layout=layout2,
                               iteration=0, base_lr=0.05, base_batch=32, lr_scaling="none",
                               warmup_iterations=0)
        replies = ray.get([a.run_interval.remote(req2) for a in kept.actors])
        phi_ref, loss_ref = reference_phi(ds, small, layout2, 4, seed=3)
        assert replies[0].phi is not None and {r.phi for r in replies} == {replies[0].phi}
        assert replies[0].phi == pytest.approx(phi_ref, abs=1e-5)
        assert replies[0].loss == pytest.approx(loss_ref, rel=1e-5)
    finally:
        release(placement)


@pytest.mark.parametrize("gpus", [1])
def test_solo_gpu_similarity_from_vsw_halves_matches_reference(ray_session, gpus):
    """One GPU (world size 1): the solo GPU runs 2 VSWs x 2 GA steps and forms both groups from
    its VSW halves; Phi equals the float64 reference of the two groups' gradient sums. (A pair
    plus a solo GPU: test_group_similarity_one_collective_matches_reference, after its
    re-placement, with the same configuration and checks.)"""
    import ray

    ds, _ = tiny_data(200)
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", gpus, speed=1.0)])
    slots = slots_for(cluster, {"n0": gpus})
    assert slots[-1].solo and sum(s.solo for s in slots) == 1
    job = JobConfig(seed=5, initial_global_batch=32, min_global_batch=8, min_local_batch=4)
    remote = ray.remote(GPUActor)
    ref = ray.put(ds)

    def make(slot, opts):
        return remote.options(**opts).remote(slot, len(slots), job, model_fn, optimizer_fn, loss_fn,
                                             ref, "cpu", False)

    placement, _ = place_actors(slots, make, emulate=True, timeout_s=60)
    try:
        server = RendezvousServer(len(slots), "gloo", generation=1, timeout_s=60)
        ray.get([a.setup.remote(server.info, s) for a, s in zip(placement.actors, slots)])
        cfg = [(1, 1)] * (len(slots) - 1) + [(2, 1)]       # solo: 2 VSWs (one per group)
        layout = [m * (ga + 1) for m, ga in cfg]
        ray.get([a.configure.remote(m, ga, 4) for a, (m, ga) in zip(placement.actors, cfg)])
        req = IntervalRequest(epoch=0, cursor=0, num_iterations=1, local_batch=4, layout=layout,
                              iteration=0, base_lr=0.05, base_batch=32, lr_scaling="none",
                              warmup_iterations=0)
        replies = ray.get([a.run_interval.remote(req) for a in placement.actors])
        phi_ref, loss_ref = reference_phi(ds, slots, layout, 4, seed=5)
        assert replies[0].phi is not None and {r.phi for r in replies} == {replies[0].phi}
        assert replies[0].phi == pytest.approx(phi_ref, abs=1e-5)
        assert replies[0].loss == pytest.approx(loss_ref, rel=1e-5)
    finally:
        release(placement)


def test_a_solo_gpu_that_becomes_a_pair_gets_new_actors(ray_session):
    """Re-placing 3 GPUs (a pair and a solo GPU) as 4 (two pairs) and back: the pair that keeps
    its shape keeps its actors; the unit whose shape changed (1 actor <-> 2) gets new actors and
    its old ones are released. (The auto-scaler moves between odd and even counts.)"""
    import ray

    @ray.remote(num_cpus=0)
    class Stub:
        def __init__(self, rank):
            self.rank = rank

        def ping(self):
            return self.rank

    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 4, speed=1.0)])

    def make(slot, opts):
        return Stub.options(**opts).remote(slot.rank)

    three = slots_for(cluster, {"n0": 3})
    four = slots_for(cluster, {"n0": 4})
    placement, new = place_actors(three, make, emulate=True, timeout_s=60)
    try:
        assert new == [0, 1, 2] and [s.solo for s in three] == [False, False, True]
        kept, solo = placement.actors[:2], placement.actors[2]
        grown, new = place_actors(four, make, emulate=True, timeout_s=60, reuse=placement)
        placement = grown
        assert new == [2, 3] and grown.actors[:2] == kept
        assert ray.get([a.ping.remote() for a in grown.actors]) == [0, 1, 2, 3]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(solo.ping.remote(), timeout=30)
        pair = grown.actors[2:]
        shrunk, new = place_actors(three, make, emulate=True, timeout_s=60, reuse=grown)
        placement = shrunk
        assert new == [2] and shrunk.actors[:2] == kept
        assert ray.get([a.ping.remote() for a in shrunk.actors]) == [0, 1, 2]
        for a in pair:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(a.ping.remote(), timeout=30)
    finally:
        release(placement)


def test_actor_death_restarts_epoch_without_that_gpu(ray_session, tmp_path):
    """The hook kills rank 1 (one GPU of the only pair) mid-epoch 1. The driver reloads the
    epoch-1 checkpoint, drops that GPU only, redoes epoch 1 on the GPU left (now a solo unit: a
    new actor, both similarity groups from its VSW halves) and finishes; epoch 0 is kept as it
    was. Two GPUs prove this with 3 actor processes (a pair of 4 needed 5). (The driver runs in
    this process: the driver actor replaces the callbacks with its own progress sink, and its
    restart is tested in test_driver_actor.py.)"""
    ds, val = tiny_data(240)
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])
    job = JobConfig(epochs=2, initial_global_batch=32, min_global_batch=16, max_global_batch=64,
                    min_local_batch=4, adapt_interval=2, autoscale=False, seed=1)
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, cluster, tmp_path / "run",
                      val_dataset=val, perf_model=perf_model(), options=DriverOptions(failure_grace_s=10),
                      callbacks=[KillOnce(epoch=1, rank=1)])
    hist = drv.run()
    assert [e.epoch for e in hist.epochs] == [0, 1]
    assert hist.epochs[0].allocation == {"n0": 2} and len(hist.epochs[0].gpu_types) == 2
    assert hist.epochs[1].allocation == {"n0": 1} and len(hist.epochs[1].gpu_types) == 1
    fail = [m for m in hist.events if "failure" in m]
    assert len(fail) == 1 and "rank 1 (fast on n0)" in fail[0] and "restarting epoch 2" in fail[0]
    # the failed attempt's intervals are gone; epoch 1 was trained once, completely
    ep1 = [r for r in hist.intervals if r.epoch == 1]
    assert sum(r.samples for r in ep1) == len(ds)
    assert [r.interval for r in ep1] == list(range(len(ep1)))
    cp = latest_checkpoint(tmp_path / "run")
    assert cp.epochs_done == 2 and cp.load_driver_state().cluster.nodes[0].num_gpus == 1
    assert all(r.phi is not None for r in ep1)    # the similarity still runs on the one GPU left
    assert drv.gpu_actors() == []        # released at the end


def test_min_local_batch_beyond_every_gpu_is_a_one_line_error(ray_session, tmp_path):
    ds, _ = tiny_data(64)
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2)])
    job = JobConfig(min_local_batch=64, min_global_batch=64, initial_global_batch=64)
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, cluster, tmp_path / "r",
                      perf_model=perf_model())
    with pytest.raises(ValueError, match=r"^min_local_batch must be <= .*32.*got 64$"):
        drv.run()
    assert drv.gpu_actors() == []


@pytest.mark.parametrize("gpus", [1, 3])
def test_one_and_three_gpu_runs_adapt_the_global_batch(ray_session, tmp_path, gpus):
    """One GPU (a solo unit: both similarity groups from its VSW halves) and three GPUs (a pair
    plus a solo GPU) train end to end with adaptive batching: every interval measures Phi, the
    requested B_G follows the adaptive rule replayed on those Phi values and moves, and every
    epoch trains each sample once."""
    from jabasray.adaptive import AdaptiveBatchController

    ds, val = tiny_data(240)
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", gpus, speed=1.0)])
    job = JobConfig(epochs=2, initial_global_batch=16, min_global_batch=8, max_global_batch=64,
                    min_local_batch=4, adapt_interval=2, alpha=0.5, gamma=0.95, autoscale=False, seed=2)
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, cluster, tmp_path / "run",
                      val_dataset=val, perf_model=perf_model())
    hist = drv.run()
    assert [e.allocation for e in hist.epochs] == [{"n0": gpus}] * 2
    assert all(len(e.gpu_types) == gpus for e in hist.epochs)
    assert all(r.phi is not None and -1.0 <= r.phi <= 1.0 for r in hist.intervals)
    ctl = AdaptiveBatchController(job)
    for r in hist.intervals:
        assert r.requested_global_batch == ctl.global_batch
        ctl.update(r.phi)
    assert len({r.requested_global_batch for r in hist.intervals}) > 1     # B_G moved
    for e in (0, 1):
        assert sum(r.samples for r in hist.intervals if r.epoch == e) == len(ds)
    solo = [r for r in hist.intervals if r.plan is not None]
    assert all(r.plan.workers[-1].gpu == "fast/solo" for r in solo)
    assert all(sum(r.layout) * r.local_batch == r.global_batch for r in hist.intervals)
