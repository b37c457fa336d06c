"""A loss that is not a per-sample mean, caught by the probe before any training, in float64.

Proves: the probe (the job's pre-flight, run before profiling and placement) refuses a loop
whose loss is summed over the batch's samples in one line naming ``per_sample_loss``, and a
hooks-API ``loss_fn`` alike; a mean loss, a BatchNorm model (whose mean moves with the batch)
and a declared sum (``per_sample_loss=False``) pass; and the declared sum trains as the plain
computation it stands for: each micro-batch's summed loss on its own, their gradients averaged
over the decoupled workers (as DDP averages its ranks' gradients).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jabasray.actors.hooks import JobHooks, probe_job, summed_loss
from jabasray.engine.iidp import IIDPWorker
from jabasray.train import bridge, epochs, prepare_data_loader, prepare_model, prepare_optimizer
from jabasray.train.actor import LoopCallables
from test_train_loop_engine import bn_net, data, micro, mlp, sgd

pytestmark = pytest.mark.usefixtures("float64")


def reduced_loop(ds, reduction, build=mlp):
    def loop(config):
        loader = prepare_data_loader(torch.utils.data.DataLoader(ds, batch_size=8))
        model = prepare_model(build())
        opt = prepare_optimizer(sgd(model.parameters()))
        for _ in epochs(1, model=model, optimizer=opt):
            for x, y in loader:
                F.cross_entropy(model(x), y, reduction=reduction).backward()
                opt.step()
    return loop


def probe_loop(loop, per_sample_loss=True):
    c = LoopCallables(loop, None, 1)
    hooks = JobHooks(dataset_fn=c.dataset_fn, step_fn=c.step_fn, collate_fn=c.collate_fn)
    try:
        return probe_job(c.model_fn, c.optimizer_fn, None, hooks, per_sample_loss=per_sample_loss)
    finally:
        bridge.active().abandon()


def test_a_summed_loss_is_refused_in_one_line_at_the_probe():
    report = probe_loop(reduced_loop(data(), "sum"))
    assert report.error.startswith("per_sample_loss: the training loss is a sum over the batch's "
                                   "samples, not a per-sample mean (loss of 8 samples ")
    assert report.error.endswith("declare JobConfig(per_sample_loss=False) or return the mean")
    assert "\n" not in report.error
    # the hooks API's loss_fn goes through the same probe
    plain = probe_job(mlp, sgd, lambda out, y: F.cross_entropy(out, y, reduction="sum"), JobHooks(),
                      dataset=data())
    assert plain.error.startswith("per_sample_loss: the training loss is a sum")


@pytest.mark.parametrize("case", ["mean", "batchnorm mean", "declared sum"])
def test_a_mean_loss_and_a_declared_sum_pass_the_probe(case):
    loop = reduced_loop(data(), "sum" if case == "declared sum" else "mean",
                        bn_net if case == "batchnorm mean" else mlp)
    report = probe_loop(loop, per_sample_loss=case != "declared sum")
    assert report.error is None and report.dataset_size == 64


def test_the_rule_on_a_batch_and_its_halves():
    assert summed_loss(3.0, 1.4, 1.6) and summed_loss(-3.0, -1.4, -1.6)
    assert not summed_loss(1.5, 1.4, 1.6)             # a mean
    assert not summed_loss(1.9, 1.4, 1.6)             # a mean moved by BatchNorm / dropout
    assert not summed_loss(0.0, 0.0, 0.0) and not summed_loss(float("nan"), 1.0, 1.0)


def test_a_declared_sum_trains_as_the_mean_of_the_micro_batches_summed_gradients():
    """2 VSWs x 2 rounds of B_L = 4 (per VSW: the sum is not batched): each update equals SGD
    on the mean over the 4 micro-batches of their summed losses."""
    ds = data()
    c = LoopCallables(reduced_loop(ds, "sum"), None, 1)
    c.dataset_fn()
    torch.manual_seed(1)
    w = IIDPWorker(c.model_fn(), c.optimizer_fn, None, step_fn=c.step_fn, per_sample_loss=False)
    run = bridge.active()
    w.configure(2, 1, 4)
    torch.manual_seed(1)
    model = mlp()
    opt = sgd(model.parameters())
    X, y = ds.tensors
    for it in range(3):
        idx = torch.arange(it * 16, it * 16 + 16)
        st = w.train_step(micro(ds, idx, [4] * 4))
        run.after_step(epoch_end=False)
        assert not st.batched
        opt.zero_grad()
        (sum(F.cross_entropy(model(X[idx[k:k + 4]]), y[idx[k:k + 4]], reduction="sum")
             for k in range(0, 16, 4)) / 4).backward()
        opt.step()
    for a, b in zip(w.model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)
    run.abandon()


def test_a_batchnorm_loop_on_three_samples_is_not_checked():
    """Under 4 samples a half would hold 1 (BatchNorm refuses it in training): no check."""
    small = torch.utils.data.TensorDataset(*(t[:3] for t in data().tensors))
    report = probe_loop(reduced_loop(small, "sum", bn_net))
    assert report.error is None and report.dataset_size == 3
