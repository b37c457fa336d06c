"""SMA learners (Crossbow Alg. 1): the engine against direct transcriptions of the algorithm.

Every reference below is written from the paper's lines with plain autograd and lists of
tensors, independently of ``jabasray.engine.sma``:

    c_j = alpha (w_j - z);  w_j <- w_j - lr grad_j - c_j;  z <- z + sum c_j + mu (z - z_prev)
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from jabasray.engine.sma import SMAWorker, sma_iteration_

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

LR, MU = 0.1, 0.9


def tiny_model(seed: int = 0, bn: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(4, 5)]
    if bn:
        layers.append(nn.BatchNorm1d(5))
    layers += [nn.Tanh(), nn.Linear(5, 3)]
    return nn.Sequential(*layers)


def make_batches(num: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(num)]


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def grads_at(model: nn.Module, ws: list[torch.Tensor], batches, weights) -> list[torch.Tensor]:
    """Gradient of sum_b weight_b * meanloss_b at parameters ``ws`` (plain autograd)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p, w in zip(ref.parameters(), ws):
            p.copy_(w)
    ref.zero_grad()
    loss = sum(wt * nn.functional.cross_entropy(ref(x), y) for (x, y), wt in zip(batches, weights))
    loss.backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def transcription(model, k, per, steps_batches, lr, mu, alpha, wd=0.0, replicas=None):
    """Alg. 1 lines 1-13 verbatim over lists of per-parameter tensors; returns (z, replicas)."""
    z = params(model)                                          # line 1: z <- w0
    z_prev = None                                              # line 2
    ws = replicas if replicas is not None else [params(model) for _ in range(k)]
    for batches in steps_batches:                              # line 3
        cs = []
        new_ws = []
        for j in range(k):                                     # line 5
            mine = batches[j * per:(j + 1) * per]              # line 6-7
            g = grads_at(model, ws[j], mine, [1.0 / per] * per)
            g = [lr * (gi + wd * wi) for gi, wi in zip(g, ws[j])]          # line 8
            c = [alpha * (wi - zi) for wi, zi in zip(ws[j], z)]           # line 9
            new_ws.append([wi - gi - ci for wi, gi, ci in zip(ws[j], g, c)])  # line 10
            cs.append(c)
        z_old = [t.clone() for t in z]                                       # line 11
        z = [zi + sum(c[i] for c in cs) + (mu * (zi - zp) if z_prev is not None else 0)
             for i, (zi, zp) in enumerate(zip(z, z_prev or z))]              # line 12
        z_prev = z_old                                                        # line 13
        ws = new_ws
    return z, ws


def assert_close_lists(a, b, atol=None):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **({} if atol is None else {"atol": atol, "rtol": 0}))


# ------------------------------------------------------------------------------------------

def test_functional_core_matches_alg1_on_random_tensors():
    gen = torch.Generator().manual_seed(1)
    k, n, alpha = 3, 17, 0.3
    w0 = torch.randn(n, generator=gen)
    reps = [torch.randn(n, generator=gen) for _ in range(k)]
    grads = [[torch.randn(n, generator=gen) for _ in range(k)] for _ in range(5)]
    # reference: verbatim lines 8-13
    z, z_prev, ws = w0.clone(), None, [r.clone() for r in reps]
    for gs in grads:
        cs = [alpha * (w - z) for w in ws]
        ws = [w - LR * g - c for w, g, c in zip(ws, gs, cs)]
        z_new = z + sum(cs) + (MU * (z - z_prev) if z_prev is not None else 0)
        z_prev, z = z, z_new
    # engine core
    ez, v, ews = w0.clone(), torch.zeros(n), [r.clone() for r in reps]
    for gs in grads:
        sma_iteration_(ews, gs, ez, v, LR, alpha, MU)
    torch.testing.assert_close(ez, z)
    for a, b in zip(ews, ws):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("m,ga,wd", [(3, 1, 0.0), (2, 0, 0.01)])
def test_worker_matches_transcription(m, ga, wd):
    model = tiny_model()
    per = m * (ga + 1)
    steps = [make_batches(per, 6, seed=s) for s in range(4)]
    ref_z, ref_ws = transcription(model, m, ga + 1, steps, LR, MU, 1.0 / m, wd)
    worker = SMAWorker(copy.deepcopy(model), nn.functional.cross_entropy, lr=LR, momentum=MU,
                       weight_decay=wd)
    worker.configure(m, ga, 6)
    assert worker.alpha == pytest.approx(1.0 / m)
    for b in steps:
        stats = worker.train_step(b)
        assert stats.num_workers == per and stats.global_num_workers == per
    assert_close_lists(params(worker.model), ref_z)
    for learner, ws in zip(worker._learners, ref_ws):
        assert_close_lists(params(learner.module), ws)


def test_step_loss_is_mean_over_learners():
    model = tiny_model()
    worker = SMAWorker(copy.deepcopy(model), nn.functional.cross_entropy, lr=LR)
    worker.configure(2, 1, 5)
    batches = make_batches(4, 5, seed=3)
    with torch.no_grad():
        expected = sum(float(nn.functional.cross_entropy(model(x), y)) for x, y in batches) / 4
    stats = worker.train_step(batches)
    assert stats.loss == pytest.approx(expected, rel=1e-10)


def test_one_learner_closed_form():
    """k = 1, alpha = 1 (the default 1/k): Alg. 1 collapses to
    w_{i+1} = z_i - lr grad(w_i),  z_{i+1} = w_i + mu (z_i - z_{i-1})  (no averaging left).
    NOTE: this is not momentum SGD on z - see the module notes of jabasray.engine.sma."""
    model = tiny_model(2)
    steps = [make_batches(1, 8, seed=10 + s) for s in range(5)]
    w, z, z_prev = params(model), params(model), None
    for b in steps:
        g = grads_at(model, w, b, [1.0])
        w_next = [zi - LR * gi for zi, gi in zip(z, g)]
        z_next = [wi + (MU * (zi - zp) if z_prev is not None else 0)
                  for wi, zi, zp in zip(w, z, z_prev or z)]
        w, z_prev, z = w_next, z, z_next
    worker = SMAWorker(copy.deepcopy(model), nn.functional.cross_entropy, lr=LR, momentum=MU)
    worker.configure(1, 0, 8)
    assert worker.alpha == 1.0
    for b in steps:
        worker.train_step(b)
    assert_close_lists(params(worker.model), z)
    assert_close_lists(params(worker._learners[0].module), w)


def test_alpha_zero_trains_independent_replicas():
    """alpha = 0 (allowed by the arithmetic, not by user validation): every learner is plain
    SGD on its own batches; z never moves (no corrections, momentum of a zero velocity)."""
    model = tiny_model(3)
    k = 3
    worker = SMAWorker(copy.deepcopy(model), nn.functional.cross_entropy, lr=LR, momentum=MU)
    worker.configure(k, 0, 4)
    worker._alpha_user = 0.0
    refs = [copy.deepcopy(model) for _ in range(k)]
    opts = [torch.optim.SGD(r.parameters(), lr=LR) for r in refs]
    for s in range(4):
        b = make_batches(k, 4, seed=20 + s)
        worker.train_step(b)
        for r, o, (x, y) in zip(refs, opts, b):
            o.zero_grad()
            nn.functional.cross_entropy(r(x), y).backward()
            o.step()
    assert_close_lists(params(worker.model), params(model), atol=0)
    for learner, r in zip(worker._learners, refs):
        assert_close_lists(params(learner.module), params(r))


def test_ragged_learner_gradient_is_union_gradient_and_empty_learner_only_corrects():
    model = tiny_model(4)
    worker = SMAWorker(copy.deepcopy(model), nn.functional.cross_entropy, lr=LR, momentum=MU)
    worker.configure(2, 1, 4)
    b = make_batches(2, 4, seed=30)
    x0 = torch.zeros(0, 4)
    y0 = torch.zeros(0, dtype=torch.long)
    ragged = [(b[0][0][:3], b[0][1][:3]), (b[1][0][:1], b[1][1][:1]), (x0, y0), (x0, y0)]
    stats = worker.train_step(ragged, ragged=True)
    assert stats.num_samples == 4
    union = [(torch.cat([b[0][0][:3], b[1][0][:1]]), torch.cat([b[0][1][:3], b[1][1][:1]]))]
    g = grads_at(model, params(model), union, [1.0])
    # first iteration: replicas == z, so c_j = 0 and w_1 = w_0 - lr g_1; learner 2 keeps w_0
    assert_close_lists(params(worker._learners[0].module),
                       [w - LR * gi for w, gi in zip(params(model), g)])
    assert_close_lists(params(worker._learners[1].module), params(model), atol=0)


def test_training_metrics_are_summed_by_samples_over_learners():
    """A step returning (loss, {name: mean}): the stats carry sum of mean x samples over every
    learner's micro-batches and the sample counts (engine.train_metrics), ragged ones included;
    the first iteration's learners all hold w_0, so ``acc`` is the reference model's."""
    model = tiny_model(6)

    def step(m, batch):
        x, y = batch
        out = m(x)
        return nn.functional.cross_entropy(out, y), {"label": y.double().mean(),
                                                     "acc": (out.argmax(1) == y).double().mean()}

    worker = SMAWorker(copy.deepcopy(model), nn.functional.cross_entropy, lr=LR, momentum=MU)
    worker.step_fn = step
    worker.configure(2, 1, 4)
    b = make_batches(3, 4, seed=31)
    x0, y0 = torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)
    ragged = [(b[0][0][:3], b[0][1][:3]), (b[1][0][:1], b[1][1][:1]), (b[2][0][:2], b[2][1][:2]), (x0, y0)]
    stats = worker.train_step(ragged, ragged=True)
    X = torch.cat([x for x, _ in ragged])
    Y = torch.cat([y for _, y in ragged])
    assert stats.metric_counts == {"label": 6, "acc": 6}
    assert float(stats.metric_sums["label"]) == pytest.approx(float(Y.double().sum()), abs=1e-12)
    with torch.no_grad():
        want = (model(X).argmax(1) == Y).double().sum()
    assert float(stats.metric_sums["acc"]) == pytest.approx(float(want), abs=1e-12)
    plain = SMAWorker(copy.deepcopy(model), nn.functional.cross_entropy, lr=LR, momentum=MU)
    plain.configure(2, 1, 4)
    assert plain.train_step(ragged, ragged=True).metric_sums == {}      # a plain loss: none


def test_restart_on_lr_change():
    worker = SMAWorker(tiny_model(5), nn.functional.cross_entropy, lr=LR, momentum=MU)
    worker.configure(3, 0, 4)
    for s in range(3):
        worker.train_step(make_batches(3, 4, seed=40 + s))
    z = params(worker.model)
    assert any(not torch.equal(a, b) for a, b in zip(params(worker._learners[0].module), z))
    worker.set_lr(LR)                                   # same value: no restart
    assert any(not torch.equal(a, b) for a, b in zip(params(worker._learners[0].module), z))
    worker.set_lr(LR / 2, restart=False)                # opt-out: no restart
    assert worker._velocity.abs().sum() > 0
    worker.set_lr(LR / 10)                              # changed value: restart from z
    assert worker.get_lr() == LR / 10
    assert float(worker._velocity.abs().sum()) == 0.0
    for learner in worker._learners:
        assert_close_lists(params(learner.module), z, atol=0)
    assert_close_lists(params(worker.model), z, atol=0)


def test_add_and_remove_learners_without_restart():
    worker = SMAWorker(tiny_model(6), nn.functional.cross_entropy, lr=LR, momentum=MU)
    worker.configure(2, 0, 4)
    for s in range(2):
        worker.train_step(make_batches(2, 4, seed=50 + s))
    old = [params(lr.module) for lr in worker._learners]
    v = worker._velocity.clone()
    worker.set_num_learners(4)
    assert worker.num_vsw == 4 and worker.total_learners == 4 and worker.alpha == 0.25
    for learner, o in zip(worker._learners[:2], old):
        assert_close_lists(params(learner.module), o, atol=0)
    for learner in worker._learners[2:]:
        assert_close_lists(params(learner.module), params(worker.model), atol=0)
    torch.testing.assert_close(worker._velocity, v)
    worker.train_step(make_batches(4, 4, seed=60))
    worker.set_num_learners(1)
    assert worker.num_vsw == 1 and worker.alpha == 1.0


def test_autotune_with_the_learner_tuner():
    """Crossbow Alg. 2 through jabasray.planners.learner_tuner: a learner is added while the
    throughput grows by more than tau, and the count settles at the peak."""
    from jabasray.planners.learner_tuner import LearnerTuner

    worker = SMAWorker(tiny_model(7), nn.functional.cross_entropy, lr=LR)
    worker.configure(1, 0, 4)
    tuner = LearnerTuner(tau=5.0)
    worker.train_step(make_batches(1, 4, seed=70))
    assert worker.autotune(tuner, gpu="g0") == 2 and worker.num_vsw == 2   # measured t > 0 + tau
    assert tuner.gpus["g0"].history[0][1] > 0
    z = params(worker.model)
    assert_close_lists(params(worker._learners[1].module), z, atol=0)      # new learner = z
    assert worker.autotune(tuner, throughput=1e9, gpu="g0") == 3
    assert worker.autotune(tuner, throughput=1e9 + 1, gpu="g0") == 2       # gain <= tau: settle
    assert worker.num_vsw == 2 and worker.alpha == 0.5 and tuner.is_settled("g0")
    worker.train_step(make_batches(2, 4, seed=71))
    assert worker.autotune(lambda tp: 3, throughput=1.0) == 3 and worker.num_vsw == 3
    with pytest.raises(ValueError, match="num_vsw"):
        worker.autotune(lambda tp: 0, throughput=1.0)
    with pytest.raises(ValueError, match="tuner"):
        worker.autotune(object(), throughput=1.0)


def test_state_dict_round_trip_continues_identically():
    a = SMAWorker(tiny_model(8, bn=True), nn.functional.cross_entropy, lr=LR, momentum=MU)
    a.configure(2, 1, 4)
    for s in range(2):
        a.train_step(make_batches(4, 4, seed=80 + s))
    b = SMAWorker(tiny_model(9, bn=True), nn.functional.cross_entropy, lr=1.0, momentum=0.0)
    b.load_state_dict(a.state_dict())
    assert (b.num_vsw, b.num_ga, b.local_batch_size, b.get_lr()) == (2, 1, 4, LR)
    for s in range(2):
        batches = make_batches(4, 4, seed=90 + s)
        sa, sb = a.train_step(batches), b.train_step(batches)
        assert sa.loss == sb.loss
    for k, v in a.model.state_dict().items():
        torch.testing.assert_close(b.model.state_dict()[k], v, atol=0, rtol=0)


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="alpha"):
        SMAWorker(tiny_model(), nn.functional.cross_entropy, lr=LR, alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        SMAWorker(tiny_model(), nn.functional.cross_entropy, lr=LR, alpha=1.5)
    with pytest.raises(ValueError, match="lr"):
        SMAWorker(tiny_model(), nn.functional.cross_entropy, lr=0.0)
    with pytest.raises(ValueError, match="momentum"):
        SMAWorker(tiny_model(), nn.functional.cross_entropy, lr=LR, momentum=1.0)
    w = SMAWorker(tiny_model(), nn.functional.cross_entropy, lr=LR, alpha=1.0)
    with pytest.raises(ValueError, match="num_vsw"):
        w.configure(0, 0, 4)
    with pytest.raises(ValueError, match="num_vsw"):
        w.set_num_learners(0)
    w.configure(2, 0, 4)
    with pytest.raises(ValueError, match="micro_batches"):
        w.train_step(make_batches(3, 4, seed=0))


# ---------------------------------------------------------------- 2-process gloo

def _gloo_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)      # as the float64 fixture in the test process
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        worker = SMAWorker(tiny_model(11, bn=True), nn.functional.cross_entropy, lr=LR,
                           momentum=MU, process_group=dist.group.WORLD, sma_sync="flat")
        worker.configure(2, 0, 4)
        losses = []
        for s in range(3):
            batches = make_batches(4, 4, seed=100 + s)[2 * rank:2 * rank + 2]
            st = worker.train_step(batches)
            losses.append(st.loss)
            assert st.global_num_workers == 4
        torch.save({"z": worker.model.state_dict(), "losses": losses,
                    "alpha": worker.alpha}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_flat_sync_over_two_ranks_equals_alg1_over_all_learners(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_gloo_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    flat = SMAWorker(tiny_model(11, bn=True), nn.functional.cross_entropy, lr=LR, momentum=MU)
    flat.configure(4, 0, 4)
    losses = [flat.train_step(make_batches(4, 4, seed=100 + s)).loss for s in range(3)]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["alpha"] == 0.25
        assert got["losses"] == pytest.approx(losses, rel=1e-10)
        for k, v in flat.model.state_dict().items():
            torch.testing.assert_close(got["z"][k], v)


def test_comm_guard_wraps_each_global_allreduce_and_changes_nothing(tmp_path):
    """comm_guard("allreduce") is entered exactly once per iteration around the all-reduce
    (one-process gloo group), and the trained weights equal an unguarded worker's."""
    import contextlib

    import torch.distributed as dist
    import torch.nn.functional as F

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        events = []

        @contextlib.contextmanager
        def guard(op):
            events.append(("enter", op))
            yield
            events.append(("exit", op))

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        workers = [SMAWorker(copy.deepcopy(model), F.cross_entropy, lr=0.1, process_group=dist.group.WORLD,
                             comm_guard=g) for g in (guard, None)]
        for w in workers:
            w.configure(num_vsw=2, num_ga=0, local_batch_size=4)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            batches = [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g))
                       for _ in range(2)]
            for w in workers:
                w.train_step(batches)
        assert events == [("enter", "allreduce"), ("exit", "allreduce")] * 3
        for a, b in zip(workers[0].model.parameters(), workers[1].model.parameters()):
            assert torch.equal(a, b)
        with pytest.raises(ValueError, match="comm_guard"):
            SMAWorker(copy.deepcopy(model), F.cross_entropy, lr=0.1, comm_guard=3)
    finally:
        dist.destroy_process_group()
