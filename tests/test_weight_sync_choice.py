"""Weight sync chosen by the model (PerfModel, weight_sync="auto"): Eq. 6 for SWS and for OWS
with the measured interference, the faster taken; the plan carries the choice per GPU and the
actors run it.

References: the OWS communication phase against an independent event simulation of two tasks
that slow each other while both run; "auto" against the minimum of the two fixed-method models;
the break-even condition sigma_u (1 - 1/sigma_c) = 1 of the module notes; LIBRA's one-thread fit
against the model that generated the measurement."""
from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from jabasray.planners import PerfModel, solve_for_batch
from jabasray.planners.libra_model import fit_one_thread_count, overlap_slowdowns
from jabasray.planners.perf_model import ows_comm_phase
from jabasray.profiles import ContentionMeasurement, synthetic_profile

SIZES = [262144.0, 1048576.0, 4194304.0]


def measurement(sigma_c: float, sigma_u: float, n: int = 2, startup: float = 2e-4,
                rate: float = 5e8, compute: float = 0.01) -> ContentionMeasurement:
    """What a gloo group would measure if LIBRA's model held exactly with these slowdowns."""
    c_hat = [2 * (n - 1) / n * c for c in SIZES]
    return ContentionMeasurement(num_workers=n, sizes=list(SIZES),
                                 comm_alone=[startup + c / rate for c in c_hat],
                                 comm_overlapped=[startup + sigma_c * c / rate for c in c_hat],
                                 compute_alone=compute, compute_overlapped=sigma_u * compute)


def simulate(comm: float, update: float, sc: float, su: float) -> float:
    """Event simulation: remaining standalone work of each task; while both run, each advances
    at 1/sigma of its speed; returns when both are done."""
    rc, ru, t = comm, update, 0.0
    while rc > 1e-15 and ru > 1e-15:
        dt = min(rc * sc, ru * su)        # time until the first of the two finishes
        rc -= dt / sc
        ru -= dt / su
        t += dt
    return t + max(rc, 0.0) + max(ru, 0.0)


@pytest.mark.parametrize("seed", range(20))
def test_ows_phase_equals_the_event_simulation(seed):
    rng = np.random.default_rng(seed)
    comm, update = rng.uniform(0, 0.05, 2)
    sc, su = 1 + rng.uniform(0, 3, 2)
    assert ows_comm_phase(comm, update, sc, su) == pytest.approx(simulate(comm, update, sc, su), rel=1e-12)
    assert ows_comm_phase(comm, update, 1.0, 1.0) == pytest.approx(max(comm, update))
    assert ows_comm_phase(0.0, update, sc, su) == update and ows_comm_phase(comm, 0.0, sc, su) == comm


@pytest.mark.parametrize("n", [2, 4])
def test_one_thread_fit_recovers_the_generating_model(n):
    meas = measurement(1.7, 1.3, n=n)
    model = fit_one_thread_count(meas)
    assert model.startup == pytest.approx(2e-4, rel=1e-9)
    assert model.alone.rate(1) == pytest.approx(5e8, rel=1e-9)
    assert model.overlapped.rate(1) == pytest.approx(5e8 / 1.7, rel=1e-9)
    assert overlap_slowdowns(model) == pytest.approx((1.7, 1.3), rel=1e-9)
    assert all(e.max_rel_error < 1e-9 for e in model.fit_errors.values())
    # flat in the thread count: gloo has one nominal choice, nothing else is claimed
    assert model.overlapped.rate(4) == model.overlapped.rate(1) and model.compute.speed(3) == model.compute.speed(1)
    flat = replace(meas, comm_alone=[2e-3, 1.5e-3, 1e-3])   # shrinks with size: no bandwidth
    with pytest.raises(ValueError, match="contention.sizes"):
        fit_one_thread_count(flat)


def profile_with(sigma_c: float, sigma_u: float, **kw):
    # 4 buckets, last one 10% of W: OWS hides 90% of the update; comm-bound at 4 GPUs
    p = synthetic_profile("g", optimizer_time=0.004, copy_time=0.001,
                          bucket_sizes=(3_000_000, 3_000_000, 3_000_000, 1_000_000), **kw)
    return replace(p, param_bytes=10_000_000, contention=measurement(sigma_c, sigma_u))


CONFIGS = list(itertools.product([8, 16, 24, 32], [1, 2, 3], [0, 2]))


@pytest.mark.parametrize("sigmas", [(1.0, 1.0), (1.5, 1.2), (3.0, 3.0), (1.2, 4.0)])
@pytest.mark.parametrize("num_gpus", [2, 4])
def test_auto_is_the_faster_of_sws_and_ows(sigmas, num_gpus):
    prof = profile_with(*sigmas)
    auto, sws, ows = (PerfModel({"g": prof}, num_gpus=num_gpus, weight_sync=w) for w in ("auto", "sws", "ows"))
    for bl, n, ga in CONFIGS:
        if n > auto.max_num_vsw("g", bl):
            continue
        ts, to = sws.iteration_time("g", bl, n, ga), ows.iteration_time("g", bl, n, ga)
        assert auto.iteration_time("g", bl, n, ga) == min(ts, to)
        assert auto.weight_sync_method("g", bl, n) == ("ows" if to < ts else "sws")
    # the OWS terms: Eq. 6 with T_ows in place of t_comm, tau U as the exposed update
    b = ows.breakdown("g", 16, 2, 1)
    u = prof.optimizer_time + prof.copy_time
    tau = 0.1
    t_ows = ows_comm_phase(ows.comm_time("g"), (1 - tau) * u, *sigmas)
    assert b.weight_sync == "ows" and b.t_comm == pytest.approx(t_ows)
    assert b.total == pytest.approx(b.t_vsw * 1 + b.t_fwd + max(b.t_bwd, t_ows) + tau * u + b.t_overhead)


def test_interference_decides_when_communication_bound():
    """Communication-bound (t_comm > t_bwd, update ends first): OWS - SWS = V (sigma_u (1 - 1/sigma_c)
    - 1), so OWS wins below the break-even line and SWS above it; no interference: OWS always."""
    def choice(sc, su):
        m = PerfModel({"g": profile_with(sc, su)}, num_gpus=8, multi_node=True)
        b = m.breakdown("g", 8, 1, 0)
        return b.weight_sync
    prof = profile_with(1.0, 1.0)
    m = PerfModel({"g": prof}, num_gpus=8, multi_node=True, weight_sync="sws")
    assert m.comm_time("g") > m.breakdown("g", 8, 1, 0).t_bwd   # the regime of the docstring
    assert choice(1.0, 1.0) == "ows"
    assert choice(2.0, 1.9) == "ows"          # 1.9 * 0.5 = 0.95 < 1
    assert choice(2.0, 2.1) == "sws"          # 2.1 * 0.5 = 1.05 > 1
    assert choice(3.0, 1.6) == "sws"          # 1.6 * 2/3 = 1.07 > 1
    # a measured speed-up under overlap is treated as no interference, never as a gain
    assert PerfModel({"g": profile_with(0.8, 0.9)}).overlap_slowdowns("g") == (1.0, 1.0)


def test_without_a_measurement_the_paper_rule_decides():
    p = synthetic_profile("g", bucket_sizes=(3_000_000, 3_000_000, 3_000_000, 1_000_000))
    assert p.contention is None
    # mean 2.5 MB / 25 MB cap = 0.1 <= R_buffer -> OWS; with a 4 MB cap 0.6 > 0.5 -> SWS
    assert PerfModel({"g": p}).weight_sync_method("g", 16, 2) == "ows"
    assert PerfModel({"g": replace(p, bucket_cap_mb=4.0)}).weight_sync_method("g", 16, 2) == "sws"


def test_the_plan_carries_the_predicted_choice_per_gpu():
    fast = profile_with(1.0, 1.0)                       # no interference -> OWS
    slow = replace(profile_with(3.0, 3.0), gpu_type="h")  # heavy interference -> SWS
    model = PerfModel({"g": fast, "h": slow}, num_gpus=4, multi_node=True)
    plan = solve_for_batch(96, ["g", "h"], model, 8)
    for w, ws in zip(plan.workers, plan.worker_weight_sync):
        assert ws == model.weight_sync_method(w.gpu, plan.local_batch_size, w.num_vsw)
    assert plan.worker_weight_sync == ["ows", "sws"] and plan.weight_sync == "mixed"
    same = solve_for_batch(96, ["g", "g"], PerfModel({"g": fast}, num_gpus=4), 8)
    assert same.weight_sync == "ows" and same.worker_weight_sync == ["ows", "ows"]


def test_the_driver_sends_the_choice_and_the_actor_runs_it():
    from actors_helpers import loss_fn, model_fn, optimizer_fn, tiny_data
    from jabasray.actors.driver import JabasDriver
    from jabasray.actors.gpu_actor import GPUActor
    from jabasray.actors.placement import Slot
    from jabasray.actors.rendezvous import Rendezvous
    from jabasray.config import JobConfig
    from jabasray.types import Plan, WorkerConfig

    slots = [Slot(rank=r, node="n0", gpu_type=g, speed=1.0, group=r % 2, pair=r // 2)
             for r, g in enumerate(["g", "g", "h", "h"])]
    plan = Plan(global_batch_size=64, local_batch_size=8, workers=[WorkerConfig("g", 2, 0), WorkerConfig("h", 1, 1)],
                iteration_time=0.1, weight_sync="mixed", worker_weight_sync=["ows", "sws"])
    fake = SimpleNamespace(pool=SimpleNamespace(slots=slots), _learners=None)
    configs = JabasDriver._rank_configs(fake, plan)
    assert [c[3] for c in configs] == ["ows", "ows", "sws", "sws"]
    assert JabasDriver._rank_configs(fake, replace(plan, worker_weight_sync=[]))[0][3] is None
    fake._learners = SimpleNamespace(counts=[1, 1, 1, 1])   # SMA: no IIDP weight sync
    assert {c[3] for c in JabasDriver._rank_configs(fake, plan)} == {None}

    ds, _ = tiny_data(32)
    slot = Slot(rank=0, node="n0", gpu_type="cpu", speed=1.0, group=0, pair=0)
    actor = GPUActor(slot, 1, JobConfig(seed=1), model_fn, optimizer_fn, loss_fn, ds, "cpu", True)
    actor.setup(Rendezvous("127.0.0.1", 29500, 1), slot, None)
    for method in ("ows", "sws", "ows"):
        actor.configure(2, 0, 4, method)
        assert actor.worker.weight_sync_method == method
    with pytest.raises(ValueError, match="weight_sync must be one of 'sws', 'ows'"):
        actor.worker.set_weight_sync("auto")


def test_switching_methods_between_steps_keeps_the_update_exact():
    """SWS and OWS compute the same update (shard optimizer): a worker switching methods every
    step ends with the weights of one that never switches."""
    import torch

    from actors_helpers import loss_fn, model_fn, optimizer_fn
    from jabasray.engine import IIDPWorker
    from jabasray.engine.buckets import trainable_parameters

    torch.manual_seed(0)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    workers = []
    for switch in (False, True):
        torch.manual_seed(3)
        w = IIDPWorker(model_fn(), optimizer_fn, loss_fn, weight_sync="sws", bucket_cap_mb=0.001)
        w.configure(2, 0, 4)
        for k in range(4):
            if switch:
                w.set_weight_sync("ows" if k % 2 == 0 else "sws")
            w.train_step([(x[:4], y[:4]), (x[4:], y[4:])])
        workers.append(w)
    a, b = (dict(trainable_parameters(w.model)) for w in workers)
    assert len(workers[0].bucket_nbytes) > 1
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6), name


def test_a_plans_ows_keeps_sws_where_clipping_or_loss_scaling_needs_the_whole_gradient():
    """A plan may predict OWS for a GPU; a worker that clips the global gradient or scales the
    loss (fp16, or a loop's GradScaler) keeps SWS, as at its construction: OWS would step a
    bucket before the global norm or the inf check saw the others. Without either it switches."""
    import torch

    from actors_helpers import loss_fn, model_fn, optimizer_fn
    from jabasray.engine import IIDPWorker

    for kw, want in (({"grad_clip_norm": 1.0}, "sws"), ({"precision": "fp16"}, "sws"), ({}, "ows")):
        w = IIDPWorker(model_fn(), optimizer_fn, loss_fn, weight_sync="sws", bucket_cap_mb=0.001, **kw)
        w.set_weight_sync("ows")
        assert w.weight_sync_method == want, kw
    w = IIDPWorker(model_fn(), optimizer_fn, loss_fn, weight_sync="sws", bucket_cap_mb=0.001)
    w.set_grad_scaler(torch.amp.GradScaler("cpu"))
    w.set_weight_sync("ows")
    assert w.weight_sync_method == "sws"
