"""The loop's own ``torch.amp.GradScaler`` under the engine, without Ray, in float64.

The loop writes the standard AMP pattern (``scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()``) and passes the scaler to ``epochs()``; the engine scales every micro-batch's
loss with it and unscales, checks and updates once per global iteration. float64 is exact
here: the scale is a power of two, so scaling the loss by it and unscaling the gradient change
no bit, and the loop with an enabled scaler must equal the loop without one.

Proves: (a) with no overflow, the same weights and optimizer states as the loop without a
scaler, and the scale grown once per global iteration (not per micro-batch); (b) on two gloo
ranks, an inf on ONE rank makes both ranks skip the same update and back off alike, the
weights equal on both and equal to plain optimizers that skip that iteration; (c) the scaler's
state (scale and growth tracker) is checkpointed and restored by ``epochs()``, also through
the GPU actor's state dict into a new actor; and an enabled scaler the engine does not know is
refused in one line.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine_reference import run_gloo_ranks
from jabasray.engine.iidp import IIDPWorker
from jabasray.train import bridge, epochs, prepare_data_loader, prepare_model, prepare_optimizer
from jabasray.train.actor import LoopCallables
from test_train_loop_engine import assert_same_optimizer_state, data, micro, mlp, scaler_loop, two_optimizers

pytestmark = pytest.mark.usefixtures("float64")

INIT = 2.0 ** 16          # GradScaler's default init_scale


def amp_worker(ds, steps, process_group=None, **scaler_kw):
    """A worker fed by the two-optimizer AMP loop (2 VSWs, 2 accumulation rounds of B_L = 4)."""
    calls = LoopCallables(scaler_loop(ds, steps, **scaler_kw), None, 1)
    calls.dataset_fn()
    torch.manual_seed(1)
    w = IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn,
                   process_group=process_group, weight_sync="ows", bucket_cap_mb=1e-4)
    w.configure(2, 1, 4)
    return w, bridge.active()


def train(w, run, ds, iterations, first=0):
    losses = []
    for it in range(first, first + iterations):
        losses.append(w.train_step(micro(ds, torch.arange(it * 16, it * 16 + 16), [4] * 4)).loss)
        run.after_step(epoch_end=False)
    return losses


def test_an_enabled_scaler_trains_as_the_loop_without_one_with_one_scale_per_iteration():
    ds = data()
    runs = {}
    for enabled in (False, True):
        steps = []
        w, run = amp_worker(ds, steps, enabled=enabled, growth_interval=1)
        runs[enabled] = (w, run, steps, train(w, run, ds, 3))
    (w0, run0, steps0, losses0), (w1, run1, steps1, losses1) = runs[False], runs[True]
    scaler = run1.state["scaler"]
    assert w1.grad_scaler is scaler and w0.grad_scaler is None
    # grown once per global iteration (4 micro-batches each): per micro-batch it would be 2^12 more
    assert scaler.get_scale() == INIT * 2 ** 3
    assert w1.weight_sync_method == "sws"          # the inf check needs the whole gradient
    assert steps0 == steps1 == [(False, False), (True, True)] * 3
    for a, b in zip(losses0, losses1):               # the engine's losses are unscaled
        torch.testing.assert_close(a, b)
    for a, b in zip(w0.model.parameters(), w1.model.parameters()):
        torch.testing.assert_close(a, b)
    assert_same_optimizer_state(w1.optimizer.optimizers, w0.optimizer.optimizers)
    # not a no-op: the loop's gradients reached the engine scaled by the scale
    assert any(not torch.equal(a, b) for a, b in zip(w1.model.parameters(), mlp().parameters()))
    run0.finish()
    run1.finish()


def test_the_scalers_state_is_checkpointed_and_restored_by_epochs():
    """Two iterations, a checkpoint (the worker's state and the loop's ``epochs()`` state, as
    the GPU actor saves them), a new worker and loop restored from it, one more iteration:
    the weights and the scaler's scale and growth tracker equal three uninterrupted iterations.
    (init_scale 2^10 and growth_interval 3: a scaler not restored would end at 2^10, or at
    2^10 not 2^11 without its growth tracker.)"""
    ds = data()
    kw = {"enabled": True, "init_scale": 2.0 ** 10, "growth_interval": 3}
    w, run = amp_worker(ds, [], **kw)
    train(w, run, ds, 3)
    w1, run1 = amp_worker(ds, [], **kw)
    train(w1, run1, ds, 2)
    engine_state, loop_state = w1.state_dict(), run1.extra_state()
    assert loop_state["scaler"]["scale"] == 2.0 ** 10 and loop_state["scaler"]["_growth_tracker"] == 2
    run1.abandon()
    w2, run2 = amp_worker(ds, [], **kw)
    w2.load_state_dict(engine_state)
    run2.restore(loop_state)
    train(w2, run2, ds, 1, first=2)
    assert run2.state["scaler"].get_scale() == run.state["scaler"].get_scale() == 2.0 ** 11
    assert run2.state["scaler"].state_dict() == run.state["scaler"].state_dict()
    for a, b in zip(w.model.parameters(), w2.model.parameters()):
        torch.testing.assert_close(a, b)
    run.abandon()
    run2.abandon()


def test_an_enabled_scaler_not_given_to_epochs_is_refused_in_one_line():
    ds = data()

    def loop(config):
        loader = prepare_data_loader(ds)
        model = prepare_model(mlp())
        opt = prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        scaler = torch.amp.GradScaler("cpu")
        for _ in epochs(1, model=model, optimizer=opt):
            for x, y in loader:
                scaler.scale(F.cross_entropy(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()

    calls = LoopCallables(loop, None, 1)
    calls.dataset_fn()
    w = IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn)
    w.configure(1, 0, 8)
    with pytest.raises(ValueError) as e:
        w.train_step(micro(ds, torch.arange(8), [8]))
    assert str(e.value) == ("GradScaler: an enabled scaler must be passed to epochs(..., scaler=scaler) "
                            "before training, so that jabasray scales, unscales and steps with it")
    assert w.grad_scaler is None
    bridge.active().abandon()


# ------------------------------------------------------------------ two ranks, inf on one
OVERFLOW_ITERATION = 1


def _amp_rank(rank: int) -> dict:
    """Rank ``rank`` of two: 3 iterations of 16 samples, this rank's 8 as 2 VSWs x 1 round of 4;
    at iteration 1 rank 1's first sample is inf (its gradient is not finite: saturated tanh
    units times inf)."""
    ds = data()
    steps = []
    calls = LoopCallables(scaler_loop(ds, steps, enabled=True, growth_interval=1), None, 1)
    calls.dataset_fn()
    torch.manual_seed(1)
    w = IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn,
                   process_group=dist.group.WORLD)
    run = bridge.active()
    w.configure(2, 0, 4)
    scales, local_finite = [], None
    for it in range(3):
        mbs = micro(ds, torch.arange(it * 16 + rank * 8, it * 16 + rank * 8 + 8), [4, 4])
        if rank == 1 and it == OVERFLOW_ITERATION:
            x = mbs[0][0].clone()
            x[0, 0] = float("inf")
            mbs[0] = (x, mbs[0][1])
        st = w.train_step(mbs, keep_local_grad=it == OVERFLOW_ITERATION)
        if it == OVERFLOW_ITERATION:
            local_finite = bool(torch.isfinite(st.local_grad).all())
        run.after_step(epoch_end=False)
        scales.append(run.state["scaler"].get_scale())
    out = {"weights": [p.detach().clone() for p in w.model.parameters()],
           "scales": torch.tensor(scales), "local_finite": local_finite,
           "steps": torch.tensor(steps)}
    run.abandon()
    w.close()
    return out


def test_an_inf_on_one_rank_skips_the_update_and_backs_off_on_both(tmp_path):
    got = run_gloo_ranks(_amp_rank, tmp_path)
    torch.manual_seed(1)
    model = mlp()
    opts = two_optimizers(model)
    X, y = data().tensors
    for it in range(3):
        if it == OVERFLOW_ITERATION:
            continue                     # the plain optimizers skip the overflowing iteration
        idx = torch.arange(it * 16, it * 16 + 16)
        for o in opts:
            o.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        for o in opts:
            o.step()
    for r in (0, 1):
        # grown, backed off (inf on rank 1 only), grown: the same on both ranks
        assert got[r]["scales"].tolist() == [INIT * 2, INIT, INIT * 2], r
        assert got[r]["steps"].tolist() == [[True, True]] * 3, r
        for a, b in zip(got[r]["weights"], model.parameters()):
            torch.testing.assert_close(a, b.detach())
    for a, b in zip(got[0]["weights"], got[1]["weights"]):
        assert torch.equal(a, b)
    # before the all-reduce, rank 0's gradient was finite and rank 1's was not
    assert got[0]["local_finite"] and not got[1]["local_finite"]


def test_the_gpu_actor_checkpoints_the_scaler_with_the_loops_state(tmp_path):
    """The same through the GPU actor of a ``JabasTorchTrainer`` job (no Ray): an interval of
    two iterations, ``state_dict()`` into a NEW actor (a re-placement), one more iteration:
    weights and scaler state equal one actor's three iterations."""
    from jabasray.actors.gpu_actor import IntervalRequest
    from jabasray.actors.placement import Slot
    from jabasray.actors.rendezvous import Rendezvous
    from jabasray.config import JobConfig, RunConfig
    from jabasray.train import JabasTorchTrainer
    from jabasray.train.actor import LoopGPUActor

    ds = data()
    job = JobConfig(epochs=1, seed=4)
    kw = {"enabled": True, "init_scale": 2.0 ** 10, "growth_interval": 3}
    t = JabasTorchTrainer(scaler_loop(ds, [], **kw), job_config=job, run_config=RunConfig(str(tmp_path), "x"))
    slot = Slot(rank=0, node="n0", gpu_type="fast", speed=1.0, group=0, pair=0)

    def actor(state=None):
        a = LoopGPUActor(slot, 1, job, t.calls.model_fn, t.calls.optimizer_fn, None, None, "cpu",
                         False, hooks=t.trainer.hooks)
        a.setup(Rendezvous("127.0.0.1", 29500, 1))
        a.configure(2, 1, 4)
        if state is not None:
            a.load_state_dict(state)
        return a

    def interval(a, first, n):
        a.run_interval(IntervalRequest(epoch=0, cursor=16 * first, num_iterations=n, local_batch=4,
                                       layout=[4], iteration=first, base_lr=None, base_batch=16,
                                       lr_scaling="none", warmup_iterations=0, similarity=False))
        return a._loop.state["scaler"].state_dict(), [p.detach().clone() for p in a.worker.model.parameters()]

    whole = actor()
    want = interval(whole, 0, 3)
    whole.shutdown()
    before = actor()
    interval(before, 0, 2)
    state = before.state_dict()
    before.shutdown()
    assert state["loop"]["scaler"]["_growth_tracker"] == 2
    after = actor(state)
    got = interval(after, 2, 1)
    after.shutdown()
    assert got[0] == want[0] and want[0]["scale"] == 2.0 ** 11
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)
